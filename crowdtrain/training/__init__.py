"""The training loop of a node and what it keeps: checkpoints, the throughput probe, the progress bar.

loop               the Trainer: builds the run's model and data, trains with the swarm until stopped
checkpoint         atomic checkpoints in the state dir, the last K kept, corrupt ones skipped
checkpoint_writer  checkpoints on an interval, from a snapshot, written by a background thread
throughput         the throughput probe: samples/s of the run's model on this machine, cached
progress_bar       the global batch's progress in the terminal

May import: `modes`, `averaging`, `models`, `data`, `dht`, `manifest`, `optimizer`, `proto`, `files`, `errors`.
"""
