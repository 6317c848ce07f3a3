"""Run-file pieces shared by the tests and the benchmarks."""

TINY_MODEL_TOML = """
[model.config]
vocab_size = 260
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 4
max_position_embeddings = 64
tie_word_embeddings = true

[data]
sequence_length = 32
"""
"""A run file's model and data tables for a tiny LM, so a global step takes seconds on two shared cores; the
benchmarks' tiny runs and the tests' (tests/harness.py) are built from it."""
