"""Peers' progress claims are bounded before hivemind's tracker adds them up (averaging/progress_bounds.py)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from lab.diloco import collaborative_optimizer, loopback_dhts
from lab.processes import await_condition

from crowdtrain.averaging.progress_bounds import (
    DISTRUST_S,
    MAX_SAMPLES_PER_SECOND,
    PLAUSIBLE_SLACK_S,
    BoundedProgressTracker,
    EpochStarts,
    ProgressBounds,
    plausible_samples,
)
from crowdtrain.collaboration.factory import clear_micro_batch_gradients
from crowdtrain.dht.records import epoch_ceiling
from crowdtrain.manifest import demo
from tests.harness import shut_down

TARGET = 32
NOW = 1_000_000.0
CREATED_AT = NOW - 3600.0


def claim(peer: str, epoch: int, **fields: Any) -> dict[str, Any]:
    """A progress record's fields as hivemind's tracker publishes them."""
    values = dict(samples_accumulated=4, samples_per_second=2.0, time=NOW - 1.0, client_mode=False)
    return dict(peer_id=peer.encode(), epoch=epoch, **{**values, **fields})


def bounds(target_batch_size: int = TARGET) -> ProgressBounds:
    return ProgressBounds(target_batch_size=target_batch_size, run_created_at=CREATED_AT)


def in_epoch_since(checker: ProgressBounds, epoch: int, started_at: float) -> ProgressBounds:
    """`checker` after this node looked at the swarm at `epoch - 1`, then stepped into `epoch` at `started_at`."""
    checker.starts.observe(epoch - 1, started_at - 60.0)
    checker.starts.observe(epoch, started_at, stepped=True)
    return checker


def estimated_samples(bounded: dict[str, Any], now: float) -> float:
    """A claim's samples as hivemind's tracker estimates them at `now`."""
    return bounded["samples_accumulated"] + (now - bounded["time"]) * bounded["samples_per_second"]


def test_honest_claims_pass_unchanged() -> None:
    claims = {b"a": claim("a", 7), b"b": claim("b", 8, samples_accumulated=TARGET)}
    assert bounds().bounded(claims, NOW, 7) == claims


def test_an_epoch_the_run_cannot_have_reached_is_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    ceiling = epoch_ceiling(CREATED_AT, NOW)
    checker = bounds()
    claims = {b"a": claim("a", 7), b"liar": claim("liar", ceiling + 1)}
    with caplog.at_level(logging.WARNING):
        assert list(checker.bounded(claims, NOW, 7)) == [b"a"]
        assert list(checker.bounded(claims, NOW, 7)) == [b"a"]
    assert len(caplog.records) == 1 and f"claims epoch {ceiling + 1}" in caplog.text
    assert list(checker.bounded({b"a": claim("a", ceiling)}, NOW, 7)) == [b"a"], "the ceiling itself is plausible"


def test_rates_times_and_samples_are_capped() -> None:
    claims = {
        b"inf": claim("inf", 7, samples_per_second=math.inf, samples_accumulated=10**9),
        b"past": claim("past", 7, time=-math.inf),
        b"future": claim("future", 7, time=NOW + 3600.0),
        b"nan": claim("nan", 7, time=math.nan),
    }
    bounded = bounds().bounded(claims, NOW, 7)
    assert bounded[b"inf"]["samples_accumulated"] == TARGET, "no claim fills more than the batch"
    assert [c["time"] for c in bounded.values()][1:] == [NOW, NOW, NOW], "no time before hivemind's horizon"
    # the infinite rate counts as the physical limit, then with 4 peers at most 64x the median (2.0)
    assert bounded[b"inf"]["samples_per_second"] == 64.0 * 2.0
    two = bounds().bounded({b"inf": claims[b"inf"], b"a": claim("a", 7)}, NOW, 7)
    assert two[b"inf"]["samples_per_second"] == MAX_SAMPLES_PER_SECOND, "no median of two"


def test_while_distrusted_only_epochs_one_ahead_of_this_node_count_until_it_expires() -> None:
    checker = bounds()
    claims = {b"a": claim("a", 7), b"next": claim("next", 8), b"liar": claim("liar", 500)}
    checker.distrust.begin(NOW)
    assert list(checker.bounded(claims, NOW + DISTRUST_S - 1, 7)) == [b"a", b"next"]
    assert list(checker.bounded(claims, NOW + DISTRUST_S - 1, 6)) == [b"a"], "the bound follows this node's epoch"
    assert list(checker.bounded(claims, NOW + DISTRUST_S, 7)) == [b"a", b"next", b"liar"], "believed again after"


def test_the_plausible_samples_are_the_rate_times_the_time_since_the_epoch_began_plus_slack() -> None:
    assert plausible_samples(2.0, 5.0, slack_s=3.0) == 16.0
    assert plausible_samples(2.0, 5.0) == 2.0 * (5.0 + PLAUSIBLE_SLACK_S)
    assert plausible_samples(2.0, -4.0, slack_s=3.0) == 6.0, "a start after now (clocks) leaves the slack"
    assert plausible_samples(0.0, 1e6) == 0.0


def test_an_epoch_begins_where_this_node_saw_it_begin() -> None:
    starts = EpochStarts()
    starts.observe(57, NOW - 100.0)
    assert starts.started_at == {}, "a joiner's first look shows no beginning"
    starts.observe(58, NOW - 50.0, stepped=True)
    assert starts.started_at == {58: NOW - 50.0}, "stepped into it"
    starts.observe(58, NOW - 40.0)
    starts.observe(59, NOW - 30.0)
    assert starts.started_at[59] == NOW - 40.0, "first shown by a look: the first peer stepped after the look before"
    starts.observe(59, NOW - 29.0, stepped=True)
    starts.observe(58, NOW - 28.0)
    starts.observe(59, NOW - 27.0)
    assert starts.started_at[59] == NOW - 40.0, "the earliest sight stays (a look that missed a record)"
    starts.observe(61, NOW - 20.0)
    assert 61 not in starts.started_at and 58 not in starts.started_at, "a jump shows none; old epochs forgotten"


def test_honest_claims_within_their_rate_pass_unchanged() -> None:
    checker = in_epoch_since(bounds(target_batch_size=10_000), 7, NOW - 20.0)
    claims = {
        b"steady": claim("steady", 7, samples_accumulated=38, time=NOW - 1.0),  # 2/s for 19 s, reported 1 s ago
        b"joiner": claim("joiner", 7, samples_accumulated=10, time=NOW),  # joined 5 s ago
        b"early": claim("early", 7, samples_accumulated=50, time=NOW),  # stepped 5 s before this node did
        b"skewed": claim("skewed", 7, samples_accumulated=38, time=NOW - 6.0),  # its clock is 5 s behind
        b"behind": claim("behind", 6, samples_accumulated=10_000, time=NOW),  # not counted toward epoch 7 anyway
    }
    assert checker.bounded(claims, NOW, 7) == claims
    slowing = {b"slowing": claim("slowing", 7, samples_accumulated=40, samples_per_second=4.0, time=NOW - 10.0)}
    assert checker.bounded(slowing, NOW - 10.0, 7) == slowing
    slowing[b"slowing"].update(samples_accumulated=50, samples_per_second=1.0, time=NOW)
    assert checker.bounded(slowing, NOW, 7) == slowing, "counted at the faster rate it claimed before"


def test_a_whole_batch_a_second_into_the_epoch_is_cut_to_the_plausible(caplog: pytest.LogCaptureFixture) -> None:
    checker = in_epoch_since(bounds(), 7, NOW - 1.0)
    plausible = plausible_samples(2.0, 1.0)
    assert plausible < TARGET
    claims = {
        b"liar": claim("liar", 7, samples_accumulated=TARGET, time=NOW),
        b"stale": claim("stale", 7, samples_accumulated=0, time=NOW - 1e6),  # hivemind adds rate x age
        b"me": claim("me", 7, samples_accumulated=TARGET, time=NOW),
    }
    with caplog.at_level(logging.WARNING):
        bounded = checker.bounded(claims, NOW, 7, own_key=b"me")
        checker.bounded(claims, NOW, 7, own_key=b"me")
    assert bounded[b"liar"]["samples_accumulated"] == int(plausible)
    assert estimated_samples(bounded[b"liar"], NOW) <= plausible
    assert estimated_samples(bounded[b"stale"], NOW) == pytest.approx(plausible)
    assert bounded[b"me"] == claims[b"me"], "this node knows its own samples"
    assert len(caplog.records) == 1, "once per peer and epoch; the stale record's samples (0) are no lie"
    assert f"of the {TARGET} samples peer …" in caplog.text and "toward epoch 7" in caplog.text
    assert checker.bounded(claims, NOW + 60.0, 7)[b"liar"]["samples_accumulated"] == TARGET, "plausible later"
    unseen = bounds().bounded(claims, NOW, 7)
    assert unseen[b"liar"]["samples_accumulated"] == TARGET, "an epoch not seen beginning: the batch bounds it"


def test_an_honest_record_older_than_the_epoch_as_seen_here_is_bounded_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # This node saw epoch 7 begin only now (it caught up by downloading the swarm's state); a peer's record of 8
    # samples at 2/s made 20 s ago extrapolates to 48, over the 20 this node can grant: bounded, and not called a
    # liar, since the samples it claims are plausible.
    checker = in_epoch_since(bounds(target_batch_size=1000), 7, NOW)
    honest = {b"early": claim("early", 7, samples_accumulated=8, time=NOW - 20.0)}
    with caplog.at_level(logging.WARNING):
        bounded = checker.bounded(honest, NOW, 7)[b"early"]
    assert bounded["samples_accumulated"] == 8
    assert estimated_samples(bounded, NOW) == pytest.approx(plausible_samples(2.0, 0.0))
    assert not caplog.records


@pytest.fixture
def dht() -> Iterator[hivemind.DHT]:
    node = hivemind.DHT(start=True)
    yield node
    node.shutdown()


def records(*claims: dict[str, Any]) -> dict[bytes, ValueWithExpiration]:
    expiration = get_dht_time() + 60.0
    return {c["peer_id"]: ValueWithExpiration(c, expiration) for c in claims}


def tracker_at(dht: hivemind.DHT, prefix: str, local_epoch: int) -> BoundedProgressTracker:
    """An unstarted tracker of an hour-old run, this node at `local_epoch`."""
    tracker = BoundedProgressTracker(
        dht=dht,
        prefix=prefix,
        target_batch_size=TARGET,
        start=False,
        bounds=ProgressBounds(target_batch_size=TARGET, run_created_at=time.time() - 3600.0),
    )
    tracker.report_local_progress(local_epoch=local_epoch, samples_accumulated=0)
    return tracker


def test_a_claim_no_download_backs_is_dropped_at_once(dht: hivemind.DHT) -> None:
    now = get_dht_time()
    tracker = tracker_at(dht, "bounds-test", local_epoch=7)
    honest = dict(claim("honest", 7), time=now)
    tracker.global_progress = tracker._parse_swarm_progress_data(records(honest, dict(claim("liar", 500), time=now)))
    assert tracker.global_epoch == 500, "believed until a download says otherwise: it may be an honest swarm"

    tracker.distrust_unbacked_epochs(local_epoch=7, loaded_epoch=None)
    assert tracker.global_epoch == 500, "no donor answered: nothing says the claim is false"
    tracker.distrust_unbacked_epochs(local_epoch=7, loaded_epoch=7)
    assert tracker.global_epoch == 7, "the swarm's newest state was epoch 7: the claim of 500 goes, at once"

    tracker.global_progress = tracker._parse_swarm_progress_data(records(honest, dict(claim("next", 8), time=now)))
    assert tracker.global_epoch == 8, "a peer one epoch ahead is still followed"


def test_epochs_an_honest_swarm_reached_during_a_slow_download_are_not_distrusted(dht: hivemind.DHT) -> None:
    """A joiner on a slow link downloads the state of epoch 138 while the swarm steps on to 141: the donor backed
    what was claimed when the download began (138), so the founder's 141 keeps counting. Distrusting it left the
    joiner ignoring the founder for 300 s, the two stepping alone and taking each other's state in turn."""
    now = get_dht_time()
    tracker = tracker_at(dht, "bounds-slow", local_epoch=138)
    founder = dict(claim("founder", 141), time=now)
    tracker.global_progress = tracker._parse_swarm_progress_data(records(founder))
    tracker.distrust_unbacked_epochs(local_epoch=138, loaded_epoch=138, claimed_at_start=138)
    assert tracker.global_epoch == 141, "the swarm moved on while the state travelled: still followed"
    tracker.distrust_unbacked_epochs(local_epoch=138, loaded_epoch=138, claimed_at_start=141)
    assert tracker.global_epoch == 138, "claimed before the download and not backed by it: ignored, as before"


def test_stepping_dates_the_beginning_of_the_epoch(dht: hivemind.DHT) -> None:
    tracker = BoundedProgressTracker(
        dht=dht, prefix="bounds-step", target_batch_size=TARGET, start=False, bounds=bounds()
    )
    tracker.report_local_progress(local_epoch=6, samples_accumulated=0)
    tracker.global_progress = tracker._parse_swarm_progress_data(records(dict(claim("a", 6), time=get_dht_time())))
    before = get_dht_time()
    with tracker.pause_updates():
        assert tracker.update_epoch(7) == 7
    assert before <= tracker.bounds.starts.started_at[7] <= get_dht_time()


def signing_dht(first: hivemind.DHT) -> tuple[hivemind.DHT, RSASignatureValidator]:
    """A DHT on loopback bootstrapped from `first`, and the validator that signs what it stores with a key of its own,
    as another peer's tracker signs its progress."""
    peers = [str(address) for address in first.get_visible_maddrs()]
    signer = RSASignatureValidator(RSAPrivateKey())
    dht = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, use_ipfs=False,
        record_validators=[signer],
    )  # fmt: skip
    return dht, signer


def test_a_fresh_reading_of_the_swarms_progress_replaces_the_view_at_once() -> None:
    # The tracker's own fetches come a refresh period apart; a step about to average alone reads again (issue 12).
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False)
    second, signer = signing_dht(first)
    try:
        tracker = BoundedProgressTracker(
            dht=first, prefix="bounds-refresh", target_batch_size=TARGET, start=False, bounds=bounds()
        )
        assert tracker.global_progress.num_peers == 0
        # Another peer reports its progress, signed as its tracker would.
        record = LocalTrainingProgress(**{**claim("other", 0), "time": get_dht_time()})
        key, expiration = tracker.training_progress_key, get_dht_time() + 60.0
        assert second.store(key, record.dict(), expiration, subkey=signer.local_public_key)
        with tracker.pause_updates():  # as hivemind.Optimizer's step holds it
            tracker.refresh_global_progress(timeout=10.0)
        assert tracker.global_progress.num_peers == 1
    finally:
        shut_down([], [second, first])


@pytest.mark.parametrize("liar_fields", [{"samples_accumulated": 256}, {"samples_accumulated": 0, "age_s": 1e6}])
@pytest.mark.parametrize(
    ("seconds", "ready", "ready_without_liar"),
    [(1.0, False, False), (17.0, False, False), (19.0, True, False), (32.0, True, True)],
)
def test_one_liar_of_three_counts_only_what_its_rate_could_have_computed(
    dht: hivemind.DHT, liar_fields: dict[str, float], seconds: float, ready: bool, ready_without_liar: bool
) -> None:
    # Two honest peers at 4 samples/s fill a batch of 256 in 32 s. A third claims the whole batch, or an old
    # record whose rate times its age is the whole batch, `seconds` into the epoch. Unbounded, it steps the swarm
    # at once. Bounded, it counts as much as a peer computing at its rate since the epoch began could have, so
    # the batch fills from (256 - 4 x 10 s of slack) / (3 x 4) = 18 s on: like a swarm of three honest peers.
    target, rate = 256, 4.0
    unbounded = ProgressTracker(dht=dht, prefix=f"plain-{seconds}", target_batch_size=target, start=False)
    checker = ProgressBounds(target_batch_size=target, run_created_at=time.time() - 3600.0)
    tracker = BoundedProgressTracker(
        dht=dht, prefix=f"bounded-{seconds}", target_batch_size=target, start=False, bounds=checker
    )
    for each in (unbounded, tracker):
        each.report_local_progress(local_epoch=7, samples_accumulated=0)
    now = get_dht_time()
    honest_samples = int(rate * seconds)
    honest = [claim(name, 7, samples_accumulated=honest_samples, samples_per_second=rate, time=now) for name in "ab"]
    liar_samples, liar_age_s = int(liar_fields["samples_accumulated"]), liar_fields.get("age_s", 0.0)
    liar = claim("liar", 7, samples_accumulated=liar_samples, samples_per_second=rate, time=now - liar_age_s)
    unbounded.global_progress = unbounded._parse_swarm_progress_data(records(*honest, liar))
    assert unbounded.ready_to_update_epoch, "without the bound, the liar steps the swarm at once"

    in_epoch_since(tracker.bounds, 7, now - seconds)
    tracker.global_progress = tracker._parse_swarm_progress_data(records(*honest, liar))
    elapsed_s = seconds + get_dht_time() - now
    counted = tracker.global_progress.samples_accumulated - 2 * honest_samples
    assert 0 <= counted <= min(liar_samples, plausible_samples(rate, elapsed_s))
    assert tracker.ready_to_update_epoch == ready
    tracker.global_progress = tracker._parse_swarm_progress_data(records(*honest))
    assert tracker.ready_to_update_epoch == ready_without_liar, "honest peers alone step at 32 s, as before"


def _train_until(optimizer: hivemind.Optimizer, model: torch.nn.Module, epoch: int, deadline: float) -> None:
    inputs = torch.randn(2, 4)
    while optimizer.local_epoch < epoch and time.monotonic() < deadline:
        model(inputs).square().mean().backward()
        optimizer.step()
        clear_micro_batch_gradients(optimizer)


@pytest.mark.swarm
def test_a_peer_claiming_a_far_epoch_costs_a_real_swarm_one_download_not_one_per_step() -> None:
    # Two honest peers (real hivemind.Optimizers, target 8 in micro-batches of 2) and a third DHT node that
    # publishes a validly signed progress record claiming epoch 500. Before the bound, both honest peers were
    # "out of sync" at every step and downloaded each other's state forever, never reaching epoch 1.
    manifest = dataclasses.replace(demo(), target_batch_size=8, created_at=time.time() - 3600.0)
    first, second = loopback_dhts(2)
    attacker, signer = signing_dht(first)
    models, optimizers, downloads = [], [], [0, 0]
    try:
        for index, dht in enumerate((first, second)):
            torch.manual_seed(0)
            models.append(torch.nn.Linear(4, 3))
            optimizer = collaborative_optimizer(dht, manifest, models[-1].parameters(), 2)
            optimizers.append(optimizer)
            download = optimizer.load_state_from_peers

            def counted(*args: Any, index: int = index, download: Any = download, **kwargs: Any) -> None:
                downloads[index] += 1
                download(*args, **kwargs)

            optimizer.load_state_from_peers = counted  # type: ignore[method-assign]
        forged = LocalTrainingProgress(
            peer_id=attacker.peer_id.to_bytes(), epoch=500, samples_accumulated=0, samples_per_second=1.0,
            time=get_dht_time(), client_mode=False,
        )  # fmt: skip
        stored = attacker.store(
            f"crowdtrain-{manifest.run_id}_progress", forged.dict(), get_dht_time() + 600.0,
            subkey=signer.local_public_key,
        )  # fmt: skip
        assert stored, "the forged record is validly signed: the DHT takes it"
        await_condition(
            lambda: all(optimizer.tracker.global_epoch == 500 for optimizer in optimizers),
            timeout_s=30.0,
            what="both honest peers see the claim of epoch 500",
        )
        deadline = time.monotonic() + 150.0
        threads = [
            threading.Thread(target=_train_until, args=(optimizer, model, 3, deadline))
            for optimizer, model in zip(optimizers, models, strict=True)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        epochs = [optimizer.local_epoch for optimizer in optimizers]
        assert min(epochs) >= 3, f"stuck at epochs {epochs} after {downloads} downloads"
        assert max(downloads) <= 3, f"a download per step: {downloads}"
    finally:
        for optimizer in optimizers:
            optimizer.shutdown()
        shut_down([], [attacker, second, first])
