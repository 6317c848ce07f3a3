"""Hand-made and random SkipPipe scheduling problems, and the constraints every schedule of one must keep."""

from __future__ import annotations

import random
from collections import Counter

from crowdtrain.modes.skippipe.roster.schedule import NodeInfo, Schedule, SkipPipeProblem, num_visited_stages, simulate


def node(peer_id: str, stage: int, seconds: float = 1.0, memory: int = 8) -> NodeInfo:
    return NodeInfo(peer_id=peer_id, stage=stage, seconds_per_microbatch=seconds, memory_microbatches=memory)


def four_by_two(slow_factor: float = 4.0, memory: int = 8) -> tuple[NodeInfo, ...]:
    """4 stages × 2 replicas, 1 s per microbatch, except s2b, `slow_factor` times slower."""
    return tuple(
        node(f"s{stage}{replica}", stage, slow_factor if f"s{stage}{replica}" == "s2b" else 1.0, memory)
        for stage in range(4)
        for replica in "ab"
    )


def problem(nodes: tuple[NodeInfo, ...], **overrides: object) -> SkipPipeProblem:
    settings: dict[str, object] = {"num_stages": 4, "num_microbatches": 16, "skip_ratio": 0.25, "seed": 7}
    settings.update(overrides)
    return SkipPipeProblem(nodes=nodes, **settings)  # type: ignore[arg-type]


def check_constraints(p: SkipPipeProblem, schedule: Schedule) -> None:
    """Constraints (1)-(4) of a schedule, and that its timeline is that of its routes."""
    by_peer = {n.peer_id: n for n in p.nodes}
    live_stages = {n.stage for n in p.nodes if n.peer_id not in p.exclude}
    present = sorted(stage for stage in live_stages if stage != 0)
    assert schedule.missing_stages == tuple(s for s in range(1, p.num_stages) if s not in live_stages)
    assert [route.microbatch for route in schedule.routes] == list(range(p.num_microbatches))
    for route in schedule.routes:
        assert route.stages[0] == 0 and route.source == route.path[0]
        assert len(set(route.stages)) == len(route.stages) == len(route.path), "no stage twice"
        assert all(by_peer[peer].stage == stage for peer, stage in zip(route.path, route.stages, strict=True))
        assert not set(route.path) & p.exclude
        assert len(route.stages) - 1 == min(num_visited_stages(p.num_stages, p.skip_ratio), len(present))
        if not p.reorder:
            assert list(route.stages) == sorted(route.stages)
    visits = Counter(stage for route in schedule.routes for stage in route.stages[1:])
    assert set(visits) <= set(present)
    for peer, peak in schedule.timeline.peak_microbatches.items():
        assert peak <= by_peer[peer].memory_microbatches
    counted = Counter(peer for route in schedule.routes for peer in route.path)
    assert {peer: count for peer, count in schedule.microbatches_per_node.items() if count} == dict(counted)
    assert schedule.timeline == simulate(p, schedule.routes)
    assert schedule.makespan_s >= max(schedule.timeline.busy_s.values()) - 1e-9


def check_balanced(schedule: Schedule, present: list[int]) -> None:
    visits = Counter(stage for route in schedule.routes for stage in route.stages[1:])
    counts = [visits[stage] for stage in present] or [0]
    assert max(counts) - min(counts) <= 1, counts


def random_problem(rng: random.Random) -> SkipPipeProblem:
    num_stages = rng.randint(2, 6)
    nodes = []
    for stage in range(num_stages):
        for replica in range(rng.choice((1, 1, 2, 2, 3)) if stage == 0 else rng.choice((0, 1, 2, 3))):
            seconds = rng.choice((0.5, 1.0, 1.0, 2.0, 4.0)) * rng.uniform(0.9, 1.1)
            nodes.append(node(f"p{stage}-{replica}", stage, seconds, rng.randint(1, 4)))
    stage_zero = [n.peer_id for n in nodes if n.stage == 0]
    exclude = {n.peer_id for n in nodes if rng.random() < 0.15} - {stage_zero[0]}
    pairs = [(a.peer_id, b.peer_id) for a in nodes for b in nodes if a != b and rng.random() < 0.2]
    return SkipPipeProblem(
        num_stages=num_stages,
        nodes=tuple(nodes),
        num_microbatches=rng.randint(1, 24),
        skip_ratio=rng.choice((0.0, 0.25, 0.5, rng.uniform(0, 0.95))),
        reorder=rng.random() < 0.5,
        seed=rng.randrange(1000),
        latency_s={pair: rng.uniform(0, 0.3) for pair in pairs},
        exclude=frozenset(exclude),
    )
