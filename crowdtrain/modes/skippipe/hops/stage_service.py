"""SkipPipe's pipeline hops: a node serves its stage's layers to the stage-0 nodes whose microbatches visit it.

A stage-0 node (the microbatch's source) sends the hidden states of a microbatch to a node of the next stage on
its path (`rpc_stage_forward`); the node runs its stage's decoder layers on them, keeps the input and output for
the backward, and answers the output. When the source's backward comes back along the path it sends the gradient
of that output (`rpc_stage_backward`); the node runs its layers' backward, which adds to its parameters' `.grad`
(the iteration's gradient), and answers the gradient of the input. Only hidden states travel: positions and the
causal mask are rebuilt from the shape (`StagedModel.activations`), as every layer of a decoder LM computes them.

Everything a caller sends is bounded and checked before it runs (`hop_wire`): a header first (`proto.StageHop`:
iteration, microbatch, stage, shape, wire dtype), the caller must be a source of the iteration in this node's roster
and the microbatch one of the iteration's, the wire dtype the run's (`hop_callers`), the stage this node's, the shape
[batch, sequence, hidden] within `HopLimits`, the payload exactly the shape's bytes (refused as soon as it runs
over), every value finite; a backward must name a forward this node holds for the same caller, with the output's
shape, and a microbatch's forward is served once per iteration. An answer that is not finite (an overflow in the
stage's layers) is refused rather than sent. Once its header is
checked, and before a byte of its payload is read, a hop takes a grant of its bytes (`hop_limits`, rpc/bulk.py):
past the hops a node receives at once, in all or from one caller, it is refused busy at once, and its payload must
come within HOP_TIME_S. A node holds at most
`memory_microbatches` forwards at once (a forward waits up to `slot_wait_s` for a slot, then the caller gets
"busy" and goes to another replica) and forgets one whose backward did not come within `hold_s` (its source died
or gave up on it). A refusal is one log line here and its sentence at the caller. An answer ends by waiting for the
caller to close the stream (`rpc.service.linger`): a stream the answering node closed first lost its answer about
once per full test-suite run under load (the caller saw "the stream ended before its header").

Besides the hops a node answers done messages (`rpc_stage_done`), pings (`rpc_stage_ping`), its replicas' asks
for its gradient of an iteration (`rpc_stage_gradient`) and a joiner's for its state (`rpc_stage_state`). What it
keeps of each iteration is `stage_ledger`'s; the calls it makes on other nodes are `stage_calls`'.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import typing
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import hivemind
import torch
from hivemind.p2p import P2PContext

from crowdtrain import proto
from crowdtrain.modes.skippipe.hops.device_clock import DeviceClock, finish_of
from crowdtrain.modes.skippipe.hops.hop_callers import RefusalLog, done_loss, done_refusal, hop_refusal
from crowdtrain.modes.skippipe.hops.hop_wire import (
    BUSY,
    CHUNK_BYTES,
    NAMESPACE,
    PACED_CHUNK_BYTES,
    WIRE_DTYPES,
    HopLimits,
    HopRefusedError,
    encode_frames,
    paced,
    paced_rate,
    payload_frames,
    prepend,
    receive_frames,
    stream_values,
)
from crowdtrain.modes.skippipe.hops.stage_calls import StageCalls
from crowdtrain.modes.skippipe.hops.stage_ledger import HeldForward, PublishedGradient, StageLedger
from crowdtrain.modes.skippipe.stages import StagedModel
from crowdtrain.rpc.bulk import BulkGate, BulkLimits, Grant
from crowdtrain.rpc.service import drain, linger

logger = logging.getLogger(__name__)

SLOT_WAIT_S = 10.0
"""How long a forward that finds the node's memory full waits for a slot before it is refused as busy."""
OPEN_WAIT_S = 10.0
"""How long a forward of the next iteration waits for this node to finish stepping the last."""
GRADIENT_WAIT_S = 2.0
"""How long a request for this node's gradient of an iteration it has not published yet waits for it before it is
answered with none (the caller asks again): a replica that is done with its share of an iteration before this one
asks at once, and gets the gradient the moment it is published, without a stream of asks."""
MAX_GRADIENT_WAITS = 16
"""Requests for a gradient not yet published held at once, from all peers (a stage's replicas send one each at a
time); more are answered at once with none, so that no peer can make this node hold a crowd of them."""
MAX_DONE_MICROBATCHES = 1 << 20
"""A done message's count of microbatches above this is not believed (its loss is left out)."""
DEFAULT_HOLD_S = 120.0
"""A forward whose backward has not come after this long is dropped (its source died or gave up)."""
MAX_STATE_ANSWERS = 2
"""States of its stage this node serves at once, one per peer (each a whole copy of the stage's state in memory)."""
HOP_TIME_S = 60.0
"""A hop's payload must have come, and its answer gone, within this many seconds of its header: a caller that stops
sending midway holds what it took no longer."""


def hop_limits(memory_microbatches: int, limits: HopLimits) -> BulkLimits:
    """What the hops a node receives may take of it at once, each at most the largest hop's payload: four times the
    forwards it holds (their backwards, and forwards waiting for a slot, come meanwhile), half of that from one
    caller. Past them a hop is refused busy at once and its source asks another replica."""
    answers = 4 * memory_microbatches
    return BulkLimits(
        max_answers=answers,
        max_answers_per_peer=2 * memory_microbatches,
        max_bytes=answers * limits.max_hop_bytes(),
        answer_time_s=HOP_TIME_S,
    )


class StageService(StageLedger, StageCalls):
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
        stop: threading.Event | None = None,
    ):
        super().__init__(dht, NAMESPACE, thread_name=f"skippipe-stage{stage}", stop=stop)
        _quiet_refusals()
        if memory_microbatches < 1:
            raise ValueError(f"memory_microbatches must be >= 1, got {memory_microbatches}")
        self.staged, self.stage, self.limits = staged, stage, limits
        self.memory_microbatches, self.hold_s, self.slot_wait_s = memory_microbatches, hold_s, slot_wait_s
        self.model_lock = threading.Lock()
        """Held while the stage's layers run forward or backward: take it to step the stage's optimizer."""
        self.hops = BulkGate(hop_limits(memory_microbatches, limits))
        """Admission of the hops this node receives, taken before a byte of their payload is read."""
        self.device = DeviceClock(finish=finish_of(staged.device))
        """Seconds the model lock was held per visit served (a forward and its backward) or, on a stage-0 node, per
        microbatch driven (`PipelineDriver`)."""
        self._held: OrderedDict[tuple[str, int, int], HeldForward] = OrderedDict()
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
        self._callers = None
        self._members: frozenset[str] | None = None
        self._done_ceiling: int | None = None
        self._refusals, self._loss_refusals = RefusalLog(), RefusalLog()
        """Peers whose refused place (`hop_callers`), or refused loss, was logged already."""
        self._losses: dict[int, dict[str, tuple[float, int]]] = {}
        self._rows: Counter[int] = Counter()
        self._gradients: OrderedDict[int, PublishedGradient] = OrderedDict()
        """Published gradients by iteration: (how many values, their wire bytes, fingerprint, wire dtype)."""
        self._state_source: Callable[[], tuple[int, int, torch.Tensor]] | None = None
        self._state_answers: BulkGate | None = None
        """Admission of the states this node serves (`set_state_source`): each answer copies the whole stage."""
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
        header, inputs, grant = await self._receive(requests, "forward", context, wait_open=True)
        with grant:
            key = (context.remote_id.to_base58(), header.iteration, header.microbatch)
            await self._reserve(key, context)
            try:
                outputs = await asyncio.to_thread(self._forward, key, inputs)
                if not bool(torch.isfinite(outputs).all()):
                    self._refuse("its hidden states overflowed in this stage's layers", "forward", context)
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
        header, grad_outputs, grant = await self._receive(requests, "backward", context)
        with grant:
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
            if not bool(torch.isfinite(grad_inputs).all()):  # the stage's step then sees it, and is skipped
                self._refuse("its gradient overflowed in this stage's layers", "backward", context)
            for frame in encode_frames(grad_inputs, _reply_header(header), header.dtype):
                self.bytes_sent += len(frame.payload)
                yield frame
        await linger()

    async def rpc_stage_done(self, request: proto.StageHop, context: P2PContext) -> proto.StageHop:
        """A source says it ran every microbatch of `request.iteration` it will: no more backwards from it. Kept only
        from a node of the roster (`hop_callers`), its loss only where an honest source could report it."""
        peer = context.remote_id.to_base58()
        callers = self._callers
        members = self._members if self._members is not None else callers.sources if callers is not None else None
        refusal = done_refusal(members, peer)
        if refusal is not None:  # answered all the same: a source of a roster this node has not read yet is honest
            if self._refusals.first(peer):
                logger.warning(f"left out a done message from peer {peer[-8:]} (said once per peer): {refusal}")
            return proto.StageHop(iteration=request.iteration, stage=self.stage)
        with self._backwards_changed:
            kept = self._keeps_done(request.iteration)
            if kept:
                self._done.setdefault(request.iteration, set()).add(peer)
                self._backwards_changed.notify_all()
            # the loss of the iteration this node just finished is kept too: a node done early steps before the
            # sources' done messages come, and reports the loss of the iteration before (`sources_losses`)
            just_finished = self._done_from is not None and request.iteration == self._done_from - 1
            if kept or just_finished:
                loss = done_loss(request, callers.num_microbatches if callers is not None else MAX_DONE_MICROBATCHES)
                if loss is not None:
                    self._losses.setdefault(request.iteration, {})[peer] = loss
                elif request.microbatches and self._loss_refusals.first(peer):
                    logger.warning(
                        f"left out the loss {request.loss:.3g} over {request.microbatches} microbatches that peer "
                        f"{peer[-8:]} reported: no honest source reports it"
                    )
        return proto.StageHop(iteration=request.iteration, stage=self.stage)

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

    async def rpc_stage_state(
        self, request: proto.StageHop, context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        """This node's state of its stage for a joining replica (`set_state_source`): a header naming the last
        finished iteration and the optimizer's steps, then float32 values; a header with no shape if none, or if
        the last finished iteration is before the one asked for (`request.iteration`)."""
        source, gate, peer = self._state_source, self._state_answers, context.remote_id.to_base58()
        grant = None
        if request.stage == self.stage and source is not None and gate is not None:
            grant = gate.admit(peer, 1)  # counted in answers, not bytes
        if grant is None or source is None:  # none served, or busy: asked again until the asker's deadline
            yield proto.StageHop(stage=self.stage)
        else:
            with grant:
                iteration, steps, values = await asyncio.to_thread(self._snapshot, source)
                if iteration < max(request.iteration, 0):  # none taken (nothing a joiner can't build), or too old
                    yield proto.StageHop(stage=self.stage)
                else:
                    header = proto.StageHop(iteration=iteration, stage=self.stage, optimizer_steps=steps)
                    for frame in encode_frames(values, header, "float32"):
                        if grant.expired():
                            logger.warning(f"a stage state for peer {peer[-8:]} ran past its time: cut short")
                            break
                        self.bytes_sent += len(frame.payload)
                        yield frame
        await linger()

    def _snapshot(self, source: Callable[[], tuple[int, int, torch.Tensor]]) -> tuple[int, int, torch.Tensor]:
        with self.model_lock:  # between steps: parameters and optimizer state of one iteration
            return source()

    def set_state_source(self, source: Callable[[], tuple[int, int, torch.Tensor]] | None, answer_s: float) -> None:
        """Serve `source()` to joining replicas: (the last finished iteration, the optimizer's steps, float32
        values), read under `model_lock`; None: serve nothing. At most MAX_STATE_ANSWERS at once, one per peer, each
        within `answer_s` (what the state takes on a slow home uplink): a peer that stops reading holds its slot no
        longer than that and the gate's grace (rpc/bulk.py), and never the other askers'."""
        limits = BulkLimits(max_answers=MAX_STATE_ANSWERS, max_answers_per_peer=1, max_bytes=MAX_STATE_ANSWERS,
                            answer_time_s=answer_s)  # fmt: skip
        self._state_source, self._state_answers = source, BulkGate(limits)

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

    def _backward(self, held: HeldForward, grad_outputs: torch.Tensor) -> torch.Tensor:
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
                if (key[0], key[2]) in self._backwards.get(key[1], ()):
                    self._refuse(f"microbatch {key[2]} of iteration {key[1]} ran here already", "forward", context)
                if len(self._held) < self.memory_microbatches:
                    empty = torch.empty(0)
                    self._held[key] = HeldForward(inputs=empty, outputs=empty, since=now)
                    return
                held = len(self._held)
            if now >= deadline:
                self._refuse(f"{BUSY} holds {held} microbatches, its memory's limit", "forward", context)
            await asyncio.sleep(0.005)

    async def _receive(
        self, requests: AsyncIterator[proto.StageHop], call: str, context: P2PContext, *, wait_open: bool = False
    ) -> tuple[proto.StageHop, torch.Tensor, Grant]:
        """The hop a caller sends, checked (`receive_frames`) against the stage this node serves, and the grant it
        holds (`hops`), taken once its header is checked, before its payload is read, which must come within the
        grant's time. With `wait_open` (a forward) the header's iteration is waited for first (`_wait_open`): a
        node that moves to another stage at that iteration serves it from then on, so a forward sent by a node
        already there is not refused for its stage."""
        peer = context.remote_id.to_base58()
        granted: list[Grant] = []

        def refused(reason: str) -> Exception:
            logger.warning(f"refused a stage {call} from peer {peer[-8:]}: {reason}")
            return HopRefusedError(f"stage {call} refused: {reason}")

        def admit(num_bytes: int) -> None:
            grant = self.hops.admit(peer, num_bytes)
            if grant is None:
                raise refused(f"{BUSY} receives as many hops as it may")
            granted.append(grant)

        first = await anext(requests, None)
        try:
            if first is not None:
                await self._check_place(first, call, context, wait_open)
            dtypes = WIRE_DTYPES if self._callers is None else (self._callers.wire_dtype,)
            frames = prepend(first, requests) if first is not None else requests
            try:
                async with asyncio.timeout(HOP_TIME_S):
                    header, shape, payload = await receive_frames(
                        frames, self.limits.check_shape, refused, self.stage, dtypes=dtypes, admit=admit
                    )
            except TimeoutError:
                raise refused(f"the hop's payload did not come within {HOP_TIME_S:g} s") from None
            tensor = stream_values(header, shape, payload, refused)
        except BaseException as e:
            for grant in granted:
                grant.release()
            if isinstance(e, HopRefusedError):
                await drain(requests)  # so that the refusal reaches the caller
            raise
        self.bytes_received += tensor.numel() * WIRE_DTYPES[header.dtype].itemsize
        return header, tensor, granted[0]

    async def _check_place(self, header: proto.StageHop, call: str, context: P2PContext, wait_open: bool) -> None:
        """With `wait_open`, wait for the hop's iteration (`_wait_open`: a node that has not read the roster that
        makes its caller a source yet reads it meanwhile), then refuse it unless that iteration's callers include
        its caller (`hop_refusal`)."""
        peer = context.remote_id.to_base58()
        if wait_open:
            await self._wait_open(header.iteration, context)
        refusal = hop_refusal(self._callers, peer, header)
        if refusal is not None:
            self._refuse_place(refusal, call, peer)

    def _refuse_place(self, reason: str, call: str, peer: str) -> NoReturn:
        """Refuse a call for the caller's place (`hop_callers`), logged once per peer."""
        if self._refusals.first(peer):
            logger.warning(f"refused a stage {call} from peer {peer[-8:]} (said once per peer): {reason}")
        raise HopRefusedError(f"stage {call} refused: {reason}")

    def _refuse(self, reason: str, call: str, context: P2PContext) -> NoReturn:
        logger.warning(f"refused a stage {call} from peer {context.remote_id.to_base58()[-8:]}: {reason}")
        raise HopRefusedError(f"stage {call} refused: {reason}")


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
