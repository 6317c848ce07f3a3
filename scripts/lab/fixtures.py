"""Run-file pieces shared by the tests and the benchmarks."""

from __future__ import annotations

import json
from typing import Any

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


def tiny_run_file(
    run_id: str, target_batch_size: int, *, mode: str = "gradients", averaging: str = "", sections: str = ""
) -> str:
    """A whole run file for the tiny model in training `mode`: a fast optimizer, short averaging timeouts;
    `averaging` adds lines to the [averaging] table, `sections` adds tables after it."""
    return f"""
run_id = "{run_id}"
target_batch_size = {target_batch_size}
{TINY_MODEL_TOML}
[optimizer]
learning_rate = 0.005
warmup_steps = 0
total_steps = 1000

[training]
mode = "{mode}"

[averaging]
matchmaking_time_s = 2.0
timeout_s = 15.0
{averaging}
{sections}"""


TINY_OLMOE_TOML = """
[model]
architecture = "OlmoeForCausalLM"

[model.config]
vocab_size = 260
hidden_size = 64
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 4
num_experts = 8
num_experts_per_tok = 2
output_router_logits = true
router_aux_loss_coef = 0.01
max_position_embeddings = 64
bos_token_id = 256
eos_token_id = 257
pad_token_id = 258
tie_word_embeddings = true

[data]
sequence_length = 32
"""
"""A tiny OLMoE's model and data tables: 2 layers of 8 experts, 16 experts for a SPES run's nodes to own."""


def tiny_skippipe_run_file(run_id: str, extra: str = "") -> str:
    """A whole SkipPipe run file for the tiny model: 2 stages, no skips, 4 microbatches an iteration, hops in float32;
    `extra` adds lines to the [skippipe] table."""
    return tiny_run_file(
        run_id,
        64,
        mode="skippipe",
        sections=f"""
[skippipe]
stages = 2
skip_ratio = 0.0
microbatches = 4
wire_dtype = "float32"
{extra}""",
    )


def tiny_spes_run_file(run_id: str) -> str:
    """A whole SPES run file for the tiny OLMoE: two inner steps a round, fp16 exchanges, short timeouts."""
    return f"""
run_id = "{run_id}"
target_batch_size = 32
{TINY_OLMOE_TOML}
[optimizer]
learning_rate = 0.005
warmup_steps = 0
total_steps = 1000

[training]
mode = "spes"

[averaging]
matchmaking_time_s = 2.0
timeout_s = 15.0

[diloco]
inner_steps = 2
compression = "fp16"
overlap = false
"""


LLAMA_20M_CONFIG: dict[str, Any] = {
    "vocab_size": 260,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""The llama-20m preset's shape with the byte vocabulary: 25.4M parameters."""


def bench_run_file(
    run_id: str,
    *,
    batch: int,
    model_config: dict[str, Any],
    sequence_length: int,
    mode: str,
    averaging_timeout_s: float,
    architecture: str = "LlamaForCausalLM",
    sections: str = "",
) -> str:
    """A benchmark's run file: `model_config` as its [model.config] table, AdamW at 1e-3 with no warm-up, 3 s of
    matchmaking; `sections` adds tables after [averaging]."""
    # TOML writes these scalars (numbers, booleans, strings) as JSON does
    model = "\n".join(f"{key} = {json.dumps(value)}" for key, value in model_config.items())
    return f"""
run_id = "{run_id}"
target_batch_size = {batch}

[model]
architecture = "{architecture}"

[model.config]
{model}

[data]
sequence_length = {sequence_length}

[optimizer]
learning_rate = 0.001
warmup_steps = 0
total_steps = 100000

[training]
mode = "{mode}"

[averaging]
matchmaking_time_s = 3.0
timeout_s = {averaging_timeout_s}
{sections}
"""
