"""Benchmark training with a poisoning peer: does the honest peers' loss still fall like a clean run's?

Four `crowdtrain run` daemons on loopback train the tiny LM (gradients mode, target batch 32, default
`mean` aggregation with every chunk checked), one arm after the other:
1. clean   four honest daemons
2. scaled  three honest daemons and one whose gradients are multiplied by --scale (1e6) before every all-reduce
3. nan     three honest daemons and one whose gradients are NaN
The attacker is a real daemon (scripts/lab/attacker.py): only its model's gradients are poisoned.
Each arm trains --window-s seconds after the swarm settles; the honest daemons' epoch and loss are read from
their Prometheus endpoints every second. The table gives, per arm, the epochs reached, the honest peers' mean
loss at the last epoch every arm reached and at the end, and how many rounds the honest reducers dropped the
attacker's parts ('dropped the parts of peer' lines in their logs). Writes <out>/poison.json and the
daemons' logs to <out>/logs/<arm>/.

    python scripts/bench_poison.py --window-s 120
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from benchlib import arms_parser, print_table, save_logs, say, scrape_metrics, start_metered_daemons, write_json
from lab.attacker import attacker_launcher
from lab.fixtures import tiny_run_file
from lab.processes import ProcessGroups, await_condition
from lab.swarm import START_TIMEOUT_S

ARMS = ("clean", "scaled", "nan")
NUM_PEERS = 4
METRICS_PORT = 9720
TARGET_BATCH = 32


def run_arm(arm: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_file = root / f"{arm}.toml"
    run_file.write_text(tiny_run_file(f"bench-poison-{arm}", TARGET_BATCH))
    groups = ProcessGroups()
    honest = list(range(NUM_PEERS - 1 if arm != "clean" else NUM_PEERS))
    curves: dict[int, dict[int, list[float]]] = {index: {} for index in honest}
    try:
        attacker = {NUM_PEERS - 1: attacker_launcher(arm, args.scale)} if arm != "clean" else {}
        nodes = start_metered_daemons(
            groups, root / arm, run_file, NUM_PEERS, micro_batch=4, metrics_port=METRICS_PORT, launchers=attacker
        )
        await_condition(
            lambda: all(scrape_metrics(METRICS_PORT + index).get("crowdtrain_epoch", 0) >= 1 for index in honest),
            START_TIMEOUT_S,
            f"{arm}: every honest daemon's first global step",
        )
        say(f"{arm}: {NUM_PEERS} daemons train; measuring {args.window_s:g} s")
        deadline = time.monotonic() + args.window_s
        while time.monotonic() < deadline:
            for node in nodes:
                node.check_alive()
            for index in honest:
                metrics = scrape_metrics(METRICS_PORT + index)
                loss = metrics.get("crowdtrain_loss")
                if loss is not None:
                    curves[index].setdefault(int(metrics["crowdtrain_epoch"]), []).append(loss)
            time.sleep(1.0)
        logs = [nodes[index].log_path.read_text(errors="replace") for index in honest]
    finally:
        groups.kill_all()
        save_logs(root / arm, args.out / "logs" / arm)
    return {
        "arm": arm,
        "honest_peers": len(honest),
        "loss_by_epoch": {
            str(index): {str(epoch): statistics.mean(losses) for epoch, losses in sorted(curve.items())}
            for index, curve in curves.items()
        },
        # a peer the plan leaves out of computing (it only aggregates) reports no loss: only trainers count
        "epochs_reached": min((max(curve) for curve in curves.values() if curve), default=0),
        "rounds_with_attacker_dropped": sum(log.count("dropped the parts of peer") for log in logs),
    }


def honest_loss_at(result: dict[str, Any], epoch: int) -> float:
    """The honest peers' mean loss at `epoch` (each peer's losses logged at that epoch, averaged)."""
    losses = [curve[str(epoch)] for curve in result["loss_by_epoch"].values() if str(epoch) in curve]
    return statistics.mean(losses) if losses else float("nan")


def main() -> None:
    parser = arms_parser(__doc__, ARMS, window_s=120.0)
    parser.add_argument("--scale", type=float, default=1e6, help="the scaled attacker's factor (1e6)")
    args = parser.parse_args()
    with TemporaryDirectory(prefix="crowdtrain-bench-poison-") as folder:
        results = [run_arm(arm, args, Path(folder)) for arm in args.arms]
    common = min(result["epochs_reached"] for result in results)
    first = min(min((int(e) for e in c), default=0) for r in results for c in r["loss_by_epoch"].values())
    rows = [
        [r["arm"], r["honest_peers"], r["epochs_reached"], honest_loss_at(r, max(first, 1)), honest_loss_at(r, common),
         honest_loss_at(r, r["epochs_reached"]), r["rounds_with_attacker_dropped"]]
        for r in results
    ]  # fmt: skip
    print_table(
        f"tiny LM, {NUM_PEERS} daemons on loopback, {args.window_s:g} s per arm; honest peers' mean loss",
        ["arm", "honest", "epochs", f"loss @ {max(first, 1)}", f"loss @ {common}", "loss at end", "drops logged"],
        rows,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(
        args.out / "poison.json",
        {"arms": results, "common_epoch": common, "settings": vars(args) | {"out": str(args.out)}},
    )


if __name__ == "__main__":
    main()
