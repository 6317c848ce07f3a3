"""SkipPipe: pipeline stages on different nodes; stage-0 nodes drive microbatches along paths that skip stages.

settings           the run file's [skippipe] section and what a SkipPipe run needs of its model (torch-free)
mode               SkipPipeMode: the training-mode seam; one iteration per global step
iteration          SkipPipeNode: one node's iteration (schedule, microbatches, waiting for the sources, the step)
stages             StagedModel: a decoder LM cut into stages, its forward along any path of them (skipped, reordered)
hops/              the pipeline hops a node serves and makes (StageService, its ledger, its calls, the wire), the
                   stage-0 driver, the device clock
replicas/          what a stage's replicas share: the summed gradient, the state, drift
roster/            who serves which stage: declarations, the leader's rosters, moves, the schedule of paths

May import: `averaging`, `planning`, `models`, `data`, `dht`, `manifest`, `optimizer`, `proto`, `errors`,
`modes.base` and `modes.progress`.
"""
