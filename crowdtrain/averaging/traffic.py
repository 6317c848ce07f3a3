"""Bytes an averager sends and receives in all-reduce rounds, counted as the tensor parts pass.

What is counted is the serialized tensor payload of every part (after compression), both as a sender
(its parts out, their averages back) and as a reducer (others' parts in, the averages out); message
framing and matchmaking are left out. The counters live in shared memory: the averager runs in a
child process, and the daemon reads them for its metrics.

The all-reduce runner built here is also where each reducer's robust aggregation is plugged in, and where
every member of a group ends a round with the one average its reducers encoded. hivemind's reducer sends each
sender the average minus that sender's part *as the reducer decoded it*, and the sender adds this delta to its
exact part: with a lossy encoding (fp16, int8) every member ended with the average plus its own encoding
error, so replicas that must stay identical (DiLoCo's global parameters, gradient-mode optimizers) drifted
apart round after round. Here a reducer sends the encoded average itself and every member, the reducer of a
part included, takes exactly that. This changes what an all-reduce message means: peers of an older
crowdtrain (protocol_version 1) can't share a round with these, so the protocol version is 2.

The sender, not the reducer, closes each all-reduce stream, once it holds every average (protocol 3). p2pd
resets a stream when its handler's side closes, and a reset drops what the other end had not read yet; a
reducer that closed as soon as it had sent its last average cost a sender that read slowly (typically one
that aggregates nothing and gets all its averages at once at the end) that average, and its round came back
partial: about one round in a hundred between three daemons on a busy CPU.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import queue
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from typing import Any, TypeVar

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import achain, aiter_with_timeout, amap_in_executor, as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time

from crowdtrain.averaging.quarantine import MAX_QUARANTINED, Quarantine, Verdict
from crowdtrain.averaging.robust import RobustPartReducer

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class AveragingTraffic:
    """Counters in shared memory: created before hivemind forks its averager process, read after."""

    sent_bytes: Synchronized
    """Serialized tensor-part bytes this peer sent in averaging rounds, B."""
    received_bytes: Synchronized
    """Serialized tensor-part bytes this peer received in averaging rounds, B."""

    @classmethod
    def new(cls) -> AveragingTraffic:
        return cls(sent_bytes=mp.Value("q", 0), received_bytes=mp.Value("q", 0))

    def totals(self) -> tuple[int, int]:
        """(sent, received) bytes so far."""
        return int(self.sent_bytes.value), int(self.received_bytes.value)


def _add(counter: Synchronized, num_bytes: int) -> None:
    with counter.get_lock():
        counter.value += num_bytes


async def _counted(
    messages: AsyncIterator[averaging_pb2.AveragingData], counter: Synchronized
) -> AsyncIterator[averaging_pb2.AveragingData]:
    async for message in messages:
        _add(counter, len(message.tensor_part.buffer))
        yield message


class _CountingStub:
    """The part of a groupmate's averager stub an all-reduce runner uses, counting what passes."""

    def __init__(self, stub: Any, traffic: AveragingTraffic):
        self._stub, self._traffic = stub, traffic

    async def rpc_aggregate_part(
        self, parts: AsyncIterator[averaging_pb2.AveragingData]
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        averages = await self._stub.rpc_aggregate_part(_counted(parts, self._traffic.sent_bytes))
        return _counted(averages, self._traffic.received_bytes)


class _CountingAllReduceRunner(AllReduceRunner):
    """hivemind's AllReduceRunner counting the tensor parts it exchanges, its reducer checking and aggregating
    each chunk by the run's rule (averaging/robust.py)."""

    def __init__(
        self,
        *,
        traffic: AveragingTraffic,
        aggregation: AggregationSettings,
        on_dropped: Callable[[str, str], None] | None = None,
        **kwargs: Any,
    ):
        self.traffic = traffic
        super().__init__(**kwargs)
        container = self.tensor_part_container
        # The runner yields averages, not deltas (a part whose reducer failed yields this peer's own values).
        container.return_deltas = False
        self._wire_type: runtime_pb2.CompressionType = container.compression.compression_type
        # hivemind's own reducer is replaced unused: marked finished, so that its finalizer does not warn of a
        # round that "received 0.0% of input tensors" in every round.
        unused: TensorPartReducer = self.tensor_part_reducer  # type: ignore[has-type]
        unused.finished.set()
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            rule=aggregation.rule,
            max_weight=aggregation.max_weight,
            sums=aggregation.sums,
            senders=[str(peer_id) for peer_id in self.sender_peer_ids],
            on_dropped=on_dropped,
        )

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        # Replaces AllReduceRunner._communicate_with_peer: what comes back from a part's reducer is the encoded
        # average, taken as it is; as its own reducer, this peer takes its average encoded and decoded the same way.
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            try:
                for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=self.weight
                    )
                    require_every_sender(self.tensor_part_reducer, part_index)
                    encoded = serialize_torch_tensor(averaged_part, self._wire_type)
                    container.register_processed_part(peer_index, part_index, deserialize_torch_tensor(encoded))
            except Exception:
                container.register_failed_reducer(peer_index)  # this peer's own parts come back un-averaged
                raise
            return
        try:
            received = await self._exchange_with_reducer(peer_id, peer_index)
            if received != container.num_parts_by_peer[peer_index]:
                expected = container.num_parts_by_peer[peer_index]
                raise AllreduceException(f"peer {peer_id} sent {received} parts, but we expected {expected}")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            container.register_failed_reducer(peer_index)
            raise

    async def _exchange_with_reducer(self, peer_id: PeerID, peer_index: int) -> int:
        """Send this peer's parts to their reducer and take the averages it sends back: how many came."""
        container = self.tensor_part_container
        expected = container.num_parts_by_peer[peer_index]
        done_sending, answered = asyncio.Event(), asyncio.Event()
        received = 0
        try:
            inputs = self._parts_until_answered(peer_index, done_sending, answered)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            async for average in amap_in_executor(
                functools.partial(_decoded_average, peer_id),
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=container.prefetch,
            ):
                if received == expected:
                    raise AllreduceException(f"peer {peer_id} sent more than the {expected} parts we expected")
                container.register_processed_part(peer_index, received, average)
                received += 1
                if received == expected:
                    answered.set()  # our end of the stream closes now; the reducer's follows
        except TimeoutError:
            if received != expected:  # a reducer slow to close a stream that gave every average is no failure
                raise
        finally:
            answered.set()
        return received

    async def _parts_until_answered(
        self, peer_index: int, done_sending: asyncio.Event, answered: asyncio.Event
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # This peer's parts for a reducer; the stream's end (hivemind's END_OF_STREAM) follows only once every
        # average came back. p2pd resets a stream whose handler side closes first, and a reset drops whatever
        # the other end had not read yet: reducers that closed as soon as they had sent the last average cost
        # their slow readers that average, and the round came back partial. So the sender closes first.
        async for message in self._generate_input_for_peer(peer_index):
            yield message
        done_sending.set()
        await answered.wait()

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # Replaces AllReduceRunner._accumulate_parts_streaming: each part's average goes back encoded as the
        # sender's part came (the same encoding for every sender), not as a delta from the sender's part. The
        # stream ends when the sender closes it, after it got every average (see _parts_until_answered).
        num_parts = self.tensor_part_reducer.num_parts
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, wire_type in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if part_index == num_parts:
                    raise AllreduceException(f"sender {sender_index} sent more than the {num_parts} parts expected")
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except BannedException:
                    logger.debug(f"sender {sender_index} is already banned")
                    break
                require_every_sender(self.tensor_part_reducer, part_index)  # else the sender is told it failed
                part_index += 1
                encoded = await loop.run_in_executor(
                    None, functools.partial(serialize_torch_tensor, averaged_part, wire_type)
                )
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        except TimeoutError:
            if part_index != num_parts:  # a sender slow to close a stream that gave every part is no failure
                raise
        finally:
            if part_index != num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _get_peer_stub(self, peer: PeerID) -> Any:
        # Wraps AllReduceRunner._get_peer_stub: the one place where this peer, as a sender, opens the stream that
        # carries its parts to a reducer and their averages back.
        return _CountingStub(super()._get_peer_stub(peer), self.traffic)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # Replaces AllReduceRunner.rpc_aggregate_part: where this peer, as a reducer, receives a groupmate's parts
        # and streams the averages back, counting both. A sender that aggregates nothing gets its averages only
        # once all are ready (hivemind's waited for the end of the sender's stream, which now comes after them).
        sender_index = self.sender_peer_ids.index(context.remote_id)
        self.active_senders.add(context.remote_id)
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()
        stream = _counted(stream, self.traffic.received_bytes)
        try:
            request: averaging_pb2.AveragingData = await asyncio.wait_for(anext(stream), self.sender_timeout)
            rejection = self._check_reasons_to_reject(request, context)
            if rejection is not None:
                yield rejection
                return
            if request.code != averaging_pb2.PART_FOR_AVERAGING:
                yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
                raise AllreduceException(f"{context.remote_id} sent {averaging_pb2.MessageCode.Name(request.code)}")
            parts = aiter_with_timeout(achain(as_aiter(request), stream), self.sender_timeout)
            averages = self._accumulate_parts_streaming(parts, sender_index)
            if self.should_delay_results(context.remote_id):
                averages = held_until_all(averages, self.tensor_part_reducer.num_parts)
            async for message in averages:
                _add(self.traffic.sent_bytes, len(message.tensor_part.buffer))
                yield message
        except BaseException as e:
            await self._ban_sender(context.remote_id)
            if not isinstance(e, Exception):
                raise  # cancelled
            logger.debug(f"Caught {e!r} when communicating with {context.remote_id}", exc_info=True)
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)


def require_every_sender(reducer: TensorPartReducer, part_index: int) -> None:
    """Raise AllreduceException when the average of part `part_index` lacks a sender's part.

    hivemind's reducer averages a part over the senders still in the round: a sender whose stream never came (it is
    banned after the sender timeout) or broke off is left out of that part and every later one, with one warning
    ("Reducer: received 50.0% of input tensors"), and the averages go back as if whole. Seen between two live
    peers of an 85M model: the joiner applied an average without the founder's gradient. Raised here instead, the
    reducer registers its own parts as failed and each other sender gets an error for the part, so every member
    counts the round as partial (averaging/exact.py). Parts a sender was dropped from for what it sent (robust.py)
    are not this: that sender is left out on purpose.
    """
    missing = [sender for sender, failed_after in enumerate(reducer.sender_failed_after) if failed_after <= part_index]
    if missing:
        raise AllreduceException(f"the average of part {part_index} lacks the parts of senders {missing}")


async def held_until_all(messages: AsyncIterator[T], num_parts: int) -> AsyncIterator[T]:
    """`messages`, the first `num_parts` held back until the last of them came (or the stream ended short)."""
    held: list[T] = []
    async for message in messages:
        if len(held) < num_parts:
            held.append(message)
            if len(held) < num_parts:
                continue
            for ready in held:
                yield ready
        else:
            yield message
    if len(held) < num_parts:
        for ready in held:
            yield ready


@dataclass(frozen=True, slots=True)
class AggregationSettings:
    """How a reducer aggregates each chunk: the manifest's rule, the most any sender's claimed weight counts, and
    whether parts are sums over the sender's samples (pseudo-gradients, whose norms grow with the inner steps
    taken) rather than means (gradients); see robust.norm_allowance."""

    rule: str = "mean"
    max_weight: float = float("inf")
    sums: bool = False


class QuarantineMatchmaking(Matchmaking):
    """hivemind's Matchmaking keeping quarantined peers out of this node's groups (averaging/quarantine.py): as a
    leader it refuses their join requests, as a follower it does not ask them to lead."""

    quarantine: Quarantine

    def _check_reasons_to_reject(self, request: averaging_pb2.JoinRequest, context: P2PContext) -> Any:
        if self.quarantine.holds(str(context.remote_id)):
            logger.debug(f"refused to group with {context.remote_id}: it is quarantined")
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return super()._check_reasons_to_reject(request, context)

    async def _request_join_group(self, leader: PeerID) -> GroupInfo | None:
        if self.quarantine.holds(str(leader)):
            logger.debug(f"did not ask {leader} to lead a group: it is quarantined")
            return None  # hivemind's search goes on with the next potential leader
        return await super()._request_join_group(leader)


class TrafficCountingAverager(DecentralizedAverager):
    """A DecentralizedAverager whose all-reduce rounds count their bytes into `traffic`, whose reducers check
    and aggregate every chunk by `aggregation` (averaging/robust.py), and which keeps the senders of bad parts
    out of its groups for a while (averaging/quarantine.py; `excluded_peers` reads them in the host process).

    Put it last among a subclass's bases (`class A(ExactGradientAverager, TrafficCountingAverager)`): its
    `_run_allreduce_inplace_` replaces hivemind's and calls no further, so overrides listed before it
    (the exact-average check) still wrap it.
    """

    def __init__(
        self,
        *args: Any,
        traffic: AveragingTraffic | None = None,
        aggregation: AggregationSettings | None = None,
        **kwargs: Any,
    ):
        self.traffic = AveragingTraffic.new() if traffic is None else traffic
        self.aggregation = AggregationSettings() if aggregation is None else aggregation
        self.quarantine = Quarantine()  # used in the averager's process
        self._new_verdicts: mp.Queue = mp.Queue()  # from the averager's process to the host's
        self._excluded: dict[str, Verdict] = {}  # the host process's view
        super().__init__(*args, **kwargs)

    @property
    def _matchmaking(self) -> QuarantineMatchmaking:
        try:
            return self.__dict__["_quarantine_matchmaking"]
        except KeyError:
            raise AttributeError("_matchmaking exists only in the averager's process, once it runs") from None

    @_matchmaking.setter
    def _matchmaking(self, matchmaking: Matchmaking) -> None:
        # hivemind builds its Matchmaking inside the averager's process (DecentralizedAverager._run_internal):
        # taken here as the subclass that keeps quarantined peers out.
        matchmaking.__class__ = QuarantineMatchmaking
        matchmaking.quarantine = self.quarantine  # type: ignore[attr-defined]
        self.__dict__["_quarantine_matchmaking"] = matchmaking

    def _quarantine_sender(self, peer_id: str, reason: str) -> None:
        # Runs in the averager's process, when this node's reducer dropped a sender's parts.
        if peer_id == str(self.peer_id):
            return  # this node's own bad gradients are dropped from its average, and it can't leave its own groups
        verdict = self.quarantine.add(peer_id, reason)
        minutes = (verdict.until - time.time()) / 60
        logger.warning(f"keeping peer {peer_id} out of this node's averaging groups for {minutes:.0f} min")
        self._new_verdicts.cancel_join_thread()  # never hold this process's exit for a host that stopped reading
        self._new_verdicts.put((peer_id, verdict))

    def excluded_peers(self) -> dict[str, Verdict]:
        """The peers this node keeps out of its averaging groups now, by peer ID (read in the host process)."""
        while True:
            try:
                peer_id, verdict = self._new_verdicts.get_nowait()
            except queue.Empty:
                break
            self._excluded[peer_id] = verdict
        now = time.time()
        self._excluded = {peer: verdict for peer, verdict in self._excluded.items() if verdict.until > now}
        while len(self._excluded) > MAX_QUARANTINED:
            del self._excluded[min(self._excluded, key=lambda peer: self._excluded[peer].until)]
        return dict(self._excluded)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        # hivemind's DecentralizedAverager._run_allreduce_inplace_ with its runner replaced by a counting one.
        group_id = group_info.group_id if group_id is None else group_id
        runner = _CountingAllReduceRunner(
            traffic=self.traffic,
            aggregation=self.aggregation,
            on_dropped=self._quarantine_sender,
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id!r} was never registered"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            alpha = self._averaging_alpha  # type: ignore[attr-defined]
            async for tensor, average in azip(as_aiter(*tensors), runner):
                # The runner yields averages: copied, so every member holds the same bits (alpha 1, the default).
                tensor.copy_(average) if alpha == 1 else tensor.lerp_(average, alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")


def _decoded_average(reducer: PeerID, message: averaging_pb2.AveragingData) -> torch.Tensor:
    if message.code != averaging_pb2.AVERAGED_PART:
        raise AllreduceException(f"{reducer} sent {averaging_pb2.MessageCode.Name(message.code)}")
    return deserialize_torch_tensor(message.tensor_part)
