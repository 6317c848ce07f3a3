"""Tensor encodings on the wire, by the manifest's names: `fp16`, `int8`, `none`.

`int8` is hivemind's uniform 8-bit quantization (a per-part codebook of 256 levels spanning six standard
deviations around the mean). Symptom worked around: hivemind 1.1.12's 8-bit `extract` calls
`int(np.frombuffer(..., count=1))`, which numpy 2 refuses, so every 8-bit part failed to decode and every
round with it failed ("received 0.0% of input tensors"). `BoundedInt8` decodes it correctly, checks the
sizes a peer sent before using them, and is installed as hivemind's decoder for that wire type.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2

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


def compression_for(name: str) -> CompressionBase:
    """The encoding a manifest names: `fp16`, `int8` or `none`."""
    if name == "fp16":
        return Float16Compression()
    if name == "int8":
        return BoundedInt8()
    if name == "none":
        return NoCompression()
    raise ValueError(f"unknown compression {name!r}")
