"""Run every benchmark, one process each, and write <out>/summary.json with the headline numbers.

`make bench` runs the full versions (and bench_training's convergence run and bench_realmodel's CPU scenario),
about 52 minutes on 2 cores;
`make bench-quick` the reduced ones, about 9 (the target is under 10; see BENCHMARKS.md). A benchmark that
fails is recorded in the summary (its exit code and error) and the others still run. Needs root for the
WAN-lab namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchlib import NOISE_CAVEAT, environment_json, print_table, say, write_json
from lab.processes import raise_keyboard_interrupt

SCRIPTS = Path(__file__).resolve().parent
BENCHMARK_TIMEOUT_S = 3600.0
"""A benchmark still running after this long is killed and recorded as failed."""
BENCHMARK_ARGS = {
    "bench_realmodel.py": ("--device", "cpu", "--model", "llama-20m", "--peers", "1", "2", "--window-s", "60",
                           "--warmup-s", "15"),
}  # fmt: skip
"""Arguments of the benchmarks that take more than --out and --quick: realmodel's quick CPU scenario."""
REALMODEL_PEERS = ("1", "2")


def run_benchmark(script: str, quick: bool, out: Path) -> dict[str, Any]:
    """Run one benchmark script in its own process group; its exit code and duration."""
    command = [sys.executable, str(SCRIPTS / script), "--out", str(out), *(["--quick"] if quick else [])]
    command += BENCHMARK_ARGS.get(script, ())
    say(f"bench_all: {' '.join(command[1:])}")
    began = time.monotonic()
    process = subprocess.Popen(command, start_new_session=True)
    try:
        code = process.wait(timeout=BENCHMARK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = -1
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the benchmark tears its lab down on SIGTERM
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return {"exit_code": code, "seconds": time.monotonic() - began}


def read(out: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return {}


def summarize(out: Path, runs: dict[str, dict[str, Any]], quick: bool) -> dict[str, Any]:
    averaging, throughput = read(out, "averaging.json"), read(out, "throughput.json").get("throughput", {})
    uniform, hetero = averaging.get("uniform", {}), averaging.get("hetero", {})
    dht = read(out, "dht.json").get("dht", {})
    footprint = read(out, "footprint.json").get("footprint", {})
    training = read(out, "training.json")
    moe = read(out, "moe.json")
    serving, moe_training = moe.get("serving", {}), moe.get("training", {})
    realmodel = read(out, "realmodel.json")

    def footprint_value(state: str, *path: str) -> Any:
        value: Any = footprint.get(state, {})
        for key in path:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        return value if value != {} else None

    environment = environment_json(quick)
    return {
        "averaging_time_over_bound": uniform.get("averaging_time_over_bound"),
        "averaging_speedup_vs_hivemind": uniform.get("averaging_speedup_vs_hivemind"),
        "averaging_speedup_vs_gloo": uniform.get("averaging_speedup_vs_gloo"),
        "averaging_equal_payload": uniform.get("equal_payload"),
        "averaging_setup": {key: uniform.get(key) for key in ("num_peers", "size_mb", "bandwidth_mbps", "bound_s")},
        "plan_speedup_vs_equal_split": hetero.get("plan_speedup_vs_equal_split"),
        "plan_speedup_vs_hivemind_load_balancing": hetero.get("plan_speedup_vs_hivemind_load_balancing"),
        "scaling_efficiency": throughput.get("scaling_efficiency"),
        "throughput_speedup_vs_hivemind": throughput.get("throughput_speedup_vs_hivemind"),
        "scaling_efficiency_per_core": throughput.get("scaling_efficiency_per_core"),
        "throughput_speedup_vs_hivemind_per_core": throughput.get("throughput_speedup_vs_hivemind_per_core"),
        "dht_get_p50_ms": dht.get("dht_get_p50_ms"),
        "dht_get_p99_ms": dht.get("get", {}).get("p99_ms"),
        "dht_get_success_after_kill": dht.get("dht_get_success_after_kill"),
        "footprint_idle_peak_rss_mib": footprint_value("idle", "memory", "peak_rss_mib"),
        "footprint_idle_pss_mib": footprint_value("idle", "memory", "pss_at_peak_mib"),
        "footprint_idle_cpu_cores": footprint_value("idle", "cpu", "cores"),
        "footprint_training_peak_rss_mib": footprint_value("training", "memory", "peak_rss_mib"),
        "footprint_training_pss_mib": footprint_value("training", "memory", "pss_at_peak_mib"),
        "footprint_training_cpu_cores": footprint_value("training", "cpu", "cores"),
        "moe_expert_calls_per_s": serving.get("moe_expert_calls_per_s"),
        "moe_expert_p50_ms": serving.get("moe_expert_p50_ms"),
        "moe_expert_p99_ms": serving.get("moe_expert_p99_ms"),
        "moe_speedup_vs_hivemind_server": serving.get("moe_speedup_vs_hivemind_server"),
        "moe_samples_per_s": moe_training.get("moe_samples_per_s"),
        "moe_samples_per_s_after_kill_ratio": moe_training.get("moe_samples_per_s_after_kill_ratio"),
        **({"training_throughput_ratio": training.get("throughput", {}).get("throughput_ratio")} if training else {}),
        **(realmodel_summary(realmodel) if realmodel else {}),
        "commit": environment["commit"],
        "uncommitted_changes": environment["uncommitted_changes"],
        "machine": {key: environment[key] for key in ("nproc", "ram_gib", "cpu_model")},
        "versions": {key: environment[key] for key in ("python", "torch", "hivemind")},
        "quick": quick,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_end": os.getloadavg(),
        "benchmarks": runs,
        "caveat": NOISE_CAVEAT,
    }


def realmodel_summary(realmodel: dict[str, Any]) -> dict[str, Any]:
    """bench_realmodel's CPU scenario: crowdtrain against hivemind and the plain loop, partial rounds, per peers."""
    summary: dict[str, Any] = {}
    for peers in REALMODEL_PEERS:
        crowdtrain = realmodel.get("crowdtrain", {}).get(peers, {})
        summary[f"realmodel_speedup_vs_hivemind_{peers}p"] = crowdtrain.get("speedup_vs_hivemind")
        summary[f"realmodel_ratio_to_plain_{peers}p"] = crowdtrain.get("ratio_to_plain")
        summary[f"realmodel_partial_averages_{peers}p"] = crowdtrain.get("partial_averages_in_window")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the reduced versions (about 9 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="results folder (bench-results/)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the benchmarks need root: they create network namespaces", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)  # run_benchmark's finally then stops the child
    args.out.mkdir(parents=True, exist_ok=True)
    scripts = ["bench_averaging.py", "bench_throughput.py", "bench_dht.py", "bench_footprint.py", "bench_moe.py"]
    if not args.quick:
        scripts.append("bench_training.py")  # convergence and loopback throughput: minutes more
        scripts.append("bench_realmodel.py")  # issue 12's comparison on a 20M model: about 10 minutes
    stale_files = ("averaging.json", "throughput.json", "dht.json", "footprint.json", "moe.json", "training.json",
                   "realmodel.json")  # fmt: skip
    for stale in stale_files:
        (args.out / stale).unlink(missing_ok=True)  # a failed benchmark must not leave an old number behind
    began = time.monotonic()
    runs = {script.removesuffix(".py"): run_benchmark(script, args.quick, args.out) for script in scripts}
    summary = summarize(args.out, runs, args.quick)
    summary["total_seconds"] = time.monotonic() - began
    write_json(args.out / "summary.json", summary)
    rows = [[key, value] for key, value in summary.items() if isinstance(value, float | int) and key != "quick"]
    rows += [
        [f"{name} exit code / seconds", f"{run['exit_code']} / {run['seconds']:.0f}"] for name, run in runs.items()
    ]
    print_table(f"Summary ({'quick' if args.quick else 'full'}, commit {summary['commit']})", ["", "value"], rows)
    print(f"wrote {args.out / 'summary.json'}\n{NOISE_CAVEAT}")
    return 0 if all(run["exit_code"] == 0 for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
