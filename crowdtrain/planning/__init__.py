"""The DeDLOC plan: who computes, who aggregates and each aggregator's share, from measured capabilities.

plan     the linear program over peers' compute and links (pure: no DHT, no torch)
planner  the plan as a pure function of the status records listed at an epoch boundary, and its digest
roles    this node's measurements, its part of the plan, and the prober that re-measures its links
ownership  SPES: which node owns which expert, from the status records (balanced by compute, stable)
skippipe SkipPipe: each microbatch's path through the pipeline stages (skips, reorders, load-aware replicas)

May import: `averaging`, `links`, `dht`, `manifest`, `proto`, `errors`.
"""
