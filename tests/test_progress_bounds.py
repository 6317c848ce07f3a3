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
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.averaging.collaboration import clear_micro_batch_gradients, make_optimizer
from crowdtrain.averaging.exact import new_partial_counter
from crowdtrain.averaging.progress_bounds import (
    DISTRUST_S,
    MAX_SAMPLES_PER_SECOND,
    BoundedProgressTracker,
    ProgressBounds,
)
from crowdtrain.averaging.state_download import epoch_ceiling
from crowdtrain.manifest import demo
from crowdtrain.testing.processes import await_condition
from tests.harness import shut_down

TARGET = 32
NOW = 1_000_000.0
CREATED_AT = NOW - 3600.0


def claim(peer: str, epoch: int, **fields: Any) -> dict[str, Any]:
    """A progress record's fields as hivemind's tracker publishes them."""
    values = dict(samples_accumulated=4, samples_per_second=2.0, time=NOW - 1.0, client_mode=False)
    return dict(peer_id=peer.encode(), epoch=epoch, **{**values, **fields})


def bounds() -> ProgressBounds:
    return ProgressBounds(target_batch_size=TARGET, run_created_at=CREATED_AT)


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


@pytest.fixture
def dht() -> Iterator[hivemind.DHT]:
    node = hivemind.DHT(start=True)
    yield node
    node.shutdown()


def records(*claims: dict[str, Any]) -> dict[bytes, ValueWithExpiration]:
    expiration = get_dht_time() + 60.0
    return {c["peer_id"]: ValueWithExpiration(c, expiration) for c in claims}


def test_a_claim_no_download_backs_is_dropped_at_once(dht: hivemind.DHT) -> None:
    now = get_dht_time()
    tracker = BoundedProgressTracker(
        dht=dht,
        prefix="bounds-test",
        target_batch_size=TARGET,
        start=False,
        bounds=ProgressBounds(target_batch_size=TARGET, run_created_at=time.time() - 3600.0),
    )
    tracker.report_local_progress(local_epoch=7, samples_accumulated=0)
    honest = dict(claim("honest", 7), time=now)
    tracker.global_progress = tracker._parse_swarm_progress_data(records(honest, dict(claim("liar", 500), time=now)))
    assert tracker.global_epoch == 500, "believed until a download says otherwise: it may be an honest swarm"

    tracker.distrust_unbacked_epochs(local_epoch=7, loaded_epoch=None)
    assert tracker.global_epoch == 500, "no donor answered: nothing says the claim is false"
    tracker.distrust_unbacked_epochs(local_epoch=7, loaded_epoch=7)
    assert tracker.global_epoch == 7, "the swarm's newest state was epoch 7: the claim of 500 goes, at once"

    tracker.global_progress = tracker._parse_swarm_progress_data(records(honest, dict(claim("next", 8), time=now)))
    assert tracker.global_epoch == 8, "a peer one epoch ahead is still followed"


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
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False)
    peers = [str(address) for address in first.get_visible_maddrs()]
    second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, use_ipfs=False)
    signer = RSASignatureValidator(RSAPrivateKey())
    attacker = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers, use_ipfs=False,
        record_validators=[signer],
    )  # fmt: skip
    models, optimizers, downloads = [], [], [0, 0]
    try:
        for index, dht in enumerate((first, second)):
            torch.manual_seed(0)
            models.append(torch.nn.Linear(4, 3))
            optimizer = make_optimizer(
                dht=dht,
                manifest=manifest,
                parameters=models[-1].parameters(),
                micro_batch_size=2,
                client_mode=False,
                group_bits="",
                private_key=RSAPrivateKey(),
                partial_counter=new_partial_counter(),
            )
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
