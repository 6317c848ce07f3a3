"""Regression tests for the root causes of partial and solo rounds between live peers (issue 12).

Most tests drive one crowdtrain override of hivemind's Optimizer or averager with hivemind's own method
underneath replaced by a recorder: pure logic, no DHT. The accumulation test runs a real lone optimizer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import hivemind
import pytest
import torch
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils import ValueWithExpiration, get_dht_time
from lab.diloco import collaborative_optimizer, loopback_dht, loopback_dhts
from lab.processes import await_condition

from crowdtrain.averaging.authored import Entry
from crowdtrain.averaging.exact import require_complete
from crowdtrain.averaging.groups import chunk_timeout_s, join_request_timeout_s
from crowdtrain.averaging.partition import PartialAverageError, PlanSharesMixin
from crowdtrain.averaging.phases import Phase, PhaseAccumulator, PhaseTimes
from crowdtrain.collaboration import hivemind_optimizer
from crowdtrain.collaboration.factory import (
    clear_micro_batch_gradients,
    discard_local_gradients,
    reuses_grad_buffers,
)
from crowdtrain.collaboration.hivemind_optimizer import CrowdtrainOptimizer
from crowdtrain.manifest import AveragingSpec, demo
from crowdtrain.node.logs import setup_logging
from crowdtrain.rpc.service import NodeStopping
from crowdtrain.state.catch_up import ANNOUNCE_FOR_S, HoldBudget, catch_up_key


class FakeStepControl:
    """A pre-scheduled averaging round as hivemind's StepControl reports it."""

    def __init__(self, *, done: bool, triggered: bool):
        self._done, self.triggered = done, triggered

    def done(self) -> bool:
        return self._done


class FakeDHT:
    """The DHT calls of the catch-up hold: `announcements` (subkey -> value) is what a read finds, `None` a read
    that fails; every store is recorded."""

    def __init__(self) -> None:
        self.announcements: dict[bytes, dict[str, Any]] | None = {}
        self.reads = 0
        self.stored: list[tuple[str, bytes, dict[str, Any], float]] = []

    def get(self, key: str, latest: bool, return_future: bool) -> Any:
        self.reads += 1
        entries = self.announcements
        found = None if not entries else ValueWithExpiration(
            {subkey: ValueWithExpiration(value, math.inf) for subkey, value in entries.items()}, math.inf
        )  # fmt: skip
        return SimpleNamespace(result=lambda timeout: found)

    def store(self, key: str, subkey: bytes, value: dict[str, Any], expiration_time: float, return_future: bool) -> Any:
        self.stored.append((key, subkey, value, expiration_time))
        return SimpleNamespace(result=lambda timeout: True)


OWN_KEY, JOINER_KEY = b"[owner:this]", b"[owner:joiner]"


def bare_optimizer(num_peers: int, scheduled: FakeStepControl | None = None) -> Any:
    optimizer: Any = object.__new__(CrowdtrainOptimizer)
    optimizer.tracker = SimpleNamespace(
        global_progress=SimpleNamespace(num_peers=num_peers),
        global_epoch=0,
        distrust_unbacked_epochs=lambda local, loaded, claimed_at_start=None: None,
        pause_updates=contextlib.nullcontext,
        refresh_global_progress=lambda timeout: None,
        last_records={},
        own_key=OWN_KEY,
    )
    optimizer.dht = FakeDHT()
    optimizer.averaging_timeout = 30.0
    optimizer.grad_averager = SimpleNamespace(
        schedule_step=lambda scheduled_time, timeout: FakeStepControl(done=False, triggered=False)
    )
    optimizer.run_id = "crowdtrain-test"
    optimizer.hold_budget = HoldBudget()
    optimizer._announced_expiration = 0.0
    optimizer.state_averager = SimpleNamespace(local_epoch=0, last_loaded_epoch=None)
    optimizer.scheduled_grads = scheduled
    optimizer.replica_diverged = False
    optimizer.num_local_gradient_steps = 0
    optimizer._parent_pid = -1  # hivemind's __del__ shuts down only what this process started
    optimizer.phases = PhaseAccumulator()
    return optimizer


@pytest.fixture
def hivemind_underneath(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Replace the hivemind methods our overrides call with recorders."""
    calls: list[tuple[str, Any]] = []

    def begin(self: Any, grad_scaler: Any) -> bool:
        calls.append(("begin", self.scheduled_grads))
        return True

    monkeypatch.setattr(hivemind.Optimizer, "_begin_averaging_gradients", begin)
    monkeypatch.setattr(
        hivemind.Optimizer, "_load_local_gradients_into_optimizer", lambda self: calls.append(("local", None))
    )
    monkeypatch.setattr(hivemind.Optimizer, "_should_load_state_from_peers", lambda self: False)
    monkeypatch.setattr(
        hivemind.Optimizer, "load_state_from_peers", lambda self, **kwargs: calls.append(("load", None))
    )
    return calls


def test_an_expired_prescheduled_round_is_replaced_by_a_fresh_search(hivemind_underneath: list) -> None:
    # The round scheduled for the predicted end of the batch gave up before the batch filled: hivemind would
    # step alone without looking for a group; the step must look for one now.
    optimizer = bare_optimizer(2, FakeStepControl(done=True, triggered=False))
    assert optimizer._begin_averaging_gradients(None)
    assert hivemind_underneath == [("begin", None)]


@pytest.mark.parametrize(
    "control", [FakeStepControl(done=False, triggered=False), FakeStepControl(done=True, triggered=True)]
)
def test_a_live_or_used_round_is_left_to_hivemind(hivemind_underneath: list, control: FakeStepControl) -> None:
    optimizer = bare_optimizer(2, control)
    optimizer._begin_averaging_gradients(None)
    assert hivemind_underneath == [("begin", control)]


@pytest.mark.parametrize("fresh_num_peers", [2, 1])
def test_a_live_round_is_not_cancelled_alone_on_an_old_view_of_the_swarm(
    monkeypatch: pytest.MonkeyPatch, fresh_num_peers: int
) -> None:
    # hivemind cancels a pre-scheduled round when the tracker counts one peer; its view may predate a joiner's
    # first report while the joiner's round is already in a group with this one: the view is read again first.
    seen: list[tuple[Any, int]] = []
    monkeypatch.setattr(
        hivemind.Optimizer,
        "_begin_averaging_gradients",
        lambda self, grad_scaler: seen.append((self.scheduled_grads, self.tracker.global_progress.num_peers)),
    )
    control = FakeStepControl(done=False, triggered=False)
    optimizer = bare_optimizer(1, control)
    reads: list[float] = []

    def refresh_global_progress(timeout: float) -> None:
        reads.append(timeout)
        optimizer.tracker.global_progress = SimpleNamespace(num_peers=fresh_num_peers)

    optimizer.tracker.refresh_global_progress = refresh_global_progress
    optimizer._begin_averaging_gradients(None)
    assert len(reads) == 1 and 0 < reads[0] <= 5.0, "one bounded read"
    assert seen == [(control, fresh_num_peers)], "hivemind decides on the fresh view, with the round kept"


@pytest.mark.parametrize(("num_peers", "control"), [(2, FakeStepControl(done=False, triggered=False)), (1, None)])
def test_the_swarms_progress_is_read_again_only_before_a_round_would_be_cancelled(
    hivemind_underneath: list, num_peers: int, control: FakeStepControl | None
) -> None:
    optimizer = bare_optimizer(num_peers, control)
    optimizer.tracker.refresh_global_progress = lambda timeout: pytest.fail("no round to cancel: no DHT read")
    optimizer._begin_averaging_gradients(None)
    assert hivemind_underneath == [("begin", control)]


def test_a_step_alone_beside_peers_makes_the_replica_download_the_swarm_state(hivemind_underneath: list) -> None:
    optimizer = bare_optimizer(3)
    optimizer._load_local_gradients_into_optimizer()
    assert optimizer.num_local_gradient_steps == 1 and optimizer.replica_diverged
    assert optimizer._should_load_state_from_peers(), "a replica that stepped alone is replaced before it trains on"
    optimizer.load_state_from_peers()
    assert not optimizer.replica_diverged and not optimizer._should_load_state_from_peers()


def test_a_state_download_is_timed_as_a_phase_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=0.0)
    optimizer = bare_optimizer(3)
    optimizer.phases = PhaseAccumulator(lambda: clock.now)

    def download(self: Any, **kwargs: Any) -> None:
        clock.now += 7.0

    monkeypatch.setattr(hivemind.Optimizer, "load_state_from_peers", download)
    optimizer.load_state_from_peers()
    assert optimizer.phases.complete_step() == PhaseTimes(state_download_s=7.0)


def test_after_a_download_the_tracker_weighs_the_claims_against_the_loaded_epoch(hivemind_underneath: list) -> None:
    optimizer = bare_optimizer(3)
    weighed: list[tuple[int, int | None, int | None]] = []
    optimizer.tracker.distrust_unbacked_epochs = lambda local, loaded, claimed_at_start=None: weighed.append(
        (local, loaded, claimed_at_start)
    )
    optimizer.tracker.global_epoch = 9
    optimizer.state_averager = SimpleNamespace(local_epoch=7, last_loaded_epoch=6)
    optimizer.load_state_from_peers()
    assert weighed == [(7, 6, 9)], "a claim the swarm's newest state can't back must not cost a download per step"


def progress_record(epoch: int) -> Any:
    return ValueWithExpiration({"epoch": epoch, "samples_accumulated": 0}, math.inf)


def test_a_step_holds_while_a_peer_downloads_the_state_and_averages_once_it_reports_the_epoch(
    hivemind_underneath: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hivemind_optimizer, "HOLD_POLL_S", 0.001)
    optimizer = bare_optimizer(2)
    optimizer.state_averager.local_epoch = 40
    optimizer.dht.announcements = {JOINER_KEY: {"until": get_dht_time() + 60}}
    refreshes: list[float] = []

    def refresh_global_progress(timeout: float) -> None:
        # The joiner's record appears (at an epoch before this node's) at the 2nd reading, at its epoch at the 4th.
        refreshes.append(timeout)
        if len(refreshes) >= 2:
            optimizer.tracker.last_records = {JOINER_KEY: progress_record(39 if len(refreshes) < 4 else 40)}
        # hivemind's own averaging must not begin while this node holds
        assert hivemind_underneath == []

    optimizer.tracker.refresh_global_progress = refresh_global_progress
    optimizer._begin_averaging_gradients(None)
    assert len(refreshes) == 4, "held until the joiner's record shows this node's epoch"
    ((call, control),) = hivemind_underneath
    assert call == "begin" and not control.done(), "then averaged, in a round scheduled now for the joiner to find"
    assert optimizer.phases.complete_step().wait_s > 0, "the hold is time waiting for the swarm"


@pytest.mark.parametrize(
    ("announcement", "joiner_epoch"),
    [
        ({"until": 1e12}, 0),  # it reports this node's epoch: it has the state
        ({"until": 0.0}, None),  # past its deadline: the joiner died, or its download failed
        ({"until": "soon"}, None),  # garbage
    ],
)
def test_no_hold_for_a_peer_that_has_the_state_or_a_stale_or_malformed_announcement(
    hivemind_underneath: list, announcement: dict[str, Any], joiner_epoch: int | None
) -> None:
    optimizer = bare_optimizer(2)
    optimizer.dht.announcements = {JOINER_KEY: announcement, OWN_KEY: {"until": 1e12}}
    if joiner_epoch is not None:
        optimizer.tracker.last_records = {JOINER_KEY: progress_record(joiner_epoch)}
    optimizer.tracker.refresh_global_progress = lambda timeout: pytest.fail("nobody to hold for")
    optimizer._begin_averaging_gradients(None)
    assert optimizer.dht.reads == 1 and hivemind_underneath == [("begin", None)]


def test_a_hold_lasts_at_most_what_the_budget_allows_whatever_the_announced_deadline(
    hivemind_underneath: list, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(hivemind_optimizer, "HOLD_POLL_S", 0.001)
    optimizer = bare_optimizer(2)
    optimizer.dht.announcements = {JOINER_KEY: {"until": get_dht_time() + 1e9}}
    optimizer.hold_budget.level_s = 0.05
    optimizer.tracker.refresh_global_progress = lambda timeout: None
    with caplog.at_level(logging.INFO, logger=hivemind_optimizer.__name__):
        optimizer._begin_averaging_gradients(None)
    assert "stepping without 1 still downloading" in caplog.text and hivemind_underneath == [("begin", None)]
    assert optimizer.hold_budget.level_s < 0.01, "the time held is spent from the budget"
    optimizer._begin_averaging_gradients(None)
    assert caplog.text.count("holding the step") == 1, "an empty budget holds no more"


def test_a_read_that_fails_during_a_hold_keeps_holding(
    hivemind_underneath: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The announcer's link is busy with its download: the DHT read times out, which must not end the hold.
    monkeypatch.setattr(hivemind_optimizer, "HOLD_POLL_S", 0.001)
    optimizer = bare_optimizer(2)
    optimizer.dht.announcements = {JOINER_KEY: {"until": get_dht_time() + 60}}
    refreshes: list[float] = []

    def refresh_global_progress(timeout: float) -> None:
        refreshes.append(timeout)
        optimizer.dht.announcements = None  # every read from now on fails
        if len(refreshes) == 3:
            optimizer.tracker.last_records = {JOINER_KEY: progress_record(0)}

    optimizer.tracker.refresh_global_progress = refresh_global_progress
    optimizer._begin_averaging_gradients(None)
    assert len(refreshes) == 3, "held through two failed reads, until the joiner's record showed the epoch"


def test_a_download_is_announced_before_it_begins_and_renewed_while_it_lasts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hivemind_optimizer, "ANNOUNCE_EVERY_S", 0.01)
    optimizer = bare_optimizer(2)
    stored = optimizer.dht.stored

    def download(self: Any, **kwargs: Any) -> None:
        # a renewal may already have come (the renewer wakes every 10 ms, this thread may have been descheduled)
        assert stored, "announced before the download begins"
        await_condition(lambda: len(stored) >= 3, 10, "two renewals while the download lasts", poll_s=0.001)

    monkeypatch.setattr(hivemind.Optimizer, "load_state_from_peers", download)
    began = get_dht_time()
    optimizer.load_state_from_peers()
    after = len(stored)
    assert stored[-1][2] == {"until": stored[-1][2]["until"], "loaded": 0}, "the last says which epoch it loaded"
    time.sleep(0.05)
    assert len(stored) == after, "no renewal once the download is over"
    assert {(key, subkey) for key, subkey, *_ in stored} == {(catch_up_key("crowdtrain-test"), OWN_KEY)}
    assert all(began + ANNOUNCE_FOR_S - 1 <= value["until"] for *_, value, _ in stored), "deadlines ahead"
    expirations = [expiration for *_, expiration in stored]
    assert expirations == sorted(set(expirations)), "each record outlives the one before, or the DHT keeps that"


def test_a_lone_peer_stepping_alone_keeps_its_replica(hivemind_underneath: list) -> None:
    optimizer = bare_optimizer(1)
    optimizer._load_local_gradients_into_optimizer()
    assert optimizer.num_local_gradient_steps == 1
    assert not optimizer._should_load_state_from_peers(), "nobody to download from, nothing diverged"


def test_a_late_part_is_awaited_for_half_the_round() -> None:
    # hivemind's default waited the matchmaking time (5 s) for a member's first part: a peer still finishing a
    # micro-batch of an 85M model was banned, and both peers' rounds came back half un-averaged.
    assert chunk_timeout_s(AveragingSpec(matchmaking_time_s=5.0, timeout_s=20.0)) == 10.0
    assert chunk_timeout_s(AveragingSpec(matchmaking_time_s=5.0, timeout_s=6.0)) == 5.0


def test_a_peer_waits_for_a_leaders_answer_well_within_the_matchmaking_time() -> None:
    # At or above the matchmaking time, two peers that asked each other to lead at once broke hivemind's deadlock
    # only after both declarations expired, asked each other again, and found no group for a whole round.
    assert join_request_timeout_s(AveragingSpec(matchmaking_time_s=2.0)) == 1.0
    assert join_request_timeout_s(AveragingSpec(matchmaking_time_s=5.0)) == 2.5
    assert join_request_timeout_s(AveragingSpec(matchmaking_time_s=30.0)) == 3.0, "hivemind's default, at most"


class FailingAverager(PlanSharesMixin):
    """The partition mixin over an all-reduce that comes back partial."""

    total_size = 1000

    def __init__(self, error: BaseException):
        self.error = error

    @property
    def _authored(self) -> Any:
        return self

    @staticmethod
    def authored_entries(group_info: Any) -> list[Entry]:
        return [Entry(share=0.5, mode=0, value={}) for _ in group_info.peer_ids]

    @staticmethod
    def get_tensors() -> Any:
        from contextlib import nullcontext

        return nullcontext([])

    async def _run_allreduce_inplace_(self, *args: Any, **kwargs: Any) -> None:
        raise self.error


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root, hivemind_logger = logging.getLogger(), logging.getLogger("hivemind")
    saved = (root.handlers[:], root.level, hivemind_logger.level)
    yield
    root.handlers[:], root.level, hivemind_logger.level = saved


def run_partial_round(error: BaseException) -> MatchmakingException:
    group = SimpleNamespace(peer_ids=["a", "b"])
    with pytest.raises(MatchmakingException) as raised:
        asyncio.run(FailingAverager(error)._aggregate_with_group(group, 0))  # type: ignore[arg-type]
    return raised.value


def test_a_partial_round_is_one_warning_line_with_counts_and_peer(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("text", 0)
    try:
        require_complete(425, 1000, ["5zqAbCdE"])
    except PartialAverageError as e:
        partial = e
    wrapped = run_partial_round(partial)
    assert capsys.readouterr().err == "", "nothing logged where the round failed: hivemind logs it once, above"
    try:
        raise wrapped
    except MatchmakingException as e:
        logging.getLogger("hivemind.averaging.averager").exception(e)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "WARNING" in lines[0], lines
    assert "425 of 1000 elements (42.50%) were not averaged in a group with 5zqAbCdE" in lines[0]


def test_an_unexpected_error_in_a_round_keeps_its_traceback(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging("text", 0)
    run_partial_round(ZeroDivisionError("a bug of ours"))
    assert "Traceback" in capsys.readouterr().err


def _one_global_step(
    *, reuse_grad_buffers: bool, poison_second: bool = False, loss_scale: float = 1.0, max_grad_norm: float = 1.0
) -> tuple[torch.Tensor, int, float]:
    """A lone peer's real hivemind.Optimizer over a linear model: target 8 in micro-batches of 2, the same data
    either way. Returns the weights after the first global step, the samples reported before it and the sum of
    Adam's second moments after it."""
    optimizer_spec = dataclasses.replace(demo().optimizer, max_grad_norm=max_grad_norm)
    manifest = dataclasses.replace(demo(), target_batch_size=8, optimizer=optimizer_spec)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    inputs = torch.randn(8, 2, 4)
    dht = loopback_dht([])
    optimizer = collaborative_optimizer(dht, manifest, model.parameters(), 2, reuse_grad_buffers=reuse_grad_buffers)
    try:
        assert reuses_grad_buffers(optimizer) == reuse_grad_buffers
        reported, micro_batch = 0, 0
        while optimizer.local_epoch == 0:
            loss = model(inputs[micro_batch]).square().mean() * loss_scale
            if poison_second and micro_batch == 1:
                loss = loss * float("nan")
            loss.backward()
            micro_batch += 1
            if not math.isfinite(loss.item()):
                discard_local_gradients(optimizer)
                continue
            reported = optimizer.tracker.local_progress.samples_accumulated + 2
            optimizer.step()
            clear_micro_batch_gradients(optimizer)
        moments = sum(float(state["exp_avg_sq"].sum()) for state in optimizer.opt.state.values())
        return model.weight.detach().clone(), reported, moments
    finally:
        optimizer.shutdown()
        dht.shutdown()


@pytest.mark.swarm
def test_grad_buffers_as_accumulator_give_the_same_step_and_a_nan_drops_the_batch() -> None:
    copied, copied_samples, _ = _one_global_step(reuse_grad_buffers=False)
    reused, reused_samples, _ = _one_global_step(reuse_grad_buffers=True)
    assert copied_samples == reused_samples == 8
    torch.testing.assert_close(reused, copied)
    # A NaN micro-batch summed into .grad can't be taken out alone: this node's whole batch is dropped (its
    # samples count from zero again) and the step that follows is finite.
    after_nan, _, _ = _one_global_step(reuse_grad_buffers=True, poison_second=True)
    assert torch.isfinite(after_nan).all()
    assert not torch.equal(after_nan, copied)  # the micro-batches before the NaN were not part of the step


@pytest.mark.swarm
def test_a_huge_gradient_is_clipped_before_it_reaches_adams_moments() -> None:
    # One 1e6-scaled gradient that got into a step (a round too small for the norm test) filled Adam's second
    # moments, and every later update was tiny for thousands of steps: the honest peers' loss stopped falling.
    _, _, clipped = _one_global_step(reuse_grad_buffers=True, loss_scale=1e6)
    assert clipped <= (1 - 0.999) * 1.0**2 * 1.0001, "a step's gradient has norm at most max_grad_norm (1.0)"
    _, _, unclipped = _one_global_step(reuse_grad_buffers=True, loss_scale=1e6, max_grad_norm=0.0)
    assert unclipped > 1e6, "without clipping the scaled gradient lands in the moments whole"


@pytest.mark.swarm
def test_a_stopping_node_cancels_the_gradient_round_its_step_waits_for_and_shuts_down_cleanly() -> None:
    """Two real optimizers; the second reported a micro-batch and then computes no more, so the first one's global
    step waits for a group that never forms, up to the averaging timeout (60-90 s in the presets: past the daemon's
    28-s leave deadline). Once the node's stop event is set, the step raises NodeStopping at once, nothing is
    applied, and the optimizer shuts down without cancelling the round a second time (hivemind raises then)."""
    averaging = dataclasses.replace(demo().averaging, timeout_s=120.0)
    manifest = dataclasses.replace(demo(), target_batch_size=8, averaging=averaging)
    first, second = loopback_dhts(2)
    stop = threading.Event()
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    phases = PhaseAccumulator()
    waiting = collaborative_optimizer(first, manifest, models[0].parameters(), 2, stop=stop, phases=phases)
    idle = collaborative_optimizer(second, manifest, models[1].parameters(), 2)
    inputs = torch.randn(2, 4)
    try:
        for model, optimizer in zip(models, (waiting, idle), strict=True):
            model(inputs).square().mean().backward()
            optimizer.step()  # both report: the first sees a swarm of two and averages its global step
            clear_micro_batch_gradients(optimizer)
        await_condition(lambda: waiting.tracker.global_progress.num_peers == 2, 60, "the first to see the second")
        before = models[0].weight.detach().clone()

        def train() -> None:
            while waiting.local_epoch == 0:
                models[0](inputs).square().mean().backward()
                waiting.step()
                clear_micro_batch_gradients(waiting)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stepping = pool.submit(train)
            looking = functools.partial(phases.seconds, Phase.MATCHMAKING)
            await_condition(lambda: looking() >= 1.0, 60, "the global step to look for its group for a second")
            assert not stepping.done(), "the step waits for its group"
            stopped_at = time.monotonic()
            stop.set()
            with pytest.raises(NodeStopping):
                stepping.result(timeout=10)
            assert time.monotonic() - stopped_at < 5.0, "at the stop, not at the 120-s timeout"
        assert waiting.local_epoch == 0 and torch.equal(models[0].weight, before), "nothing applied"
    finally:
        waiting.shutdown()  # raises if it cancels the cancelled round again
        idle.shutdown()
        second.shutdown()
        first.shutdown()
