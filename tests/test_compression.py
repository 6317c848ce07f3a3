"""Wire encodings: int8 decodes on numpy 2 (hivemind's own decoder failed every part); topk is exact for fp16 values;
neither trusts a size, index or value it is sent."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2

from crowdtrain import proto
from crowdtrain.codecs.compression import (
    CODECS,
    INT8_BLOCK,
    SPARSE_WIRE_TYPE,
    BoundedInt8,
    SparseFloat16,
    codec_for,
    compression_for,
    decode_int8_blocks,
    encode_int8_blocks,
    int8_blocks_size,
)
from crowdtrain.manifest import DILOCO_COMPRESSIONS, AveragingSpec
from tests.messages import set_field


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


def test_int8_blocks_round_each_value_within_half_a_step_of_its_own_blocks_scale() -> None:
    tensor = torch.randn(2 * INT8_BLOCK + 5) * 1e-3
    tensor[7] = 1.0  # an outlier coarsens its own block only
    tensor[INT8_BLOCK : 2 * INT8_BLOCK] = 0.0  # an all-zero block
    payload = encode_int8_blocks(tensor)
    assert len(payload) == int8_blocks_size(tensor.numel()) == tensor.numel() + 4 * 3
    decoded = decode_int8_blocks(payload, tensor.numel())
    for block in range(3):
        part = slice(block * INT8_BLOCK, (block + 1) * INT8_BLOCK)
        step = float(tensor[part].abs().max()) / 127
        assert float((decoded[part] - tensor[part]).abs().max()) <= step / 2 * (1 + 1e-6)
    assert torch.equal(decoded[INT8_BLOCK : 2 * INT8_BLOCK], torch.zeros(INT8_BLOCK))
    assert float(decoded[7]) == 1.0 and int(torch.count_nonzero(decoded[:INT8_BLOCK])) < INT8_BLOCK / 10
    assert torch.equal(decode_int8_blocks(encode_int8_blocks(torch.zeros(1)), 1), torch.zeros(1))


@pytest.mark.parametrize(
    ("payload", "sentence"),
    [
        (b"", "do not hold 4 values"),
        (b"\0" * 9, "do not hold 4 values"),
        (np.float32(-1.0).tobytes() + b"\1" * 4, "negative or non-finite"),
        (np.float32(np.inf).tobytes() + b"\1" * 4, "negative or non-finite"),
        (np.float32(1.0).tobytes() + b"\x80" * 4, "outside"),
    ],
)
def test_a_hostile_int8_block_payload_is_an_error(payload: bytes, sentence: str) -> None:
    with pytest.raises(ValueError, match=sentence):
        decode_int8_blocks(payload, 4)


def test_names() -> None:
    assert compression_for("none").compression_type == runtime_pb2.NONE
    assert compression_for("fp16").compression_type == runtime_pb2.FLOAT16
    with pytest.raises(ValueError):
        compression_for("zip")
    admitted = set(DILOCO_COMPRESSIONS) | {"fp16", "none"}  # DiLoCo's and the averaging section's
    assert admitted <= set(CODECS), "every name a manifest admits has its codec"
    with pytest.raises(ValueError, match="compression must be"):
        AveragingSpec(compression="int8")


@pytest.mark.parametrize("name", sorted(CODECS))
def test_each_codec_is_what_it_says_on_the_wire(name: str) -> None:
    # What the rest of the code reads of a codec (its wire slot, bytes per value, lossy, error feedback) is what
    # its encoder does to a dense tensor.
    codec = codec_for(name)
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    encoder = codec.make()
    assert encoder.compression_type == codec.wire_type
    part = encoder.compress(tensor, CompressionInfo.from_tensor(tensor))
    assert part.compression == codec.wire_type
    assert len(part.buffer) == pytest.approx(codec.bytes_per_value * tensor.numel(), rel=0.3), "dense: a few bytes"
    decoded = deserialize_torch_tensor(part)
    assert torch.equal(decoded, tensor) != codec.lossy
    assert codec.error_feedback == (name == "topk"), "only top-k sends part of a tensor and keeps the rest back"


def sparse_part(tensor: torch.Tensor) -> runtime_pb2.Tensor:
    return serialize_torch_tensor(tensor, compression_for("topk").compression_type)


def test_topk_parts_round_trip_exactly_for_fp16_values_in_a_few_bytes_per_value() -> None:
    dense = torch.zeros(10_000)
    indices = torch.randperm(10_000, generator=torch.Generator().manual_seed(0))[:100]
    dense[indices] = torch.randn(100).half().float()  # values as error feedback sends them: exact in fp16
    serialized = sparse_part(dense.reshape(100, 100))
    assert serialized.compression == SPARSE_WIRE_TYPE
    assert len(serialized.buffer) < 100 * 4 + 16  # fp16 value plus a 1-2 byte gap each, against 20,000 dense
    decoded = deserialize_torch_tensor(serialized)  # hivemind's registry holds SparseFloat16 for that wire type
    assert decoded.shape == (100, 100) and torch.equal(decoded.view(-1), dense)


def test_a_dense_average_goes_dense_within_fp16_resolution() -> None:
    tensor = torch.randn(4096)
    serialized = sparse_part(tensor)
    message = proto.SparsePart.FromString(serialized.buffer)
    assert message.dense and len(message.index_gaps) == 0 and len(serialized.buffer) < 2 * 4096 + 16
    assert torch.allclose(deserialize_torch_tensor(serialized), tensor, atol=1e-2, rtol=1e-3)


def hostile_sparse_parts() -> list[tuple[str, runtime_pb2.Tensor]]:
    def with_part(**fields: object) -> runtime_pb2.Tensor:
        part = proto.SparsePart(version=1, index_gaps=[2, 3], values=np.array([1.0, -2.0], "<f2").tobytes())
        for name, value in fields.items():
            set_field(part, name, value)
        return runtime_pb2.Tensor(
            compression=SPARSE_WIRE_TYPE, buffer=part.SerializeToString(), size=[8], dtype="float32"
        )

    huge = with_part()
    set_field(huge, "size", [2**16, 2**16])
    int64 = with_part()
    int64.dtype = "int64"
    return [
        ("version 0", with_part(version=0)),
        ("version 2", with_part(version=2)),
        ("an index past the end", with_part(index_gaps=[2, 6])),
        ("indices that repeat", with_part(index_gaps=[2, 0])),
        ("more indices than values", with_part(index_gaps=[1, 1, 1])),
        ("half a value", with_part(values=b"\x00\x3c\x00")),
        ("a NaN", with_part(values=np.array([1.0, np.nan], "<f2").tobytes())),
        ("an infinity", with_part(values=np.array([np.inf, 1.0], "<f2").tobytes())),
        ("dense with too few values", with_part(dense=True, index_gaps=[])),
        ("dense with indices", with_part(dense=True, values=np.ones(8, "<f2").tobytes())),
        ("more places than a part has", huge),
        ("an integer dtype", int64),
        (
            "not a SparsePart",
            runtime_pb2.Tensor(compression=SPARSE_WIRE_TYPE, buffer=b"\xff\xff", size=[8], dtype="float32"),
        ),
    ]


@pytest.mark.parametrize(("label", "message"), hostile_sparse_parts())
def test_a_hostile_topk_part_is_an_error(label: str, message: runtime_pb2.Tensor) -> None:
    with pytest.raises(ValueError):
        SparseFloat16().extract(message)
