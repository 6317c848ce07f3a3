"""Averaging traffic: the bytes of every tensor part, counted on both ends of a real all-reduce on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from lab.diloco import identity_key, loopback_dhts

from crowdtrain.averaging import traffic as traffic_module
from crowdtrain.averaging.exact import ExactRoundsMixin, new_partial_counter
from crowdtrain.averaging.partition import PlannedAverager
from crowdtrain.averaging.traffic import AveragingTraffic, TrafficCountingAverager, held_until_all
from crowdtrain.codecs.compression import compression_for
from tests.harness import ALLREDUCE_TIMEOUT_S, JOIN_REQUEST_TIMEOUT_S, MATCHMAKING_TIME_S, shut_down, step_together


class _CountingAverager(PlannedAverager, TrafficCountingAverager):
    """A plan-partitioned averager counting its bytes, as the optimizer's averagers do."""


class _ExactCountingAverager(ExactRoundsMixin, _CountingAverager):
    """The same, failing a round with any un-averaged part, as the gradient averager does."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.partial_counter = new_partial_counter()
        super().__init__(*args, **kwargs)


PAIR: dict[str, Any] = {
    "target_group_size": 2,
    "min_group_size": 2,
    "min_matchmaking_time": MATCHMAKING_TIME_S,
    "request_timeout": JOIN_REQUEST_TIMEOUT_S,
    "allreduce_timeout": ALLREDUCE_TIMEOUT_S,
    "share": 0.5,
    "start": True,
}
"""Each averager of a pair: one group of two, matched within seconds, each aggregating half."""


def averaged_pair(prefix: str, values: list[torch.Tensor], **options: Any) -> list[torch.Tensor]:
    """Two counting averagers on loopback holding `values`, one round between them; what each holds after it."""
    first, second = loopback_dhts(2)
    averagers = [
        _CountingAverager(
            [values[rank].clone()],
            dht=dht,
            prefix=prefix,
            author=identity_key(dht),
            **(PAIR | {name: value[rank] for name, value in options.items()}),
        )
        for rank, dht in enumerate((first, second))
    ]
    try:
        gathered = step_together(averagers)
        assert all(result is not None for result in gathered), "both peers found the group"
        results = []
        for averager in averagers:
            with averager.get_tensors() as tensors:
                results.append(tensors[0].clone())
        return results
    finally:
        shut_down(averagers, (first, second))


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_each_peer_counts_the_parts_it_sends_and_receives_as_sender_and_reducer() -> None:
    num_elements = 1000  # fp32, uncompressed: each peer's half is 2000 bytes on the wire
    traffic = [AveragingTraffic.new(), AveragingTraffic.new()]
    values = [torch.arange(num_elements, dtype=torch.float32) * (rank + 1) for rank in range(2)]
    results = averaged_pair("traffic-test", values, traffic=traffic)
    assert torch.allclose(results[0], torch.stack(values).mean(dim=0))
    half_bytes = num_elements // 2 * 4
    # Each peer sends its half for the other (and gets the average back), and reduces the other's half.
    assert traffic[0].totals() == traffic[1].totals() == (2 * half_bytes, 2 * half_bytes)


@pytest.mark.swarm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", ["int8", "fp16"])
def test_every_member_ends_a_compressed_round_with_the_same_average(compression: str) -> None:
    # hivemind sends each sender the average *minus its own part as the reducer decoded it*, and the sender adds
    # that to its exact part: every member ended with the average plus its own compression error, and replicas
    # drifted apart round after round. Every member must hold the one average the reducers encoded.
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(100_000, generator=generator) * (rank + 1) for rank in range(2)]
    encoding = compression_for(compression)
    results = averaged_pair(f"identical-{compression}", values, compression=[encoding, encoding])
    assert torch.equal(results[0], results[1]), f"replicas differ by up to {(results[0] - results[1]).abs().max()}"
    mean = torch.stack(values).mean(dim=0)
    assert (results[0] - mean).abs().mean() < 0.05 * mean.abs().mean()  # the average, within the encoding


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_sender_that_aggregates_nothing_gets_every_average() -> None:
    # A member with no share gets its averages only once all are ready, and it (not the reducer) ends the stream
    # once it holds them all: a reducer that ended first could lose the tail of a slow reader's averages.
    num_elements = 200_000  # several parts of the part size below, all reduced by the first peer
    values = [torch.arange(num_elements, dtype=torch.float32) * rank for rank in range(2)]
    results = averaged_pair("zero-share", values, share=[1.0, 0.0], part_size_bytes=[2**16, 2**16])
    mean = torch.stack(values).mean(dim=0)
    assert torch.equal(results[0], mean) and torch.equal(results[1], mean)


def test_a_zero_share_senders_averages_are_held_until_all_are_ready() -> None:
    async def scenario() -> list[tuple[str, int]]:
        ready: list[tuple[str, int]] = []

        async def averages(count: int) -> AsyncIterator[int]:
            for index in range(count):
                ready.append(("ready", index))
                yield index

        async for index in held_until_all(averages(3), num_parts=3):
            ready.append(("sent", index))
        async for index in held_until_all(averages(2), num_parts=3):  # the reducer's stream ended short
            ready.append(("sent short", index))
        return ready

    events = asyncio.run(scenario())
    assert events == [
        *(("ready", index) for index in range(3)),
        *(("sent", index) for index in range(3)),
        *(("ready", index) for index in range(2)),
        *(("sent short", index) for index in range(2)),
    ]


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_sender_whose_parts_never_come_makes_the_round_partial_for_every_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Seen between two live peers of an 85M model: one peer's stream to the other came 50 s late; the other, as
    # reducer, banned it after the sender timeout and averaged its half over itself alone ("Reducer: received 50.0%
    # of input tensors"), then applied that as the average. Both must count the round as partial instead.
    first, second = loopback_dhts(2)
    late_peer = second.peer_id
    exchange = traffic_module._CountingAllReduceRunner._exchange_with_reducer

    async def late_for_its_reducers(self: Any, peer_id: Any, peer_index: int) -> int:
        if self.peer_id == late_peer:
            await asyncio.sleep(6.0)  # past the other's sender timeout below
        return int(await exchange(self, peer_id, peer_index))

    # inherited by the averager processes, which fork after this
    monkeypatch.setattr(traffic_module._CountingAllReduceRunner, "_exchange_with_reducer", late_for_its_reducers)
    values = [torch.full((20_000,), float(rank + 1)) for rank in range(2)]  # 5 parts of 16 KiB: each reduces some
    averagers = [
        _ExactCountingAverager(
            [values[rank].clone()],
            dht=dht,
            prefix="late-sender",
            author=identity_key(dht),
            sender_timeout=2.0,
            part_size_bytes=2**14,
            **PAIR,
        )
        for rank, dht in enumerate((first, second))
    ]
    try:
        with ThreadPoolExecutor(2) as pool:
            rounds = [pool.submit(averager.step, timeout=40, allow_retries=False) for averager in averagers]
            outcomes = [round_.exception(timeout=60) for round_ in rounds]
        for averager, outcome in zip(averagers, outcomes, strict=True):
            # hivemind hands the round's PartialAverageError to the caller inside a MatchmakingException
            assert outcome is not None and "were not averaged" in str(outcome), outcome
            assert averager.partial_counter.value == 1
    finally:
        shut_down(averagers, (first, second))
