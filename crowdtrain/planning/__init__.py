"""The DeDLOC plan: who computes, who aggregates and each aggregator's share, from measured capabilities.

plan     the linear program over peers' compute and links (pure: no DHT, no torch)
planner  the plan as a pure function of the status records listed at an epoch boundary, and its digest
roles    this node's measurements, its part of the plan, and the prober that re-measures its links

May import: `averaging`, `links`, `dht`, `manifest`, `proto`, `errors`.
"""
