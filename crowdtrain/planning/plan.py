"""The DeDLOC adaptive-averaging plan: who computes, who aggregates, and each aggregator's share.

Diskin et al. 2021, "Distributed Deep Learning In Open Collaborations", Sec. 3.2 and Appendix.
Peers i = 1..n publish their compute c_i (samples/s), upload u_i and download d_i (Mbit/s, used here
in bytes/s) and whether others can dial them. The gradient is P bytes on the wire; a global step
takes B samples. The plan chooses

    x_i ∈ {0, 1}   peer i computes gradients: it sends the parts of its gradient to their aggregators
                   and receives the averaged parts back
    g_i ≥ 0        the fraction of the vector that peer i aggregates; Σ_i g_i = 1; g_i = 0 for a peer
                   nobody can dial (it cannot receive parts), a forced client, or one with a zero link

With N_x = Σ_j x_j, peer i moves in a butterfly all-reduce, in each direction,

    x_i·P·(1 − g_i)         its own gradient's other parts out, their averages in
    + g_i·P·(N_x − x_i)     the other computing peers' parts of its share in, the averages out

so for a fixed x the averaging time is the linear program in (g, T)

    T(x) = min T  s.t.  x_i·P·(1 − g_i) + g_i·P·(N_x − x_i) ≤ min(u_i, d_i)·T   for every i,
                        Σ_i g_i = 1,  g_i ≥ 0,  g_i = 0 where i is unreachable

(the upload and the download constraint have the same left side, so they merge with min(u_i, d_i));
two unreachable peers never need to talk, since only reachable peers aggregate. The plan maximises
the swarm's throughput, a batch's compute time plus its averaging time:

    max_x  S(x) = B / (B / Σ_i x_i·c_i + T(x))

over every x of the free peers (c_i > 0, no forced role) when there are at most 12, greedily above:
start with every peer that can compute on, switch off the one whose removal raises S most (or the k
with the slowest links), until none does; also start from nobody and switch peers on; keep the better
end. Ties go to the choice found first (more computing peers, then earlier peer IDs). Forced roles:
client → g_i = 0, x_i = [c_i > 0]; aggregator → x_i = 0; trainer → x_i = 1. With min_share > 0,
aggregators given less than it are barred and T(x) is solved again (as hivemind's min_size).

The search needs T(x) thousands of times, and one `linprog` call costs ~4 ms, so it uses the LP's
closed form: each constraint caps g_i by κ_i(T) = (r_i·T − x_i) / (N_x − 2·x_i), r_i = min(u_i, d_i)/P,
rising in T (no cap where N_x − 2·x_i ≤ 0), and every computing peer but a lone aggregating one needs
T ≥ 1 / r_i (its traffic at g_i = 0); T(x) is the smallest T meeting those needs at which the caps sum
to 1 (water filling). HiGHS then solves the chosen x's LP: its status decides the fallback, and its
optimum must agree. The optimum often holds many g (with two computing peers every split costs the
same), and LP solvers pick any vertex, so the plan takes one canonical point, g_i = κ_i(T*) / Σ_j κ_j(T*):
computed in plain Python floats in peer-ID order, it comes out bit for bit the same on every node.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from scipy.optimize import OptimizeResult, linprog

from crowdtrain.roles import Role

logger = logging.getLogger(__name__)

ROLES = (Role.TRAINER, Role.AGGREGATOR, Role.CLIENT)
"""The roles a plan assigns, in the order a role tuple lists them."""
BYTES_PER_MEGABIT = 125_000
MIN_BANDWIDTH_MBPS = 1e-3
"""A measured zero bandwidth is taken as this, so the time is huge but finite."""
MAX_ENUMERATED_PEERS = 12
"""Up to this many peers free to compute or not, every choice is tried; above, the greedy search."""
IMPROVEMENT_TOLERANCE = 1e-9
"""A choice replaces the best one only if its throughput is higher by this much, relatively."""
SOLVER_AGREEMENT_TOLERANCE = 1e-6
NO_AGGREGATOR = "equal-split fallback: no reachable peer can aggregate"


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerCapabilities:
    """What one peer measured about itself, as published in its status."""

    peer_id: str
    """The peer's ID (base58)."""
    samples_per_second: float
    """Measured training throughput in samples/s; 0 if it cannot compute."""
    upload_mbps: float
    """Measured upload bandwidth to peers in Mbit/s."""
    download_mbps: float
    """Measured download bandwidth from peers in Mbit/s."""
    reachable: bool
    """Whether peers can dial it (only such a peer, with nonzero bandwidth, can aggregate)."""
    forced_role: str | None = None
    """A `--role` override the plan honours: trainer, aggregator, client, or None to let the plan choose."""

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise ValueError("peer_id must be a non-empty string")
        for name in ("samples_per_second", "upload_mbps", "download_mbps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} of peer {self.peer_id} must be a finite number >= 0, got {value!r}")
        if self.forced_role is not None and self.forced_role not in ROLES:
            raise ValueError(f"forced_role must be one of {', '.join(ROLES)} or None, got {self.forced_role!r}")
        if self.forced_role == Role.AGGREGATOR and not self.reachable:
            raise ValueError(
                f"peer {self.peer_id} is forced to aggregate but peers cannot dial it: "
                "open its port or announce a reachable address, or give it another role"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanProblem:
    """What the plan is for: the vector averaged and the batch it accumulates."""

    vector_size_bytes: int
    """Size of the gradient on the wire, in bytes."""
    target_batch_size: int
    """Samples per global step."""
    min_share: float = 0.0
    """Aggregators whose share would be below this fraction get none (as hivemind's min_size)."""

    def __post_init__(self) -> None:
        if self.vector_size_bytes <= 0:
            raise ValueError(f"vector_size_bytes must be positive, got {self.vector_size_bytes}")
        if self.target_batch_size <= 0:
            raise ValueError(f"target_batch_size must be positive, got {self.target_batch_size}")
        if not 0.0 <= self.min_share < 1.0:
            raise ValueError(f"min_share must be in [0, 1), got {self.min_share!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The role of every peer and each aggregator's share; dicts are in peer-ID order (read-only)."""

    roles: dict[str, tuple[str, ...]]
    """Roles per peer ID, in the order of ROLES; empty for a reachable peer with nothing to do.
    A forced aggregator keeps its role even with share 0."""
    shares: dict[str, float]
    """Fraction of the vector each peer aggregates (sum 1; 0 for non-aggregators; empty if none can)."""
    computes: dict[str, bool]
    """Whether each peer computes gradients."""
    averaging_time_s: float
    """Expected all-reduce time in seconds (inf when nobody can aggregate)."""
    samples_per_second: float
    """Expected swarm throughput counting the averaging time, B / (B / Σ c_i + T)."""
    solver: str
    """"highs", or "equal-split fallback: <reason>"."""


@dataclass(frozen=True, slots=True)
class _Swarm:
    """The peers sorted by ID, as parallel tuples in the units of the formulation."""

    peer_ids: tuple[str, ...]
    compute: tuple[float, ...]  # c_i, samples/s
    rates: tuple[float, ...]  # r_i = min(u_i, d_i) / P, vectors/s
    reachable: tuple[bool, ...]
    can_aggregate: tuple[bool, ...]
    fixed: tuple[bool | None, ...]  # x_i set by a forced role or zero compute; None: the search decides
    forced: tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class _Solution:
    """One choice of x with its averaging time, canonical shares and throughput."""

    computes: tuple[bool, ...]
    can_aggregate: tuple[bool, ...]
    time_s: float
    shares: tuple[float, ...]
    samples_per_second: float


def compute_plan(peers: Sequence[PeerCapabilities], problem: PlanProblem) -> Plan:
    """The plan every node computes alike from the same capabilities, whatever their order."""
    swarm = _make_swarm(peers, problem)
    if not any(swarm.can_aggregate):
        computes = tuple(bool(fixed) if fixed is not None else True for fixed in swarm.fixed)
        throughput = sum(c for c, on in zip(swarm.compute, computes, strict=True) if on)
        return _make_plan(swarm, computes, None, math.inf, throughput, NO_AGGREGATOR)
    best = _search(swarm, problem)
    result = _solve_lp(swarm, best.computes, best.can_aggregate)
    shares = best.shares
    solver = "highs"
    if result.status != 0:
        logger.warning("DeDLOC plan: HiGHS failed (%s); splitting the vector equally", result.message)
        num_aggregators = sum(swarm.can_aggregate)
        shares = tuple(1.0 / num_aggregators if can else 0.0 for can in swarm.can_aggregate)
        solver = f"equal-split fallback: {result.message}"
    elif not math.isclose(result.x[-1], best.time_s, rel_tol=SOLVER_AGREEMENT_TOLERANCE, abs_tol=1e-9):
        logger.warning(
            "DeDLOC plan: HiGHS gives T=%.6g s, the closed form %.6g s; using HiGHS", result.x[-1], best.time_s
        )
        shares = _normalized([max(share, 0.0) for share in result.x[:-1]])
    time_s = _allreduce_time(swarm, best.computes, shares)
    throughput = _throughput(problem.target_batch_size, _compute_sum(swarm, best.computes), time_s)
    return _make_plan(swarm, best.computes, shares, time_s, throughput, solver)


def swarm_samples_per_second(
    target_batch_size: int, compute_samples_per_second: float, averaging_time_s: float
) -> float:
    """DeDLOC's objective: B samples per (B / Σ c_i + T) seconds."""
    return _throughput(target_batch_size, compute_samples_per_second, averaging_time_s)


def allreduce_time_s(
    peers: Sequence[PeerCapabilities], problem: PlanProblem, computes: Mapping[str, bool], shares: Mapping[str, float]
) -> float:
    """The all-reduce time in seconds of given roles and shares: the slowest peer's load over its bandwidth."""
    swarm = _make_swarm(peers, problem)
    x = tuple(computes.get(peer_id, False) for peer_id in swarm.peer_ids)
    return _allreduce_time(swarm, x, tuple(shares.get(peer_id, 0.0) for peer_id in swarm.peer_ids))


def equal_split_time_s(
    peers: Sequence[PeerCapabilities], problem: PlanProblem, computes: Mapping[str, bool] | None = None
) -> float:
    """The all-reduce time in seconds when every peer that may aggregate takes an equal share.

    `computes` defaults to every peer that can compute (and is not forced to aggregate); inf if nobody may aggregate.
    """
    swarm = _make_swarm(peers, problem)
    if computes is None:
        x = tuple(True if fixed is None else fixed for fixed in swarm.fixed)
    else:
        x = tuple(computes.get(peer_id, False) for peer_id in swarm.peer_ids)
    num_aggregators = sum(swarm.can_aggregate)
    if not num_aggregators:
        return math.inf
    return _allreduce_time(swarm, x, tuple(1.0 / num_aggregators if can else 0.0 for can in swarm.can_aggregate))


def _make_swarm(peers: Sequence[PeerCapabilities], problem: PlanProblem) -> _Swarm:
    if not peers:
        raise ValueError("a plan needs at least one peer")
    ordered = sorted(peers, key=lambda peer: peer.peer_id)
    for before, after in itertools.pairwise(ordered):
        if before.peer_id == after.peer_id:
            raise ValueError(f"peer {before.peer_id} appears twice; each peer must be listed once")
    rates = tuple(
        max(min(peer.upload_mbps, peer.download_mbps), MIN_BANDWIDTH_MBPS)
        * BYTES_PER_MEGABIT
        / problem.vector_size_bytes
        for peer in ordered
    )
    return _Swarm(
        peer_ids=tuple(peer.peer_id for peer in ordered),
        compute=tuple(peer.samples_per_second for peer in ordered),
        rates=rates,
        reachable=tuple(peer.reachable for peer in ordered),
        can_aggregate=tuple(_can_aggregate(peer) for peer in ordered),
        fixed=tuple(_fixed_computes(peer) for peer in ordered),
        forced=tuple(peer.forced_role for peer in ordered),
    )


def _can_aggregate(peer: PeerCapabilities) -> bool:
    # A zero bandwidth is taken as tiny for the time, but a part is never handed to a dead link unless forced.
    if peer.forced_role == Role.AGGREGATOR:
        return True
    return peer.reachable and peer.forced_role != Role.CLIENT and min(peer.upload_mbps, peer.download_mbps) > 0


def _fixed_computes(peer: PeerCapabilities) -> bool | None:
    if peer.forced_role == Role.TRAINER:
        return True
    if peer.forced_role == Role.AGGREGATOR or peer.samples_per_second == 0:
        return False
    return True if peer.forced_role == Role.CLIENT else None


def _search(swarm: _Swarm, problem: PlanProblem) -> _Solution:
    """The x with the highest throughput: all choices for few free peers, the greedy search for many."""
    free = [i for i, fixed in enumerate(swarm.fixed) if fixed is None]
    baseline = tuple(bool(fixed) for fixed in swarm.fixed)
    if _compute_sum(swarm, tuple(fixed is None or fixed for fixed in swarm.fixed)) == 0:
        return _evaluate(swarm, problem, baseline)  # nobody can compute: average nothing, fast
    if len(free) <= MAX_ENUMERATED_PEERS:
        best: _Solution | None = None
        for x in _all_choices(baseline, free):
            if _compute_sum(swarm, x) > 0:
                candidate = _evaluate(swarm, problem, x)
                best = candidate if _is_better(candidate, best) else best
        assert best is not None
        return best
    return _greedy(swarm, problem, baseline, free)


def _all_choices(baseline: tuple[bool, ...], free: list[int]) -> Iterator[tuple[bool, ...]]:
    # More computing peers first, then earlier peer IDs first: on a tie the first one found stays.
    for num_on in range(len(free), -1, -1):
        for on in itertools.combinations(free, num_on):
            yield tuple(computes or i in on for i, computes in enumerate(baseline))


def _greedy(swarm: _Swarm, problem: PlanProblem, baseline: tuple[bool, ...], free: list[int]) -> _Solution:
    """DeDLOC's greedy, from everyone computing, and also from nobody; the better end wins (the first on a tie)."""
    everyone = tuple(computes or i in free for i, computes in enumerate(baseline))
    switched_off = _hill_climb(swarm, problem, _evaluate(swarm, problem, everyone), free, switch_on=False)
    switched_on = _hill_climb(swarm, problem, _evaluate(swarm, problem, baseline), free, switch_on=True)
    return switched_on if _is_better(switched_on, switched_off) else switched_off


def _hill_climb(swarm: _Swarm, problem: PlanProblem, best: _Solution, free: list[int], switch_on: bool) -> _Solution:
    """Take the move that raises throughput most until none does: switch one free peer off (on if `switch_on`),
    or, switching off, the k free computing peers with the slowest links. Two slow links stall
    one-at-a-time removal (either alone still sets T), and one peer alone can beat all (a lone reachable
    trainer needs no averaging), hence the group moves and the climb from nobody."""
    while True:
        improved: _Solution | None = None
        for trial in _moves(swarm, best.computes, free, switch_on):
            if _compute_sum(swarm, trial) > 0:
                candidate = _evaluate(swarm, problem, trial)
                improved = candidate if _is_better(candidate, improved or best) else improved
        if improved is None:
            return best
        best = improved


def _moves(swarm: _Swarm, x: tuple[bool, ...], free: list[int], switch_on: bool) -> Iterator[tuple[bool, ...]]:
    flippable = [i for i in free if x[i] != switch_on]
    for i in flippable:
        yield tuple(switch_on if j == i else on for j, on in enumerate(x))
    if not switch_on:
        slowest_first = sorted(flippable, key=lambda i: (swarm.rates[i], i))
        for num_slow in range(2, len(slowest_first) + 1):
            slow = set(slowest_first[:num_slow])
            yield tuple(on and j not in slow for j, on in enumerate(x))


def _is_better(candidate: _Solution, best: _Solution | None) -> bool:
    if best is None:
        return True
    return candidate.samples_per_second > best.samples_per_second * (1.0 + IMPROVEMENT_TOLERANCE)


def _evaluate(swarm: _Swarm, problem: PlanProblem, x: tuple[bool, ...]) -> _Solution:
    """Optimal time and canonical shares for x; aggregators below min_share are dropped and the rest re-solved."""
    can_aggregate = swarm.can_aggregate
    time_s = _optimal_time(swarm, x, can_aggregate)
    shares = _canonical_shares(swarm, x, can_aggregate, time_s)
    if problem.min_share > 0 and max(shares) >= problem.min_share and any(0 < s < problem.min_share for s in shares):
        # Dropping them raises T, which only raises the others' caps: one re-solve suffices.
        can_aggregate = tuple(share >= problem.min_share for share in shares)
        time_s = _optimal_time(swarm, x, can_aggregate)
        shares = _canonical_shares(swarm, x, can_aggregate, time_s)
    throughput = _throughput(problem.target_batch_size, _compute_sum(swarm, x), time_s)
    return _Solution(x, can_aggregate, time_s, shares, throughput)


def _optimal_time(swarm: _Swarm, x: tuple[bool, ...], can_aggregate: tuple[bool, ...]) -> float:
    """T(x) in closed form: the smallest T meeting every peer's own need at which the caps κ_i sum to 1."""
    num_computing = sum(x)
    need_s = 0.0
    uncapped = False
    ramps = []  # (T where κ_i starts rising, its slope, its offset): κ_i(T) = max(0, slope·T − offset)
    for computes, rate, can in zip(x, swarm.rates, can_aggregate, strict=True):
        excess = num_computing - 2 * computes  # N_x − 2·x_i
        if not (can and excess < 0):  # the lone computing aggregator can keep its whole vector
            need_s = max(need_s, computes / rate)
        if can and excess <= 0:
            uncapped = True
        elif can:
            ramps.append((computes / rate, rate / excess, computes / excess))
    return max(need_s, 0.0 if uncapped else _water_level(ramps))


def _water_level(ramps: list[tuple[float, float, float]]) -> float:
    """The smallest T with Σ max(0, slope·T − offset) = 1; inf without ramps."""
    ramps.sort()
    slope_sum = offset_sum = 0.0
    for k, (_, slope, offset) in enumerate(ramps):
        slope_sum += slope
        offset_sum += offset
        level = (1.0 + offset_sum) / slope_sum
        if k + 1 == len(ramps) or level <= ramps[k + 1][0]:
            return level
    return math.inf


def _canonical_shares(
    swarm: _Swarm, x: tuple[bool, ...], can_aggregate: tuple[bool, ...], time_s: float
) -> tuple[float, ...]:
    """The optimum's canonical point: each aggregator's cap κ_i(T*), scaled to sum to 1."""
    num_computing = sum(x)
    caps = []
    for computes, rate, can in zip(x, swarm.rates, can_aggregate, strict=True):
        excess = num_computing - 2 * computes
        if not can:
            caps.append(0.0)
        elif excess <= 0:
            caps.append(1.0)
        else:
            caps.append(min(1.0, max(0.0, (rate * time_s - computes) / excess)))
    return _normalized(caps)


def _normalized(values: Sequence[float]) -> tuple[float, ...]:
    total = sum(values)
    return tuple(value / total for value in values)


def _solve_lp(swarm: _Swarm, x: tuple[bool, ...], can_aggregate: tuple[bool, ...]) -> OptimizeResult:
    """The LP of the module docstring for a fixed x, per vector (rows divided by P), with HiGHS."""
    num_peers, num_computing = len(x), sum(x)
    rows = []
    for i, (computes, rate) in enumerate(zip(x, swarm.rates, strict=True)):
        row = [0.0] * (num_peers + 1)  # variables: g_1..g_n, T
        row[i], row[-1] = float(num_computing - 2 * computes), -rate
        rows.append(row)
    return linprog(
        c=[0.0] * num_peers + [1.0],
        A_ub=rows,
        b_ub=[-float(computes) for computes in x],
        A_eq=[[1.0] * num_peers + [0.0]],
        b_eq=[1.0],
        bounds=[(0.0, 1.0 if can else 0.0) for can in can_aggregate] + [(0.0, None)],
        method="highs",
    )


def _allreduce_time(swarm: _Swarm, x: tuple[bool, ...], shares: Sequence[float]) -> float:
    num_computing = sum(x)
    loads = (computes * (1.0 - g) + g * (num_computing - computes) for computes, g in zip(x, shares, strict=True))
    return max(load / rate for load, rate in zip(loads, swarm.rates, strict=True))


def _compute_sum(swarm: _Swarm, x: tuple[bool, ...]) -> float:
    return sum(c for c, computes in zip(swarm.compute, x, strict=True) if computes)


def _throughput(target_batch_size: int, compute_samples_per_second: float, averaging_time_s: float) -> float:
    if compute_samples_per_second <= 0 or math.isinf(averaging_time_s):
        return 0.0
    return target_batch_size / (target_batch_size / compute_samples_per_second + averaging_time_s)


def _make_plan(
    swarm: _Swarm,
    x: tuple[bool, ...],
    shares: tuple[float, ...] | None,
    time_s: float,
    throughput: float,
    solver: str,
) -> Plan:
    roles: dict[str, tuple[str, ...]] = {}
    for i, peer_id in enumerate(swarm.peer_ids):
        aggregates = (shares is not None and shares[i] > 0) or swarm.forced[i] == Role.AGGREGATOR
        client = not swarm.reachable[i] or swarm.forced[i] == Role.CLIENT
        held = {Role.TRAINER: x[i], Role.AGGREGATOR: aggregates, Role.CLIENT: client}
        roles[peer_id] = tuple(str(role) for role in ROLES if held[role])
    return Plan(
        roles=roles,
        shares={} if shares is None else dict(zip(swarm.peer_ids, shares, strict=True)),
        computes=dict(zip(swarm.peer_ids, x, strict=True)),
        averaging_time_s=time_s,
        samples_per_second=throughput,
        solver=solver,
    )
