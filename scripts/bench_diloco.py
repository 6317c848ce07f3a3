"""Benchmark DiLoCo against DeDLOC gradient averaging: the same model, data and daemons, side by side.

Two `crowdtrain run` daemons on loopback train a 25M-parameter LLaMA (the llama-20m preset's shape, sequence
64), one arm after the other: `gradients` (an fp16 all-reduce of the gradients per global batch of 64) and
`diloco` (inner AdamW steps, an all-reduce of int8 pseudo-gradients every `--inner-steps` global batches).
For each arm it prints the swarm's samples/s over the window (from the epochs completed: one epoch is
a global batch, or an outer round of inner-steps global batches), the averaging bytes each peer sent per
1000 samples (the daemons' Prometheus counters), rounds that came back partial, and the loss at the end.

    python scripts/bench_diloco.py --window-s 150 --warmup-s 45
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from crowdtrain.testing.bench import print_table, say, scrape_metrics, start_metered_daemons, write_json
from crowdtrain.testing.processes import ProcessGroups

RUN_FILE = """
run_id = "bench-diloco"
target_batch_size = 64

[model.config]
vocab_size = 260
hidden_size = 512
intermediate_size = 1376
num_hidden_layers = 8
num_attention_heads = 8
num_key_value_heads = 8
max_position_embeddings = 512
tie_word_embeddings = true

[data]
sequence_length = 64

[optimizer]
learning_rate = 0.001
warmup_steps = 0
total_steps = 100000

[averaging]
mode = "{mode}"
matchmaking_time_s = 3.0
timeout_s = 60.0
{diloco}
"""
METRICS_PORT = 29400


def run_arm(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    diloco = f'\n[diloco]\ninner_steps = {args.inner_steps}\ncompression = "int8"\n' if mode == "diloco" else ""
    run_file = root / f"{mode}.toml"
    run_file.write_text(RUN_FILE.format(mode=mode, diloco=diloco))
    samples_per_epoch = 64 * (args.inner_steps if mode == "diloco" else 1)
    groups = ProcessGroups()
    try:
        start_metered_daemons(groups, root / mode, run_file, 2, micro_batch=8, metrics_port=METRICS_PORT)
        say(f"{mode}: 2 daemons up; {args.warmup_s:g} s warm-up, then {args.window_s:g} s measured")
        time.sleep(args.warmup_s)
        before = [scrape_metrics(METRICS_PORT + index) for index in range(2)]
        started = time.monotonic()
        time.sleep(args.window_s)
        after = [scrape_metrics(METRICS_PORT + index) for index in range(2)]
        elapsed = time.monotonic() - started
    finally:
        groups.kill_all()
    epochs = min(a["crowdtrain_epoch"] for a in after) - min(b["crowdtrain_epoch"] for b in before)
    samples = epochs * samples_per_epoch
    key = "crowdtrain_averaging_sent_bytes"
    sent = [a[key] - b[key] for a, b in zip(after, before, strict=True)]
    return {
        "mode": mode,
        "epochs_in_window": epochs,
        "samples_per_second": samples / elapsed,
        "sent_bytes_per_peer_per_1000_samples": (sum(sent) / 2) / max(samples, 1) * 1000,
        "partial_averages": sum(a["crowdtrain_partial_averages"] for a in after),
        "loss_at_end": sum(a.get("crowdtrain_loss", float("nan")) for a in after) / 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window-s", type=float, default=150.0, help="measured seconds per arm (150)")
    parser.add_argument("--warmup-s", type=float, default=45.0, help="seconds before the window (45)")
    parser.add_argument("--inner-steps", type=int, default=8, help="DiLoCo's H in global batches (8)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="results folder (bench-results/)")
    args = parser.parse_args()
    with TemporaryDirectory(prefix="crowdtrain-bench-diloco-") as folder:
        results = [run_arm(mode, args, Path(folder)) for mode in ("gradients", "diloco")]
    gradients, diloco = results
    rows = [
        [r["mode"], r["samples_per_second"], r["epochs_in_window"], r["sent_bytes_per_peer_per_1000_samples"] / 2**20,
         r["partial_averages"], r["loss_at_end"]]
        for r in results
    ]  # fmt: skip
    print_table(
        f"25M LLaMA, 2 daemons on loopback, {args.window_s:g} s windows, DiLoCo H = {args.inner_steps}",
        ["mode", "samples/s", "epochs", "MiB sent/peer/1k samples", "partial", "loss"],
        rows,
    )
    if gradients["sent_bytes_per_peer_per_1000_samples"] and diloco["sent_bytes_per_peer_per_1000_samples"]:
        ratio = gradients["sent_bytes_per_peer_per_1000_samples"] / diloco["sent_bytes_per_peer_per_1000_samples"]
        print(f"DiLoCo sends {ratio:.1f}x fewer bytes per sample; samples/s ratio "
              f"{diloco['samples_per_second'] / max(gradients['samples_per_second'], 1e-9):.2f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "diloco.json", {"arms": results, "settings": vars(args) | {"out": str(args.out)}})


if __name__ == "__main__":
    main()
