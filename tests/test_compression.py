"""Wire encodings: int8 decodes on numpy 2 (hivemind's own decoder failed every part) and trusts no size sent."""

from __future__ import annotations

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from crowdtrain.averaging.compression import BoundedInt8, compression_for


def test_int8_round_trips_within_its_resolution_through_hiveminds_own_decoder() -> None:
    tensor = torch.randn(4096)
    serialized = serialize_torch_tensor(tensor, compression_for("int8").compression_type)
    assert len(serialized.buffer) < tensor.numel() * 4 / 3  # about a quarter of fp32, plus the codebook
    decoded = deserialize_torch_tensor(serialized)  # hivemind's registry now holds BoundedInt8
    assert decoded.shape == tensor.shape and decoded.dtype == torch.float32
    # 256 levels over six standard deviations: within range the error is a fraction of a level; the rare values
    # beyond three deviations are clipped to the outermost level
    error = (decoded - tensor).abs()
    assert error.mean() < 6 / 256 and float((error > 6 / 256).float().mean()) < 0.01


@pytest.mark.parametrize(
    "mutate",
    [
        lambda message: message.__setattr__("buffer", message.buffer[:-1]),  # fewer values than its size says
        lambda message: message.__setattr__("buffer", b"\xff" * 8 + message.buffer[8:]),  # a huge codebook
        lambda message: message.__setattr__("buffer", b"\x01"),
        lambda message: message.size.__setitem__(0, 10**9),
        lambda message: message.__setattr__("dtype", "int64"),
    ],
)
def test_a_hostile_int8_part_is_an_error_not_a_read_past_its_buffer(mutate: object) -> None:
    message = serialize_torch_tensor(torch.randn(64), runtime_pb2.UNIFORM_8BIT)
    mutate(message)  # type: ignore[operator]
    with pytest.raises(ValueError):
        BoundedInt8().extract(message)


def test_names() -> None:
    assert compression_for("none").compression_type == runtime_pb2.NONE
    assert compression_for("fp16").compression_type == runtime_pb2.FLOAT16
    with pytest.raises(ValueError):
        compression_for("zip")
