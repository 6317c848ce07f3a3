"""What tests and benchmarks share: real daemons, their child processes, /proc, the WAN lab and the tiny run.

swarm      `crowdtrain run` daemons started, awaited and read back through `crowdtrain status --json`
processes  children in sessions of their own, killed with all they started; waits with deadlines
procfs     the one /proc reader of tests and benchmarks: sessions, groups, children, CPU time, memory
wanlab     hosts as network namespaces behind one bridge, each with its own upload/download cap (root only)
fixtures   run files: the tiny model's tables (a global step in seconds on two shared cores), the benchmarks' runs
diloco     real DiLoCoModes in one process over loopback DHTs, for the outer-step tests and the wire benchmark
attacker   a `crowdtrain run` daemon whose gradients are poisoned (scaled or NaN), for the trust benchmark
look_ahead SkipPipe's overlapped exchange in one process: the reference of the pipeline test and its benchmark

Not part of the installed package: it lives in scripts/, which pytest's `pythonpath` (pyproject.toml) and
`python scripts/<benchmark>.py` put on the path. A child that runs a module of it goes through
`processes.lab_module`, which puts scripts/ on the child's path. It may import all of crowdtrain; nothing in
crowdtrain imports `lab`. The benchmarks' own plumbing is scripts/benchlib.py.
"""
