"""Bytes an averager sends and receives in all-reduce rounds, counted as the tensor parts pass.

What is counted is the serialized tensor payload of every part (after compression), both as a sender
(its parts out, their averages back) and as a reducer (others' parts in, the averages out); message
framing and matchmaking are left out. The counters live in shared memory: the averager runs in a
child process, and the daemon reads them for its metrics.

The all-reduce runner built here is also where each reducer's robust aggregation is plugged in.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.timed_storage import get_dht_time

from crowdtrain.averaging.robust import RobustPartReducer


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

    def __init__(self, *, traffic: AveragingTraffic, aggregation: AggregationSettings, **kwargs: Any):
        self.traffic = traffic
        super().__init__(**kwargs)
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            rule=aggregation.rule,
            max_weight=aggregation.max_weight,
            senders=[str(peer_id) for peer_id in self.sender_peer_ids],
        )

    def _get_peer_stub(self, peer: PeerID) -> Any:
        # Wraps AllReduceRunner._get_peer_stub: the one place where this peer, as a sender, opens the stream that
        # carries its parts to a reducer and their averages back.
        return _CountingStub(super()._get_peer_stub(peer), self.traffic)

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # Wraps AllReduceRunner.rpc_aggregate_part: where this peer, as a reducer, receives a groupmate's parts
        # and streams the averages back.
        async for message in super().rpc_aggregate_part(_counted(stream, self.traffic.received_bytes), context):
            _add(self.traffic.sent_bytes, len(message.tensor_part.buffer))
            yield message


@dataclass(frozen=True, slots=True)
class AggregationSettings:
    """How a reducer aggregates each chunk: the manifest's rule, and the most any sender's claimed weight counts."""

    rule: str = "mean"
    max_weight: float = float("inf")


class TrafficCountingAverager(DecentralizedAverager):
    """A DecentralizedAverager whose all-reduce rounds count their bytes into `traffic`, and whose reducers check
    and aggregate every chunk by `aggregation` (averaging/robust.py).

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
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        # hivemind's DecentralizedAverager._run_allreduce_inplace_ with its runner replaced by a counting one.
        group_id = group_info.group_id if group_id is None else group_id
        runner = _CountingAllReduceRunner(
            traffic=self.traffic,
            aggregation=self.aggregation,
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
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
