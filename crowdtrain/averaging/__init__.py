"""Data-parallel training together: global batches (DeDLOC) and Moshpit group averaging.

grid          Moshpit grid coordinates as hivemind group bits
schedule      the learning-rate schedule per global step
collaboration hivemind.Optimizer configured from the run manifest, with Moshpit keys
exact         reject partial all-reduce results and count them
phases        where the time of a global step goes: per-phase seconds, the matchmaking/all-reduce split
traffic       the bytes of all-reduce rounds, counted as tensor parts pass
checkpoint    atomic checkpoints in the state dir, the last K kept, corrupt ones skipped
checkpoint_writer  checkpoints on an interval, from a snapshot, written by a background thread
plan          the DeDLOC plan: who computes, who aggregates, each aggregator's share (not wired in yet)
"""
