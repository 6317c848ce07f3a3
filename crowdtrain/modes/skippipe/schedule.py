"""SkipPipe's scheduler: which nodes each microbatch of an iteration visits, and in which order (pure).

SkipPipe (Gensyn et al. 2025, "SkipPipe: Partial and Reordered Pipelining Framework for Training LLMs in
Heterogeneous Networks") trains a model cut into S pipeline stages on volunteer nodes, several replicas per
stage. Stage 0 holds the embeddings, the first layers and the head, so each of the M microbatches of an
iteration starts at a stage-0 node and comes back to that node for the head and the last backward. In between
it visits only some of the stages 1..S-1, skipping a share k of them, and with `reorder` in any order; the
paper shows the model still converges when every stage is trained about equally often. Fewer hops and the
freedom of choosing replicas let a scheduler route around slow nodes instead of waiting on them.

What this module decides, for one iteration: each microbatch's source (a stage-0 node) and its path. With
c_n the measured seconds per microbatch of node n, h_n the seconds its link takes to move one microbatch's hidden
states (`seconds_per_hop`, 0 where not measured) and L_n the seconds already given to n in this iteration,
microbatches are taken in order m = 0..M-1 and

    V = S-1 - floor(k·(S-1) + 1/2), at least 1, at most the stages present   stages a path visits
    stages(m) = the V stages visited least so far; ties by hash(seed, m, stage)
    w_n = c_n + 2V·h_n for a stage-0 node, c_n + 2·h_n for the others        one visit's cost
    node(m, s) = argmin_n over the live replicas of s of (L_n + w_n); ties by peer ID   then L_n += w_n
    order(m)   = ascending stages, or, with reorder, by L_n before m (the node free first goes first)

The link term is there because hops are source-routed (`pipeline.driver`): every hop of a microbatch leaves and
comes back through its source's link, so a source behind a 25 Mbit/s home link moves 2V payloads each way per
microbatch, a node of stages 1.. two. Without it the greedy split the microbatches evenly between a stage's replicas
of equal compute, and in the WAN lab the source on the 25 Mbit/s link finished its half 2 s after the one on 100;
with it that source takes 3 of 8, both finish together, and iterations were 6.6% shorter (BENCHMARKS.md). With the
replicas' gradient exchange running during the iteration (`background_share`), h_n is the seconds per hop on what
the exchange leaves of the link (`foreground_nodes`): there the slow source takes 2 of 8, and overlapped iterations
were 7-14% shorter.

Last, the start order. A source starts its microbatches in their order, as many at once as its memory holds. The
greedy gives a slow replica a visit only once its faster twin has a queue, so the slow visits fall to the last
microbatches, and in the WAN lab's hop trace the last microbatches' round trips through the 4x slow node (3.9 s
forward, 3.3 s backward, from a source that started them 6 s into an iteration of 14) ended the iteration. So the
routes are numbered again with the microbatches whose path holds the slowest visit first (`_slowest_first`; the
greedy's order among equals). The schedule keeps that order only where the timeline below ends it sooner than the
greedy's order, so in the model it never ends later; on the benchmark's shape it ends 11% sooner.

Taking the least-visited stages keeps every stage's visit count within one of every other's (the counts
are c or c+1 before a step and c+1 or c+2 after one). Choosing the replica with the earliest finish (list
scheduling) gives a replica c times slower about 1/c of the share. Dead nodes (`exclude`) are never chosen;
a stage with no live replica is skipped by every path and named in `Schedule.missing_stages`, counting
among the skipped ones; with no live stage-0 node nothing can be scheduled (`StageZeroUnavailableError`).

The greedy balances each node's total load but, beyond the start order, not when the load comes, and leaves
collisions to the nodes' queues, as the timeline below models them. Three schedulers try to do better; nodes run the
greedy (`schedule_microbatches`) and the others are for the benchmarks. The figures below were measured against the
greedy before it chose its start order; against the greedy now, `planned` is 8.1% shorter on the benchmark's shape
and `searched` 2.1% (tests/test_skippipe_schedule.py):

- `planned` routes the greedy's stage sets again by prioritized planning (the completion step of the paper's
  search, below) and keeps whichever routes the timeline ends first. On the swarm benchmark's shape (4 stages × 2
  replicas, one 4× slow, 8 microbatches, k = 0.25 reordered) that is 11.8% shorter than the greedy in the model,
  in 4-8 ms a schedule; on random heterogeneous swarms 0-12% shorter. Across 8 processes prioritized routes made
  iterations 9% shorter in two runs and `planned` 2% longer in a third, and in the WAN lab 1.6% shorter
  (BENCHMARKS.md): not what nodes run. Its routes may pass no microbatch through a replica; such a stage node did
  not notice a dead source (a fresh-clone run failed the test of a swarm that loses its only stage-0 node that
  way, tests/test_skippipe_moves.py) until it was made to ping its sources (`SkipPipeNode._wait_sources`).
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

The timeline (`simulate`): a visit's forward takes FORWARD_SHARE of c_n and its backward the rest; at stage
0 the backward is split evenly between the head, run when the last forward comes back, and the first layers'
backward at the very end. A microbatch's ops run in the order forward along the path, head, backward along
the path in reverse, each hop between two nodes taking its latency and the transfer over the slower of their
links (max(h_a, h_b); the timeline hops from node to node, not through the source, and a link carries any
number of transfers at once, so it sees less of a slow link than the greedy's load does). A node runs one op at a
time, never idles while an op is ready, and picks backwards first (they free memory), then heads, forwards, and new
microbatches, lowest microbatch first. A source starts its microbatches in order, each only when every node
on its path has a free slot of its `memory_microbatches`; the slot is held until the backward there ends.
Reserving the whole path up front cannot deadlock, even when reordered paths cross. The makespan is when
the last backward ends; a node's peak memory is the most microbatches whose activations it held at once.

Everything is in peer-ID order and ties go by hashes, so every node computes the same schedule bit for bit
from the same inputs, whatever their order, and can check the one a leader announces.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

DEFAULT_LATENCY_S = 0.05
"""The one-way latency between two nodes with no measured one, in seconds."""
MAX_SECONDS_PER_HOP = 600.0
"""Cap on a node's link seconds per hop (a node that slow gets no microbatch anyway)."""
FORWARD_SHARE = 1.0 / 3.0
"""The forward's share of a microbatch's compute at a node; the backward costs about twice as much."""

IMPROVE_EVALUATIONS = 64
"""The most timelines `_improve` simulates for one schedule (about 1 ms each for 8 microbatches on 8 nodes)."""
CBS_EXPANSIONS = 128
"""The most conflicts `conflict_based`'s search splits on before it completes its best node by prioritized planning."""
PLAN_EXPANSIONS = 256
"""The most A* entries `_Planner.plan` expands for one microbatch before it completes the best one greedily. Without
a bound, prioritized planning took 5.7 s a schedule on 8 stages × 3 replicas with 32 microbatches, and 12 × 2 with
16 did not end within 4 minutes; with it, 0.55 and 0.85 s."""
IMPROVE_MIN_S = 1e-9
"""A change `_improve` keeps must shorten the makespan by more than this (float noise is no improvement)."""

_EPSILON_S = 1e-9
"""Two ops overlap at a node only by more than this (one that ends as another starts does not)."""
_BACKWARD, _HEAD, _FORWARD, _START = 0, 1, 2, 3
"""Op kinds, in the order a free node prefers them."""


class StageZeroUnavailableError(ValueError):
    """No live node holds stage 0, so no microbatch can start."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    """One node serving one stage, as it measured itself."""

    peer_id: str
    """The node's peer ID."""
    stage: int
    """The stage it serves, 0..num_stages-1."""
    seconds_per_microbatch: float
    """Forward and backward of one microbatch on its stage, in seconds (> 0)."""
    memory_microbatches: int
    """How many microbatches' activations it can hold at once (>= 1)."""
    seconds_per_hop: float = 0.0
    """Seconds its link takes to send or to receive one microbatch's hidden states (or their gradient), at the
    slower of its measured upload and download (>= 0); 0: not measured, only latencies count."""

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise ValueError("peer_id must be a non-empty string")
        if not math.isfinite(self.seconds_per_microbatch) or self.seconds_per_microbatch <= 0:
            raise ValueError(f"seconds_per_microbatch of {self.peer_id} must be finite and > 0")
        if not math.isfinite(self.seconds_per_hop) or self.seconds_per_hop < 0:
            raise ValueError(f"seconds_per_hop of {self.peer_id} must be finite and >= 0")
        if self.memory_microbatches < 1:
            raise ValueError(f"memory_microbatches of {self.peer_id} must be >= 1, got {self.memory_microbatches}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SkipPipeProblem:
    """One iteration to schedule: the stages, the nodes, the links and SkipPipe's parameters."""

    num_stages: int
    """S, the number of pipeline stages (>= 2); stage 0 holds the embeddings, first layers and head."""
    nodes: tuple[NodeInfo, ...]
    """Every node, in any order; peer IDs unique."""
    num_microbatches: int
    """M, microbatches per iteration (>= 1)."""
    skip_ratio: float = 0.0
    """k in [0, 1): the share of stages 1..S-1 each microbatch skips, rounded half up."""
    reorder: bool = False
    """Whether a path may visit its stages in any order, not only ascending."""
    seed: int = 0
    """The iteration's seed: it breaks ties (and draws `random_skipping`'s paths)."""
    latency_s: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """Measured one-way latency between two nodes in seconds, either way round; others take the default."""
    default_latency_s: float = DEFAULT_LATENCY_S
    """The latency of a pair with no measurement, in seconds."""
    exclude: AbstractSet[str] = frozenset()
    """Peer IDs of dead nodes, never scheduled."""
    background_share: float = 0.0
    """In [0, 1): the share of its stage's slowest link each replica's gradient exchange takes while the iteration
    runs (`overlap_exchange` paces it to BACKGROUND_SHARE); hops are costed at what it leaves (`foreground_nodes`)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.background_share < 1.0:
            raise ValueError(f"background_share must be in [0, 1), got {self.background_share!r}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if not 0.0 <= self.skip_ratio < 1.0:
            raise ValueError(f"skip_ratio must be in [0, 1), got {self.skip_ratio!r}")
        peer_ids = [node.peer_id for node in self.nodes]
        if len(set(peer_ids)) != len(peer_ids):
            raise ValueError("every node must have its own peer_id")
        for node in self.nodes:
            if not 0 <= node.stage < self.num_stages:
                raise ValueError(f"node {node.peer_id} serves stage {node.stage}, not one of 0..{self.num_stages - 1}")
        for latency in (self.default_latency_s, *self.latency_s.values()):
            if not math.isfinite(latency) or latency < 0:
                raise ValueError(f"latencies must be finite and >= 0 seconds, got {latency!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Route:
    """One microbatch's path: the stages it visits and the node of each, stage 0 (its source) first."""

    microbatch: int
    """The microbatch's index in the iteration."""
    stages: tuple[int, ...]
    """The stages in visiting order, 0 first; the return to stage 0 for the head is implicit."""
    path: tuple[str, ...]
    """The peer ID serving each of `stages`."""

    @property
    def source(self) -> str:
        """The stage-0 node that starts the microbatch and runs its head."""
        return self.path[0]


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    """What the timeline model makes of a set of routes."""

    makespan_s: float
    """When the iteration's last backward ends, in seconds from its start."""
    busy_s: dict[str, float]
    """Seconds each live node computes in the iteration, by peer ID."""
    peak_microbatches: dict[str, int]
    """The most microbatches whose activations each live node held at once."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """An iteration's routes, with what the timeline model expects of them."""

    routes: tuple[Route, ...]
    """One route per microbatch, in microbatch order."""
    missing_stages: tuple[int, ...]
    """Stages with no live replica, which every path skips."""
    timeline: Timeline
    """The makespan, load and memory `simulate` gives these routes."""
    microbatches_per_node: dict[str, int]
    """How many microbatches visit each live node, by peer ID."""

    @property
    def makespan_s(self) -> float:
        """The iteration's expected time in seconds."""
        return self.timeline.makespan_s


@dataclass(frozen=True, slots=True)
class _Swarm:
    """The live nodes by stage, each stage's replicas in peer-ID order."""

    nodes: dict[str, NodeInfo]
    replicas: dict[int, tuple[str, ...]]  # stage -> peer IDs; only stages with a live replica
    missing_stages: tuple[int, ...]
    num_visited: int


def seconds_per_hop(payload_bytes: int, upload_mbps: float | None, download_mbps: float | None) -> float:
    """A node's `NodeInfo.seconds_per_hop`: `payload_bytes` (one microbatch's hidden states on the wire) at the slower
    of its upload and download, at most MAX_SECONDS_PER_HOP; 0 where either is not measured (None or not > 0)."""
    if upload_mbps is None or download_mbps is None or not (upload_mbps > 0 and download_mbps > 0):
        return 0.0
    return min(8 * payload_bytes / (min(upload_mbps, download_mbps) * 1e6), MAX_SECONDS_PER_HOP)


def num_visited_stages(num_stages: int, skip_ratio: float) -> int:
    """V, how many of stages 1..S-1 a path visits: S-1 less k·(S-1) rounded half up, at least 1."""
    num_others = num_stages - 1
    return max(1, num_others - math.floor(skip_ratio * num_others + 0.5))


def schedule_microbatches(problem: SkipPipeProblem) -> Schedule:
    """SkipPipe's schedule for one iteration, the one nodes run: least-visited stages, earliest-finishing replicas,
    and the microbatches started slowest visit first where the timeline ends sooner so (`_greedy`)."""
    swarm = _live_swarm(problem)
    return _greedy(problem, swarm)


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


def _greedy(problem: SkipPipeProblem, swarm: _Swarm) -> Schedule:
    """The greedy's routes (`_greedy_routes`) in its order, or started slowest visit first (`_slowest_first`),
    whichever the timeline ends first (the greedy's order on a tie). Where the two orders are one (no visit is
    slower than another's), the timeline runs once."""
    routes = _greedy_routes(problem, swarm)
    first, reordered = _finish(problem, swarm, routes), _slowest_first(swarm, routes)
    return first if reordered == routes else _sooner(first, _finish(problem, swarm, reordered))


def _sooner(first: Schedule, second: Schedule) -> Schedule:
    """`second` if the timeline ends it sooner than `first` (by more than IMPROVE_MIN_S), else `first`."""
    return second if second.makespan_s < first.makespan_s - IMPROVE_MIN_S else first


def _slowest_first(swarm: _Swarm, routes: list[Route]) -> list[Route]:
    """The same routes numbered again so that the microbatches whose path holds the slowest visit (`_visit_s`,
    stage 0 aside) come first, the greedy's order among equals: each source then starts those first, and their
    long waits at the slow node overlap the other microbatches instead of ending the iteration."""

    def slowest(route: Route) -> float:
        return max((_visit_s(swarm, peer) for peer in route.path[1:]), default=0.0)

    ordered = sorted(routes, key=lambda route: -slowest(route))  # stable: the greedy's order among equals
    return [replace(route, microbatch=index) for index, route in enumerate(ordered)]


def _greedy_routes(problem: SkipPipeProblem, swarm: _Swarm) -> list[Route]:
    visits = {stage: 0 for stage in swarm.replicas if stage != 0}
    load_s = dict.fromkeys(swarm.nodes, 0.0)
    routes = []
    for microbatch in range(problem.num_microbatches):
        stages = sorted(visits, key=lambda stage: (visits[stage], _tie(problem.seed, microbatch, stage), stage))
        hops = []  # (L_n before this microbatch, stage, node)
        for stage in [0, *sorted(stages[: swarm.num_visited])]:
            node = min(swarm.replicas[stage], key=lambda peer: (load_s[peer] + _visit_s(swarm, peer), peer))
            hops.append((load_s[node], stage, node))
            load_s[node] += _visit_s(swarm, node)
        source, visited = hops[0], hops[1:]
        if problem.reorder:
            visited.sort()
        for _, stage, _ in visited:
            visits[stage] += 1
        routes.append(_route(microbatch, [source, *visited]))
    return routes


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


def simulate(problem: SkipPipeProblem, routes: Sequence[Route]) -> Timeline:
    """The makespan, load and peak memory of any routes over the problem's nodes, in the timeline model."""
    nodes = foreground_nodes(problem)
    for route in routes:
        unknown = sorted(set(route.path) - nodes.keys())
        if unknown:
            raise ValueError(f"microbatch {route.microbatch} visits {', '.join(unknown)}, not a node of the problem")
    live = sorted(peer for peer in nodes if peer not in problem.exclude)
    return _Timeline(problem, nodes, list(routes)).run(live)


def foreground_nodes(problem: SkipPipeProblem) -> dict[str, NodeInfo]:
    """The problem's nodes by peer ID, each with the seconds per hop of the link its stage's background exchange
    leaves it. With `background_share` b, a stage's live replicas exchange their gradients at b of the slowest one's
    link (the pacing takes the slower of the two ends), so a node moving 1/h_n payloads a second keeps
    1/h_n - b/h_max for hops: the slowest replica (1 - b) of its link, a replica on a link four times faster 7/8 of
    its own at b = 1/2. Without it the greedy gave the replicas on slow home links as many microbatches as if their
    links were free, and their hops queued behind the exchange (the WAN lab). Unmeasured links (0), a stage's lone
    replica, and b = 0 are left as they are."""
    nodes = {node.peer_id: node for node in problem.nodes}
    if problem.background_share == 0.0:
        return nodes
    slowest: dict[int, float] = {}
    replicas: dict[int, int] = {}
    for node in problem.nodes:
        if node.peer_id not in problem.exclude:
            replicas[node.stage] = replicas.get(node.stage, 0) + 1
            slowest[node.stage] = max(slowest.get(node.stage, 0.0), node.seconds_per_hop)
    for node in problem.nodes:
        if node.peer_id in problem.exclude or node.seconds_per_hop == 0.0 or replicas[node.stage] < 2:
            continue
        left = 1.0 / node.seconds_per_hop - problem.background_share / slowest[node.stage]
        nodes[node.peer_id] = replace(node, seconds_per_hop=min(1.0 / left, MAX_SECONDS_PER_HOP))
    return nodes


def _live_swarm(problem: SkipPipeProblem) -> _Swarm:
    foreground = foreground_nodes(problem)
    live = sorted((foreground[node.peer_id] for node in problem.nodes if node.peer_id not in problem.exclude),
                  key=lambda n: n.peer_id)  # fmt: skip
    replicas: dict[int, tuple[str, ...]] = {}
    for stage in range(problem.num_stages):
        peers = tuple(node.peer_id for node in live if node.stage == stage)
        if peers:
            replicas[stage] = peers
    if 0 not in replicas:
        raise StageZeroUnavailableError(
            "no live node serves stage 0 (embeddings and head), so no microbatch can start: bring one back"
        )
    missing = tuple(stage for stage in range(1, problem.num_stages) if stage not in replicas)
    num_visited = min(num_visited_stages(problem.num_stages, problem.skip_ratio), len(replicas) - 1)
    return _Swarm({node.peer_id: node for node in live}, replicas, missing, num_visited)


def _cost(swarm: _Swarm, peer: str) -> float:
    return swarm.nodes[peer].seconds_per_microbatch


def _visit_s(swarm: _Swarm, peer: str) -> float:
    """What one visit costs `peer` in the greedy's load: its compute and its link's transfers. Hops are source-routed
    (each returns to the source), so a node of stages 1.. receives and sends two payloads a visit (the hidden states
    forward, their gradient back), and a source 2V of each: every hop of the microbatch passes its link."""
    node = swarm.nodes[peer]
    transfers = 2 * swarm.num_visited if node.stage == 0 else 2
    return node.seconds_per_microbatch + transfers * node.seconds_per_hop


def _tie(seed: int, microbatch: int, stage: int) -> int:
    digest = hashlib.blake2b(f"skippipe:{seed}:{microbatch}:{stage}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _route(microbatch: int, hops: Sequence[tuple[float, int, str]]) -> Route:
    return Route(
        microbatch=microbatch, stages=tuple(stage for _, stage, _ in hops), path=tuple(node for _, _, node in hops)
    )


def _finish(problem: SkipPipeProblem, swarm: _Swarm, routes: list[Route]) -> Schedule:
    counts = dict.fromkeys(swarm.nodes, 0)
    for route in routes:
        for peer in route.path:
            counts[peer] += 1
    return Schedule(
        routes=tuple(routes),
        missing_stages=swarm.missing_stages,
        timeline=simulate(problem, routes),
        microbatches_per_node=counts,
    )


@dataclass(frozen=True, slots=True)
class _Op:
    node: str
    duration_s: float
    kind: int
    releases: bool  # the node's slot for this microbatch is free once this op ends


class _Timeline:
    """The event simulation behind `simulate`: ops are started in the order of their start times."""

    def __init__(self, problem: SkipPipeProblem, nodes: Mapping[str, NodeInfo], routes: list[Route]) -> None:
        self.problem, self.nodes, self.routes = problem, nodes, routes
        self.ops = [self._ops(route) for route in routes]
        self.step = [0] * len(routes)  # each microbatch's next op
        self.ready_s = [0.0] * len(routes)  # when that op may start
        self.free_s = dict.fromkeys(nodes, 0.0)
        self.pending: dict[str, set[int]] = {peer: set() for peer in nodes}  # started microbatches' next ops
        self.unstarted: dict[str, list[int]] = {peer: [] for peer in nodes}  # by source, in order
        for index, route in enumerate(routes):
            self.unstarted[route.source].append(index)
        self.sources = {route.source for route in routes}
        self.slots: dict[str, dict[int, float]] = {peer: {} for peer in nodes}  # microbatch -> release (inf)
        self.held: dict[str, list[tuple[float, int]]] = {peer: [] for peer in nodes}  # (time, +1 or -1)
        self.busy_s = dict.fromkeys(nodes, 0.0)
        self.now_s = 0.0

    def run(self, live: Sequence[str]) -> Timeline:
        candidates = {peer: self._candidate(peer) for peer in self.nodes}
        makespan_s = 0.0
        for _ in range(sum(len(ops) for ops in self.ops)):
            found = [(candidate, peer) for peer, candidate in candidates.items() if candidate is not None]
            assert found, "reserving a microbatch's whole path cannot deadlock"
            (start_s, _, index), peer = min(found)
            touched = self._start(index, start_s)
            makespan_s = max(makespan_s, self.free_s[peer])
            for other in touched:
                candidates[other] = self._candidate(other)
        peaks = {peer: _peak(self.held[peer]) for peer in live}
        return Timeline(
            makespan_s=makespan_s, busy_s={peer: self.busy_s[peer] for peer in live}, peak_microbatches=peaks
        )

    def _ops(self, route: Route) -> list[_Op]:
        def cost(peer: str) -> float:
            return self.nodes[peer].seconds_per_microbatch

        source, visited = route.path[0], route.path[1:]
        forward = [_Op(peer, FORWARD_SHARE * cost(peer), _FORWARD, False) for peer in visited]
        backward = [_Op(peer, (1 - FORWARD_SHARE) * cost(peer), _BACKWARD, True) for peer in reversed(visited)]
        last_share = (1 - FORWARD_SHARE) / 2 * cost(source)
        return [
            _Op(source, FORWARD_SHARE * cost(source), _START, False),
            *forward,
            _Op(source, last_share, _HEAD, False),
            *backward,
            _Op(source, last_share, _BACKWARD, True),
        ]

    def _candidate(self, peer: str) -> tuple[float, int, int] | None:
        """(start, kind, microbatch) of the op this node runs next, as far as is known now; None if none."""
        options = [(self.ready_s[index], self.ops[index][self.step[index]].kind, index) for index in self.pending[peer]]
        if self.unstarted[peer]:
            index = self.unstarted[peer][0]
            admitted_s = max(self._slot_free_s(other) for other in self.routes[index].path)
            if math.isfinite(admitted_s):
                options.append((admitted_s, _START, index))
        if not options:
            return None
        start_s = max(self.free_s[peer], min(ready_s for ready_s, _, _ in options))
        kind, index = min((kind, index) for ready_s, kind, index in options if ready_s <= start_s)
        return start_s, kind, index

    def _slot_free_s(self, peer: str) -> float:
        """The earliest time from now at which the node has a free slot, given the releases known now."""
        releases = sorted(release_s for release_s in self.slots[peer].values() if release_s > self.now_s)
        excess = len(releases) - (self.nodes[peer].memory_microbatches - 1)
        return self.now_s if excess <= 0 else releases[excess - 1]

    def _start(self, index: int, start_s: float) -> set[str]:
        """Starts the microbatch's next op; returns the nodes whose next op may have changed."""
        self.now_s = start_s
        op = self.ops[index][self.step[index]]
        end_s = start_s + op.duration_s
        touched = {op.node, *self.sources}
        if op.kind == _START:
            self.unstarted[op.node].pop(0)
            for peer in self.routes[index].path:
                kept = {other: release_s for other, release_s in self.slots[peer].items() if release_s > start_s}
                self.slots[peer] = {**kept, index: math.inf}
        else:
            self.pending[op.node].remove(index)
        if op.kind in (_START, _FORWARD):
            self.held[op.node].append((start_s, 1))
        if op.releases:
            self.slots[op.node][index] = end_s
            self.held[op.node].append((end_s, -1))
        self.free_s[op.node] = end_s
        self.busy_s[op.node] += op.duration_s
        self.step[index] += 1
        if self.step[index] < len(self.ops[index]):
            following = self.ops[index][self.step[index]].node
            self.ready_s[index] = end_s + _hop_s(self.problem, self.nodes, op.node, following)
            self.pending[following].add(index)
            touched.add(following)
        return touched


def _hop_s(problem: SkipPipeProblem, nodes: Mapping[str, NodeInfo], sender: str, receiver: str) -> float:
    """A hop's time in the timeline: the pair's latency and the payload's transfer over the slower of their links."""
    if sender == receiver:
        return 0.0
    measured = problem.latency_s.get((sender, receiver), problem.latency_s.get((receiver, sender)))
    transfer_s = max(nodes[sender].seconds_per_hop, nodes[receiver].seconds_per_hop)
    return (problem.default_latency_s if measured is None else measured) + transfer_s


def _peak(events: list[tuple[float, int]]) -> int:
    """The most intervals open at once; one that ends when another starts does not overlap it."""
    peak = count = 0
    for _, change in sorted(events):
        count += change
        peak = max(peak, count)
    return peak
