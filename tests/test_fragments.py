"""Streaming DiLoCo's fragments (modes/diloco/fragments.py): the cut, the flat buffer, the manifest's rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lab.diloco import diloco_peers

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import PRESETS, DiLoCoSpec, RunManifest, TrainingSpec, demo
from crowdtrain.modes.diloco.fragments import Fragments

SHAPES = [torch.Size(shape) for shape in [(10, 4), (4,), (4, 4), (4, 4), (8, 2), (3,)]]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 6])
def test_fragments_are_runs_of_consecutive_tensors_covering_all_once(count: int) -> None:
    fragments = Fragments.split(SHAPES, count)
    assert fragments.count == count
    assert [index for members in fragments.members for index in members] == list(range(len(SHAPES)))
    assert all(members for members in fragments.members)


def test_the_cut_falls_at_the_tensor_boundary_nearest_each_share() -> None:
    # 95 values: halves at 47.5; after tensor 1 the count is 44 (3.5 away), after tensor 2 it is 60 (12.5 away)
    assert Fragments.split(SHAPES, 2).members == ((0, 1), (2, 3, 4, 5))
    # a tensor larger than a share still leaves one tensor for every later fragment
    assert Fragments.split([torch.Size([1000]), torch.Size([1]), torch.Size([1])], 3).members == ((0,), (1,), (2,))
    with pytest.raises(ValueError, match="7 fragments need 7 tensors"):
        Fragments.split(SHAPES, 7)


def test_one_fragment_keeps_the_tensors_shapes_and_more_share_one_flat_buffer() -> None:
    single = Fragments.split(SHAPES, 1)
    assert not single.flat and single.buffer_shapes() == SHAPES and single.of_round(5) == 0
    fragments = Fragments.split(SHAPES, 3)  # 40 / 20 / 35 values
    assert fragments.flat and fragments.buffer_shapes() == [torch.Size([40])]
    assert [fragments.of_round(round_) for round_ in range(5)] == [0, 1, 2, 0, 1]


def test_a_fragment_written_into_the_flat_buffer_reads_back_the_same_and_zeroes_the_rest() -> None:
    fragments = Fragments.split(SHAPES, 3)
    buffers = [torch.full((40,), 7.0)]
    values = [torch.randn(SHAPES[index]) for index in fragments.members[2]]
    fragments.write(buffers, 2, values)
    assert all(torch.equal(a, b) for a, b in zip(fragments.read(buffers, 2), values, strict=True))
    assert torch.equal(buffers[0][35:], torch.zeros(5)), "the tail past the fragment's 35 values is zero"


def test_the_manifest_takes_fragments_only_where_each_fragment_keeps_its_h() -> None:
    assert DiLoCoSpec().fragments == 1 and DiLoCoSpec(inner_steps=8, fragments=4).fragments == 4
    with pytest.raises(ValueError, match="must be a multiple of fragments"):
        DiLoCoSpec(inner_steps=6, fragments=4)
    with pytest.raises(ValueError, match="not topk"):
        DiLoCoSpec(inner_steps=8, fragments=2, compression="topk")
    with pytest.raises(ValueError, match="not topk"):
        DiLoCoSpec(inner_steps=8, fragments=2, min_inner_steps=4, max_inner_steps=16)
    with pytest.raises(ValueError, match="between 1 and 64"):
        DiLoCoSpec(fragments=65)
    base = demo()
    run = dataclasses.replace(
        base,
        training=TrainingSpec(mode="diloco"),
        diloco=DiLoCoSpec(inner_steps=8, fragments=4),
    )
    assert RunManifest.from_bytes(run.to_bytes()).diloco == run.diloco, "fragments travel with the manifest"
    unset = dataclasses.replace(run, diloco=DiLoCoSpec(inner_steps=8))
    assert RunManifest.from_bytes(unset.to_bytes()).diloco.fragments == 1  # type: ignore[union-attr]


def test_a_spes_run_refuses_fragments() -> None:
    spes = PRESETS["spes-demo"]()
    assert spes.diloco is not None
    with pytest.raises(ValueError, match="diloco.fragments must be 1"):
        dataclasses.replace(spes, diloco=dataclasses.replace(spes.diloco, inner_steps=8, fragments=2))


def test_a_model_with_fewer_tensors_than_fragments_is_refused_in_one_sentence() -> None:
    base = demo()
    run = dataclasses.replace(
        base,
        training=TrainingSpec(mode="diloco"),
        diloco=DiLoCoSpec(inner_steps=4, fragments=4),
    )
    with pytest.raises(BadInputError, match="diloco.fragments doesn't fit its model: 4 fragments need 4 tensors"):
        with diloco_peers(run, 1, [torch.zeros(3), torch.zeros(2)]):
            pass
