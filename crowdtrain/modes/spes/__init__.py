"""SPES: DiLoCo rounds over the dense parameters; each node trains and serves only the experts it owns.

mode             SPESMode: DiLoCo's rounds plus owned experts, fetched from their owners after each round
ownership        which node owns which expert, a pure function of the status records (balanced by compute)
gathered         what a node gathers with its round for ownership (compute, memory, dialable), signed, read
owned_experts    owned slices of transformers' fused expert tensors as trainable parameters
expert_exchange  each owner serves its experts by round; the others fetch and check them
expert_merging   the expert-merging warm-up: each expert pulled toward its most similar ones

May import: what `modes.diloco` may, and `modes.diloco`.
"""
