"""All-reduce machinery: Moshpit groups, plan-partitioned rounds, exactness, traffic and phase accounting.

grid          Moshpit grid coordinates as hivemind group bits
groups        this peer's Moshpit group key and size fitted to the swarm; join request and chunk timeouts
partition     each round's partition from the plan's shares; expected round failures as one warning line
exact         reject partial all-reduce results and count them
phases        where the time of a global step goes: per-phase seconds, the matchmaking/all-reduce split
traffic       the bytes of all-reduce rounds, counted as tensor parts pass; the runner with robust reducers
robust        each chunk checked (shape, finite, norm) and aggregated by mean, trimmed mean or CenteredClip
quarantine    peers caught sending bad parts kept out of this node's groups for a while
progress_bounds  peers' progress claims bounded before hivemind's tracker sums them
authored      each member's gathered data signed by it and checked by every member before use

May import: `codecs`, `dht`, `manifest`, `proto`, `errors`.
"""
