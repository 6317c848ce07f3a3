"""Benchmark SkipPipe's schedulers in their timeline model: the nodes' greedy, a local search, the paper's CBS.

Pure computation, no network (`planning.skippipe`): for each swarm, iterations 0..N-1 (the seed of each), the
modeled makespan of the full pipeline, random skipping, the greedy nodes run (least-visited stages,
earliest-finishing replicas, the slowest visits started first: `schedule_microbatches`), its routes improved by
local search against the timeline (`searched`), the paper's conflict-based search with A* (`conflict_based`), its
prioritized planning alone (`conflict_based` with no split), the better of the greedy and that (`planned`), the
greedy's routes started in its own order (`greedy_in_order`: what nodes ran before they started the slowest visits
first), and the milliseconds each of the last five takes. Swarms: 4 stages × 2 replicas, 8 microbatches, k = 0.25,
reorder, 2 microbatches of memory per node (bench_skippipe_swarm.py's settings):

    bench        every node 1 s per microbatch but one replica of stage 3, 4× slower
    random-<i>   each node 0.5-2× of 1 s and the links 0-50 ms one way, drawn from seed i

    python scripts/bench_skippipe_schedule.py [--swarms 8] [--iterations 10]

The makespans are the model's, not measured iterations: bench_skippipe_swarm.py measures those (its
`swarm-searched`, `swarm-cbs` and `swarm-prioritized` arms against `swarm`).
"""

from __future__ import annotations

import functools
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import bench_parser, environment_json, print_table, say, write_json
from skippipe_schedulers import (
    CBS_EXPANSIONS,
    IMPROVE_EVALUATIONS,
    conflict_based,
    full_pipeline,
    greedy_in_order,
    planned,
    random_skipping,
    searched,
)

from crowdtrain.modes.skippipe.roster.schedule import NodeInfo, SkipPipeProblem, schedule_microbatches

NUM_STAGES, REPLICAS, MICROBATCHES, SKIP_RATIO, MEMORY = 4, 2, 8, 0.25, 2


def swarm(seed: int | None) -> tuple[tuple[NodeInfo, ...], dict[tuple[str, str], float]]:
    """The nodes and links of `bench` (seed None) or of `random-<seed>`."""
    rng = random.Random(seed)
    nodes = []
    for index in range(NUM_STAGES * REPLICAS):
        seconds = rng.uniform(0.5, 2.0) if seed is not None else 4.0 if index == NUM_STAGES * REPLICAS - 1 else 1.0
        nodes.append(
            NodeInfo(
                peer_id=f"node{index}",
                stage=index // REPLICAS,
                seconds_per_microbatch=seconds,
                memory_microbatches=MEMORY,
            )
        )
    peers = [node.peer_id for node in nodes]
    links = {} if seed is None else {(a, b): rng.uniform(0, 0.05) for a in peers for b in peers if a < b}
    return tuple(nodes), links


SEARCHES = {
    "searched": searched,
    "cbs": conflict_based,
    "prioritized": functools.partial(conflict_based, expansions=0),
    "planned": planned,
    "in-order": greedy_in_order,
}
"""The schedulers that search, by column: each is timed."""


def measure(name: str, seed: int | None, iterations: int) -> dict[str, Any]:
    nodes, links = swarm(seed)
    makespans: dict[str, list[float]] = {arm: [] for arm in ("full", "random", "greedy", *SEARCHES)}
    milliseconds: dict[str, list[float]] = {arm: [] for arm in SEARCHES}
    for iteration in range(iterations):
        problem = SkipPipeProblem(
            num_stages=NUM_STAGES,
            nodes=nodes,
            num_microbatches=MICROBATCHES,
            skip_ratio=SKIP_RATIO,
            reorder=True,
            seed=iteration,
            latency_s=links,
        )
        makespans["full"].append(full_pipeline(problem).makespan_s)
        makespans["random"].append(random_skipping(problem).makespan_s)
        makespans["greedy"].append(schedule_microbatches(problem).makespan_s)
        for arm, scheduler in SEARCHES.items():
            started = time.perf_counter()
            makespans[arm].append(scheduler(problem).makespan_s)
            milliseconds[arm].append((time.perf_counter() - started) * 1000)
    means = {arm: statistics.fmean(values) for arm, values in makespans.items()}
    return {
        "swarm": name,
        "makespan_s": means,
        "vs_greedy": {arm: means[arm] / means["greedy"] - 1 for arm in SEARCHES},
        "schedule_ms": {arm: statistics.median(values) for arm, values in milliseconds.items()},
    }


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--swarms", type=int, default=8, help="random swarms besides `bench` (8)")
    parser.add_argument("--iterations", type=int, default=10, help="iterations (seeds) per swarm (10)")
    args = parser.parse_args()
    rows = []
    for name, seed in [("bench", None), *[(f"random-{index}", index) for index in range(args.swarms)]]:
        say(f"{name}: {args.iterations} iterations")
        rows.append(measure(name, seed, args.iterations))
    print_table(
        f"SkipPipe's schedulers in their timeline model: mean makespan in s over {args.iterations} iterations "
        f"({NUM_STAGES} stages × {REPLICAS}, {MICROBATCHES} microbatches, k = {SKIP_RATIO}, reorder; local search "
        f"within {IMPROVE_EVALUATIONS} timelines, CBS within {CBS_EXPANSIONS} splits); vs greedy, ms per schedule",
        ["swarm", "full", "random", "greedy", *SEARCHES, *(f"{arm} vs greedy, ms" for arm in SEARCHES)],
        [
            [
                row["swarm"],
                *(row["makespan_s"][arm] for arm in ("full", "random", "greedy", *SEARCHES)),
                *(f"{row['vs_greedy'][arm]:+.1%}, {row['schedule_ms'][arm]:.0f}" for arm in SEARCHES),
            ]
            for row in rows
        ],
    )
    for arm in SEARCHES:
        gains = [row["vs_greedy"][arm] for row in rows[1:]]
        if gains:
            print(f"random swarms: {arm} vs greedy {min(gains):+.1%} to {max(gains):+.1%}")
    results = {"environment": environment_json(quick=False), "arguments": vars(args) | {"out": str(args.out)}}
    write_json(Path(args.out) / "skippipe_schedule.json", results | {"swarms": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
