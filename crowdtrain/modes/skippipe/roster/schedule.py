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

The link term is there because hops are source-routed (`driver`): every hop of a microbatch leaves and comes back
through its source's link, so a source behind a slow home link moves 2V payloads each way per microbatch, a node of
stages 1.. two; without it a slow-linked source gets as many microbatches as a fast one and ends the iteration late.
With the replicas' gradient exchange running during the iteration (`background_share`), h_n is the seconds per hop
on what the exchange leaves of the link (`foreground_nodes`).

Last, the start order. A source starts its microbatches in their order, as many at once as its memory holds. The
greedy gives a slow replica a visit only once its faster twin has a queue, so the slow visits fall to the last
microbatches, whose round trips through the slow node would end the iteration. So the routes are numbered again with
the microbatches whose path holds the slowest visit first (`_slowest_first`; the greedy's order among equals), and
that order is kept only where the timeline below ends it sooner than the greedy's, so in the model it never ends
later.

Taking the least-visited stages keeps every stage's visit count within one of every other's (the counts are c or
c+1 before a step and c+1 or c+2 after one). Choosing the replica with the earliest finish (list scheduling) gives a
replica c times slower about 1/c of the share (a declared c counts as at least the median's / 4: `costs`). Dead
nodes (`exclude`) are never chosen; a stage with no live replica is skipped by every path and named in
`Schedule.missing_stages`, counting among the skipped ones; with no live stage-0 node nothing can be scheduled
(`StageZeroUnavailableError`). The schedulers the benchmarks compare against (the full pipeline, random skipping, the
paper's conflict-based search and others) live outside the package, in scripts/skippipe_schedulers.py, and use this
module's timeline.

The timeline (`simulate`): a visit's forward takes FORWARD_SHARE of c_n and its backward the rest; at stage 0 the
backward is split evenly between the head, run when the last forward comes back, and the first layers' backward at
the very end. A microbatch's ops run in the order forward along the path, head, backward along the path in reverse,
each hop between two nodes taking its latency and the transfer over the slower of their links (max(h_a, h_b); the
timeline hops from node to node, not through the source, and a link carries any number of transfers at once, so it
sees less of a slow link than the greedy's load does). A node runs one op at a time, never idles while an op is
ready, and picks backwards first (they free memory), then heads, forwards, and new microbatches, lowest microbatch
first. A source starts its microbatches in order, each only when every node on its path has a free slot of its
`memory_microbatches`; the slot is held until the backward there ends. Reserving the whole path up front cannot
deadlock, even when reordered paths cross. The makespan is when the last backward ends; a node's peak memory is the
most microbatches whose activations it held at once.

Everything is in peer-ID order and ties go by hashes, so every node computes the same schedule bit for bit
from the same inputs, whatever their order, and can check the one a leader announces.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace

from crowdtrain.modes.skippipe.roster.costs import MAX_SECONDS_PER_HOP, counted_compute

DEFAULT_LATENCY_S = 0.05
"""The one-way latency between two nodes with no measured one, in seconds."""
FORWARD_SHARE = 1.0 / 3.0
"""The forward's share of a microbatch's compute at a node; the backward costs about twice as much."""

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
    """The iteration's seed: it breaks ties (and draws the random baseline's paths)."""
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


def num_visited_stages(num_stages: int, skip_ratio: float) -> int:
    """V, how many of stages 1..S-1 a path visits: S-1 less k·(S-1) rounded half up, at least 1."""
    num_others = num_stages - 1
    return max(1, num_others - math.floor(skip_ratio * num_others + 0.5))


def schedule_microbatches(problem: SkipPipeProblem) -> Schedule:
    """SkipPipe's schedule for one iteration, the one nodes run: least-visited stages, earliest-finishing replicas,
    and the microbatches started slowest visit first where the timeline ends sooner so (`_greedy`)."""
    swarm = _live_swarm(problem)
    return _greedy(problem, swarm)


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
    live = counted_compute(sorted((foreground[n.peer_id] for n in problem.nodes if n.peer_id not in problem.exclude),
                                  key=lambda n: n.peer_id))  # fmt: skip
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
