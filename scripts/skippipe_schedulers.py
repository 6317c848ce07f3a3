"""SkipPipe schedulers no node runs, for the benchmarks to compare with the greedy the nodes run.

The greedy (`crowdtrain.modes.skippipe.roster.schedule.schedule_microbatches`) balances each node's total load and the
start order, but not when the load comes, and leaves collisions to the nodes' queues. The schedulers here try to do
better, or are the baselines; all are scored by the product's timeline (`simulate`) and use the greedy's
internals, so they move with it. How much shorter each is than the greedy, in the model and across processes, is
in BENCHMARKS.md (`bench_skippipe_schedule.py`, `bench_skippipe_swarm.py`); tests/test_skippipe_schedulers.py
checks what each keeps of the greedy's and that the search and `planned` end no later than it:

- `planned` routes the greedy's stage sets again by prioritized planning (the completion step of the paper's
  search, below) and keeps whichever routes the timeline ends first, in a few milliseconds a schedule. Across
  processes its gain was small or none: not what nodes run. Its routes may pass no microbatch through a replica;
  a stage node given none finds a dead source by pinging its sources (`SkipPipeNode._wait_sources`).
- `conflict_based` is the paper's method: conflict-based search (CBS) over the microbatches' space-time paths, with
  A* for each microbatch (`_Planner`, `_conflict_search`). It keeps the greedy's stage sets (the paper's first
  phase, a cap on each stage's visits, is what least-visited-first gives) and chooses each microbatch's source,
  replicas, order and op times such that no two microbatches' ops overlap at a node and no node holds more
  microbatches' activations than its memory. With 8 microbatches the search never ends conflict-free within
  CBS_EXPANSIONS splits, and prioritized planning completes its node with the fewest conflicts; in the model that
  is 6.5% shorter than the greedy on the benchmark's shape and 11% shorter to 3% longer on random swarms, worse
  than prioritized planning from no split on the former, at 60-120 ms a schedule; across processes it was no
  faster than the greedy (each node spent 0.2-0.3 s of its iteration on it).
- `searched` improves the greedy's routes against the timeline (`_improve`): sweeps over the microbatches in order
  try each hop on the stage's other replicas and, with reorder, each swap of two visited stages, and keep a change
  that shortens the makespan, within IMPROVE_EVALUATIONS timelines; the stage sets stay the greedy's. In the model
  it shortens the greedy's makespan by 12% on the benchmark's shape and by 4-22% on random swarms; across 8
  processes on 2 cores its iterations were 6% longer than the greedy's (0.15 s of each node's iteration went to the
  search: 55 ms alone, more with 8 processes on 2 cores).

`full_pipeline` (k = 0, ascending, replicas in turn) and `random_skipping` (the same k, stages and replicas drawn at
random) are the baselines to compare against, and `greedy_in_order` (the greedy without its start order) what nodes
ran before.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# The greedy's internals: these schedulers start from its stage sets and routes and score with its timeline.
from crowdtrain.modes.skippipe.roster.schedule import (
    _EPSILON_S,
    FORWARD_SHARE,
    IMPROVE_MIN_S,
    Route,
    Schedule,
    SkipPipeProblem,
    _cost,
    _finish,
    _greedy,
    _greedy_routes,
    _hop_s,
    _live_swarm,
    _route,
    _sooner,
    _Swarm,
    _tie,
    simulate,
)

IMPROVE_EVALUATIONS = 64
"""The most timelines `_improve` simulates for one schedule (about 1 ms each for 8 microbatches on 8 nodes)."""
CBS_EXPANSIONS = 128
"""The most conflicts `conflict_based`'s search splits on before it completes its best node by prioritized planning."""
PLAN_EXPANSIONS = 256
"""The most A* entries `_Planner.plan` expands for one microbatch before it completes the best one greedily. Without
a bound, prioritized planning took 5.7 s a schedule on 8 stages × 3 replicas with 32 microbatches, and 12 × 2 with
16 did not end within 4 minutes; with it, 0.55 and 0.85 s."""


def planned(problem: SkipPipeProblem) -> Schedule:
    """The greedy's schedule, or the routes prioritized planning finds for the same stage sets (`conflict_based` with
    no split), whichever the timeline ends first (the greedy's on a tie); for benchmarks (see the module's doc)."""
    swarm = _live_swarm(problem)
    first = _greedy(problem, swarm)
    plans = _prioritized(_Planner(problem, swarm), [route.stages[1:] for route in first.routes])
    return _sooner(first, _finish(problem, swarm, [plan.route for plan in plans]))


def searched(problem: SkipPipeProblem) -> Schedule:
    """The greedy's routes improved by local search against the timeline (`_improve`): shorter in the model, not in
    the measured iterations so far (see the module's doc); for benchmarks."""
    swarm = _live_swarm(problem)
    return _finish(problem, swarm, _improve(problem, swarm, list(_greedy(problem, swarm).routes)))


def greedy_in_order(problem: SkipPipeProblem) -> Schedule:
    """The greedy's routes in the greedy's own order, the start order not chosen: what nodes ran before; for
    benchmarks."""
    swarm = _live_swarm(problem)
    return _finish(problem, swarm, _greedy_routes(problem, swarm))


def _improve(problem: SkipPipeProblem, swarm: _Swarm, routes: list[Route]) -> list[Route]:
    """`searched`'s local search on the timeline's makespan: in sweeps over the microbatches in order, try each hop
    on each other live replica of its stage and, with reorder, each swap of two visited stages; keep a change that
    shortens the makespan, at most IMPROVE_EVALUATIONS timelines in all. Neither move changes which stages a
    path visits, so the visit counts stay balanced; no randomness, so every node finds the same routes."""
    best_s = simulate(problem, routes).makespan_s
    evaluations, improved = 0, True
    while improved and evaluations < IMPROVE_EVALUATIONS:
        improved = False
        for index in range(len(routes)):
            for candidate in _neighbours(problem, swarm, routes[index]):
                if evaluations >= IMPROVE_EVALUATIONS:
                    return routes
                evaluations += 1
                trial = [*routes[:index], candidate, *routes[index + 1 :]]
                makespan_s = simulate(problem, trial).makespan_s
                if makespan_s < best_s - IMPROVE_MIN_S:
                    routes, best_s, improved = trial, makespan_s, True
                    break  # on to the next microbatch from the route kept
    return routes


def _neighbours(problem: SkipPipeProblem, swarm: _Swarm, route: Route) -> list[Route]:
    """The routes one move away from `route`: one hop on another replica (the source too), or two visited stages
    swapped (with reorder)."""
    found = []
    for hop, stage in enumerate(route.stages):
        for peer in swarm.replicas[stage]:
            if peer != route.path[hop]:
                path = (*route.path[:hop], peer, *route.path[hop + 1 :])
                found.append(Route(microbatch=route.microbatch, stages=route.stages, path=path))
    if problem.reorder:
        for first in range(1, len(route.stages)):
            for second in range(first + 1, len(route.stages)):
                order = list(range(len(route.stages)))
                order[first], order[second] = second, first
                found.append(
                    Route(
                        microbatch=route.microbatch,
                        stages=tuple(route.stages[i] for i in order),
                        path=tuple(route.path[i] for i in order),
                    )
                )
    return found


def conflict_based(problem: SkipPipeProblem, *, expansions: int = CBS_EXPANSIONS) -> Schedule:
    """The paper's way: conflict-based search over the microbatches' space-time paths, A* for each (`_Planner`).

    Each path keeps the greedy's stages, so the visit counts stay balanced; the search chooses sources, replicas,
    the order (with reorder) and when each op runs, such that no two microbatches' ops overlap at one node and no
    node holds more microbatches' activations than its memory."""
    swarm = _live_swarm(problem)
    stage_sets = [route.stages[1:] for route in _greedy(problem, swarm).routes]
    plans = _conflict_search(_Planner(problem, swarm), stage_sets, expansions)
    return _finish(problem, swarm, [plan.route for plan in plans])


_Interval = tuple[str, float, float]
"""(peer ID, start, end): one op of a microbatch at a node, or a span a microbatch must leave free there."""


@dataclass(frozen=True, slots=True)
class _Plan:
    route: Route
    ops: tuple[_Interval, ...]  # every op in running order: start, forwards, head, backwards, last backward
    done_s: float


class _Planner:
    """A* for one microbatch: the route and op times that end its last backward first, given its stages and the
    spans it must leave free at each node. An op may wait for a free span, never overlap one. The bound on what is
    left (the cheapest replica's forward and backward of each stage still to visit, the backwards of the nodes
    visited, no latency, no wait) never overestimates, so the first finished route popped is the earliest, unless
    PLAN_EXPANSIONS entries were expanded first: then the entry popped is completed step by step by the lowest
    bound. Entries are ordered by bound, then finished first, then path: every node pops the same."""

    def __init__(self, problem: SkipPipeProblem, swarm: _Swarm) -> None:
        self.problem, self.swarm = problem, swarm
        self.cheapest = {stage: min(_cost(swarm, peer) for peer in peers) for stage, peers in swarm.replicas.items()}

    def plan(
        self, microbatch: int, stages: Sequence[int], forbidden: Mapping[str, Sequence[tuple[float, float]]]
    ) -> _Plan:
        open_list: list[_Entry] = []
        for source in self.swarm.replicas[0]:
            start = self._op(forbidden, source, 0.0, FORWARD_SHARE * _cost(self.swarm, source))
            bound = start[2] + (1 - FORWARD_SHARE) * _cost(self.swarm, source) + sum(self.cheapest[s] for s in stages)
            heapq.heappush(open_list, (bound, 1, (source,), (0,), (start,), tuple(sorted(stages))))
        for expanded in itertools.count():
            _, unfinished, path, order, ops, remaining = heapq.heappop(open_list)
            if unfinished and expanded >= PLAN_EXPANSIONS:  # the rest greedily: each step the lowest bound
                while remaining:
                    _, _, path, order, ops, remaining = min(self._forwards(forbidden, path, order, ops, remaining))
                _, unfinished, path, order, ops, remaining = self._backwards(forbidden, path, order, ops)
            if not unfinished:
                return _Plan(route=Route(microbatch=microbatch, stages=order, path=path), ops=ops, done_s=ops[-1][2])
            if remaining:
                for entry in self._forwards(forbidden, path, order, ops, remaining):
                    heapq.heappush(open_list, entry)
            else:
                heapq.heappush(open_list, self._backwards(forbidden, path, order, ops))
        raise AssertionError("unreachable: the loop returns")

    def _forwards(
        self,
        forbidden: Mapping[str, Sequence[tuple[float, float]]],
        path: tuple[str, ...],
        order: tuple[int, ...],
        ops: tuple[_Interval, ...],
        remaining: tuple[int, ...],
    ) -> list[_Entry]:
        """The entries one forward further: each next stage (the lowest one without reorder) on each replica."""
        found: list[_Entry] = []
        previous, _, previous_end_s = ops[-1]
        for stage in remaining if self.problem.reorder else remaining[:1]:
            rest = tuple(other for other in remaining if other != stage)
            for peer in self.swarm.replicas[stage]:
                ready_s = previous_end_s + _hop_s(self.problem, self.swarm.nodes, previous, peer)
                step = self._op(forbidden, peer, ready_s, FORWARD_SHARE * _cost(self.swarm, peer))
                visited = (*path, peer)
                bound = (
                    step[2]
                    + sum(self.cheapest[other] for other in rest)
                    + sum((1 - FORWARD_SHARE) * _cost(self.swarm, node) for node in visited)
                )
                found.append((bound, 1, visited, (*order, stage), (*ops, step), rest))
        return found

    def _backwards(
        self,
        forbidden: Mapping[str, Sequence[tuple[float, float]]],
        path: tuple[str, ...],
        order: tuple[int, ...],
        ops: tuple[_Interval, ...],
    ) -> _Entry:
        """The finished entry of a route whose forwards are planned: the head, the backwards in reverse, the last."""
        source = path[0]
        share = (1 - FORWARD_SHARE) / 2 * _cost(self.swarm, source)
        planned = list(ops)
        for peer, duration_s in [
            (source, share),
            *((peer, (1 - FORWARD_SHARE) * _cost(self.swarm, peer)) for peer in reversed(path[1:])),
            (source, share),
        ]:
            previous, _, previous_end_s = planned[-1]
            ready_s = previous_end_s + _hop_s(self.problem, self.swarm.nodes, previous, peer)
            planned.append(self._op(forbidden, peer, ready_s, duration_s))
        return (planned[-1][2], 0, path, order, tuple(planned), ())

    def conflicts(self, plans: Sequence[_Plan]) -> list[_Conflict]:
        """Every conflict of these plans, the earliest first: each two ops of two microbatches that overlap at a
        node, and at each node the first moment more microbatches hold activations there (from their first op there
        to their last) than its memory; each with the spans that would resolve it, one per branch."""
        ops: dict[str, list[tuple[float, float, int]]] = {}
        for index, plan in enumerate(plans):
            for peer, start_s, end_s in plan.ops:
                ops.setdefault(peer, []).append((start_s, end_s, index))
        holds = _holds(plans)
        found: list[_Conflict] = []
        for peer in sorted(ops):
            at = sorted(ops[peer])
            for position, (start_s, end_s, index) in enumerate(at):
                for other_start_s, other_end_s, other in at[position + 1 :]:
                    if other_start_s >= end_s - _EPSILON_S:
                        break
                    if other != index:
                        branches = ((index, (peer, other_start_s, other_end_s)), (other, (peer, start_s, end_s)))
                        found.append((other_start_s, peer, branches))
            found.extend(self._memory_conflict(peer, holds[peer]))
        found.sort(key=lambda conflict: conflict[:2])
        return found

    def full(self, plans: Sequence[_Plan]) -> list[_Interval]:
        """At each node where these plans fill the memory at some moment, the span from 0 to the last such moment's
        end: a microbatch whose ops there leave it free holds activations there only while a slot is free."""
        spans = []
        for peer, by_microbatch in sorted(_holds(plans).items()):
            events = sorted(
                (time_s, change)
                for first_s, last_s in by_microbatch.values()
                for time_s, change in ((first_s, 1), (last_s, -1))
            )
            held, full_until_s = 0, 0.0
            for time_s, change in events:  # at one time, leaving (-1) sorts before coming (+1)
                held += change
                if change < 0 and held + 1 >= self.swarm.nodes[peer].memory_microbatches:
                    full_until_s = time_s
            if full_until_s > 0:
                spans.append((peer, 0.0, full_until_s))
        return spans

    def _memory_conflict(self, peer: str, holds: Mapping[int, tuple[float, float]]) -> list[_Conflict]:
        """The first moment more microbatches hold activations at `peer` than its memory, as a conflict whose
        branches each make one of them start there only once another has left."""
        memory = self.swarm.nodes[peer].memory_microbatches
        held: list[tuple[float, int]] = []  # (leaves at, microbatch), of those there now
        for index, (first_s, last_s) in sorted(holds.items(), key=lambda item: (item[1], item[0])):
            held = [(leaves_s, other) for leaves_s, other in held if leaves_s > first_s + _EPSILON_S]
            held.append((last_s, index))
            if len(held) > memory:
                branches = tuple(
                    (holder, (peer, 0.0, min(leaves_s for leaves_s, other in held if other != holder)))
                    for _, holder in sorted(held, key=lambda entry: entry[1])
                )
                return [(first_s, peer, branches)]
        return []

    @staticmethod
    def _op(
        forbidden: Mapping[str, Sequence[tuple[float, float]]], peer: str, ready_s: float, duration_s: float
    ) -> _Interval:
        """The op at `peer` from the earliest time at or after `ready_s` at which it overlaps no forbidden span."""
        start_s = ready_s
        # The spans are sorted by start: once one starts after the op would end, none later overlaps it.
        for free_from, free_to in forbidden.get(peer, ()):
            if start_s + duration_s <= free_from + _EPSILON_S:
                break
            if start_s < free_to - _EPSILON_S:
                start_s = max(start_s, free_to)
        return (peer, start_s, start_s + duration_s)


_Conflict = tuple[float, str, tuple[tuple[int, _Interval], ...]]
"""(when, where, and for each branch a microbatch and the span it must leave free there)."""
_Entry = tuple[float, int, tuple[str, ...], tuple[int, ...], tuple[_Interval, ...], tuple[int, ...]]
"""An A* entry: (bound, 0 if finished, path, its stages, its ops so far, the stages still to visit)."""


def _conflict_search(planner: _Planner, stage_sets: Sequence[tuple[int, ...]], expansions: int) -> list[_Plan]:
    """CBS's high level: a best-first search over sets of spans each microbatch must leave free, from none.

    A tree node's plans are each microbatch's A* under its spans. Its first conflict (`_Planner.conflicts`) splits
    it: two ops of two microbatches overlapping at a node in two (either leaves the other's op free), more
    microbatches holding activations at a node than its memory in one per holder (it comes after another leaves).
    Nodes go by makespan, then how many conflicts they have, then the sum of the microbatches' ends; a node with
    none is the answer. After `expansions` splits, the node with the fewest conflicts is completed by prioritized
    planning under its spans (`_prioritized`)."""
    if expansions <= 0:
        return _prioritized(planner, stage_sets)
    count = len(stage_sets)
    none: tuple[tuple[_Interval, ...], ...] = tuple(() for _ in range(count))
    open_list: list[
        tuple[tuple[float, int, float], int, tuple[tuple[_Interval, ...], ...], list[_Plan], list[_Conflict]]
    ] = []
    serial = 0

    def push(spans: tuple[tuple[_Interval, ...], ...], plans: list[_Plan]) -> None:
        nonlocal serial
        conflicts = planner.conflicts(plans)
        key = (max(plan.done_s for plan in plans), len(conflicts), sum(plan.done_s for plan in plans))
        heapq.heappush(open_list, (key, serial, spans, plans, conflicts))
        serial += 1

    push(none, [planner.plan(m, stage_sets[m], {}) for m in range(count)])
    seen: set[frozenset[tuple[int, _Interval]]] = {frozenset()}
    fewest = (math.inf, 0, none)
    for _ in range(expansions):
        if not open_list:
            break
        (_, conflicting, _), number, spans, plans, conflicts = heapq.heappop(open_list)
        if not conflicting:
            return plans
        fewest = min(fewest, (conflicting, number, spans), key=lambda entry: entry[:2])
        taken_here = frozenset((index, taken) for index, spanned in enumerate(spans) for taken in spanned)
        for agent, span in conflicts[0][2]:
            key = taken_here | {(agent, span)}
            if key in seen:
                continue
            seen.add(key)
            changed = (*spans[agent], span)
            replanned = planner.plan(agent, stage_sets[agent], _forbidden(changed))
            push((*spans[:agent], changed, *spans[agent + 1 :]), [*plans[:agent], replanned, *plans[agent + 1 :]])
    return _prioritized(planner, stage_sets, fewest[2])


def _prioritized(
    planner: _Planner, stage_sets: Sequence[tuple[int, ...]], spans: Sequence[tuple[_Interval, ...]] = ()
) -> list[_Plan]:
    """Prioritized planning: each microbatch in order by A*, leaving free its own `spans` (none by default), every
    earlier microbatch's ops and, at each node, the time until the earlier ones last filled its memory. No two ops
    overlap and no node holds more than its memory (`_Planner.full`)."""
    plans: list[_Plan] = []
    for m, stages in enumerate(stage_sets):
        taken = [*(spans[m] if spans else ()), *(interval for plan in plans for interval in plan.ops)]
        plans.append(planner.plan(m, stages, _forbidden([*taken, *planner.full(plans)])))
    return plans


def _holds(plans: Sequence[_Plan]) -> dict[str, dict[int, tuple[float, float]]]:
    """By node, then by microbatch: from its first op there to its last, when it holds activations there."""
    holds: dict[str, dict[int, tuple[float, float]]] = {}
    for index, plan in enumerate(plans):
        for peer, start_s, end_s in plan.ops:
            first_s, last_s = holds.setdefault(peer, {}).get(index, (start_s, end_s))
            holds[peer][index] = (min(first_s, start_s), max(last_s, end_s))
    return holds


def _forbidden(spans: Sequence[_Interval]) -> dict[str, list[tuple[float, float]]]:
    by_peer: dict[str, list[tuple[float, float]]] = {}
    for peer, start_s, end_s in spans:
        by_peer.setdefault(peer, []).append((start_s, end_s))
    return {peer: sorted(taken) for peer, taken in by_peer.items()}


def full_pipeline(problem: SkipPipeProblem) -> Schedule:
    """The baseline: every microbatch through every live stage in order, each stage's replicas in turn."""
    swarm = _live_swarm(problem)
    routes = []
    for microbatch in range(problem.num_microbatches):
        hops = [
            (0.0, stage, swarm.replicas[stage][microbatch % len(swarm.replicas[stage])]) for stage in swarm.replicas
        ]
        routes.append(_route(microbatch, sorted(hops, key=lambda hop: hop[1])))
    return _finish(problem, swarm, routes)


def random_skipping(problem: SkipPipeProblem) -> Schedule:
    """The ablation: SkipPipe's k and reorder, but stages, replicas and sources drawn at random from the seed."""
    swarm = _live_swarm(problem)
    rng = random.Random(_tie(problem.seed, -1, -1))
    others = sorted(stage for stage in swarm.replicas if stage != 0)
    routes = []
    for microbatch in range(problem.num_microbatches):
        stages = rng.sample(others, swarm.num_visited)
        if not problem.reorder:
            stages.sort()
        hops = [(0.0, stage, rng.choice(swarm.replicas[stage])) for stage in [0, *stages]]
        routes.append(_route(microbatch, hops))
    return _finish(problem, swarm, routes)
