"""Benchmark the swarm's throughput on heterogeneous links: crowdtrain daemons against a plain hivemind.Optimizer loop.

On scripts/scenarios/hetero.toml (one 1 Gbit/s host, three at 20 Mbit/s), one process per WAN-lab host:
1. standalone  N plain torch loops of the demo model (one thread each, all at once, no network): the sum of
               their samples/s is what the machine computes with no collaboration at all
2. crowdtrain   N `crowdtrain run` daemons of the demo model with a smaller global batch (so a short window
               holds several global steps); the swarm's global samples/s is the slope of its progress
               (epoch * B + samples accumulated) read by `crowdtrain status --watch`
3. hivemind    N plain training loops of the same model, data and global batch wrapped in hivemind.Optimizer
               with default settings; the swarm's global samples/s is the sum of the samples the loops
               processed in the window (blocked time in averaging included)
scaling_efficiency = crowdtrain / standalone; throughput_speedup_vs_hivemind = crowdtrain / hivemind.
Run as root. Writes <out>/throughput.json and <out>/throughput.png.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib as bench
import torch
from bench_training import MICRO_BATCH_SIZE, WARMUP_S, initial_model, load_sampler, measure_standalone
from lab.processes import (
    LineReader,
    Poller,
    ProcessGroups,
    await_condition,
    child_env,
    exit_when_orphaned,
    raise_keyboard_interrupt,
)
from lab.procfs import cpu_seconds_by_process
from lab.swarm import StatusWatcher, SwarmSettled, start_swarm
from lab.wanlab import Lab, Scenario

from crowdtrain.data import load_token_stream
from crowdtrain.manifest import RunManifest, load_run_file
from crowdtrain.models import load_tokenizer, model_kind, training_loss

HETERO_SCENARIO = bench.REPO_ROOT / "scripts" / "scenarios" / "hetero.toml"
STATUS_INTERVAL_S = 2.0
TRAINING_TIMEOUT_S = 300.0
"""For every daemon to report samples/s, or every hivemind worker to finish its first micro-batch."""
QUICK_WARMUP_S = 5.0
"""The quick run's warm-up before each measured window (the full run's: WARMUP_S)."""
RUN_TOML = 'run_id = "bench-throughput"\ntarget_batch_size = {target_batch_size}\n'
"""The demo preset (model, data, optimizer, averaging) with a smaller global batch."""


# --- hivemind.Optimizer with default settings, one per host ------------------------------------------------------


def run_hivemind_worker(args: argparse.Namespace) -> None:
    """Hidden mode: train with hivemind.Optimizer (defaults) until the window sent on stdin has passed.

    Protocol as bench_training's standalone worker, with two more lines first: read `dht <initial peer or ->`
    (the worker is started ahead and imports meanwhile), print this DHT's addresses as soon as it runs (the
    other workers join through the first one's), a `ready` JSON line after the first
    micro-batch, read `<start> <end>` (unix seconds), print one JSON line at the window's end with the
    samples of the micro-batches that began and ended inside it, then train on until killed.
    """
    import hivemind

    torch.set_num_threads(1)
    manifest = load_run_file(args.run_file)
    # Started ahead, during the crowdtrain swarm's start-up: wait, idle, for `dht <initial peer or ->`.
    command, _, initial_peer = sys.stdin.readline().strip().partition(" ")
    if command != "dht":
        raise SystemExit("the benchmark that started this worker is gone")
    dht = hivemind.DHT(
        initial_peers=[initial_peer] if initial_peer not in ("", "-") else None,
        host_maddrs=[f"/ip4/{args.address}/tcp/0"],
        use_ipfs=False,
        start=True,
    )
    maddrs = [str(maddr) for maddr in dht.get_visible_maddrs() if f"/ip4/{args.address}/" in str(maddr)]
    print(json.dumps({"maddrs": maddrs}), flush=True)
    model, kind = initial_model(manifest), model_kind(manifest.model)
    sampler = load_sampler(manifest, args.cache_dir, f"hivemind-{args.address}")
    optimizer = hivemind.Optimizer(
        dht=dht,
        run_id="bench-hivemind",
        target_batch_size=manifest.target_batch_size,
        batch_size_per_step=MICRO_BATCH_SIZE,
        optimizer=functools.partial(torch.optim.AdamW, lr=manifest.optimizer.learning_rate),
        params=model.parameters(),
        verbose=False,
    )
    generator = torch.Generator().manual_seed(0)
    micro_step = 0

    def train_micro_batch() -> None:
        nonlocal micro_step
        batch = sampler.batch(optimizer.local_epoch, MICRO_BATCH_SIZE, micro_step)
        training_loss(model, batch, kind, generator=generator).backward()
        optimizer.step()
        optimizer.zero_grad()
        micro_step += 1

    train_micro_batch()
    window = bench.await_window()
    counted = {"samples": 0}
    first_epoch = optimizer.local_epoch

    def report_at_window_end() -> None:
        # From a thread, on time: at the window's end the main thread may be blocked in a global step
        # (matchmaking and state averaging) for many seconds more. The benchmark kills this process after.
        time.sleep(max(0.0, window[1] - time.time()))
        seconds = window[1] - window[0]
        samples = counted["samples"]
        print(json.dumps({"samples": samples, "seconds": seconds, "samples_per_second": samples / seconds,
                          "epochs": [first_epoch, optimizer.local_epoch]}), flush=True)  # fmt: skip

    threading.Thread(target=report_at_window_end, name="report", daemon=True).start()
    bench.train_counting_window(train_micro_batch, window, counted, MICRO_BATCH_SIZE)


def start_hivemind_workers(
    groups: ProcessGroups, lab: Lab, run_file: Path, cache_dir: Path, log_dir: Path
) -> list[tuple[subprocess.Popen, LineReader]]:
    """One hivemind.Optimizer worker per host, started ahead: each imports torch and hivemind, then waits."""
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--hivemind-worker", "--run-file", str(run_file)]
    command += ["--cache-dir", str(cache_dir)]
    workers = []
    for host in lab.hosts:
        full = ["ip", "netns", "exec", host.namespace, *command, "--address", host.address]
        with open(log_dir / f"hivemind-{host.name}.log", "wb") as log:
            process = groups.start(full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        workers.append((process, LineReader(process.stdout)))  # type: ignore[arg-type]
    return workers


def measure_hivemind(
    groups: ProcessGroups,
    lab: Lab,
    workers: list[tuple[subprocess.Popen, LineReader]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    duration_s, warmup_s = args.duration, args.warmup
    bench.say(f"throughput: {len(lab.hosts)} hivemind.Optimizer loops (default settings), one per host")
    initial_peer = "-"
    for host, (process, reader) in zip(lab.hosts, workers, strict=True):
        process.stdin.write(f"dht {initial_peer}\n")  # type: ignore[union-attr]
        process.stdin.flush()  # type: ignore[union-attr]
        started = json.loads(reader.next_line(TRAINING_TIMEOUT_S, f"hivemind worker in {host.name} to start its DHT"))
        if initial_peer == "-":  # the first one's DHT is the others' initial peer
            initial_peer = started["maddrs"][0]
    for host, (_, reader) in zip(lab.hosts, workers, strict=True):
        reader.next_line(TRAINING_TIMEOUT_S, f"hivemind worker in {host.name} to train")
    pgids = [process.pid for process, _ in workers]
    memory = bench.MemoryPeaks(pgids)
    with Poller([memory.poll], period_s=1.0):
        start = time.time() + warmup_s
        for process, _ in workers:
            process.stdin.write(f"{start} {start + duration_s}\n")  # type: ignore[union-attr]
            process.stdin.flush()  # type: ignore[union-attr]
        cpu_started, cpu_before = time.monotonic(), cpu_seconds_by_process(pgids)
        timeout_s = warmup_s + duration_s + TRAINING_TIMEOUT_S
        results = [
            json.loads(reader.next_line(timeout_s, f"hivemind worker {i}")) for i, (_, reader) in enumerate(workers)
        ]
        cpu_ended, cpu_after = time.monotonic(), cpu_seconds_by_process(pgids)
    for process, _ in workers:
        groups.kill(process)
    return {
        "settings": "hivemind.Optimizer defaults (matchmaking 15 s, state averaging every epoch, no compression)",
        "per_host": {host.name: result for host, result in zip(lab.hosts, results, strict=True)},
        "samples_per_second": sum(result["samples_per_second"] for result in results),
        "num_global_steps_in_window": max(r["epochs"][1] for r in results) - min(r["epochs"][0] for r in results),
        "cpu_cores_per_host": [
            bench.cpu_use(cpu_before, cpu_after, pgid, cpu_ended - cpu_started)["cores"] for pgid in pgids
        ],
        "memory_per_host": [bench.memory_json(memory.groups[pgid]) for pgid in pgids],
    }


# --- crowdtrain daemons, one per host --------------------------------------------------------------------------


def measure_crowdtrain(
    groups: ProcessGroups, lab: Lab, run_file: Path, root: Path, args: argparse.Namespace
) -> dict[str, Any]:
    duration_s, warmup_s = args.duration, args.warmup
    bench.say(f"throughput: {len(lab.hosts)} crowdtrain daemons, one per host")
    env = child_env(
        CROWDTRAIN_MICRO_BATCH_SIZE=str(MICRO_BATCH_SIZE),
        CROWDTRAIN_NUM_THREADS="1",
        CROWDTRAIN_STATUS_INTERVAL_S=f"{STATUS_INTERVAL_S:g}",
    )
    launchers = [("ip", "netns", "exec", host.namespace) for host in lab.hosts]
    placements = [(f"/ip4/{host.address}/tcp/0", launcher) for host, launcher in zip(lab.hosts, launchers, strict=True)]
    nodes = start_swarm(groups, root, len(lab.hosts), ["--run-file", str(run_file)], env, placements)
    peer_ids = [node.node_info["peer_id"] for node in nodes]
    watcher = StatusWatcher(groups, nodes[0].address, STATUS_INTERVAL_S, root / "status.log", launchers[0])

    all_settled = SwarmSettled(nodes, watcher, peer_ids, lambda line: bench.say(f"throughput: {line}"))

    pgids = [node.process.pid for node in nodes]
    memory = bench.MemoryPeaks(pgids)
    with Poller([memory.poll], period_s=1.0):
        await_condition(all_settled, TRAINING_TIMEOUT_S, "every daemon to probe and every trainer to train")
        bench.say(f"throughput: the swarm trains; {warmup_s:g} s warm-up, then measuring {duration_s:g} s")
        time.sleep(warmup_s)  # a warm-up interval, not a synchronisation: the same one the other loops get
        started, ended, cpu_before, cpu_after = bench.measured_window(nodes, duration_s, pgids)
        snapshots = watcher.between(started, ended)
    for process in [watcher.process, *(node.process for node in nodes)]:
        groups.kill(process)
    rate = bench.progress_rate(snapshots)
    epochs = [snapshot["run"]["epoch"] for _, snapshot in snapshots]
    last = snapshots[-1][1] if snapshots else {"peers": []}
    return {
        "samples_per_second": rate,
        "num_status_samples": len(snapshots),
        "num_global_steps_in_window": (epochs[-1] - epochs[0]) if epochs else 0,
        "local_steps_per_peer_at_end": {p["peer_id"]: p.get("local_steps") for p in last["peers"]},
        "roles_at_end": {p["peer_id"]: p.get("roles") for p in last["peers"]},
        "aggregation_shares_at_end": {p["peer_id"]: p.get("aggregation_share") for p in last["peers"]},
        "links_at_end_mbps": {p["peer_id"]: [p.get("upload_mbps"), p.get("download_mbps")] for p in last["peers"]},
        "partial_averages_at_end": last.get("run", {}).get("partial_averages"),
        "cpu_cores_per_host": [bench.cpu_use(cpu_before, cpu_after, pgid, ended - started)["cores"] for pgid in pgids],
        "memory_per_host": [bench.memory_json(memory.groups[pgid]) for pgid in pgids],
    }


# --- The benchmark ---------------------------------------------------------------------------------------------


def bench_throughput(groups: ProcessGroups, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_file = root / "throughput.toml"
    run_file.write_text(RUN_TOML.format(target_batch_size=args.batch))
    manifest: RunManifest = load_run_file(str(run_file))
    cache_dir = root / "data-cache"
    load_token_stream(manifest.data, load_tokenizer(manifest.model), cache_dir)  # tokenise once, not per worker
    scenario = Scenario.load(args.scenario)
    num_hosts = sum(spec.count for spec in scenario.hosts)
    standalone = measure_standalone(groups, root, cache_dir, num_hosts, args.standalone_duration, args.warmup)
    results: dict[str, Any] = {"standalone": standalone}
    with Lab(scenario) as lab:
        hosts = [{"name": h.name, "upload_mbps": h.upload_mbps, "download_mbps": h.download_mbps} for h in lab.hosts]
        # hivemind's workers import torch and hivemind while the crowdtrain swarm starts up, then wait idle on
        # stdin (no CPU) through its measured window: their phase then starts without the import minute.
        hivemind_workers = start_hivemind_workers(groups, lab, run_file, cache_dir, root / "hivemind")
        waiting = [process for process, _ in hivemind_workers]
        for name, measure in (
            ("crowdtrain", lambda: measure_crowdtrain(groups, lab, run_file, root / "crowdtrain", args)),
            ("hivemind", lambda: measure_hivemind(groups, lab, hivemind_workers, args)),
        ):
            try:
                results[name] = measure()
            except Exception as e:  # the other swarm's number is still worth having
                traceback.print_exc()
                results[name] = {"error": f"{type(e).__name__}: {e}", "samples_per_second": None}
            finally:
                for process in list(groups.processes):  # the phase's own processes; the waiting workers stay
                    if name == "hivemind" or process not in waiting:
                        groups.kill(process)
    crowdtrain, hivemind = results["crowdtrain"]["samples_per_second"], results["hivemind"]["samples_per_second"]
    # Other users' load moves between the three phases on a shared machine: samples per CPU-second of the
    # processes measured is the steadier comparison (it still charges p2pd, DHT and averagers to the swarms).
    cores = {
        "standalone": sum(item["cpu_cores"] for item in standalone["per_process"]),
        "crowdtrain": sum(results["crowdtrain"].get("cpu_cores_per_host", [])),
        "hivemind": sum(results["hivemind"].get("cpu_cores_per_host", [])),
    }
    per_core = {name: _ratio(results[name]["samples_per_second"], cores[name]) for name in cores}
    return {
        "scenario": args.scenario.name,
        "hosts": hosts,
        "target_batch_size": args.batch,
        "micro_batch_size": MICRO_BATCH_SIZE,
        "duration_s": args.duration,
        "standalone_duration_s": args.standalone_duration,
        "warmup_s": args.warmup,
        **results,
        "scaling_efficiency": _ratio(crowdtrain, standalone["samples_per_second"]),
        "hivemind_scaling_efficiency": _ratio(hivemind, standalone["samples_per_second"]),
        "throughput_speedup_vs_hivemind": _ratio(crowdtrain, hivemind),
        "cpu_cores": cores,
        "samples_per_core_second": per_core,
        "scaling_efficiency_per_core": _ratio(per_core["crowdtrain"], per_core["standalone"]),
        "throughput_speedup_vs_hivemind_per_core": _ratio(per_core["crowdtrain"], per_core["hivemind"]),
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not denominator > 0 or not math.isfinite(numerator):
        return None
    return numerator / denominator


def print_throughput(result: dict[str, Any]) -> None:
    rows = [
        ["standalone torch loops, sum", result["standalone"]["samples_per_second"], None, None],
        ["crowdtrain daemons", result["crowdtrain"]["samples_per_second"], result["crowdtrain"].get(
            "num_global_steps_in_window"), sum(result["crowdtrain"].get("cpu_cores_per_host", []))],
        ["hivemind.Optimizer, defaults", result["hivemind"]["samples_per_second"], result["hivemind"].get(
            "num_global_steps_in_window"), sum(result["hivemind"].get("cpu_cores_per_host", []))],
    ]  # fmt: skip
    hosts = ", ".join(f"{h['name']} {min(h['upload_mbps'], h['download_mbps']):g}" for h in result["hosts"])
    bench.print_table(
        f"Throughput on {result['scenario']} ({hosts} Mbit/s), B = {result['target_batch_size']}, "
        f"{result['duration_s']:g} s",
        ["", "global samples/s", "global steps in window", "CPU cores"],
        rows,
    )
    for key in (
        "scaling_efficiency",
        "hivemind_scaling_efficiency",
        "throughput_speedup_vs_hivemind",
        "scaling_efficiency_per_core",
        "throughput_speedup_vs_hivemind_per_core",
    ):
        value = result[key]
        print(f"{key} = {'—' if value is None else f'{value:.3f}'}")


@bench.plot_to_png(figsize=(7, 4.5))
def plot(result: dict[str, Any], axes: Any) -> None:
    names = ["standalone sum", "crowdtrain", "hivemind defaults"]
    values = [result[key]["samples_per_second"] or 0.0 for key in ("standalone", "crowdtrain", "hivemind")]
    axes.bar(names, values, color=["grey", "C0", "C1"])
    axes.set(ylabel="samples/s", title=f"{result['scenario']}: global throughput, B = {result['target_batch_size']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench.bench_parser(__doc__, "a shorter window and a smaller global batch")
    parser.add_argument("--scenario", type=Path, default=HETERO_SCENARIO, help="the scenario TOML")
    parser.add_argument("--batch", type=int, help="global batch B (default 512, quick 256)")
    parser.add_argument("--duration", type=float, help="measured seconds of each swarm (default 120, quick 30)")
    parser.add_argument(
        "--standalone-duration", type=float, help="measured seconds of the standalone loops (default 60, quick 15)"
    )
    parser.add_argument("--hivemind-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-file", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batch = args.batch or (256 if args.quick else 512)
    # The window must hold whole global steps of the slowest swarm: hivemind's defaults spend ~20 s of each one
    # matchmaking and averaging the whole state, and a 20 s window could fall entirely inside one. Quick's 30 s
    # window holds about one global step of each swarm, so its ratios move by a third from run to run.
    args.duration = args.duration or (30.0 if args.quick else 120.0)
    # The standalone loops have no global steps: their rate is steady after the warm-up.
    args.standalone_duration = args.standalone_duration or (15.0 if args.quick else 60.0)
    args.warmup = QUICK_WARMUP_S if args.quick else WARMUP_S
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hivemind_worker:
        threading.Thread(target=exit_when_orphaned, daemon=True).start()
        run_hivemind_worker(args)
        return 0
    if os.geteuid() != 0:
        print("bench_throughput needs root: it creates network namespaces", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    report = bench.Report("throughput", print_throughput, plot, "every child process was killed and the lab torn down")
    log_dir = args.out / "logs" / "throughput"
    prefix = "crowdtrain-bench-throughput-"
    measure = functools.partial(bench_throughput, args=args)
    return bench.run_benchmark(report, args.out, args.quick, lambda: bench.with_children(prefix, log_dir, measure))


if __name__ == "__main__":
    sys.exit(main())
