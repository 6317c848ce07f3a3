"""The DeDLOC plan: hand-computed swarms, an independent brute force with HiGHS, determinism, fallbacks."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import time
from types import SimpleNamespace

import pytest
from scipy.optimize import linprog

from crowdtrain.planning import plan as plan_module
from crowdtrain.planning.plan import (
    NO_AGGREGATOR,
    PeerCapabilities,
    Plan,
    PlanProblem,
    compute_plan,
    equal_split_time_s,
    swarm_samples_per_second,
)

# 100 MB on the wire over 100 Mbit/s = 12.5 MB/s: one whole vector takes 8 s to send.
VECTOR_BYTES = 100_000_000
PROBLEM = PlanProblem(vector_size_bytes=VECTOR_BYTES, target_batch_size=1000)


def peer(
    peer_id: str,
    samples_per_second: float = 10.0,
    mbps: float = 100.0,
    reachable: bool = True,
    forced_role: str | None = None,
) -> PeerCapabilities:
    return PeerCapabilities(
        peer_id=peer_id,
        samples_per_second=samples_per_second,
        upload_mbps=mbps,
        download_mbps=mbps,
        reachable=reachable,
        forced_role=forced_role,
    )


def lp_time_s(peers: list[PeerCapabilities], problem: PlanProblem, computes: dict[str, bool]) -> float:
    """The averaging LP of the module docstring built independently, in bytes and seconds, with both rows."""
    num_peers = len(peers)
    num_computing = sum(computes[p.peer_id] for p in peers)
    size = problem.vector_size_bytes
    rows, bounds = [], []
    for i, p in enumerate(peers):
        x = float(computes[p.peer_id])
        for mbps in (max(p.upload_mbps, 1e-3), max(p.download_mbps, 1e-3)):
            # x·P·(1 − g) + g·P·(N − x) ≤ bandwidth·T  ⇔  g·P·(N − 2x) − bandwidth·T ≤ −x·P
            row = [0.0] * (num_peers + 1)
            row[i], row[-1] = size * (num_computing - 2 * x), -mbps * 125_000
            rows.append((row, -x * size))
        can_aggregate = p.reachable and p.forced_role != "client" and min(p.upload_mbps, p.download_mbps) > 0
        bounds.append((0.0, 1.0 if can_aggregate else 0.0))
    result = linprog(
        c=[0.0] * num_peers + [1.0],
        A_ub=[row for row, _ in rows],
        b_ub=[bound for _, bound in rows],
        A_eq=[[1.0] * num_peers + [0.0]],
        b_eq=[1.0],
        bounds=bounds + [(0.0, None)],
        method="highs",
    )
    assert result.status == 0, result.message
    return float(result.x[-1])


def assert_valid_shares(plan: Plan) -> None:
    assert math.isclose(sum(plan.shares.values()), 1.0, abs_tol=1e-9)
    assert all(share >= 0 for share in plan.shares.values())
    for peer_id, share in plan.shares.items():
        assert (share > 0) <= ("aggregator" in plan.roles[peer_id])


def test_two_identical_peers_split_evenly() -> None:
    plan = compute_plan([peer("a"), peer("b")], PROBLEM)
    assert plan.shares == {"a": 0.5, "b": 0.5}
    assert plan.roles == {"a": ("trainer", "aggregator"), "b": ("trainer", "aggregator")}
    assert plan.computes == {"a": True, "b": True}
    # Each sends the other half of its gradient and receives the average of its own half:
    # P·(1 − ½) + ½·P·(2 − 1) = P = 1e8 bytes each way, at 100 Mbit/s = 1.25e7 bytes/s → 8 s.
    assert plan.averaging_time_s == pytest.approx(8.0, rel=1e-12)
    # B / (B / Σc + T) = 1000 / (1000 / 20 + 8) = 1000 / 58 (beats one peer alone, 10 samples/s, T = 0).
    assert plan.samples_per_second == pytest.approx(1000 / 58, rel=1e-12)
    assert plan.solver == "highs"


def test_the_faster_link_takes_the_larger_share_and_beats_an_equal_split() -> None:
    # With two computing peers every split costs P each way; with three, aggregating costs more.
    peers = [peer("fast", mbps=1000.0), peer("slow1"), peer("slow2")]
    plan = compute_plan(peers, PROBLEM)
    assert all(plan.computes.values())
    assert plan.shares["fast"] > plan.shares["slow1"] and plan.shares["fast"] > plan.shares["slow2"]
    # fast aggregates everything: the slow peers send and receive one vector each, 1e8 / 1.25e7 = 8 s;
    # fast receives two parts and sends two averages, 2e8 / 1.25e8 = 1.6 s.
    assert plan.shares["fast"] == pytest.approx(1.0)
    assert plan.averaging_time_s == pytest.approx(8.0)
    # Equal thirds: a slow peer sends 2/3 P of its gradient plus 2 · 1/3 P of averages = 4/3 P → 10.67 s.
    assert equal_split_time_s(peers, PROBLEM) == pytest.approx(32 / 3)
    assert plan.averaging_time_s < equal_split_time_s(peers, PROBLEM)


def test_one_fast_node_among_many_slow_ones() -> None:
    peers = [peer("fast", samples_per_second=100.0, mbps=1000.0)]
    peers += [peer(f"slow{i}", samples_per_second=5.0, mbps=20.0) for i in range(7)]
    # Small batch: a slow peer needs 1e8 / 2.5e6 = 40 s to ship its vector, more than the batch takes
    # the fast node alone (4096 / 100 = 41 s of compute with no averaging beats 4096 / (4096/135 + 40)).
    problem = PlanProblem(vector_size_bytes=VECTOR_BYTES, target_batch_size=4096)
    plan = compute_plan(peers, problem)
    assert plan.computes == {p.peer_id: p.peer_id == "fast" for p in peers}
    assert plan.shares["fast"] == 1.0 and plan.averaging_time_s == 0.0
    assert plan.samples_per_second == pytest.approx(100.0)
    assert swarm_samples_per_second(4096, 135.0, 40.0) < plan.samples_per_second
    assert all(plan.roles[f"slow{i}"] == () for i in range(7))
    # Large batch: the slow peers' compute is worth 40 s of averaging; the fast link aggregates it all.
    problem = PlanProblem(vector_size_bytes=VECTOR_BYTES, target_batch_size=100_000)
    plan = compute_plan(peers, problem)
    assert all(plan.computes.values())
    assert plan.shares["fast"] == pytest.approx(1.0) and plan.averaging_time_s == pytest.approx(40.0)
    assert plan.samples_per_second == pytest.approx(100_000 / (100_000 / 135 + 40))


def test_nobody_reachable_falls_back() -> None:
    peers = [peer("a", reachable=False), peer("b", samples_per_second=0.0, reachable=False)]
    plan = compute_plan(peers, PROBLEM)
    assert plan.solver == NO_AGGREGATOR
    assert plan.shares == {} and plan.averaging_time_s == math.inf
    assert plan.samples_per_second == 10.0
    assert plan.roles == {"a": ("trainer", "client"), "b": ("client",)}
    assert plan.computes == {"a": True, "b": False}


def test_reachable_peers_forced_to_be_clients_leave_no_aggregator() -> None:
    plan = compute_plan([peer("a", forced_role="client"), peer("b", reachable=False)], PROBLEM)
    assert plan.solver == NO_AGGREGATOR
    assert plan.roles == {"a": ("trainer", "client"), "b": ("trainer", "client")}


def test_the_reachable_peer_aggregates_for_the_unreachable_one() -> None:
    plan = compute_plan([peer("behind-nat", reachable=False), peer("public")], PROBLEM)
    assert plan.shares == {"behind-nat": 0.0, "public": 1.0}
    assert plan.roles == {"behind-nat": ("trainer", "client"), "public": ("trainer", "aggregator")}
    # behind-nat sends its whole gradient and receives the average: P each way, 8 s; public the same.
    assert plan.averaging_time_s == pytest.approx(8.0)


def test_a_weak_trainer_with_a_strong_link_only_aggregates() -> None:
    # Three trainers at 100 Mbit/s (r = 1.25e7 / 1e8 = 0.125 vectors/s) and a 200 Mbit/s peer that barely computes.
    peers = [peer(f"s{i}") for i in range(3)] + [peer("w", samples_per_second=0.1, mbps=200.0)]
    plan = compute_plan(peers, PROBLEM)
    assert plan.roles["w"] == ("aggregator",) and not plan.computes["w"]
    assert all(plan.computes[f"s{i}"] for i in range(3))
    # w only aggregates (N = 3): an s moves (1 − g_s) + 2·g_s = 1 + g_s vectors, w moves 3·g_w.
    # At T every cap is full: 3·(0.125·T − 1) + 0.25·T / 3 = 1  →  T = 4 / (0.375 + 1/12) = 96/11 s.
    aggregating = 96 / 11
    assert plan.averaging_time_s == pytest.approx(aggregating)
    # w also computes (N = 4): each moves 1 + 2·g; (0.125·T − 1)·3/2 + (0.25·T − 1)/2 = 1  →  T = 1.2 / 0.125 = 9.6 s.
    computing = 9.6
    forced = compute_plan([*peers[:3], peer("w", samples_per_second=0.1, mbps=200.0, forced_role="trainer")], PROBLEM)
    assert forced.averaging_time_s == pytest.approx(computing) and all(forced.computes.values())
    # 0.1 samples/s more does not pay for 0.87 s more averaging:
    assert plan.samples_per_second == pytest.approx(swarm_samples_per_second(1000, 30.0, aggregating))
    assert forced.samples_per_second == pytest.approx(swarm_samples_per_second(1000, 30.1, computing))
    assert plan.samples_per_second > forced.samples_per_second


def test_forced_roles_are_honoured() -> None:
    peers = [
        peer("agg", samples_per_second=50.0, mbps=1000.0, forced_role="aggregator"),
        peer("cli", mbps=1000.0, forced_role="client"),
        peer("slowpoke", samples_per_second=1.0, mbps=1.0, forced_role="trainer"),
        peer("free"),
    ]
    plan = compute_plan(peers, PROBLEM)
    assert plan.roles["agg"] == ("aggregator",) and not plan.computes["agg"]
    assert plan.roles["cli"] == ("trainer", "client") and plan.shares["cli"] == 0.0
    assert plan.computes["slowpoke"] and "trainer" in plan.roles["slowpoke"]
    assert_valid_shares(plan)
    # Unforced, the plan would let agg compute, cli aggregate and slowpoke (800 s per vector) rest.
    unforced = compute_plan([peer(p.peer_id, p.samples_per_second, p.upload_mbps) for p in peers], PROBLEM)
    assert unforced.computes["agg"] and unforced.shares["cli"] > 0 and not unforced.computes["slowpoke"]


def test_an_unreachable_forced_aggregator_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot dial"):
        peer("hidden", reachable=False, forced_role="aggregator")


def test_permuting_the_input_gives_the_identical_plan() -> None:
    rng = random.Random(7)
    for num_peers in (8, 16):
        peers = [
            PeerCapabilities(
                peer_id=f"peer-{rng.getrandbits(32):08x}",
                samples_per_second=rng.choice([0.0, rng.uniform(1, 50)]),
                upload_mbps=rng.uniform(5, 500),
                download_mbps=rng.uniform(5, 500),
                reachable=rng.random() < 0.7,
            )
            for _ in range(num_peers)
        ]
        expected = compute_plan(peers, PROBLEM)
        for _ in range(5):
            rng.shuffle(peers)
            plan = compute_plan(peers, PROBLEM)
            assert plan == expected
            assert list(plan.roles) == list(expected.roles) == sorted(expected.roles)


def test_sixteen_peers_take_the_greedy_path_quickly() -> None:
    rng = random.Random(16)
    peers = [
        PeerCapabilities(
            peer_id=f"p{i:02d}",
            samples_per_second=rng.uniform(1, 50),
            upload_mbps=rng.uniform(5, 500),
            download_mbps=rng.uniform(5, 500),
            reachable=rng.random() < 0.7,
        )
        for i in range(16)
    ]
    problem = PlanProblem(vector_size_bytes=VECTOR_BYTES, target_batch_size=4096)
    started = time.perf_counter()
    plan = compute_plan(peers, problem)
    assert time.perf_counter() - started < 1.0
    assert plan.solver == "highs"
    assert_valid_shares(plan)
    everyone = swarm_samples_per_second(
        4096, sum(p.samples_per_second for p in peers), lp_time_s(peers, problem, dict.fromkeys(plan.computes, True))
    )
    assert plan.samples_per_second >= everyone
    assert plan.averaging_time_s == pytest.approx(lp_time_s(peers, problem, plan.computes), rel=1e-6)


def test_the_plan_is_the_brute_force_optimum_of_the_lp() -> None:
    rng = random.Random(3)
    for _ in range(6):
        peers = [
            PeerCapabilities(
                peer_id=f"p{i}",
                samples_per_second=rng.choice([0.0, 1.0, 10.0, 40.0]),
                upload_mbps=rng.choice([0.0, 10.0, 100.0, 1000.0]),
                download_mbps=rng.choice([10.0, 100.0, 1000.0]),
                reachable=i == 0 or rng.random() < 0.5,
            )
            for i in range(4)
        ]
        problem = PlanProblem(vector_size_bytes=rng.choice([10**7, 10**8]), target_batch_size=rng.choice([256, 4096]))
        best = 0.0
        for bits in itertools.product((False, True), repeat=len(peers)):
            computes = {p.peer_id: on and p.samples_per_second > 0 for p, on in zip(peers, bits, strict=True)}
            compute = sum(p.samples_per_second for p in peers if computes[p.peer_id])
            if compute > 0:
                best = max(
                    best,
                    swarm_samples_per_second(problem.target_batch_size, compute, lp_time_s(peers, problem, computes)),
                )
        plan = compute_plan(peers, problem)
        assert plan.samples_per_second == pytest.approx(best, rel=1e-6)
        assert plan.averaging_time_s == pytest.approx(lp_time_s(peers, problem, plan.computes), rel=1e-6, abs=1e-9)
        assert_valid_shares(plan)


def test_zero_bandwidth_is_tiny_not_a_crash() -> None:
    peers = [
        peer("a"),
        peer("b"),
        PeerCapabilities(peer_id="mute", samples_per_second=10.0, upload_mbps=0.0, download_mbps=50.0, reachable=True),
    ]
    plan = compute_plan(peers, PROBLEM)
    assert not plan.computes["mute"] and plan.shares["mute"] == 0.0  # never handed a part
    assert plan.averaging_time_s == pytest.approx(8.0)
    assert_valid_shares(plan)
    # Forced to train, it ships its vector at 1e-3 Mbit/s = 125 bytes/s: 1e8 / 125 = 8e5 s, finite.
    plan = compute_plan([peer("a"), peer("b"), dataclasses.replace(peers[2], forced_role="trainer")], PROBLEM)
    assert plan.computes["mute"] and plan.averaging_time_s == pytest.approx(8e5)
    assert_valid_shares(plan)
    # The only reachable peer has a dead link: nobody can aggregate.
    assert compute_plan([peers[2], peer("nat", reachable=False)], PROBLEM).solver == NO_AGGREGATOR


def test_nobody_able_to_compute_averages_nothing() -> None:
    plan = compute_plan([peer("a", samples_per_second=0.0), peer("b", samples_per_second=0.0)], PROBLEM)
    assert plan.computes == {"a": False, "b": False}
    assert plan.shares == {"a": 0.5, "b": 0.5} and plan.averaging_time_s == 0.0 and plan.samples_per_second == 0.0


def test_aggregators_below_min_share_get_none() -> None:
    # All compute (N = 3, a peer moves 1 + g vectors); at the slow peer's 8 s the middle one has room
    # for 1.05·0.125·8 − 1 = 0.05 of the vector and the fast one for all of it: shares 1/1.05, 0.05/1.05.
    peers = [peer("fast", mbps=1000.0), peer("middle", mbps=105.0), peer("slow")]
    plan = compute_plan(peers, PROBLEM)
    assert plan.shares["middle"] == pytest.approx(0.05 / 1.05)
    assert plan.averaging_time_s == pytest.approx(8.0)
    pruned = compute_plan(peers, PlanProblem(vector_size_bytes=VECTOR_BYTES, target_batch_size=1000, min_share=0.1))
    assert pruned.shares == {"fast": 1.0, "middle": 0.0, "slow": 0.0}
    assert pruned.roles["middle"] == ("trainer",) and pruned.averaging_time_s == pytest.approx(8.0)


def test_a_solver_failure_falls_back_to_an_equal_split(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        plan_module, "linprog", lambda *args, **kwargs: SimpleNamespace(status=4, message="numerical trouble")
    )
    peers = [peer("fast", mbps=1000.0), peer("slow1"), peer("slow2"), peer("nat", reachable=False)]
    with caplog.at_level(logging.WARNING, logger="crowdtrain.planning.plan"):
        plan = compute_plan(peers, PROBLEM)
    assert plan.solver == "equal-split fallback: numerical trouble"
    assert plan.shares == {"fast": 1 / 3, "nat": 0.0, "slow1": 1 / 3, "slow2": 1 / 3}
    assert plan.averaging_time_s == pytest.approx(equal_split_time_s(peers, PROBLEM, plan.computes))
    assert "HiGHS failed" in caplog.text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"samples_per_second": -1.0},
        {"upload_mbps": math.nan},
        {"download_mbps": math.inf},
        {"peer_id": ""},
        {"forced_role": "expert-host"},
    ],
)
def test_bad_capabilities_are_rejected(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "peer_id": "a",
        "samples_per_second": 1.0,
        "upload_mbps": 1.0,
        "download_mbps": 1.0,
        "reachable": True,
    }
    with pytest.raises(ValueError):
        PeerCapabilities(**(fields | kwargs))  # type: ignore[arg-type]


def test_bad_problems_and_peer_lists_are_rejected() -> None:
    with pytest.raises(ValueError):
        PlanProblem(vector_size_bytes=0, target_batch_size=1)
    with pytest.raises(ValueError):
        PlanProblem(vector_size_bytes=1, target_batch_size=0)
    with pytest.raises(ValueError):
        PlanProblem(vector_size_bytes=1, target_batch_size=1, min_share=1.0)
    with pytest.raises(ValueError, match="at least one peer"):
        compute_plan([], PROBLEM)
    with pytest.raises(ValueError, match="twice"):
        compute_plan([peer("a"), peer("a")], PROBLEM)
