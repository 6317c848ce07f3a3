"""How SkipPipe's hops travel: a tensor as a stream of `proto.StageHop` frames, bounded and checked on receipt.

A stream opens with a header (iteration, microbatch, stage, shape, wire dtype) and carries the tensor's bytes in
chunks after it. A receiver checks the header before it reads any value (the stage, the shape [batch, sequence,
hidden] within `HopLimits`, the wire dtype), refuses the payload as soon as it runs over the shape's bytes, and takes
exactly those bytes, every value finite (`receive_frames`, `stream_values`). Both sides read streams so: a node what
its callers send (`stage_service`), a caller what the node answers (`stage_calls`).

Values travel in the wire dtype the caller chose, `float16` by default (half of float32's bytes; SkipPipe's paper
sends activations in half precision); the answer uses the request's dtype. Compute is float32 on the node. A stage's
gradient for its other replicas (`rpc_stage_gradient`) may also travel as `int8` (`codecs.compression`'s int8
blocks: a quarter of float32's bytes), encoded once when it is published. The answer to a background exchange is
paced (`paced_rate`, `paced`), so that it does not fill the queue in front of a link the pipeline's hops share.
"""

from __future__ import annotations

import asyncio
import math
import time
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import torch

from crowdtrain import proto
from crowdtrain.codecs.compression import decode_int8_blocks, encode_int8_blocks, int8_blocks_size
from crowdtrain.errors import CrowdtrainError

NAMESPACE = "crowdtrain.skippipe.v2"
"""Prefix of the hop protocol names; a new, incompatible protocol gets a new one (v2: answers linger until the caller,
who stops reading at the announced size, closes the stream; see `linger`)."""
CHUNK_BYTES = 1 << 20
"""Payload bytes per streamed frame."""
WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""How hidden states and their gradients may travel."""
GRADIENT_DTYPES = (*WIRE_DTYPES, "int8")
"""How a stage's gradient may travel between its replicas."""
BUSY = "busy:"
"""Starts the refusal of a forward that finds the node's memory full (the caller may ask again later)."""
MAX_FINGERPRINT = 1024
"""The most values of a replica's parameter fingerprint (`drift.fingerprint`) a gradient carries."""
PACED_CHUNK_BYTES = 64 << 10
"""Payload bytes per frame of a paced answer (a background exchange's): at most this much is queued ahead of the
pipeline's hops on a link at a time."""
MAX_PACED_S = 20.0
"""A paced answer is sent at least this fast: whatever rate a caller asks for (or this node's share allows), it ends
within this long where the link allows, inside a SkipPipe node's default exchange timeout (30 s)."""


class HopRefusedError(CrowdtrainError):
    """A hop request this node does not run: its sentence goes back to the caller."""


class HopFailedError(CrowdtrainError):
    """A hop to a peer did not give an answer: refused, timed out, unreachable, or a malformed answer."""

    def __init__(self, message: str, *, busy: bool = False, refused: bool = False):
        super().__init__(message)
        self.busy = busy
        """The peer refused only because it holds as many microbatches as it can: worth asking again later."""
        self.refused = refused
        """The peer's handler answered with a refusal: the peer is there (e.g. its schedule differed for a moment)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HopLimits:
    """The largest tensor a hop may carry: [max_batch, max_sequence, hidden_size]."""

    max_batch: int
    max_sequence: int
    hidden_size: int

    def check_shape(self, shape: typing.Sequence[int]) -> tuple[int, ...]:
        """`shape` as a tuple when it is [batch, sequence, hidden] within the limits; else HopRefusedError."""
        if len(shape) != 3:
            raise HopRefusedError(f"hidden states must be [batch, sequence, hidden], got {len(shape)} dimensions")
        batch, sequence, hidden = (int(size) for size in shape)
        if not 1 <= batch <= self.max_batch or not 1 <= sequence <= self.max_sequence or hidden != self.hidden_size:
            raise HopRefusedError(
                f"hidden states of shape {[batch, sequence, hidden]}; this run takes [1..{self.max_batch}, "
                f"1..{self.max_sequence}, {self.hidden_size}]"
            )
        return batch, sequence, hidden

    def max_hop_bytes(self) -> int:
        """The payload of the largest hop, in the widest wire dtype (float32)."""
        return self.max_batch * self.max_sequence * self.hidden_size * WIRE_DTYPES["float32"].itemsize


def wire_bytes(tensor: torch.Tensor, dtype: str) -> bytes:
    """`tensor`'s values as they travel in `dtype` (one of GRADIENT_DTYPES; int8: flattened)."""
    if dtype == "int8":
        return encode_int8_blocks(tensor)
    return tensor.detach().to("cpu", WIRE_DTYPES[dtype]).contiguous().view(torch.uint8).numpy().tobytes()


def wire_size(shape: typing.Sequence[int], dtype: str) -> int:
    """The bytes of a tensor of `shape` in wire dtype `dtype`."""
    numel = math.prod(shape)
    return int8_blocks_size(numel) if dtype == "int8" else numel * WIRE_DTYPES[dtype].itemsize


def wire_values(payload: bytes | bytearray, shape: typing.Sequence[int], dtype: str) -> torch.Tensor:
    """The float32 tensor of `shape` that `payload` (exactly `wire_size` bytes) carries in `dtype`; ValueError if it
    is malformed or holds a value that is not finite."""
    if dtype == "int8":
        tensor = decode_int8_blocks(payload, math.prod(shape)).view(tuple(shape))
    else:
        writable = payload if isinstance(payload, bytearray) else bytearray(payload)  # torch.frombuffer wants one
        tensor = torch.frombuffer(writable, dtype=WIRE_DTYPES[dtype]).view(tuple(shape)).float()
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError("the values hold NaN or infinite ones")
    return tensor


def encode_frames(tensor: torch.Tensor, header: proto.StageHop, dtype: str) -> Iterator[proto.StageHop]:
    """`tensor` as a stream: `header` with its shape and dtype, then its bytes in `CHUNK_BYTES` chunks."""
    return payload_frames(wire_bytes(tensor, dtype), list(tensor.shape), header, dtype)


def payload_frames(
    payload: bytes, shape: typing.Sequence[int], header: proto.StageHop, dtype: str, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[proto.StageHop]:
    """The stream of a tensor of `shape` whose values `payload` carries in `dtype`: `header` with the shape and
    dtype, then the payload in `chunk_bytes` chunks."""
    first = proto.StageHop()
    first.CopyFrom(header)
    first.shape[:] = list(shape)
    first.dtype = dtype
    yield first
    for offset in range(0, len(payload), chunk_bytes):
        yield proto.StageHop(payload=payload[offset : offset + chunk_bytes])


def paced_rate(asked: float, own: float | None, size: int) -> float | None:
    """Bytes per second to send a background answer of `size` bytes at: the slower of the caller's cap `asked`
    (infinity: its link not measured) and this node's own share of its upload `own` (None: not measured), but at
    least what ends it within MAX_PACED_S; None: not paced (a foreground request: `asked` 0, or not a number, or
    neither side measured)."""
    if not asked > 0:  # 0, negative or NaN: a foreground request
        return None
    rate = min(asked, own if own is not None and own > 0 else math.inf)
    return None if math.isinf(rate) else max(rate, size / MAX_PACED_S)


async def paced(frames: Iterator[proto.StageHop], bytes_per_s: float | None) -> AsyncIterator[proto.StageHop]:
    """`frames` as they may go: all at once (`bytes_per_s` None), or each one's payload no sooner than the payload
    before it takes at `bytes_per_s`. A background transfer sent at a link's full speed fills the queue in front of
    that link (the home router's, here the WAN lab's 400 ms of tbf), and every hop of the pipeline behind it waits
    the whole queue: a 512 KB hop over a 25 Mbit/s link took 0.18 s alone, 0.91 s beside a bulk TCP transfer, and
    0.20-0.37 s beside one paced at half the link in 64 KB writes (raw TCP in the WAN lab)."""
    began, sent = time.monotonic(), 0
    for frame in frames:
        if bytes_per_s is not None and (wait := began + sent / bytes_per_s - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        sent += len(frame.payload)
        yield frame


async def receive_frames(
    frames: AsyncIterator[proto.StageHop],
    check_shape: Callable[[typing.Sequence[int]], tuple[int, ...]],
    error: Callable[[str], Exception],
    expected_stage: int | None = None,
    *,
    to_end: bool = True,
    dtypes: typing.Collection[str] = WIRE_DTYPES,
    admit: Callable[[int], None] | None = None,
) -> tuple[proto.StageHop, tuple[int, ...], bytearray]:
    """The header a stream carries, its shape and the payload's bytes (exactly the shape's in the header's dtype),
    checked as the module says, the header's stage against `expected_stage` and its wire dtype against `dtypes`
    before any value is read; raises `error(sentence)`. With `to_end` (a request: the caller ends its stream) a
    frame past the shape's bytes is refused; without it (an answer: the answering node lingers until the caller
    closes) reading stops at the shape's bytes. The values are read by `stream_values`, where the caller likes (a
    stage's gradient off the service's loop). `admit(bytes)`: called once the header is checked, before a byte of
    the payload is read; it raises to refuse the stream (a node that receives as many hops as it may)."""
    header = await anext(frames, None)
    if header is None:
        raise error("the stream ended before its header")
    shape = _checked_shape(header, check_shape, error, expected_stage, dtypes)
    size = wire_size(shape, header.dtype)
    if admit is not None:
        admit(size)
    received = bytearray()
    async for frame in frames:
        received += frame.payload
        if len(received) > size:
            raise error(f"the stream carries more than the {size} bytes of its shape {list(shape)}")
        if len(received) == size and not to_end:
            break
    if len(received) != size:
        raise error(f"the stream ended after {len(received)} of its {size} bytes")
    return header, shape, received


def stream_values(
    header: proto.StageHop, shape: typing.Sequence[int], payload: bytearray, error: Callable[[str], Exception]
) -> torch.Tensor:
    """The float32 tensor `receive_frames`' payload carries; raises `error(sentence)` if it is malformed."""
    try:
        return wire_values(payload, shape, header.dtype)
    except ValueError as e:
        raise error(str(e)) from None


def _checked_shape(
    header: proto.StageHop,
    check_shape: Callable[[typing.Sequence[int]], tuple[int, ...]],
    error: Callable[[str], Exception],
    expected_stage: int | None,
    dtypes: typing.Collection[str],
) -> tuple[int, ...]:
    """The shape a header announces, once its stage, wire dtype and shape passed `receive_frames`' checks."""
    if expected_stage is not None and header.stage != expected_stage:
        raise error(f"this node serves stage {expected_stage}, not {header.stage}")
    if header.dtype not in dtypes:
        raise error(f"wire dtype {header.dtype[:20]!r} is not one of {sorted(dtypes)}")
    if header.payload:
        raise error("the header frame carries values")
    try:
        return check_shape(header.shape)
    except HopRefusedError as e:
        raise error(str(e)) from None


async def prepend(first: proto.StageHop, rest: AsyncIterator[proto.StageHop]) -> AsyncIterator[proto.StageHop]:
    """`rest` with `first` before it (a header read ahead of the stream it opens)."""
    yield first
    async for frame in rest:
        yield frame
