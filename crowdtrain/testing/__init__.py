"""What tests and benchmarks share: real daemons, their child processes, /proc, the WAN lab and the tiny run.

swarm      `crowdtrain run` daemons started, awaited and read back through `crowdtrain status --json`
processes  children in sessions of their own, killed with all they started; waits with deadlines
procfs     the one /proc reader of tests and benchmarks: sessions, groups, children, CPU time, memory
wanlab     hosts as network namespaces behind one bridge, each with its own upload/download cap (root only)
fixtures   the tiny model and data tables of a run file, so a global step takes seconds on two shared cores
diloco     real DiLoCoModes in one process over loopback DHTs, for the outer-step tests and the wire benchmark
attacker   a `crowdtrain run` daemon whose gradients are poisoned (scaled or NaN), for the trust benchmark
bench      benchmarks only: memory and CPU peaks, progress rates, tables, environment, JSON, plots, main()

May import every other package; nothing in crowdtrain imports `testing`.
"""
