"""SkipPipe's pipeline hops: a node serves its stage's layers to the stage-0 nodes whose microbatches visit it.

A stage-0 node (the microbatch's source) sends the hidden states of a microbatch to a node of the next stage on
its path (`rpc_stage_forward`); the node runs its stage's decoder layers on them, keeps the input and output for
the backward, and answers the output. When the source's backward comes back along the path it sends the gradient
of that output (`rpc_stage_backward`); the node runs its layers' backward, which adds to its parameters' `.grad`
(the iteration's gradient), and answers the gradient of the input. Only hidden states travel: positions and the
causal mask are rebuilt from the shape (`StagedModel.activations`), as every layer of a decoder LM computes them.

Everything a caller sends is bounded and checked before it runs: a header first (`proto.StageHop`: iteration,
microbatch, stage, shape, wire dtype), the stage must be this node's, the shape [batch, sequence, hidden] within
`HopLimits`, the payload exactly the shape's bytes (refused as soon as it runs over), every value finite; a
backward must name a forward this node holds for the same caller, with the output's shape. A node holds at most
`memory_microbatches` forwards at once (a forward waits up to `slot_wait_s` for a slot, then the caller gets
"busy" and goes to another replica) and forgets one whose backward did not come within `hold_s` (its source died
or gave up on it). A refusal is one log line here and its sentence at the caller. An answer ends by waiting for the
caller to close the stream (`dht.service.linger`): a stream the answering node closed first lost its answer about
once per full test-suite run under load (the caller saw "the stream ended before its header").

Values travel in the wire dtype the caller chose, `float16` by default (half of float32's bytes; SkipPipe's paper
sends activations in half precision); the answer uses the request's dtype. Compute is float32 on the node. A stage's
gradient for its other replicas (`rpc_stage_gradient`) may also travel as `int8` (`averaging.compression`'s int8
blocks: a quarter of float32's bytes), encoded once when it is published.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import typing
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import hivemind
import torch
from hivemind.p2p import P2PContext, PeerID

from crowdtrain import proto
from crowdtrain.averaging.compression import decode_int8_blocks, encode_int8_blocks, int8_blocks_size
from crowdtrain.dht.service import P2PService, drain, linger
from crowdtrain.errors import CrowdtrainError
from crowdtrain.modes.skippipe.device_clock import DeviceClock, finish_of
from crowdtrain.modes.skippipe.stages import StagedModel

logger = logging.getLogger(__name__)

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
SLOT_WAIT_S = 10.0
"""How long a forward that finds the node's memory full waits for a slot before it is refused as busy."""
OPEN_WAIT_S = 10.0
"""How long a forward of the next iteration waits for this node to finish stepping the last."""
GRADIENT_RETRY_S = 0.02
"""Between asks for a replica's gradient that is not published yet."""
GRADIENT_WAIT_S = 2.0
"""How long a request for this node's gradient of an iteration it has not published yet waits for it before it is
answered with none (the caller asks again): a replica that is done with its share of an iteration before this one
asks at once, and gets the gradient the moment it is published, without a stream of asks."""
MAX_GRADIENT_WAITS = 16
"""Requests for a gradient not yet published held at once, from all peers (a stage's replicas send one each at a
time); more are answered at once with none, so that no peer can make this node hold a crowd of them."""
MAX_ITERATIONS_AHEAD = 64
"""Done messages are kept for at most this many iterations at once, from the open one on (the rest are dropped)."""
MAX_DONE_MICROBATCHES = 1 << 20
"""A done message's count of microbatches above this is not believed (its loss is left out)."""
MAX_FINGERPRINT = 1024
"""The most values of a replica's parameter fingerprint (`pipeline.iteration.fingerprint`) a gradient carries."""
DEFAULT_HOLD_S = 120.0
"""A forward whose backward has not come after this long is dropped (its source died or gave up)."""
PACED_CHUNK_BYTES = 64 << 10
"""Payload bytes per frame of a paced answer (a background exchange's): at most this much is queued ahead of the
pipeline's hops on a link at a time."""
MAX_PACED_S = 20.0
"""A paced answer is sent at least this fast: whatever rate a caller asks for (or this node's share allows), it ends
within this long where the link allows, inside a SkipPipe node's default exchange timeout (30 s)."""

T = TypeVar("T")
_Published = tuple[int, bytes, torch.Tensor, str]
"""A published gradient: how many values, their wire bytes, the fingerprint, the wire dtype."""


class HopRefusedError(CrowdtrainError):
    """A hop request this node does not run: its sentence goes back to the caller."""


class HopFailedError(CrowdtrainError):
    """A hop to a peer did not give an answer: refused, timed out, unreachable, or a malformed answer."""

    def __init__(self, message: str, *, busy: bool = False):
        super().__init__(message)
        self.busy = busy
        """The peer refused only because it holds as many microbatches as it can: worth asking again later."""


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
) -> tuple[proto.StageHop, tuple[int, ...], bytearray]:
    """The header a stream carries, its shape and the payload's bytes (exactly the shape's in the header's dtype),
    checked as the module says, the header's stage against `expected_stage` and its wire dtype against `dtypes`
    before any value is read; raises `error(sentence)`. With `to_end` (a request: the caller ends its stream) a
    frame past the shape's bytes is refused; without it (an answer: the answering node lingers until the caller
    closes) reading stops at the shape's bytes. The values are read by `stream_values`, where the caller likes (a
    stage's gradient off the service's loop)."""
    header = await anext(frames, None)
    if header is None:
        raise error("the stream ended before its header")
    shape = _checked_shape(header, check_shape, error, expected_stage, dtypes)
    size = wire_size(shape, header.dtype)
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


@dataclass(slots=True)
class _Held:
    """A forward this node ran and whose backward it waits for."""

    inputs: torch.Tensor
    outputs: torch.Tensor
    since: float
    forward_s: float = 0.0
    """Seconds the forward held the device (`DeviceClock`)."""


class StageService(P2PService):
    """Serves one stage of `staged` to callers (forward and backward hops) and calls other nodes' stages."""

    def __init__(
        self,
        dht: hivemind.DHT,
        staged: StagedModel,
        stage: int,
        limits: HopLimits,
        *,
        memory_microbatches: int = 4,
        hold_s: float = DEFAULT_HOLD_S,
        slot_wait_s: float = SLOT_WAIT_S,
    ):
        super().__init__(dht, NAMESPACE, thread_name=f"skippipe-stage{stage}")
        _quiet_refusals()
        if memory_microbatches < 1:
            raise ValueError(f"memory_microbatches must be >= 1, got {memory_microbatches}")
        self.staged, self.stage, self.limits = staged, stage, limits
        self.memory_microbatches, self.hold_s, self.slot_wait_s = memory_microbatches, hold_s, slot_wait_s
        self.model_lock = threading.Lock()
        """Held while the stage's layers run forward or backward: take it to step the stage's optimizer."""
        self.device = DeviceClock(finish=finish_of(staged.device))
        """Seconds the model lock was held per visit served (a forward and its backward) or, on a stage-0 node, per
        microbatch driven (`PipelineDriver`)."""
        self._held: OrderedDict[tuple[str, int, int], _Held] = OrderedDict()
        self._held_lock = threading.Lock()
        self._backwards: dict[int, set[tuple[str, int]]] = {}
        """(source, microbatch) of each backward run here, by iteration (until it finishes)."""
        self._backwards_changed = threading.Condition(self._held_lock)
        self.bytes_received = self.bytes_sent = 0
        """Payload bytes this node sent and received: hops (as a source and as a stage), gradients and states."""
        self._open: int | None = None
        """The iteration whose forwards are served (later ones wait for it, then are refused); None: any."""
        self._done_from: int | None = None
        """Done messages are kept from this iteration on (`_keeps_done`); None: the newest ones."""
        self._done: dict[int, set[str]] = {}
        self._losses: dict[int, dict[str, tuple[float, int]]] = {}
        self._rows: Counter[int] = Counter()
        self._gradients: OrderedDict[int, _Published] = OrderedDict()
        """Published gradients by iteration: (how many values, their wire bytes, fingerprint, wire dtype)."""
        self._state_source: Callable[[], tuple[int, int, torch.Tensor]] | None = None
        self._state_reads = asyncio.Semaphore(1)  # one state snapshot at a time: each copies the whole stage
        self._gradient_waits = 0
        """Gradient requests held now (`rpc_stage_gradient`), at most MAX_GRADIENT_WAITS; only the service's loop
        touches it."""
        self.background_bytes_per_s: float | None = None
        """The share of this node's upload a background exchange's answer may take (`paced_rate`); None: not
        measured (only the caller's cap paces it)."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return f"{namespace}::StageService.{method_name}"  # one protocol name, whatever subclass serves it

    # ----- serving -----

    async def rpc_stage_forward(
        self, requests: typing.AsyncIterator[proto.StageHop], context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        """Run this stage on a microbatch's hidden states; keep what its backward needs; answer the outputs."""
        header, inputs = await self._receive(requests, "forward", context, wait_open=True)
        key = (context.remote_id.to_base58(), header.iteration, header.microbatch)
        await self._reserve(key, context)
        try:
            outputs = await asyncio.to_thread(self._forward, key, inputs)
        except BaseException:
            with self._held_lock:
                self._held.pop(key, None)
            raise
        for frame in encode_frames(outputs, _reply_header(header), header.dtype):
            self.bytes_sent += len(frame.payload)
            yield frame
        await linger()

    async def rpc_stage_backward(
        self, requests: typing.AsyncIterator[proto.StageHop], context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        """Run this stage's backward for a microbatch it ran forward for the caller; answer the inputs' gradient."""
        header, grad_outputs = await self._receive(requests, "backward", context)
        key = (context.remote_id.to_base58(), header.iteration, header.microbatch)
        with self._held_lock:
            held = self._held.pop(key, None)
        if held is None:
            self._refuse(
                f"no forward of microbatch {header.microbatch} of iteration {header.iteration}", "backward", context
            )
        if held.outputs.shape != grad_outputs.shape:
            self._refuse(
                f"a gradient of shape {list(grad_outputs.shape)} for outputs of {list(held.outputs.shape)}",
                "backward",
                context,
            )
        grad_inputs = await asyncio.to_thread(self._backward, held, grad_outputs)
        with self._backwards_changed:
            self._backwards.setdefault(header.iteration, set()).add((key[0], header.microbatch))
            self._backwards_changed.notify_all()
        for frame in encode_frames(grad_inputs, _reply_header(header), header.dtype):
            self.bytes_sent += len(frame.payload)
            yield frame
        await linger()

    async def rpc_stage_done(self, request: proto.StageHop, context: P2PContext) -> proto.StageHop:
        """A source says it ran every microbatch of `request.iteration` it will: no more backwards from it."""
        with self._backwards_changed:
            peer = context.remote_id.to_base58()
            kept = self._keeps_done(request.iteration)
            if kept:
                self._done.setdefault(request.iteration, set()).add(peer)
                self._backwards_changed.notify_all()
            # the loss of the iteration this node just finished is kept too: a node done early steps before the
            # sources' done messages come, and reports the loss of the iteration before (`sources_losses`)
            just_finished = self._done_from is not None and request.iteration == self._done_from - 1
            if kept or just_finished:
                if math.isfinite(request.loss) and 0 < request.microbatches <= MAX_DONE_MICROBATCHES:
                    self._losses.setdefault(request.iteration, {})[peer] = (request.loss, request.microbatches)
        return proto.StageHop(iteration=request.iteration, stage=self.stage)

    def _keeps_done(self, iteration: int) -> bool:
        """Whether a done message of `iteration` is kept: while this node runs iterations, from the open one on,
        within MAX_ITERATIONS_AHEAD; before its first one and while it is held (`hold`), the newest
        MAX_ITERATIONS_AHEAD iterations' (older ones are dropped). Under the lock."""
        if self._done_from is not None:
            return self._done_from <= iteration <= self._done_from + MAX_ITERATIONS_AHEAD
        if iteration in self._done or len(self._done) < MAX_ITERATIONS_AHEAD:
            return True
        oldest = min(self._done)
        if oldest > iteration:
            return False
        self._done.pop(oldest)
        self._losses.pop(oldest, None)
        return True

    async def rpc_stage_ping(self, request: proto.StageHop, context: P2PContext) -> proto.StageHop:
        """Whether this node is still there, and the iteration it serves (`iteration`; 0 before any)."""
        return proto.StageHop(iteration=max(self._open or 0, 0), stage=self.stage)

    async def rpc_stage_gradient(
        self, request: proto.StageHop, context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        """This replica's gradient of `request.iteration` (flattened, in the dtype it was published in), for the
        stage's other replicas, waiting up to GRADIENT_WAIT_S for it (while fewer than MAX_GRADIENT_WAITS requests
        wait); a header with no shape while it is not ready (yet, or any more). A background request
        (`max_bytes_per_s`) is answered paced (`paced_rate`, `paced`)."""
        published = self._published(request)
        if published is None and self._gradient_waits < MAX_GRADIENT_WAITS:
            self._gradient_waits += 1
            try:
                deadline = time.monotonic() + GRADIENT_WAIT_S
                while published is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                    published = self._published(request)
            finally:
                self._gradient_waits -= 1
        if not published:
            yield proto.StageHop(iteration=request.iteration, stage=self.stage)
        else:
            numel, payload, fingerprint, dtype = published
            header = _reply_header(request)
            header.fingerprint[:] = fingerprint.tolist()
            rate = paced_rate(request.max_bytes_per_s, self.background_bytes_per_s, len(payload))
            chunk_bytes = CHUNK_BYTES if rate is None else PACED_CHUNK_BYTES
            async for frame in paced(payload_frames(payload, [numel], header, dtype, chunk_bytes), rate):
                self.bytes_sent += len(frame.payload)
                yield frame
        await linger()

    def _published(self, request: proto.StageHop) -> _Published | typing.Literal[False] | None:
        """This node's gradient that `request` asks for, as published; None: not yet; False: none will come (of
        another stage than this node's, or older than those kept)."""
        with self._held_lock:
            if request.stage != self.stage:
                return False
            if request.iteration in self._gradients:
                return self._gradients[request.iteration]
            return False if self._gradients and request.iteration < next(iter(self._gradients)) else None

    async def rpc_stage_state(
        self, request: proto.StageHop, context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        """This node's state of its stage for a joining replica (`set_state_source`): a header naming the last
        finished iteration and the optimizer's steps, then float32 values; a header with no shape if none, or if
        the last finished iteration is before the one asked for (`request.iteration`)."""
        source = self._state_source
        if request.stage != self.stage or source is None:
            yield proto.StageHop(stage=self.stage)
        else:
            async with self._state_reads:
                iteration, steps, values = await asyncio.to_thread(self._snapshot, source)
                if iteration < max(request.iteration, 0):  # none taken (nothing a joiner can't build), or too old
                    yield proto.StageHop(stage=self.stage)
                else:
                    header = proto.StageHop(iteration=iteration, stage=self.stage, optimizer_steps=steps)
                    for frame in encode_frames(values, header, "float32"):
                        self.bytes_sent += len(frame.payload)
                        yield frame
        await linger()

    def _snapshot(self, source: Callable[[], tuple[int, int, torch.Tensor]]) -> tuple[int, int, torch.Tensor]:
        with self.model_lock:  # between steps: parameters and optimizer state of one iteration
            return source()

    def set_state_source(self, source: Callable[[], tuple[int, int, torch.Tensor]] | None) -> None:
        """Serve `source()` to joining replicas: (the last finished iteration, the optimizer's steps, float32
        values), read under `model_lock`; None: serve nothing."""
        self._state_source = source

    async def _wait_open(self, iteration: int, context: P2PContext) -> None:
        """With iterations opened (`open_iteration`): a forward of the next one waits until it opens (this node
        still steps the last), one of a closed iteration is refused."""
        deadline = time.monotonic() + OPEN_WAIT_S
        while self._open is not None and iteration > self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if self._open is not None and iteration != self._open:
            reason = "is over" if iteration < self._open else "has not begun"
            self._refuse(f"{BUSY} iteration {iteration} {reason} here (at {self._open})", "forward", context)

    def _forward(self, key: tuple[str, int, int], inputs: torch.Tensor) -> torch.Tensor:
        with self._held_lock:
            self._rows[key[1]] += inputs.shape[0]
        spent: list[float] = []
        with self.device.timed(self.model_lock, spent):
            inputs.requires_grad_(True)
            outputs = self.staged.run_stage(self.stage, self.staged.activations(inputs)).hidden_states
        with self._held_lock:
            held = self._held.get(key)
            if held is not None:  # still reserved (not expired meanwhile)
                held.inputs, held.outputs, held.forward_s = inputs, outputs, spent[0]
        return outputs.detach()

    def _backward(self, held: _Held, grad_outputs: torch.Tensor) -> torch.Tensor:
        spent = [held.forward_s]
        with self.device.timed(self.model_lock, spent):
            torch.autograd.backward(held.outputs, grad_outputs.to(held.outputs.device))
        self.device.record(sum(spent))
        assert held.inputs.grad is not None
        return held.inputs.grad

    async def _reserve(self, key: tuple[str, int, int], context: P2PContext) -> None:
        """Take one of the `memory_microbatches` slots for `key`, after dropping forwards held past `hold_s`;
        waits up to `slot_wait_s` for a slot to free (a backward ending), then refuses as busy."""
        deadline = time.monotonic() + self.slot_wait_s
        while True:
            now = time.monotonic()
            with self._held_lock:
                for old in [old for old, held in self._held.items() if now - held.since > self.hold_s]:
                    logger.info(f"dropped microbatch {old[2]} of iteration {old[1]} from {old[0][-8:]}: no backward")
                    del self._held[old]
                if key in self._held:
                    self._refuse(f"microbatch {key[2]} of iteration {key[1]} is already held", "forward", context)
                if len(self._held) < self.memory_microbatches:
                    empty = torch.empty(0)
                    self._held[key] = _Held(inputs=empty, outputs=empty, since=now)
                    return
                held = len(self._held)
            if now >= deadline:
                self._refuse(f"{BUSY} holds {held} microbatches, its memory's limit", "forward", context)
            await asyncio.sleep(0.005)

    async def _receive(
        self, requests: AsyncIterator[proto.StageHop], call: str, context: P2PContext, *, wait_open: bool = False
    ) -> tuple[proto.StageHop, torch.Tensor]:
        """The hop a caller sends, checked (`receive_frames`) against the stage this node serves. With `wait_open`
        (a forward) the header's iteration is waited for first (`_wait_open`): a node that moves to another stage
        at that iteration serves it from then on, so a forward sent by a node already there is not refused for
        its stage (a CI run: the leader dropped a moving node that refused one, and the stage went unserved)."""

        def refused(reason: str) -> Exception:
            logger.warning(f"refused a stage {call} from peer {context.remote_id.to_base58()[-8:]}: {reason}")
            return HopRefusedError(f"stage {call} refused: {reason}")

        first = await anext(requests, None)
        try:
            if first is not None and wait_open:
                await self._wait_open(first.iteration, context)
            frames = _prepend(first, requests) if first is not None else requests
            header, shape, payload = await receive_frames(
                frames, self.limits.check_shape, refused, expected_stage=self.stage
            )
            tensor = stream_values(header, shape, payload, refused)
        except HopRefusedError:
            await drain(requests)  # so that the refusal reaches the caller
            raise
        self.bytes_received += tensor.numel() * WIRE_DTYPES[header.dtype].itemsize
        return header, tensor

    def _refuse(self, reason: str, call: str, context: P2PContext) -> NoReturn:
        logger.warning(f"refused a stage {call} from peer {context.remote_id.to_base58()[-8:]}: {reason}")
        raise HopRefusedError(f"stage {call} refused: {reason}")

    # ----- the stage's iteration -----

    def set_stage(self, stage: int, memory_microbatches: int) -> None:
        """Serve `stage` from now on (between iterations: forwards held and gradients published are dropped)."""
        if memory_microbatches < 1:
            raise ValueError(f"memory_microbatches must be >= 1, got {memory_microbatches}")
        with self.model_lock, self._held_lock:
            self.stage, self.memory_microbatches = stage, memory_microbatches
            self._held.clear()
            self.device.clear()
            self._gradients.clear()

    def open_iteration(self, iteration: int) -> None:
        """Serve forwards of `iteration` from now on (and refuse those of others)."""
        with self._held_lock:
            self._open = self._done_from = iteration

    def hold(self, iteration: int) -> None:
        """While this node runs no iteration (starting, joining, or left out of the roster) and does not know its
        next one: serve no forward past `iteration` (those of later ones wait, then are refused), and keep the done
        messages of the newest MAX_ITERATIONS_AHEAD iterations, whichever its next turns out to be. Before, a node
        held at iteration -1 kept only iterations -1..63: a joiner entering a swarm at iteration 487 dropped the
        other sources' done messages, waited for them until its replica gave up on it, and was dropped from the
        roster (a fresh-clone CI run)."""
        with self._held_lock:
            self._open, self._done_from = iteration, None

    def wait_sources(
        self,
        iteration: int,
        sources: typing.Collection[str],
        timeout_s: float,
        backwards: typing.Collection[tuple[str, int]] | None = None,
    ) -> set[str]:
        """Wait until every one of `sources` said it is done with `iteration`, or the backwards of every one of
        `backwards` ((source, microbatch); None: not these) ran here, or `timeout_s`; the sources that said so."""
        deadline = time.monotonic() + timeout_s
        with self._backwards_changed:
            while (
                not set(sources) <= self._done.get(iteration, set())
                and not (backwards is not None and set(backwards) <= self._backwards.get(iteration, set()))
                and (left := deadline - time.monotonic()) > 0
            ):
                self._backwards_changed.wait(left)
            return self._done.get(iteration, set()) & set(sources)

    def publish_gradient(
        self, iteration: int, gradient: torch.Tensor, fingerprint: torch.Tensor, dtype: str = "float32"
    ) -> torch.Tensor:
        """Serve `gradient` (flattened) as this replica's of `iteration`, sent as `dtype` (one of GRADIENT_DTYPES),
        with the `fingerprint` of its parameters before the iteration's step (float32, at most MAX_FINGERPRINT
        values); the last two are kept. The float32 values the other replicas will receive (where every replica
        must sum the same bits, this node's own term is these)."""
        if fingerprint.numel() > MAX_FINGERPRINT:
            raise ValueError(f"a fingerprint holds at most {MAX_FINGERPRINT} values")
        if dtype not in GRADIENT_DTYPES:
            raise ValueError(f"a gradient travels as one of {sorted(GRADIENT_DTYPES)}, not {dtype!r}")
        payload = wire_bytes(gradient.reshape(-1), dtype)
        sent = wire_values(payload, [gradient.numel()], dtype)
        with self._held_lock:
            self._gradients[iteration] = (gradient.numel(), payload, fingerprint.detach().float().cpu(), dtype)
            while len(self._gradients) > 2:
                self._gradients.popitem(last=False)
        return sent

    def backwards_run(self, iteration: int) -> set[tuple[str, int]]:
        """(source, microbatch) of each backward of `iteration` run here (until it finishes)."""
        with self._held_lock:
            return set(self._backwards.get(iteration, ()))

    def finish_iteration(self, iteration: int) -> int:
        """Forget `iteration`'s held forwards and backward count (its step is taken); how many forwards were still
        held without their backward."""
        with self._held_lock:
            stale = [key for key in self._held if key[1] <= iteration]
            for key in stale:
                del self._held[key]
            for old in [old for old in self._backwards if old <= iteration]:
                del self._backwards[old]
            for old in [old for old in self._done if old <= iteration]:
                del self._done[old]
            for old in [old for old in self._losses if old < iteration]:  # its own: for late done messages
                del self._losses[old]
            for old in [old for old in self._rows if old <= iteration]:
                del self._rows[old]
        return len(stale)

    def sources_losses(self, iteration: int) -> list[tuple[float, int]]:
        """(mean loss, microbatches) of each source that said it is done with `iteration` (until the next one
        finishes)."""
        with self._held_lock:
            return list(self._losses.get(iteration, {}).values())

    def rows_served(self, iteration: int) -> int:
        """Sequences whose hidden states this node ran forward in `iteration` (until it finishes)."""
        with self._held_lock:
            return self._rows[iteration]

    @property
    def held_microbatches(self) -> int:
        with self._held_lock:
            return len(self._held)

    # ----- calling other nodes -----

    def call(
        self, peer_id: str, call: str, header: proto.StageHop, tensor: torch.Tensor, timeout_s: float
    ) -> torch.Tensor:
        """Send `tensor` to `peer_id`'s `rpc_stage_<call>` ("forward" or "backward") under `header` (iteration,
        microbatch, stage, wire dtype) and return its answer, float32; HopFailedError with a sentence if none."""
        where = f"peer {peer_id[-8:]}"
        try:
            return self.run(self._call(PeerID.from_base58(peer_id), call, header, tensor, where), timeout_s)
        except HopFailedError:
            raise
        except TimeoutError:
            raise HopFailedError(f"{where} did not answer a stage {call} within {timeout_s:.1f} s") from None
        except Exception as e:
            raise HopFailedError(f"{where} failed a stage {call}: {e}", busy=BUSY in str(e)) from None

    async def _call(
        self, peer: PeerID, call: str, header: proto.StageHop, tensor: torch.Tensor, where: str
    ) -> torch.Tensor:
        async def frames() -> AsyncIterator[proto.StageHop]:
            for frame in encode_frames(tensor, header, header.dtype):
                self.bytes_sent += len(frame.payload)
                yield frame

        answers = await getattr(self._stub(peer), f"rpc_stage_{call}")(frames())
        try:

            def failed(reason: str) -> HopFailedError:
                return HopFailedError(f"{where}: {reason}")

            reply, shape, payload = await receive_frames(answers, self.limits.check_shape, failed, to_end=False)
            answer = stream_values(reply, shape, payload, failed)
        finally:
            await answers.aclose()
        self.bytes_received += answer.numel() * WIRE_DTYPES[reply.dtype].itemsize
        if (reply.iteration, reply.microbatch, reply.stage) != (header.iteration, header.microbatch, header.stage):
            raise HopFailedError(f"{where} answered for another microbatch or stage")
        if answer.shape != tensor.shape:
            raise HopFailedError(f"{where} answered shape {list(answer.shape)} for {list(tensor.shape)}")
        return answer

    def _stub(self, peer: PeerID | str) -> typing.Any:
        """The stub that calls `peer`'s stage RPCs."""
        peer_id = PeerID.from_base58(peer) if isinstance(peer, str) else peer
        return self.get_stub(self.require_p2p(), peer_id, namespace=NAMESPACE)

    def say_done(
        self, peers: typing.Collection[str], iteration: int, timeout_s: float, loss: float = 0.0, microbatches: int = 0
    ) -> list[str]:
        """Tell each of `peers`, all at once, that this source will send no more of `iteration` (and the mean `loss`
        of its `microbatches`); the peers that could not be told (each logged)."""
        request = proto.StageHop(iteration=iteration, loss=loss, microbatches=microbatches)

        async def tell(peer_id: str) -> str | None:
            try:
                await self._stub(peer_id).rpc_stage_done(request, timeout=timeout_s)  # the stub bounds it
            except Exception as e:
                logger.info(f"peer {peer_id[-8:]} was not told iteration {iteration} is done: {e!r}")
                return peer_id
            return None

        async def tell_all() -> list[str | None]:
            return await asyncio.gather(*(tell(peer) for peer in peers))

        return [peer for peer in self.run(tell_all(), timeout_s + 1.0) if peer is not None]

    def ping(self, peer_id: str, timeout_s: float) -> int | None:
        """The iteration `peer_id` serves (0 before any), or None if it does not answer within `timeout_s`."""
        try:
            answer = self.run(self._stub(peer_id).rpc_stage_ping(proto.StageHop(), timeout=timeout_s), timeout_s + 1.0)
        except Exception as e:
            logger.debug(f"peer {peer_id[-8:]} did not answer a ping: {e!r}")
            return None
        return int(answer.iteration)

    def fetch_gradient(
        self, peer_id: str, iteration: int, num_values: int, timeout_s: float, max_bytes_per_s: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`peer_id`'s gradient of `iteration` for this node's stage, `num_values` values (float32, whatever wire
        dtype they came in), and the fingerprint of its parameters before the step (None unless it sent one of
        MAX_FINGERPRINT finite values or fewer); waits up to `timeout_s` for it to be published; HopFailedError if
        it is not had. `max_bytes_per_s` > 0: a background exchange, to be sent paced at most this fast (infinity:
        at the answering node's own share of its upload)."""
        request = proto.StageHop(iteration=iteration, stage=self.stage, max_bytes_per_s=max_bytes_per_s)
        what = f"gradient of iteration {iteration}"
        header, gradient = self._fetch_flat(peer_id, "gradient", request, num_values, timeout_s, what)
        fingerprint = torch.tensor(list(header.fingerprint[:MAX_FINGERPRINT]), dtype=torch.float32)
        if len(header.fingerprint) > MAX_FINGERPRINT or not bool(fingerprint.isfinite().all()):
            return gradient, None
        return gradient, fingerprint

    def fetch_state(
        self, peer_id: str, num_values: int, timeout_s: float, stage: int | None = None, since: int = 0
    ) -> tuple[proto.StageHop, torch.Tensor]:
        """`peer_id`'s state of `stage` (default: this node's; `set_state_source`'s layout, `num_values` float32
        values) and its header (the iteration it is from, `since` or later, and the optimizer's steps), waiting
        up to `timeout_s` for one; HopFailedError if not had."""
        request = proto.StageHop(stage=self.stage if stage is None else stage, iteration=since)
        return self._fetch_flat(peer_id, "state", request, num_values, timeout_s, "state")

    def _fetch_flat(
        self, peer_id: str, call: str, request: proto.StageHop, num_values: int, timeout_s: float, what: str
    ) -> tuple[proto.StageHop, torch.Tensor]:
        where = f"peer {peer_id[-8:]}"
        deadline = time.monotonic() + timeout_s
        try:
            fetching = self._fetch(PeerID.from_base58(peer_id), call, request, num_values, deadline, where, what)
            reply, payload = self.run(fetching, timeout_s + 1.0)
        except HopFailedError:
            raise
        except Exception as e:
            raise HopFailedError(f"{where} did not send its {what}: {e!r}") from None
        # in the calling thread: a stage's gradient (millions of values) decoded on the loop held up every hop
        return reply, stream_values(reply, [num_values], payload, lambda reason: HopFailedError(f"{where}: {reason}"))

    async def _fetch(
        self,
        peer: PeerID,
        call: str,
        request: proto.StageHop,
        num_values: int,
        deadline: float,
        where: str,
        what: str,
    ) -> tuple[proto.StageHop, bytearray]:
        """The header and the bytes of one vector of `num_values` from `rpc_stage_<call>` (in the header's dtype,
        not decoded), asking again while the peer has none yet."""

        def flat(shape: typing.Sequence[int]) -> tuple[int, ...]:
            if list(shape) != [num_values]:
                raise HopRefusedError(f"a {what} of shape {list(shape)[:4]}, not [{num_values}]")
            return (num_values,)

        stub = self._stub(peer)
        while True:
            answers = await getattr(stub, f"rpc_stage_{call}")(request)
            try:
                header = await anext(answers, None)
                if header is not None and header.shape:
                    if header.stage != request.stage:
                        raise HopFailedError(f"{where} sent stage {header.stage}'s {what}, not stage {request.stage}'s")
                    reply, _, payload = await receive_frames(
                        _prepend(header, answers),
                        flat,
                        lambda reason: HopFailedError(f"{where}: {reason}"),
                        to_end=False,
                        dtypes=GRADIENT_DTYPES if call == "gradient" else ("float32",),
                    )
                    self.bytes_received += len(payload)
                    return reply, payload
            finally:
                await answers.aclose()
            if time.monotonic() + GRADIENT_RETRY_S > deadline:
                raise HopFailedError(f"{where} had no {what} for stage {request.stage} in time")
            await asyncio.sleep(GRADIENT_RETRY_S)


async def _prepend(first: proto.StageHop, rest: AsyncIterator[proto.StageHop]) -> AsyncIterator[proto.StageHop]:
    yield first
    async for frame in rest:
        yield frame


def _reply_header(request: proto.StageHop) -> proto.StageHop:
    return proto.StageHop(iteration=request.iteration, microbatch=request.microbatch, stage=request.stage)


class _QuietRefusals(logging.Filter):
    """Drops hivemind's traceback for a hop this module refused: its one line is already logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HopRefusedError))


def _quiet_refusals() -> None:
    handler_logger = logging.getLogger("hivemind.p2p.p2p_daemon")
    if not any(isinstance(existing, _QuietRefusals) for existing in handler_logger.filters):
        handler_logger.addFilter(_QuietRefusals())
