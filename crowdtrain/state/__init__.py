"""The verified state transfer: a training state downloaded from peers, checked and corroborated before it loads.

template       what a downloaded state must look like: this node's own tensors, the epoch bound, the checks
download       a joiner's download: donors by priority, the stream bounded and checked; bad donors skipped
corroboration  other donors' digests judge a downloaded state; this node's own served to joiners
serving        the state this node serves to joiners, admitted as a bulk answer (rpc/bulk.py)
digest         a seeded sketch of a state (sums, norms, sampled values) on the wire, and the majority rule
catch_up       the swarm holds its global step, bounded, for a peer announcing it downloads the swarm's state

May import: `dht`, `manifest`, `proto`, `errors`; `collaboration` and `modes` import it.
"""
