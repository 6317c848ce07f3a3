"""Benchmark DiLoCo against DeDLOC gradient averaging: the same model, data and daemons, side by side.

Two `crowdtrain run` daemons on loopback train a 25M-parameter LLaMA (the llama-20m preset's shape, sequence
64), one arm after the other: `gradients` (an fp16 all-reduce of the gradients per global batch of 64) and
`diloco` (inner AdamW steps, an all-reduce of int8 pseudo-gradients every `--inner-steps` global batches, the
inner steps waiting for it) and `diloco-overlap` (the same, the all-reduce running while the next round's inner
steps go on: `diloco.overlap`, the default).
For each arm it prints the swarm's samples/s over the window (the samples both peers computed, from their
`crowdtrain_samples_trained` counters), the epochs completed (a global batch, or an outer round of
inner-steps global batches), the averaging bytes each peer sent per
1000 samples (the daemons' Prometheus counters), the compute utilisation of the peers' last rounds (time in
forward and backward / wall time), rounds that came back partial, and the loss at the end.

    python scripts/bench_diloco.py --window-s 150 --warmup-s 45 [--arms diloco diloco-overlap]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from benchlib import (
    arms_parser,
    print_table,
    save_logs,
    say,
    scrape_metrics,
    start_metered_daemons,
    write_json,
)
from lab.fixtures import LLAMA_20M_CONFIG, bench_run_file
from lab.processes import ProcessGroups

METRICS_PORT = 29400


ARMS = ("gradients", "diloco", "diloco-overlap")


def run_arm(arm: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    mode = "gradients" if arm == "gradients" else "diloco"
    overlap = "true" if arm == "diloco-overlap" else "false"
    diloco = f'\n[diloco]\ninner_steps = {args.inner_steps}\ncompression = "int8"\noverlap = {overlap}\n'
    run_file = root / f"{arm}.toml"
    run_file.write_text(
        bench_run_file(
            "bench-diloco",
            batch=64,
            model_config=LLAMA_20M_CONFIG,
            sequence_length=64,
            mode=mode,
            averaging_timeout_s=60.0,
            sections=diloco if mode == "diloco" else "",
        )
    )
    groups = ProcessGroups()
    try:
        start_metered_daemons(groups, root / arm, run_file, 2, micro_batch=8, metrics_port=METRICS_PORT)
        say(f"{arm}: 2 daemons up; {args.warmup_s:g} s warm-up, then {args.window_s:g} s measured")
        time.sleep(args.warmup_s)
        before = [scrape_metrics(METRICS_PORT + index) for index in range(2)]
        started = time.monotonic()
        time.sleep(args.window_s)
        after = [scrape_metrics(METRICS_PORT + index) for index in range(2)]
        elapsed = time.monotonic() - started
    finally:
        groups.kill_all()
        save_logs(root / arm, args.out / "logs" / arm)
    epochs = min(a["crowdtrain_epoch"] for a in after) - min(b["crowdtrain_epoch"] for b in before)
    counter = "crowdtrain_samples_trained"
    samples = sum(a[counter] - b[counter] for a, b in zip(after, before, strict=True))
    key = "crowdtrain_averaging_sent_bytes"
    sent = [a[key] - b[key] for a, b in zip(after, before, strict=True)]
    return {
        "mode": arm,
        "epochs_in_window": epochs,
        "samples_per_second": samples / elapsed,
        "sent_bytes_per_peer_per_1000_samples": (sum(sent) / 2) / max(samples, 1) * 1000,
        "partial_averages": sum(a["crowdtrain_partial_averages"] for a in after),
        "compute_utilisation": sum(a.get("crowdtrain_compute_utilisation", float("nan")) for a in after) / 2,
        "loss_at_end": sum(a.get("crowdtrain_loss", float("nan")) for a in after) / 2,
    }


def main() -> None:
    parser = arms_parser(__doc__, ARMS, window_s=150.0)
    parser.add_argument("--warmup-s", type=float, default=45.0, help="seconds before the window (45)")
    parser.add_argument("--inner-steps", type=int, default=8, help="DiLoCo's H in global batches (8)")
    args = parser.parse_args()
    with TemporaryDirectory(prefix="crowdtrain-bench-diloco-") as folder:
        results = {arm: run_arm(arm, args, Path(folder)) for arm in args.arms}
    rows = [
        [r["mode"], r["samples_per_second"], r["epochs_in_window"], r["sent_bytes_per_peer_per_1000_samples"] / 2**20,
         r["compute_utilisation"], r["partial_averages"], r["loss_at_end"]]
        for r in results.values()
    ]  # fmt: skip
    print_table(
        f"25M LLaMA, 2 daemons on loopback, {args.window_s:g} s windows, DiLoCo H = {args.inner_steps}",
        ["mode", "samples/s", "epochs", "MiB sent/peer/1k samples", "computing", "partial", "loss"],
        rows,
    )
    gradients = results.get("gradients")
    for arm in ("diloco", "diloco-overlap"):
        diloco = results.get(arm)
        if gradients is None or diloco is None or not diloco["sent_bytes_per_peer_per_1000_samples"]:
            continue
        ratio = gradients["sent_bytes_per_peer_per_1000_samples"] / diloco["sent_bytes_per_peer_per_1000_samples"]
        print(f"{arm} sends {ratio:.1f}x fewer bytes per sample; samples/s ratio "
              f"{diloco['samples_per_second'] / max(gradients['samples_per_second'], 1e-9):.2f}")  # fmt: skip
    if "diloco" in results and "diloco-overlap" in results:
        speedup = results["diloco-overlap"]["samples_per_second"] / max(results["diloco"]["samples_per_second"], 1e-9)
        print(f"overlap: {speedup:.2f}x the samples/s of DiLoCo waiting for each round")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = vars(args) | {"out": str(args.out)}
    write_json(args.out / "diloco.json", {"arms": list(results.values()), "settings": settings})


if __name__ == "__main__":
    main()
