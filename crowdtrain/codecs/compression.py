"""Tensor encodings on the wire, by the manifest's names: `fp16`, `int8`, `topk`, `none`.

`int8` is hivemind's uniform 8-bit quantization (a per-part codebook of 256 levels spanning six standard
deviations around the mean). Symptom worked around: hivemind 1.1.12's 8-bit `extract` calls
`int(np.frombuffer(..., count=1))`, which numpy 2 refuses, so every 8-bit part failed to decode and every
round with it failed ("received 0.0% of input tensors"). `BoundedInt8` decodes it correctly, checks the
sizes a peer sent before using them, and is installed as hivemind's decoder for that wire type.

`topk` is `SparseFloat16`: a part's nonzero values in fp16 with their indices (a `SparsePart` message, versioned),
or all its values when that is smaller. The sparsity comes from DiLoCo's error feedback
(codecs/error_feedback.py), which zeroes all but each tensor's largest values before the all-reduce; the
codec itself is exact for fp16 values, so every peer's part is averaged as it was chosen. A reducer's average of
k-sparse parts is at most (group size × k)-sparse, and goes back in the same encoding.

`encode_int8_blocks` / `decode_int8_blocks` are a flat vector in blocks of INT8_BLOCK values, each block's values
rounded to int8 steps of its largest magnitude / 127 (one float32 scale per block): SkipPipe's gradient exchange
and SPES's expert changes (in blocks of 256) in a quarter of float32's bytes. Unlike the uniform codebook above
(one per part, six deviations wide, values beyond clipped), nothing is clipped, and an outlier coarsens only its
own block.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
)
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2

from crowdtrain import proto

# torch deprecates quantize_per_tensor, which hivemind's quantizer calls once per part: one line per part.
warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor", category=UserWarning)


class BoundedInt8(Uniform8BitQuantization):
    """hivemind's Uniform8BitQuantization with a decoder that works on numpy 2 and trusts no size it is sent."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        if len(buffer) < 8:
            raise ValueError("an 8-bit part shorter than its header")
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        numel = math.prod(serialized_tensor.size)
        if codebook_size != self.n_bins or len(buffer) != 8 + 4 * codebook_size + numel:
            raise ValueError(f"an 8-bit part of {len(buffer)} bytes does not hold {numel} values")
        if serialized_tensor.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"an 8-bit part of dtype {serialized_tensor.dtype!r}")
        codebook = torch.as_tensor(np.frombuffer(buffer, offset=8, count=codebook_size, dtype=np.float32).copy())
        indices = np.frombuffer(buffer, offset=8 + 4 * codebook_size, dtype=np.uint8)
        values = codebook[torch.as_tensor(indices, dtype=torch.int64)].reshape(tuple(serialized_tensor.size))
        return values.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)


hivemind_serialization._BASE_COMPRESSION_TYPES["UNIFORM_8BIT"] = BoundedInt8()

SPARSE_WIRE_TYPE = runtime_pb2.BLOCKWISE_8BIT
"""The hivemind wire type of a SparseFloat16 part. Symptom worked around: hivemind picks a part's decoder by its own
closed enum (runtime_pb2.CompressionType), which can't gain a value without forking its proto. crowdtrain takes the
slot of BLOCKWISE_8BIT, which it never sends (hivemind's blockwise codec needs bitsandbytes, not a dependency); the
buffer is a versioned SparsePart, so a genuine blockwise part is refused, never misread."""
SPARSE_PART_VERSION = 1
"""The SparsePart encoding this crowdtrain writes and the only one it reads."""
MAX_SPARSE_PART_VALUES = DEFAULT_PART_SIZE_BYTES
"""Cap on the values of a sparse part (the product of its size): hivemind cuts tensors into parts of at most
DEFAULT_PART_SIZE_BYTES as SparseFloat16 estimates them (as fp16: 2^18 float32 or 2^19 16-bit values). A few
bytes claiming 10^9 zeros would otherwise cost the decoder 4 GB."""
MAX_PART_DIMENSIONS = 8
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_FP16_MAX = float(torch.finfo(torch.float16).max)


class SparseFloat16(CompressionBase):
    """A tensor part as its nonzero values in fp16 and their indices, or all its values in fp16 when that is
    smaller (proto SparsePart); the decoder trusts no count, index or value it is sent."""

    compression_type = SPARSE_WIRE_TYPE

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        if not tensor.is_floating_point():
            raise ValueError(f"SparseFloat16 does not encode {tensor.dtype} tensors")
        flat = tensor.detach().cpu().reshape(-1).float().clamp(-_FP16_MAX, _FP16_MAX)
        indices = torch.nonzero(flat).view(-1).numpy()
        gaps = np.diff(indices, prepend=0).astype(np.uint32)
        # packed varints: 1 byte per 7 bits of each gap, plus 2 bytes per value, against 2 bytes per value dense
        sparse_bytes = int(np.searchsorted([2**7, 2**14, 2**21, 2**28], gaps, side="right").sum()) + 3 * len(gaps)
        if sparse_bytes < 2 * flat.numel():
            values = flat[torch.from_numpy(indices)].half().numpy().astype("<f2").tobytes()
            part = proto.SparsePart(version=SPARSE_PART_VERSION, index_gaps=gaps.tolist(), values=values)
        else:
            part = proto.SparsePart(version=SPARSE_PART_VERSION, dense=True, values=_fp16_bytes(flat))
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=part.SerializeToString(),
            size=tensor.shape,
            dtype=str(tensor.dtype).removeprefix("torch."),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        size, dtype = tuple(serialized_tensor.size), serialized_tensor.dtype
        if len(size) > MAX_PART_DIMENSIONS or dtype not in FLOAT_DTYPES:
            raise ValueError(f"a sparse part of {len(size)} dimensions and dtype {dtype!r}")
        numel = math.prod(size)
        if numel > MAX_SPARSE_PART_VALUES:
            raise ValueError(f"a sparse part of {numel} values, more than {MAX_SPARSE_PART_VALUES}")
        try:
            part = proto.SparsePart.FromString(serialized_tensor.buffer)
        except DecodeError as e:
            raise ValueError(f"not a SparsePart message: {e}") from None
        if part.version != SPARSE_PART_VERSION:
            raise ValueError(f"a sparse part of version {part.version}; this crowdtrain reads {SPARSE_PART_VERSION}")
        if len(part.values) % 2:
            raise ValueError("a sparse part with half a value")
        values = np.frombuffer(part.values, dtype="<f2")
        if not np.isfinite(values).all():
            raise ValueError("a sparse part with NaN or infinite values")
        if part.dense:
            if len(part.index_gaps) or len(values) != numel:
                raise ValueError(
                    f"a dense part of {len(values)} values and {len(part.index_gaps)} indices, not {numel}"
                )
            flat = torch.from_numpy(values.astype(np.float32))
        else:
            flat = torch.zeros(numel, dtype=torch.float32)
            flat[torch.from_numpy(_sparse_indices(part.index_gaps, len(values), numel))] = torch.from_numpy(
                values.astype(np.float32)
            )
        return flat.reshape(size).to(getattr(torch, dtype)).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # As fp16, so that parts are cut as for fp16: a reducer's average of k-sparse parts can be far denser.
        return 16.0 / (8 * info.descriptor.dtype.itemsize)


def _sparse_indices(index_gaps: Sequence[int], num_values: int, numel: int) -> np.ndarray:
    """The indices of a sparse part from their gaps: one per value, strictly increasing, all below `numel`."""
    if len(index_gaps) != num_values or num_values > numel:
        raise ValueError(f"a sparse part of {num_values} values, {len(index_gaps)} indices and {numel} places")
    gaps = np.asarray(index_gaps, dtype=np.int64)
    if num_values > 1 and int(gaps[1:].min()) < 1:
        raise ValueError("a sparse part whose indices do not increase")
    indices = np.cumsum(gaps)
    if num_values and int(indices[-1]) >= numel:
        raise ValueError(f"a sparse part with index {int(indices[-1])} of {numel} places")
    return indices


def _fp16_bytes(flat: torch.Tensor) -> bytes:
    return flat.half().numpy().astype("<f2").tobytes()


hivemind_serialization._BASE_COMPRESSION_TYPES[runtime_pb2.CompressionType.Name(SPARSE_WIRE_TYPE)] = SparseFloat16()


INT8_BLOCK = 4096
"""Values per block of `encode_int8_blocks` by default (one float32 scale each: 0.1% more bytes than int8 alone)."""


def int8_blocks_size(numel: int, block: int = INT8_BLOCK) -> int:
    """The bytes of `numel` values encoded by `encode_int8_blocks` in blocks of `block` values."""
    return numel + 4 * -(-numel // block)


def encode_int8_blocks(flat: torch.Tensor, block: int = INT8_BLOCK) -> bytes:
    """A flat float tensor as its blocks' scales (little-endian float32, one per `block` values: the block's largest
    magnitude / 127), then its values as int8 multiples of their block's scale, rounded to nearest: no value is
    clipped, each is off by at most half its block's step."""
    flat = flat.detach().to("cpu", torch.float32).reshape(-1)
    blocks = -(-flat.numel() // block)
    padded = torch.nn.functional.pad(flat, (0, blocks * block - flat.numel())).view(blocks, block)
    scales = padded.abs().amax(dim=1) / 127.0
    steps = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)  # an all-zero block stays zero
    values = torch.round(padded / steps).clamp_(-127, 127).to(torch.int8).reshape(-1)[: flat.numel()]
    return scales.numpy().astype("<f4").tobytes() + values.numpy().tobytes()


def decode_int8_blocks(payload: bytes | bytearray, numel: int, block: int = INT8_BLOCK) -> torch.Tensor:
    """The float32 values `encode_int8_blocks` encoded in blocks of `block`, `numel` of them; ValueError unless
    `payload` is exactly their bytes with finite, non-negative scales and values within ±127."""
    if len(payload) != int8_blocks_size(numel, block):
        raise ValueError(f"{len(payload)} bytes of int8 blocks do not hold {numel} values")
    blocks = -(-numel // block)
    scales = torch.from_numpy(np.frombuffer(payload, dtype="<f4", count=blocks).astype(np.float32))
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError("int8 blocks with a negative or non-finite scale")
    values = torch.from_numpy(np.frombuffer(payload, dtype=np.int8, offset=4 * blocks).copy())
    if bool((values == -128).any()):
        raise ValueError("int8 blocks with a value outside ±127")
    padded = torch.nn.functional.pad(values.float(), (0, blocks * block - numel)).view(blocks, block)
    return (padded * scales.unsqueeze(1)).reshape(-1)[:numel]


@dataclass(frozen=True, slots=True)
class Codec:
    """A wire encoding of averaged tensors, by its manifest name, with what the rest of the code needs to know of it:
    chosen once from the manifest (`codec_for`), never compared by name elsewhere."""

    name: str
    make: Callable[[], CompressionBase]
    """A new hivemind encoder and decoder of parts on the wire (one per averager)."""
    wire_type: runtime_pb2.CompressionType.ValueType
    """The hivemind wire slot its parts travel in (hivemind picks a part's decoder by it)."""
    bytes_per_value: int
    """Wire bytes per value of a dense tensor (top-k: per value it sends); what the plan partitions."""
    lossy: bool
    """Whether a value comes out of the wire other than it went in (every member must then apply the decoded
    average, not its own exact one: averaging/traffic.py)."""
    error_feedback: bool
    """Whether a sender sends only part of each tensor and keeps the rest back for its next round
    (codecs/error_feedback.py); an average of such parts is sparse, which robust aggregation can't judge."""


CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        Codec("fp16", Float16Compression, runtime_pb2.FLOAT16, 2, lossy=True, error_feedback=False),
        Codec("int8", BoundedInt8, runtime_pb2.UNIFORM_8BIT, 1, lossy=True, error_feedback=False),
        Codec("topk", SparseFloat16, SPARSE_WIRE_TYPE, 2, lossy=True, error_feedback=True),
        Codec("none", NoCompression, runtime_pb2.NONE, 4, lossy=False, error_feedback=False),
    )
}
"""Every codec a manifest may name (which of them a section admits is the section's: `manifest/specs.py`,
`modes/diloco/settings.py`)."""


def codec_for(name: str) -> Codec:
    """The codec a manifest names; ValueError for an unknown name."""
    codec = CODECS.get(name)
    if codec is None:
        raise ValueError(f"unknown compression {name!r}")
    return codec


def compression_for(name: str) -> CompressionBase:
    """A new encoder of the codec a manifest names."""
    return codec_for(name).make()
