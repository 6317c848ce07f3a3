"""SkipPipe: pipeline stages on different nodes; stage-0 nodes drive microbatches along paths that skip stages.

mode               SkipPipeMode: the training-mode seam; one iteration per global step
declaration        the stage a node takes and declares, with what its device, memory and link take per microbatch
rostering          a node's place in the roster: its first iteration, the leader's rosters, moves between stages,
                   stage 0 founded again
stages             StagedModel: a decoder LM cut into stages, its forward along any path of them (skipped, reordered)
schedule           each microbatch's path through the stages (skips, reorders, load-aware replicas), from the roster
membership         stage declarations and the leader's rosters in the DHT
iteration          SkipPipeNode: one node's iteration (schedule, microbatches, waiting for the sources, the step)
gradient_exchange  the stage's gradient summed over its replicas, in the background with overlap_exchange
stage_state        the stage's parameters and AdamW moments: taken from a replica, served, kept beside a look-ahead
drift              fingerprints of the replicas' parameters, and whether the replicas drifted apart
stage_service      StageService: the hops a node serves for its stage (forward, backward, done, ping, gradient,
                   state), bounded and checked
stage_ledger       what a stage node keeps of its iterations: forwards held for their backward, done messages,
                   gradients
stage_calls        the calls a node makes on other nodes' stages: hops, done messages, pings, gradients, states
hop_wire           a tensor as a stream of proto.StageHop frames: wire dtypes, bounds checked on receipt, pacing
driver             PipelineDriver: a stage-0 node runs its microbatches along their routes and back, rerouting a
                   failed hop to another replica of its stage or skipping the stage
device_clock       DeviceClock: the seconds a node's device takes per microbatch it computes, which it declares

May import: `averaging`, `planning`, `models`, `data`, `dht`, `manifest`, `optimizer`, `proto`, `errors`, and
`modes.base`.
"""

from crowdtrain.modes.skippipe.driver import MicrobatchOutcome, PipelineDriver
from crowdtrain.modes.skippipe.hop_wire import HopFailedError, HopLimits, HopRefusedError
from crowdtrain.modes.skippipe.stage_service import StageService

__all__ = ["HopFailedError", "HopLimits", "HopRefusedError", "MicrobatchOutcome", "PipelineDriver", "StageService"]
