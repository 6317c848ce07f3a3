"""Presets: plain functions returning a whole run manifest, by name in `PRESETS`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from crowdtrain.manifest.run import RunManifest
from crowdtrain.manifest.specs import AveragingSpec, DataSpec, ModelSpec, MoESpec, OptimizerSpec, TrainingSpec
from crowdtrain.modes.diloco.settings import DiLoCoSpec
from crowdtrain.modes.skippipe.settings import SkipPipeSpec
from crowdtrain.modes.spes.settings import SPESSpec
from crowdtrain.structured import FieldError


def demo() -> RunManifest:
    """The default run: a small LLaMA-style causal LM on the embedded corpus, CPU-friendly."""
    return _byte_llama_run(
        "demo",
        _byte_llama_config(
            hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, max_position_embeddings=256
        ),
        sequence_length=128,
        optimizer=OptimizerSpec(name="adamw", learning_rate=1e-3, warmup_steps=10, total_steps=10_000),
        target_batch_size=1024,
    )


def demo_moe() -> RunManifest:
    """The demo LM with every FFN replaced by a DMoE layer over a 4x4 grid of tiny experts, CPU-friendly."""
    return dataclasses.replace(
        demo(),
        run_id="demo-moe",
        moe=MoESpec(grid=(4, 4), expert="ffn", expert_hidden_size=128, k=2, k_min=1, uid_prefix="ffn"),
    )


def llama_20m() -> RunManifest:
    """A 25M-parameter LLaMA on the embedded corpus, sized for CPU benchmarks: sequence 128."""
    return _byte_llama_run(
        "llama-20m",
        _byte_llama_config(hidden_size=512, intermediate_size=1376, num_layers=8, num_heads=8),
        sequence_length=128,
        optimizer=OptimizerSpec(name="adamw", learning_rate=1e-3, warmup_steps=20, total_steps=10_000),
        target_batch_size=256,
    )


def llama_85m() -> RunManifest:
    """An 85M-parameter LLaMA (GPT-2 small's shape) on the embedded corpus, for a GPU: sequence 512."""
    return _byte_llama_run(
        "llama-85m",
        _byte_llama_config(hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12),
        sequence_length=512,
        optimizer=OptimizerSpec(name="adamw", learning_rate=6e-4, warmup_steps=50, total_steps=10_000),
        target_batch_size=512,
        averaging_timeout_s=60.0,  # 170 MB of fp16 gradients per round: about 30 s over 50 Mbit/s home uplinks
    )


def llama_350m() -> RunManifest:
    """A 351M-parameter LLaMA (24 layers of width 1024) on the embedded corpus, for GPUs: sequence 512."""
    return _byte_llama_run(
        "llama-350m",
        _byte_llama_config(hidden_size=1024, intermediate_size=3392, num_layers=24, num_heads=16),
        sequence_length=512,
        optimizer=OptimizerSpec(name="adamw", learning_rate=3e-4, warmup_steps=100, total_steps=10_000),
        target_batch_size=512,
        averaging_timeout_s=90.0,  # 0.7 GB of fp16 gradients per round: about a minute over 100 Mbit/s links
    )


def _byte_llama_run(
    run_id: str,
    config: dict[str, Any],
    *,
    sequence_length: int,
    optimizer: OptimizerSpec,
    target_batch_size: int,
    averaging_timeout_s: float | None = None,
) -> RunManifest:
    """A gradients-mode run of a byte-level LLaMA on the embedded corpus, fp16 on the wire; the averaging timeout
    AveragingSpec's unless given."""
    averaging = AveragingSpec(group_size=16, grid_dims=2, compression="fp16")
    if averaging_timeout_s is not None:
        averaging = dataclasses.replace(averaging, timeout_s=averaging_timeout_s)
    return RunManifest(
        run_id=run_id,
        model=ModelSpec(config=config),
        data=DataSpec(source="embedded", sequence_length=sequence_length),
        optimizer=optimizer,
        target_batch_size=target_batch_size,
        training=TrainingSpec(mode="gradients"),
        averaging=averaging,
    )


def skippipe_demo() -> RunManifest:
    """SkipPipe on the demo LM: its 4 layers in 4 stages, each microbatch skipping a quarter of stages 1-3."""
    return dataclasses.replace(
        demo(),
        run_id="skippipe-demo",
        training=TrainingSpec(mode="skippipe"),
        skippipe=SkipPipeSpec(stages=4, skip_ratio=0.25, reorder=True, microbatches=8, wire_dtype="float16"),
    )


def spes_demo() -> RunManifest:
    """SPES on a 5M-parameter OLMoE (8 routed experts per layer, top-2), CPU-friendly, with the merging warm-up."""
    return RunManifest(
        run_id="spes-demo",
        model=_byte_olmoe(hidden_size=192, intermediate_size=256, num_layers=4, num_heads=4, experts=8),
        data=DataSpec(source="embedded", sequence_length=128),
        optimizer=OptimizerSpec(name="adamw", learning_rate=1e-3, warmup_steps=10, total_steps=10_000),
        target_batch_size=256,
        training=TrainingSpec(mode="spes"),
        averaging=AveragingSpec(group_size=16, grid_dims=2, compression="fp16"),
        diloco=DiLoCoSpec(inner_steps=20, compression="fp16", overlap=False),
        spes=SPESSpec(merge_every=10, merge_neighbours=2, merge_alpha=0.1, merge_warmup_steps=200),
    )


def spes_28m() -> RunManifest:
    """SPES on a 28M-parameter OLMoE (6 layers of 8 experts, top-2), the realistic shape for CPU benchmarks."""
    return dataclasses.replace(
        spes_demo(),
        run_id="spes-28m",
        model=_byte_olmoe(hidden_size=384, intermediate_size=448, num_layers=6, num_heads=6, experts=8),
    )


def spes_250m() -> RunManifest:
    """SPES on a 255M-parameter OLMoE (12 layers of 16 experts, top-2; 30M dense), for GPUs: sequence 512."""
    return dataclasses.replace(
        spes_demo(),
        run_id="spes-250m",
        model=_byte_olmoe(hidden_size=768, intermediate_size=512, num_layers=12, num_heads=12, experts=16),
        data=DataSpec(source="embedded", sequence_length=512),
        optimizer=OptimizerSpec(name="adamw", learning_rate=6e-4, warmup_steps=50, total_steps=10_000),
        target_batch_size=512,
        averaging=AveragingSpec(group_size=16, grid_dims=2, compression="fp16", timeout_s=60.0),
        diloco=DiLoCoSpec(inner_steps=50, compression="fp16", overlap=False),
    )


def _byte_olmoe(
    *, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, experts: int
) -> ModelSpec:
    """An OlmoeForCausalLM over the byte tokenizer: top-2 routing with OLMoE's load-balancing loss."""
    config = {
        "vocab_size": 260,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.01,
        "max_position_embeddings": 512,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 258,
        "tie_word_embeddings": True,
    }
    return ModelSpec(architecture="OlmoeForCausalLM", config=config, tokenizer="bytes")


def _byte_llama_config(
    *, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, max_position_embeddings: int = 512
) -> dict[str, Any]:
    """A LlamaForCausalLM config over the byte tokenizer (260 ids), embeddings tied."""
    return {
        "vocab_size": 260,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
    }


PRESETS: dict[str, Callable[[], RunManifest]] = {
    "demo": demo,
    "demo-moe": demo_moe,
    "llama-20m": llama_20m,
    "llama-85m": llama_85m,
    "llama-350m": llama_350m,
    "skippipe-demo": skippipe_demo,
    "spes-demo": spes_demo,
    "spes-28m": spes_28m,
    "spes-250m": spes_250m,
}


def preset_summaries() -> dict[str, str]:
    """Each preset's name and the first line of its docstring, in `PRESETS` order."""
    return {name: (build.__doc__ or "").strip().splitlines()[0] for name, build in PRESETS.items()}


def preset_manifest(name: object) -> RunManifest:
    """The manifest of the preset `name`; raises FieldError listing the presets when none is called so."""
    build = PRESETS.get(name) if isinstance(name, str) else None
    if build is None:
        raise FieldError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    return build()
