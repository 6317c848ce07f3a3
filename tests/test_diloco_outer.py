"""DiLoCo's outer step, exactly: known pseudo-gradients on 2 and 4 real peers give the known update on every one.

Each peer is a real DiLoCoMode (its averager process, its progress tracker, DHTs on loopback) with a tiny replica;
what its inner steps would have done is written straight into its parameters, so the test knows each
pseudo-gradient and the samples it stands for. The outer round must average them weighted by samples, apply one
Nesterov SGD step to the round's global parameters, and leave every peer with the same bits, also when the
pseudo-gradients travel in int8 (each peer used to keep its own encoding error). With top-k, every peer applies
the mean of what each sent (its largest values, with its residual added) and keeps the rest back, and a
checkpoint gives a restarted peer its round, outer momentum and residual back.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from lab.diloco import close_peers, computing_peer, diloco_peers, identity_key, loopback_dhts
from lab.processes import await_condition

from crowdtrain import proto
from crowdtrain.averaging.phases import Phase
from crowdtrain.codecs.error_feedback import keep_top_k_
from crowdtrain.manifest import DiLoCoSpec, RunManifest, TrainingSpec, demo
from crowdtrain.modes.diloco import pseudo_gradients
from crowdtrain.modes.diloco.joining import (
    MAX_RESYNC_TRIES,
    RESYNC_RETRY_S,
    START_DIGEST_BYTES,
    _gathered_digest,
    _tiebreak,
)
from crowdtrain.modes.diloco.mode import DiLoCoMode
from crowdtrain.modes.progress import Progress
from crowdtrain.rpc.service import NodeStopping
from crowdtrain.training.checkpoint import load_checkpoint, write_checkpoint

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

OUTER_LR, OUTER_MOMENTUM = 0.5, 0.9


def manifest(
    num_peers: int,
    compression: str,
    topk_fraction: float = 0.02,
    overlap: bool = False,
    adaptive: bool = False,
    fragments: int = 1,
) -> RunManifest:
    base = demo()
    return dataclasses.replace(
        base,
        run_id=f"outer-{num_peers}-{compression}{'-overlap' if overlap else ''}{'-adaptive' if adaptive else ''}"
        f"-{fragments}",
        target_batch_size=64,
        training=TrainingSpec(mode="diloco"),
        averaging=dataclasses.replace(base.averaging, group_size=4, matchmaking_time_s=2.0),
        diloco=DiLoCoSpec(
            inner_steps=fragments,
            fragments=fragments,
            outer_learning_rate=OUTER_LR,
            outer_momentum=OUTER_MOMENTUM,
            compression=compression,
            topk_fraction=topk_fraction,
            overlap=overlap,
            min_inner_steps=1 if adaptive else None,
            max_inner_steps=64 if adaptive else None,
        ),
    )


def end_of_round(
    modes: list[DiLoCoMode], start: torch.Tensor, pseudo_gradients: list[torch.Tensor], samples: list[int]
) -> None:
    """Set each peer's replica to θ₀ − its pseudo-gradient, over its samples, reported; wait until every peer's
    tracker sees them all."""
    for mode, pseudo_gradient, num_samples in zip(modes, pseudo_gradients, samples, strict=True):
        with torch.no_grad():
            mode.parameters[0].copy_(start - pseudo_gradient)
        mode.samples = num_samples
        mode.tracker.report_local_progress(mode.round, num_samples)
    await_condition(
        lambda: all(mode.tracker.global_progress.num_peers == len(modes) for mode in modes),
        60,
        "every peer's tracker to see the others",
    )


def run_one_outer_round(
    modes: list[DiLoCoMode], start: torch.Tensor, pseudo_gradients: list[torch.Tensor], samples: list[int]
) -> None:
    """`end_of_round`, then the outer round on all."""
    end_of_round(modes, start, pseudo_gradients, samples)
    with ThreadPoolExecutor(len(modes)) as pool:
        list(pool.map(lambda mode: mode._outer_round(), modes))
        if modes[0].spec.overlap:  # the round's all-reduce went on in the background: wait for it as the next would
            list(pool.map(lambda mode: mode._finish_round_in_flight(wait=True), modes))


def assert_every_peer_stepped_to(modes: list[DiLoCoMode], expected: torch.Tensor, tolerance: float) -> None:
    for mode in modes:
        assert mode.round == 1 and mode.num_local_rounds == 0, "the round was averaged with the whole group"
        assert torch.allclose(mode.global_parameters[0], expected, atol=tolerance)
        replica, start = mode.parameters[0].detach(), mode.global_parameters[0]
        # with overlap the replica moved by θ₀' − θ_end from θ_end: the same values, up to float rounding
        same = torch.allclose(replica, start, atol=1e-6) if mode.spec.overlap else torch.equal(replica, start)
        assert same, "the next round starts from them"
    assert all(torch.equal(mode.global_parameters[0], modes[0].global_parameters[0]) for mode in modes)


@pytest.mark.parametrize(
    ("num_peers", "compression", "tolerance", "overlap"),
    # int8: 256 levels over 6 deviations, times 0.95
    [(2, "none", 1e-6, False), (4, "none", 1e-6, False), (4, "int8", 0.1, False), (4, "int8", 0.1, True)],
)
def test_every_peer_applies_the_weighted_mean_pseudo_gradient_with_one_nesterov_step(
    num_peers: int, compression: str, tolerance: float, overlap: bool
) -> None:
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(num_peers, compression, overlap=overlap), num_peers, [start]) as modes:
        # what each peer's inner steps did: a known pseudo-gradient over a known number of samples
        generator = torch.Generator().manual_seed(num_peers)
        pseudo_gradients = [torch.randn(3, 4, generator=generator) for _ in modes]
        samples = [8 * (rank + 1) for rank in range(num_peers)]
        run_one_outer_round(modes, start, pseudo_gradients, samples)
        mean = sum(w * g for w, g in zip(samples, pseudo_gradients, strict=True)) / sum(samples)
        # Nesterov SGD's first step: the buffer is the gradient, the update (1 + momentum) times it
        assert_every_peer_stepped_to(modes, start - OUTER_LR * (1 + OUTER_MOMENTUM) * mean, tolerance)


def test_with_overlap_inner_steps_go_on_and_the_outer_step_moves_them_with_the_rounds_end_point() -> None:
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(2, "topk", topk_fraction=1.0, overlap=True), 2, [start]) as modes:
        generator = torch.Generator().manual_seed(11)
        pseudo_gradients = [torch.randn(3, 4, generator=generator) for _ in modes]
        end_of_round(modes, start, pseudo_gradients, [8, 8])
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda mode: mode._outer_round(), modes))
        moved = [torch.full((3, 4), 0.01 * (rank + 1)) for rank in range(2)]
        for mode, step in zip(modes, moved, strict=True):
            # the round is in flight: nothing applied yet, the next round's inner steps go on from θ_end
            assert mode.round == 0 and mode.training_round == 1 and mode.tracker.local_progress.epoch == 1
            assert torch.equal(mode.global_parameters[0], start)
            with torch.no_grad():
                mode.parameters[0].add_(step)  # an inner step taken while the all-reduce runs
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda mode: mode._finish_round_in_flight(wait=True), modes))
        mean = (pseudo_gradients[0] + pseudo_gradients[1]) / 2  # equal samples; topk 1.0 sends all, in fp16
        expected = start - OUTER_LR * (1 + OUTER_MOMENTUM) * mean
        for mode, step in zip(modes, moved, strict=True):
            assert mode.round == 1 and mode.num_local_rounds == 0 and mode.training_round == 1
            assert torch.allclose(mode.global_parameters[0], expected, atol=2e-3)
            # θ ← θ₀' + (θ − θ_end): the inner step survives, re-based on the new global parameters
            assert torch.allclose(mode.parameters[0].detach(), mode.global_parameters[0] + step, atol=1e-6)
            # the residual is Δ_end − what was sent: fp16's rounding alone (from the current θ it would hold the step)
            assert mode.feedback is not None and float(mode.feedback.residuals[0].abs().max()) < 2e-3
        assert torch.equal(modes[0].global_parameters[0], modes[1].global_parameters[0])


def test_with_adaptive_h_the_group_takes_the_lower_median_of_its_proposals_from_the_next_round() -> None:
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(3, "none", adaptive=True), 3, [start]) as modes:
        generator = torch.Generator().manual_seed(5)
        run_one_outer_round(modes, start, [torch.randn(3, 4, generator=generator) for _ in modes], [8, 8, 8])
        assert all(mode.round == 1 and mode.round_batches == 1 for mode in modes), "round 1 gathered H = 1 from all"
        # Each peer now proposes from its own measurements; set them so the agreement is known: 5, 9 and a
        # liar's 10**9 (outside [1, 64], ignored): the lower median of (5, 9) is 5.
        for mode, proposal in zip(modes, [5, 9, 10**9], strict=True):
            mode._proposal = proposal
        run_one_outer_round(modes, modes[0].global_parameters[0].clone(), [torch.zeros(3, 4)] * 3, [8, 8, 8])
        for mode in modes:
            assert mode.round == 2 and mode.round_batches == 5, "every member took the same H for the next round"
            assert mode.tracker.target_batch_size == 5 * mode.context.manifest.target_batch_size
            progress = Progress()
            mode.report(progress)
            assert progress.inner_steps == 5
            assert 1 <= mode._proposal <= 64, "its next proposal comes from its measurements, within bounds"
            assert mode._outer_state()[0]["inner_steps"] == 5, "a joiner takes the H in force with the state"


def test_with_topk_every_peer_applies_the_mean_of_what_each_sent_and_keeps_back_the_rest() -> None:
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    fraction = 0.25  # 3 values of 12 per peer
    residuals = [torch.randn(3, 4, generator=torch.Generator().manual_seed(rank)) * 0.1 for rank in range(2)]
    with diloco_peers(manifest(2, "topk", topk_fraction=fraction), 2, [start]) as modes:
        for mode, residual in zip(modes, residuals, strict=True):
            assert mode.feedback is not None
            mode.feedback.residuals[0].copy_(residual)  # kept back in earlier rounds
        generator = torch.Generator().manual_seed(7)
        pseudo_gradients = [torch.randn(3, 4, generator=generator) for _ in modes]
        samples = [8, 24]
        run_one_outer_round(modes, start, pseudo_gradients, samples)
        # what each sent: the top 3 of its pseudo-gradient plus its residual, in fp16; the rest stays behind
        sent = []
        for pseudo_gradient, residual in zip(pseudo_gradients, residuals, strict=True):
            corrected = pseudo_gradient + residual
            sent.append(corrected.clone())
            keep_top_k_(sent[-1], fraction)
            assert int(torch.count_nonzero(sent[-1])) == 3
        for mode, pseudo_gradient, residual, mine in zip(modes, pseudo_gradients, residuals, sent, strict=True):
            assert mode.feedback is not None
            assert torch.allclose(mode.feedback.residuals[0], pseudo_gradient + residual - mine, atol=1e-6)
        mean = sum(w * s for w, s in zip(samples, sent, strict=True)) / sum(samples)
        # the average goes back in fp16: within its resolution, and the same bits on every peer
        assert_every_peer_stepped_to(modes, start - OUTER_LR * (1 + OUTER_MOMENTUM) * mean, 2e-3)


def test_a_topk_peers_checkpoint_restores_its_round_outer_momentum_and_residual(tmp_path: Path) -> None:
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    run = manifest(2, "topk", topk_fraction=0.25)
    with diloco_peers(run, 2, [start]) as modes:
        generator = torch.Generator().manual_seed(3)
        run_one_outer_round(modes, start, [torch.randn(3, 4, generator=generator) for _ in modes], [8, 8])
        saved = modes[0]
        assert saved.feedback is not None and int((saved.feedback.residuals[0].abs() > 1e-3).sum()) == 9, "kept back"
        replica = torch.nn.Module()
        replica.weight = saved.parameters[0]
        path = write_checkpoint(tmp_path, saved.round, replica.state_dict(), saved.state_dict(), keep=2)
        expected_momentum = saved.outer_optimizer.state[saved.global_parameters[0]]["momentum_buffer"].clone()
        expected_residual = saved.feedback.residuals[0].clone()
        expected_global = saved.global_parameters[0].clone()
    # a restarted node: a fresh mode (fresh DHT, zero state) takes the checkpoint as the training loop does
    with diloco_peers(run, 1, [start]) as (restarted,):
        checkpoint = load_checkpoint(path, replica)
        restarted.load_state_dict(checkpoint.optimizer_state)
        assert restarted.round == checkpoint.epoch == 1
        assert torch.equal(restarted.global_parameters[0], expected_global)
        momentum = restarted.outer_optimizer.state[restarted.global_parameters[0]]["momentum_buffer"]
        assert torch.equal(momentum, expected_momentum)
        assert restarted.feedback is not None and torch.equal(restarted.feedback.residuals[0], expected_residual)
        assert restarted.tracker.local_progress.epoch == 1, "it reports the round it resumed at"


def test_peers_at_different_rounds_never_meet_and_the_others_average_without_the_one_ahead() -> None:
    """Four peers end a round at once, one of them a round ahead. Under one matchmaking key for every round they met
    and nobody applied the group (two peers one round apart stayed so for 16 rounds in a CI run); keyed by round,
    the three of round 0 average together and the one ahead ends its round alone."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(4, "none"), 4, [start]) as modes:
        generator = torch.Generator().manual_seed(7)
        pseudo_gradients = [torch.randn(3, 4, generator=generator) for _ in modes]
        modes[3].round = 1
        run_one_outer_round(modes, start, pseudo_gradients, [8, 8, 8, 8])
        assert [mode.num_local_rounds for mode in modes] == [0, 0, 0, 1], "round 0 averaged without the one ahead"
        mean = sum(pseudo_gradients[:3]) / 3
        assert_every_peer_stepped_to(modes[:3], start - OUTER_LR * (1 + OUTER_MOMENTUM) * mean, 1e-6)
        assert modes[3].round == 2 and modes[3].context.traffic.sent_bytes.value == 0
        assert [mode.averager.excluded_peers() for mode in modes] == [{}] * 4, "an honest peer was quarantined"


def test_a_member_that_gathers_another_round_than_its_key_costs_one_round_and_is_kept_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer can still join another round's key (it lies about its round): here every peer's averager looks for
    its group under round 0's key while one gathers round 1, with a pseudo-gradient 100x the others'. Such a round is
    never applied, so nothing is sent for it, and the reducers' norm check must not drop and quarantine an honest
    peer for it (it used to, keeping a late joiner out of its groups for 10 min). The liar is kept out of the honest
    peers' groups instead (issue 47, finding 3: it aborted every round), so the next round they average without it."""
    monkeypatch.setattr(pseudo_gradients, "_step_round", lambda serializer, step: 0)  # before the averagers fork
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(4, "none"), 4, [start]) as modes:
        generator = torch.Generator().manual_seed(7)
        deltas = [torch.randn(3, 4, generator=generator) for _ in modes]
        deltas[3] *= 100
        modes[3].round = 1
        run_one_outer_round(modes, start, deltas, [8, 8, 8, 8])
        assert [mode.num_local_rounds for mode in modes] == [1, 1, 1, 1], "a round of mixed rounds is not applied"
        liar = str(modes[3].averager.peer_id)
        excluded = [set(await_excluded(mode)) for mode in modes[:3]]
        assert excluded == [{liar}] * 3 and modes[3].averager.excluded_peers() == {}, "only the liar is kept out"
        assert [mode.context.traffic.sent_bytes.value for mode in modes] == [0] * 4, "the skipped all-reduce sent"
        modes[3].round = modes[0].round + 1  # it lies again
        run_one_outer_round(modes, modes[0].global_parameters[0].clone(), deltas, [8, 8, 8, 8])
        assert [mode.num_local_rounds for mode in modes] == [1, 1, 1, 2], "the honest three averaged without it"


def test_a_member_whose_entry_is_not_its_own_costs_its_group_the_round_and_nobody_is_kept_out() -> None:
    """What every member sees when the leader rewrites a member's gathered entry (it relays them all; issue 47,
    finding 3): here one member's entry is signed by a key its peer ID does not derive from. The group averages
    nothing, and nobody is kept out, since a forgery and a malformed entry can't be told apart: signing with its
    own key again, the member averages the next round with all."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(4, "none"), 4, [start]) as modes:
        generator = torch.Generator().manual_seed(7)
        deltas = [torch.randn(3, 4, generator=generator) for _ in modes]
        modes[3].averager._author = RSAPrivateKey()  # its step signs in this process
        run_one_outer_round(modes, start, deltas, [8, 8, 8, 8])
        assert [mode.num_local_rounds for mode in modes] == [1, 1, 1, 1], "no member applied the round"
        assert [mode.context.traffic.sent_bytes.value for mode in modes] == [0] * 4, "nothing was sent for it"
        modes[3].averager._author = identity_key(modes[3].context.dht)
        run_one_outer_round(modes, modes[0].global_parameters[0].clone(), deltas, [8, 8, 8, 8])
        assert [mode.round for mode in modes] == [2] * 4
        assert [mode.num_local_rounds for mode in modes] == [1, 1, 1, 1], "all four averaged the next round"


def await_excluded(mode: DiLoCoMode) -> dict[str, object]:
    """The peers `mode`'s averager keeps out, once it keeps one (its verdicts come from the averager's process)."""
    await_condition(lambda: bool(mode.averager.excluded_peers()), 10, "a verdict")
    return dict(mode.averager.excluded_peers())


def end_round_together(modes: list[DiLoCoMode], samples: int) -> None:
    """Every peer reports `samples` toward its round and ends it (waiting for the average, with overlap)."""
    for mode in modes:
        mode.samples = samples
        mode.tracker.report_local_progress(mode.round, samples)
    await_condition(
        lambda: all(mode.tracker.global_progress.num_peers == len(modes) for mode in modes), 60, "the peers"
    )
    with ThreadPoolExecutor(len(modes)) as pool:
        list(pool.map(lambda mode: mode._outer_round(), modes))
        if modes[0].spec.overlap:
            list(pool.map(lambda mode: mode._finish_round_in_flight(wait=True), modes))


@pytest.mark.parametrize("overlap", [False, True])
def test_with_fragments_a_round_averages_one_fragment_and_the_other_trains_on_until_its_turn(overlap: bool) -> None:
    """Streaming DiLoCo with 2 fragments: round 0 averages fragment 0 and leaves fragment 1 (θ₀, momentum and the
    peers' own replicas) alone; round 1 averages fragment 1 with a pseudo-gradient spanning both rounds."""
    first, second = torch.linspace(-1.0, 1.0, 12).reshape(3, 4), torch.linspace(0.0, 2.0, 6)
    step = OUTER_LR * (1 + OUTER_MOMENTUM)  # Nesterov's first step on a fresh buffer
    with diloco_peers(manifest(2, "none", overlap=overlap, fragments=2), 2, [first, second]) as modes:
        generator = torch.Generator().manual_seed(13)
        firsts = [torch.randn(3, 4, generator=generator) for _ in modes]
        seconds = [torch.randn(6, generator=generator) for _ in modes]
        for mode, delta, other in zip(modes, firsts, seconds, strict=True):
            assert (
                mode.fragments.members == ((0,), (1,)) and mode.round_samples == mode.context.manifest.target_batch_size
            )
            with torch.no_grad():
                mode.parameters[0].copy_(first - delta)
                mode.parameters[1].copy_(second - other)
        end_round_together(modes, 8)
        expected_first = first - step * (firsts[0] + firsts[1]) / 2
        for mode, other in zip(modes, seconds, strict=True):
            assert mode.round == 1 and mode.num_local_rounds == 0
            assert torch.allclose(mode.global_parameters[0], expected_first, atol=1e-6)
            assert torch.allclose(mode.parameters[0].detach(), mode.global_parameters[0], atol=1e-6)
            assert torch.equal(mode.global_parameters[1], second), "fragment 1's round has not come"
            assert torch.equal(mode.parameters[1].detach(), second - other), "its inner steps are kept"
            assert "momentum_buffer" not in mode.outer_optimizer.state.get(mode.global_parameters[1], {})
        laters = [torch.randn(6, generator=generator) for _ in modes]
        for mode, later in zip(modes, laters, strict=True):
            with torch.no_grad():
                mode.parameters[1].sub_(later)  # round 1's inner steps on fragment 1
        end_round_together(modes, 8)
        spans = [other + later for other, later in zip(seconds, laters, strict=True)]  # both rounds' steps
        expected_second = second - step * (spans[0] + spans[1]) / 2
        for mode in modes:
            assert mode.round == 2 and mode.num_local_rounds == 0
            assert torch.allclose(mode.global_parameters[1], expected_second, atol=1e-6)
            assert torch.allclose(mode.parameters[1].detach(), mode.global_parameters[1], atol=1e-6)
            assert torch.allclose(mode.global_parameters[0], expected_first, atol=1e-6), "fragment 0 waits for round 2"
        assert all(
            torch.equal(a, b) for a, b in zip(modes[0].global_parameters, modes[1].global_parameters, strict=True)
        )


def test_with_overlap_a_peer_that_notices_the_rounds_end_late_joins_its_all_reduce_instead_of_downloading() -> None:
    """With overlap a peer's epoch moves on as soon as it ends a round. A peer that trained in that round and comes
    to its end a micro-batch later (a slow step, a held-out score) must end it too and join the all-reduce, not
    take a state: in the WAN lab that download cost the founder four minutes and every later round."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(2, "none", overlap=True), 2, [start]) as modes:
        early, late = modes
        generator = torch.Generator().manual_seed(17)
        pseudo_gradients = [torch.randn(3, 4, generator=generator) for _ in modes]
        end_of_round(modes, start, pseudo_gradients, [8, 8])
        with ThreadPoolExecutor(2) as pool:
            ended = pool.submit(early._outer_round)  # its all-reduce starts in the background; its epoch is 1
            await_condition(lambda: late.tracker.global_epoch == 1, 30, "the late peer to see the swarm at epoch 1")
            assert not late._behind_the_swarm(), "one round late with samples of that round: not behind"
            assert late.tracker.ready_to_update_epoch, "its next micro-batch ends the round"
            late._outer_round()
            ended.result()
            list(pool.map(lambda mode: mode._finish_round_in_flight(wait=True), modes))
        expected = start - OUTER_LR * (1 + OUTER_MOMENTUM) * (pseudo_gradients[0] + pseudo_gradients[1]) / 2
        assert_every_peer_stepped_to(modes, expected, 1e-6)


def test_a_round_in_flight_the_swarm_has_moved_two_rounds_past_is_given_up_not_waited_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Groups are keyed by round, so a peer whose round the swarm has left behind (a joiner that took a state as
    the others' round closed) finds nobody: waiting out the averaging timeout stalled it 15 s per round in a CI
    log. Once a peer trains two rounds past it, every group of that round has closed: the round is given up at
    once, unaveraged, and the peer takes the swarm's state next; it ends none of its own meanwhile."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    run = manifest(2, "none", overlap=True)
    run = dataclasses.replace(run, averaging=dataclasses.replace(run.averaging, timeout_s=120.0))
    with diloco_peers(run, 2, [start]) as modes:
        behind, ahead = modes
        ahead.round = 1
        end_of_round(modes, start, [torch.ones(3, 4), torch.ones(3, 4)], [8, 8])  # the other trains in round 1
        behind._outer_round()  # round 0's all-reduce starts in the background: nobody else is in round 0
        assert behind._in_flight is not None and behind._in_flight.round == 0
        ahead.tracker.report_local_progress(2, 8)  # the other trains in round 2: round 1's all-reduce has begun
        await_condition(lambda: behind.tracker.global_epoch == 2, 30, "the swarm to be seen at round 2")
        with caplog.at_level("WARNING", logger="crowdtrain.modes.diloco.overlap"):
            behind._finish_round_in_flight(wait=True)
        assert "outer round 0 found no group before the swarm moved on to round 2" in caplog.text
        assert behind.round == 1 and behind.num_local_rounds == 1 and behind.diverged, "unaveraged: take a state"
        assert behind._behind_the_swarm(), "its next micro-batch downloads the swarm's state"
        # with the swarm two rounds past the one it trains in, it ends no round of its own until it took a state
        ahead.tracker.report_local_progress(3, 8)
        await_condition(lambda: behind.tracker.global_epoch == 3, 30, "the swarm to be seen at round 3")
        assert behind.tracker.ready_to_update_epoch and behind._left_behind()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stopping_node_cancels_the_round_it_waits_for_at_once_and_keeps_its_round(overlap: bool) -> None:
    """A Ctrl-C while the outer round waits for its group (up to the averaging timeout, 60-90 s in the presets)
    used to wait it out: past the daemon's 28-s leave deadline, which then exits with no final checkpoint. Now the
    wait ends at the stop with NodeStopping, the round is cancelled, and the round's state is left as it was (a
    checkpoint holds the last applied round)."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    run = manifest(2, "none", overlap=overlap)
    run = dataclasses.replace(run, averaging=dataclasses.replace(run.averaging, timeout_s=120.0))
    with diloco_peers(run, 2, [start]) as modes:
        waiting, ahead = modes
        ahead.round = 1  # nobody else is in round 0: the round's matchmaking finds no group
        end_of_round(modes, start, [torch.ones(3, 4), torch.ones(3, 4)], [8, 8])
        with ThreadPoolExecutor(1) as pool:
            if overlap:
                waiting._outer_round()  # the all-reduce in the background; the next round ends by waiting for it
                outcome = pool.submit(waiting._finish_round_in_flight, True)
            else:
                outcome = pool.submit(waiting._outer_round)
            looking = functools.partial(waiting.context.phases.seconds, Phase.MATCHMAKING)
            await_condition(lambda: looking() >= 1.0, 30, "the round to look for its group for a second")
            assert not outcome.done(), "the round waits for its group"
            stopped_at = time.monotonic()
            waiting.context.stop.set()
            with pytest.raises(NodeStopping):
                outcome.result(timeout=10)
            assert time.monotonic() - stopped_at < 5.0, "at the stop, not at the 120-s timeout"
        assert waiting.round == 0 and waiting.num_local_rounds == 0, "no round ended, alone or not"
        assert torch.equal(waiting.global_parameters[0], start), "no outer step applied"


def test_a_node_left_behind_that_gets_no_state_joins_the_swarms_round_with_its_own() -> None:
    """On a home link a whole state can take longer than the download's timeout while the swarm trains (the WAN
    lab's streaming arm): a node two rounds behind whose download brings nothing must not wait out of every round
    for one that may never fit; it moves to the swarm's round with its own θ₀ and averages from there."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(2, "none"), 2, [start]) as modes:
        behind, ahead = modes
        behind.round = 1  # it averaged with the swarm before: its θ₀ is of the swarm's lineage
        ahead.tracker.report_local_progress(3, 8)
        await_condition(lambda: behind.tracker.global_epoch == 3, 30, "the swarm to be seen at round 3")
        assert behind._left_behind() and behind._behind_the_swarm()
        behind.averager.load_state_from_peers = lambda **kwargs: None  # type: ignore[method-assign]  # timed out
        assert not behind._load_state_from_peers()
        assert behind.round == 3 and behind.training_round == 3 and not behind._left_behind()
        assert torch.equal(behind.global_parameters[0], start), "its own θ₀: nothing came to replace it"


def test_a_joiner_that_gets_no_state_keeps_the_initial_weights_out_of_the_swarms_rounds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A joiner at round 0 holds the run's initial weights: when no donor's state comes (two donors that differ for
    a round refuse each other's corroboration), joining the swarm's round with them would average a fresh model's
    pseudo-gradients into the swarm's and keep its θ₀ off the swarm's for good (a CI log). It asks again later."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(2, "none"), 2, [start]) as modes:
        joiner, ahead = modes
        ahead.tracker.report_local_progress(3, 8)
        await_condition(lambda: joiner.tracker.global_epoch == 3, 30, "the swarm to be seen at round 3")
        joiner.averager.load_state_from_peers = lambda **kwargs: None  # type: ignore[method-assign]  # refused
        with caplog.at_level("WARNING", logger="crowdtrain.modes.diloco.joining"):
            assert not joiner._load_state_from_peers()
        assert "waits for the swarm's state of outer round 3" in caplog.text
        assert joiner.round == 0 and joiner._left_behind(), "it ends no round with the initial weights"
        assert not joiner._behind_the_swarm(), "not at once: a download per micro-batch would be all it does"
        joiner._sync_not_before = 0.0  # SYNC_RETRY_S later
        assert joiner._behind_the_swarm(), "it asks for the swarm's state again"


def test_a_stopping_joiner_leaves_its_state_download_at_once_with_its_state_as_it_was() -> None:
    """A joiner's state download can take its whole timeout (120 s) on a home link; a Ctrl-C must not wait it out
    (the daemon's leave deadline is 28 s). The download's wait ends at the stop; nothing is loaded."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(2, "none"), 2, [start]) as modes:
        joiner, ahead = modes
        ahead.tracker.report_local_progress(3, 8)
        await_condition(lambda: joiner.tracker.global_epoch == 3, 30, "the swarm to be seen at round 3")
        assert joiner._behind_the_swarm()
        joiner.context.stop.set()
        started = time.monotonic()
        with pytest.raises(NodeStopping, match="a state download was cut short"):
            joiner._load_state_from_peers()
        assert time.monotonic() - started < 5.0, "at the stop, not at the download's 120-s timeout"
        assert joiner.round == 0 and torch.equal(joiner.global_parameters[0], start), "nothing loaded"


def test_peers_whose_global_parameters_differ_after_an_averaged_round_resync_to_the_higher_ranked() -> None:
    """Two peers that each stepped a round alone in the same round (neither saw the other yet) then averaged every
    round, each applying the same Δ to its own θ₀: their states never agreed again, and a joiner could corroborate
    neither (a CI log of test_diloco). Each round now gathers a digest of its θ₀; the lower-ranked of two that differ
    takes a state (corroborated), the other keeps its own."""
    start = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
    with diloco_peers(manifest(2, "none"), 2, [start]) as modes:
        for mode in modes:  # below the matchmaking time: hivemind's matchmaking deadlocks otherwise
            kwargs = mode.averager.matchmaking_kwargs
            assert kwargs["request_timeout"] < kwargs["min_matchmaking_time"]
        run_one_outer_round(modes, start, [torch.ones(3, 4), torch.ones(3, 4)], [8, 8])
        assert not any(mode._resync for mode in modes), "peers in step hold the same bits"
        lower, higher = sorted(modes, key=lambda mode: _tiebreak(mode.context.peer_id))
        with torch.no_grad():
            lower.global_parameters[0].add_(0.25)  # a round it stepped apart
        run_one_outer_round(modes, start, [torch.ones(3, 4), torch.ones(3, 4)], [8, 8])
        assert all(mode.round == 2 and mode.num_local_rounds == 0 for mode in modes), "the round was averaged"
        assert not torch.equal(lower.global_parameters[0], higher.global_parameters[0]), "the same Δ on each θ₀"
        assert lower._resync and lower._behind_the_swarm(), "the lower-ranked one takes a state next"
        assert not higher._resync and not higher._behind_the_swarm()
        # It asks at once; the peer above may not have declared the round yet (a CI log: SYNC_RETRY_S later the two
        # had averaged eight rounds apart). A try that finds no state is made again RESYNC_RETRY_S later, a few times.
        real_load = lower.averager.load_state_from_peers
        lower.averager.load_state_from_peers = lambda **kwargs: None  # type: ignore[method-assign]  # none above
        for _ in range(MAX_RESYNC_TRIES):
            assert not lower._load_state_from_peers()
            assert lower._resync and not lower._behind_the_swarm(), "not at once"
            assert lower._sync_not_before - time.monotonic() <= RESYNC_RETRY_S
            lower._sync_not_before = 0.0  # RESYNC_RETRY_S later
            assert lower._behind_the_swarm(), "it asks again"
        assert not lower._load_state_from_peers()
        assert not lower._resync and not lower._behind_the_swarm(), "then the next averaged round decides"
        lower.averager.load_state_from_peers = real_load  # type: ignore[method-assign]
        lower._resync, lower._resync_tries, lower._sync_not_before = True, 0, 0.0
        await_condition(lambda: lower._behind_the_swarm() and lower._load_state_from_peers(), 30, "the state above")
        assert lower.round == 2 and not lower._resync
        for mine, theirs in zip(lower.global_parameters, higher.global_parameters, strict=True):
            assert torch.equal(mine, theirs), "the higher-ranked peer's θ₀"
        run_one_outer_round(modes, start, [torch.ones(3, 4), torch.ones(3, 4)], [8, 8])
        assert not any(mode._resync for mode in modes), "in step again"


@pytest.mark.parametrize(
    "value", [3, [3, None], [3, None, b"x"], [3, None, "0" * START_DIGEST_BYTES], [3, None, 7], list(range(9))]
)
def test_a_gathered_value_without_a_well_formed_digest_has_none(value: object) -> None:
    assert _gathered_digest(value) is None
    assert _gathered_digest([3, None, bytes(START_DIGEST_BYTES)]) == bytes(START_DIGEST_BYTES)


def test_a_peer_others_cant_dial_averages_its_outer_round_and_serves_no_state() -> None:
    """A volunteer behind a NAT is a client-mode averager: hivemind refuses a state-sharing priority on one."""
    run = manifest(2, "none")
    dhts = loopback_dhts(2)
    statuses = [proto.PeerStatus(peer_id=dht.peer_id.to_base58()) for dht in dhts]
    modes: list[DiLoCoMode] = []
    try:
        modes.append(computing_peer(run, dhts[0], statuses, DiLoCoMode))
        modes.append(computing_peer(run, dhts[1], statuses, DiLoCoMode, client_mode=True))
        start = modes[0].global_parameters[0].clone()
        pseudo = [torch.full_like(start, 0.01), torch.full_like(start, 0.03)]
        run_one_outer_round(modes, start, pseudo, [32, 32])
        assert [mode.round for mode in modes] == [1, 1]
        assert [mode.num_local_rounds for mode in modes] == [0, 0], "the NATed peer averaged with the public one"
        assert modes[1].averager.state_sharing_priority == 0, "a client serves no state"
        assert modes[0].averager.state_sharing_priority >= 1
    finally:
        close_peers(modes, dhts)
