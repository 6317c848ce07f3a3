"""What tests and benchmarks share: the WAN lab and the tiny run used to exercise real daemons.

wanlab    hosts as network namespaces behind one bridge, each with its own upload/download cap (root only)
fixtures  the tiny model and data tables of a run file, so a global step takes seconds on two shared cores

May import every other package; nothing in the daemon imports `testing`.
"""
