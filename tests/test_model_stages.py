"""SkipPipe's model side: the cut into stages, the full path as the model itself, skipped and reordered paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
)

from crowdtrain.errors import BadInputError
from crowdtrain.modes.skippipe.stages import StagedModel, check_path, stage_layers

SHAPE: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def olmoe() -> torch.nn.Module:
    torch.manual_seed(0)
    return OlmoeForCausalLM(OlmoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2))


def tokens() -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("num_layers", "num_stages"), [(8, 4), (4, 4), (7, 3), (10, 4), (5, 1), (6, 5)])
def test_stages_cover_every_layer_once_in_order(num_layers: int, num_stages: int) -> None:
    stages = stage_layers(num_layers, num_stages)
    assert len(stages) == num_stages
    assert [layer for stage in stages for layer in stage] == list(range(num_layers))
    sizes = [len(stage) for stage in stages]
    assert stages[0].start == 0 and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes[0] == min(sizes), "stage 0 also runs the embeddings and head, so it never gets an extra layer"


@pytest.mark.parametrize("num_stages", [0, 9])
def test_stage_counts_outside_one_to_the_layers_are_refused(num_stages: int) -> None:
    with pytest.raises(ValueError, match="num_stages must be between 1 and the 8 layers"):
        stage_layers(8, num_stages)


@pytest.mark.parametrize("sizes", [[1, 2, 2, 3], [5, 1, 1, 1]])
def test_stages_can_be_cut_unevenly(sizes: list[int]) -> None:
    stages = stage_layers(8, 4, sizes)
    assert [len(stage) for stage in stages] == sizes
    assert [layer for stage in stages for layer in stage] == list(range(8))


@pytest.mark.parametrize("sizes", [[1, 2, 2], [0, 3, 3, 2], [1, 2, 2, 2], [2, 2, 2, 3]])
def test_a_cut_that_misses_a_layer_or_a_stage_is_refused(sizes: list[int]) -> None:
    with pytest.raises(ValueError, match="must give each of the 4 stages at least one of the 8 layers, all of them"):
        stage_layers(8, 4, sizes)


@pytest.mark.parametrize("build", [llama, olmoe], ids=["llama", "olmoe"])
@pytest.mark.parametrize(("num_stages", "sizes"), [(4, None), (3, [1, 2, 1])], ids=["even", "uneven"])
def test_the_full_path_computes_the_model_itself(build: object, num_stages: int, sizes: list[int] | None) -> None:
    model = build()  # type: ignore[operator]
    staged = StagedModel(model, num_stages=num_stages, sizes=sizes)
    batch = tokens()
    with torch.no_grad():
        expected = model(input_ids=batch, labels=batch)
        loss, logits = staged.loss(batch, staged.full_path), staged.logits(batch, list(range(num_stages)))
    assert staged.full_path == tuple(range(num_stages))
    assert [len(stage) for stage in staged.stages] == (sizes or [1, 1, 1, 1])
    assert float(loss) == pytest.approx(float(expected.loss), abs=1e-5)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)


def test_the_stages_split_the_parameters() -> None:
    staged = StagedModel(llama(), num_stages=4)
    by_stage = [{id(parameter) for parameter in staged.stage_parameters(stage)} for stage in range(4)]
    assert set().union(*by_stage) == {id(parameter) for parameter in staged.model.parameters()}
    assert sum(len(ids) for ids in by_stage) == len(set().union(*by_stage)), "no parameter in two stages"
    assert id(staged.model.model.embed_tokens.weight) in by_stage[0]
    assert id(staged.model.lm_head.weight) in by_stage[0]


def test_a_skipped_stage_is_not_run_and_gets_no_gradient() -> None:
    staged = StagedModel(llama(), num_stages=4)
    batch = tokens()
    with torch.no_grad():
        full = float(staged.loss(batch, staged.full_path))
    skipped = staged.loss(batch, [0, 1, 3])
    skipped.backward()
    assert float(skipped.detach()) != pytest.approx(full, abs=1e-4)
    assert all(parameter.grad is None for parameter in staged.stage_parameters(2))
    for stage in (0, 1, 3):
        gradients = [parameter.grad for parameter in staged.stage_parameters(stage)]
        assert all(gradient is not None and gradient.abs().sum() > 0 for gradient in gradients), stage


def test_a_reordered_path_differs_from_the_ascending_one() -> None:
    staged = StagedModel(llama(), num_stages=4)
    batch = tokens()
    with torch.no_grad():
        ascending = staged.logits(batch, [0, 1, 3])
        reordered = staged.logits(batch, [0, 3, 1])
    assert not torch.allclose(ascending, reordered, atol=1e-4)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ([], "must start at stage 0"),
        ([1, 2], "must start at stage 0"),
        ([0, 2, 2], "visits a stage twice"),
        ([0, 4], "names stage 4, not one of 0..3"),
        ([0, -1], "names stage -1, not one of 0..3"),
    ],
)
def test_bad_paths_are_refused_in_one_sentence(path: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_path(path, 4)
    staged = StagedModel(llama(), num_stages=4)
    with pytest.raises(ValueError, match=message):
        staged.loss(tokens(), path)


def test_a_stage_out_of_range_is_refused() -> None:
    staged = StagedModel(llama(), num_stages=4)
    with pytest.raises(ValueError, match="stage 4 is not one of 0..3"):
        staged.stage_parameters(4)
    with pytest.raises(ValueError, match="stage -1 is not one of 0..3"):
        staged.run_stage(-1, staged.embed(tokens()))


def test_a_model_without_decoder_layers_is_refused() -> None:
    with pytest.raises(BadInputError, match="Linear has no model.layers, so it cannot be cut into SkipPipe stages"):
        StagedModel(torch.nn.Linear(4, 4), num_stages=2)


def test_models_whose_loss_or_masks_a_path_would_change_are_refused() -> None:
    torch.manual_seed(0)
    routed = OlmoeForCausalLM(OlmoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, output_router_logits=True))
    with pytest.raises(BadInputError, match="output_router_logits to False"):
        StagedModel(routed, num_stages=2)
    windowed = MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=8))
    with pytest.raises(BadInputError, match="sliding_window to None"):
        StagedModel(windowed, num_stages=2)
