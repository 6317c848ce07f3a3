"""Benchmark a real model side by side: a plain torch loop, stock hivemind.Optimizer and crowdtrain daemons.

Issue 12's benchmark. On one machine, one model (a run preset, `--model`), one sequence length, micro-batch
and target batch, on loopback, one after the other:
1. plain        one plain torch loop: AdamW as the manifest, gradients accumulated over the target batch, the
                precision crowdtrain picks (`auto`: fp32 on CPU; bf16 autocast, or fp16 with a scaler, on CUDA)
2. hivemind N   N stock `hivemind.Optimizer` workers, one process each: fp16 gradients, the manifest's
                matchmaking time, the target batch, use_local_updates=False; swarm samples/s is the slope of the
                swarm's progress (epoch * B + samples accumulated) as worker 0's progress tracker sees it, sampled
                every second; the samples the workers computed in the window are kept beside it
                (`samples_per_second_computed`: it also counts samples computed past the target batch)
3. crowdtrain N N `crowdtrain run` daemons; swarm samples/s is the slope of the run's progress (epoch * B +
                samples accumulated) read by `crowdtrain status --watch`, plus partial averages, solo steps and
                whether the peers' published plan agrees (shares sum to 1, roles match shares)
Both swarms are measured the same way, in samples of global batches of the target size: a peer that computes
past the target while the swarm steps adds samples to a larger batch, not to more of them.
Arms 2 and 3 run back to back for each peer count. Peak RSS of each arm's processes is sampled; on CUDA also
the plain loop's torch.cuda.max_memory_allocated and the GPU's memory in use (nvidia-smi, when present).
Writes <out>/realmodel.json and <out>/realmodel.png; an arm that fails is recorded and the script exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bench_training import initial_model, load_sampler
from benchlib import (
    MIB,
    NOISE_CAVEAT,
    POLL_S,
    MemoryPeaks,
    await_window,
    bench_parser,
    environment_json,
    memory_json,
    print_table,
    progress_rate,
    pyplot,
    save_figure,
    say,
    say_written,
    train_counting_window,
    with_children,
    write_json,
)
from lab import processes
from lab.swarm import START_TIMEOUT_S, StatusWatcher, SwarmSettled, start_swarm

from crowdtrain.data import load_token_stream
from crowdtrain.manifest import PRESETS, RunManifest, load_run_file
from crowdtrain.models import (
    apply_tf32,
    autocast,
    count_parameters,
    load_tokenizer,
    model_kind,
    precision_for_device,
    training_loss,
)
from crowdtrain.node.config import ROLES
from crowdtrain.roles import AUTO

RUN_ID = "bench-realmodel"
STATUS_INTERVAL_S = 2.0
TRAINING_TIMEOUT_S = 600.0
"""For a worker's first micro-batch (a joiner first downloads the state), or every daemon to train."""
REPORT_MARGIN_S = 120.0
"""How long after its window's end a worker may take to print its result."""
SHARE_SUM_TOLERANCE = 0.02
"""Published aggregation shares agree when they sum to 1 within this."""
ARMS = ("plain", "hivemind", "crowdtrain")
DEFAULTS = {
    # The CPU scenario: the 85M model, a large vector averaged about as often as it is computed.
    "cpu": {"model": "llama-85m", "sequence_length": 32, "micro_batch": 2, "target_batch": 32, "threads": 1,
            "peers": [1, 2], "window_s": 120.0, "warmup_s": 30.0},
    # Its CUDA scenario: every peer on the one GPU.
    "cuda": {"model": "llama-85m", "sequence_length": 512, "micro_batch": 16, "target_batch": 512, "threads": 0,
             "peers": [1, 2, 4], "window_s": 90.0, "warmup_s": 30.0},
}  # fmt: skip


# --- The run file every arm reads ----------------------------------------------------------------------------


def bench_manifest(args: argparse.Namespace) -> RunManifest:
    """The preset with the benchmark's sequence length, target batch and matchmaking time."""
    preset = PRESETS[args.model]()
    if preset.moe is not None:
        raise processes.HarnessError(f"--model {args.model} is a DMoE run: this benchmark compares dense models")
    averaging = preset.averaging
    if args.matchmaking_s is not None:
        averaging = dataclasses.replace(averaging, matchmaking_time_s=args.matchmaking_s)
    return dataclasses.replace(
        preset,
        run_id=RUN_ID,
        target_batch_size=args.target_batch,
        data=dataclasses.replace(preset.data, sequence_length=args.sequence_length),
        averaging=averaging,
    )


def write_run_file(manifest: RunManifest, path: Path) -> None:
    """Every field of `manifest` as a run file (a run file overrides the demo preset: nothing is left implied)."""
    tables = dataclasses.asdict(manifest)
    tables.pop("created_at")  # stamped by the founder
    for optional_section in [name for name, value in tables.items() if value is None]:
        tables.pop(optional_section)  # moe, diloco, spes, ...: None in this dense gradients-mode run, no table
    lines = [f"{key} = {_toml_value(value)}" for key, value in tables.items() if not isinstance(value, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines += ["", f"[{name}]"]
            lines += [f"{key} = {_toml_value(value)}" for key, value in table.items() if not isinstance(value, dict)]
            for sub_name, sub_table in table.items():
                if isinstance(sub_table, dict):
                    lines += ["", f"[{name}.{sub_name}]"]
                    lines += [f"{key} = {_toml_value(value)}" for key, value in sub_table.items()]
    path.write_text("\n".join(lines) + "\n")
    if load_run_file(str(path)) != manifest:
        raise processes.HarnessError(f"the run file {path} does not read back as the benchmark's manifest")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str | int | float):
        return json.dumps(value)  # a JSON string or number is a TOML one
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(key)} = {_toml_value(item)}" for key, item in value.items()) + "}"
    raise processes.HarnessError(f"cannot write {value!r} into a run file")


def resolve_precision(setting: str, device: str) -> str:
    """fp32, bf16 or fp16: what a crowdtrain node on `device` (cpu or cuda) computes in for `setting`."""
    return precision_for_device(setting, "cuda:0" if device == "cuda" else "cpu").name


# --- The loops the plain and hivemind workers run -------------------------------------------------------------


class MicroBatches:
    """Forward and backward of one micro-batch at the chosen precision; the same in the plain and hivemind loops."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        if args.threads:
            torch.set_num_threads(args.threads)
        self.manifest = load_run_file(args.run_file)
        self.device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
        self.resolved = precision_for_device(args.precision, str(self.device))
        self.precision = self.resolved.name
        apply_tf32(self.resolved)
        self.model = initial_model(self.manifest).to(self.device)
        self.kind = model_kind(self.manifest.model)
        self.sampler = load_sampler(self.manifest, args.cache_dir, name)
        self.micro_batch = args.micro_batch
        self.generator = torch.Generator(device=self.device).manual_seed(0)

    def loss(self, epoch: int, step: int) -> torch.Tensor:
        batch = self.sampler.batch(epoch, self.micro_batch, step).to(self.device, non_blocking=True)
        with autocast(self.resolved, str(self.device)):
            return training_loss(self.model, batch, self.kind, generator=self.generator)  # type: ignore[arg-type]

    def optimizer_kwargs(self) -> dict[str, Any]:
        spec = self.manifest.optimizer
        return {"lr": spec.learning_rate, "weight_decay": spec.weight_decay}


def run_plain_worker(args: argparse.Namespace) -> None:
    """Hidden mode: a plain torch loop for warmup_s, then one JSON line about the next window_s."""
    loop = MicroBatches(args, "plain")
    optimizer = torch.optim.AdamW(loop.model.parameters(), **loop.optimizer_kwargs())
    scaler = torch.amp.GradScaler(loop.device.type, enabled=loop.precision == "fp16")
    num_micro_batches = math.ceil(loop.manifest.target_batch_size / loop.micro_batch)
    start = time.time() + args.warmup_s
    end = start + args.window_s
    samples = step = micro_step = 0
    while True:
        began = time.time()
        loss = loop.loss(step, micro_step)
        scaler.scale(loss / num_micro_batches).backward()  # the mean gradient over the target batch
        micro_step += 1
        if micro_step == num_micro_batches:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            step, micro_step = step + 1, 0
        last_loss = loss.item()  # also waits for the GPU
        if time.time() > end:
            break
        if began >= start:
            samples += loop.micro_batch
    result = {"samples": samples, "seconds": args.window_s, "samples_per_second": samples / args.window_s,
              "optimizer_steps": step, "loss": last_loss, "precision": loop.precision}  # fmt: skip
    if loop.device.type == "cuda":
        result["cuda_max_memory_allocated_mib"] = torch.cuda.max_memory_allocated(loop.device) / MIB
    print(json.dumps(result), flush=True)


def run_hivemind_worker(args: argparse.Namespace) -> None:
    """Hidden mode: train with a stock hivemind.Optimizer until killed.

    Protocol: print this DHT's addresses as soon as it runs (the others join through the first one's); a
    `ready` line after the first micro-batch; read `<start> <end>` (unix seconds); at the window's end print
    one JSON line with the samples of the micro-batches that began and ended inside it.
    """
    import hivemind
    from hivemind.compression import Float16Compression

    dht = hivemind.DHT(
        initial_peers=[args.initial_peer] if args.initial_peer not in (None, "-") else None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        use_ipfs=False,
        start=True,
    )
    print(json.dumps({"maddrs": [str(maddr) for maddr in dht.get_visible_maddrs()]}), flush=True)
    loop = MicroBatches(args, f"hivemind-{args.index}")
    manifest = loop.manifest
    optimizer = hivemind.Optimizer(
        dht=dht,
        run_id="bench-realmodel-hivemind",
        target_batch_size=manifest.target_batch_size,
        batch_size_per_step=loop.micro_batch,
        optimizer=lambda params: torch.optim.AdamW(params, **loop.optimizer_kwargs()),
        params=loop.model.parameters(),
        matchmaking_time=manifest.averaging.matchmaking_time_s,
        grad_compression=Float16Compression(),
        use_local_updates=False,
        verbose=False,
    )
    scaler = hivemind.GradScaler() if loop.precision == "fp16" else None
    micro_step = 0

    def train_micro_batch() -> None:
        nonlocal micro_step
        loss = loop.loss(optimizer.local_epoch, micro_step)
        (loss if scaler is None else scaler.scale(loss)).backward()
        optimizer.step(grad_scaler=scaler)
        if scaler is not None:
            scaler.update()
        optimizer.zero_grad()
        loss.item()  # waits for the GPU
        micro_step += 1

    train_micro_batch()
    window = await_window()
    counted = {"samples": 0}
    threading.Thread(
        target=_report_at_window_end, args=(optimizer, window, counted, loop), name="report", daemon=True
    ).start()
    train_counting_window(train_micro_batch, window, counted, loop.micro_batch)


def _report_at_window_end(optimizer: Any, window: list[float], counted: dict[str, int], loop: MicroBatches) -> None:
    # From a thread, on time: at the window's end the training thread may be blocked in a global step for many
    # seconds more. The swarm's progress (epoch * B + accumulated) is sampled every second as a cross-check.
    target = loop.manifest.target_batch_size
    time.sleep(max(0.0, window[0] - time.time()))
    first_epoch, progress = optimizer.local_epoch, []
    while time.time() < window[1]:
        tracker = optimizer.tracker.global_progress
        progress.append([time.time(), tracker.epoch * target + tracker.samples_accumulated])
        time.sleep(min(1.0, max(0.0, window[1] - time.time())))
    seconds = window[1] - window[0]
    print(json.dumps({"samples": counted["samples"], "seconds": seconds,
                      "samples_per_second": counted["samples"] / seconds, "precision": loop.precision,
                      "epochs": [first_epoch, optimizer.local_epoch], "progress": progress}), flush=True)  # fmt: skip


# --- The arms ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Bench:
    """What every arm shares: the options, the run file, the data cache and where children keep their files."""

    args: argparse.Namespace
    groups: processes.ProcessGroups
    root: Path
    run_file: Path
    manifest: RunManifest
    precision: str
    """fp32, bf16 or fp16: the plain and hivemind loops' (crowdtrain's daemons choose their own)."""

    def worker_command(self, mode: str, *extra: str) -> list[str]:
        args = self.args
        command = [sys.executable, str(Path(__file__).resolve()), mode, "--run-file", str(self.run_file)]
        command += ["--cache-dir", str(self.root / "data-cache"), "--device", args.device]
        command += ["--micro-batch", str(args.micro_batch), "--threads", str(args.threads)]
        command += ["--precision", self.precision, "--window-s", f"{args.window_s:g}"]
        return [*command, "--warmup-s", f"{args.warmup_s:g}", *extra]


class GpuMemoryPeak:
    """The most GPU memory in use (all processes) that nvidia-smi reported; off without it or on CPU."""

    def __init__(self, enabled: bool) -> None:
        self.command = shutil.which("nvidia-smi") if enabled else None
        self.peak_mib: float | None = None

    def poll(self) -> None:
        if self.command is None:
            return
        try:
            result = subprocess.run(
                [self.command, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            used = sum(float(line) for line in result.stdout.split())
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return
        self.peak_mib = max(self.peak_mib or 0.0, used)


def measuring_memory(bench: Bench, pids: Sequence[int]) -> tuple[MemoryPeaks, GpuMemoryPeak, processes.Poller]:
    memory, gpu = MemoryPeaks(pids), GpuMemoryPeak(bench.args.device == "cuda")
    return memory, gpu, processes.Poller([memory.poll, gpu.poll], period_s=1.0)


def memory_result(memory: MemoryPeaks, gpu: GpuMemoryPeak, pids: Sequence[int]) -> dict[str, Any]:
    per_process = [memory_json(memory.groups[pid]) for pid in pids]
    return {
        "peak_rss_mib_per_process": [item["peak_rss_mib"] for item in per_process],
        "peak_rss_mib_max": max(item["peak_rss_mib"] for item in per_process),
        "memory_per_process": per_process,
        "gpu_memory_used_peak_mib": gpu.peak_mib,
    }


def measure_plain(bench: Bench) -> dict[str, Any]:
    args = bench.args
    say(f"plain torch loop ({bench.precision}): {args.warmup_s:g} s warm-up, then {args.window_s:g} s")
    with open(bench.root / "plain.log", "wb") as log:
        worker = bench.groups.start(
            bench.worker_command("--plain-worker"), stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
    reader = processes.LineReader(worker.stdout)  # type: ignore[arg-type]
    memory, gpu, poller = measuring_memory(bench, [worker.pid])
    with poller:
        timeout_s = TRAINING_TIMEOUT_S + args.warmup_s + args.window_s + REPORT_MARGIN_S
        result = json.loads(reader.next_line(timeout_s, "the plain torch loop's result"))
    bench.groups.kill(worker)
    return {**result, "memory": memory_result(memory, gpu, [worker.pid])}


def measure_hivemind(bench: Bench, num_peers: int) -> dict[str, Any]:
    args = bench.args
    say(f"hivemind: {num_peers} hivemind.Optimizer workers, one process each")
    workers: list[tuple[subprocess.Popen, processes.LineReader]] = []
    initial_peer = "-"
    for index in range(num_peers):
        command = bench.worker_command("--hivemind-worker", "--index", str(index), "--initial-peer", initial_peer)
        with open(bench.root / f"hivemind-{num_peers}peers-{index}.log", "wb") as log:
            process = bench.groups.start(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        reader = processes.LineReader(process.stdout)  # type: ignore[arg-type]
        workers.append((process, reader))
        started = json.loads(reader.next_line(START_TIMEOUT_S, f"hivemind worker {index} to start its DHT"))
        if index == 0:  # the first one's DHT is the others' initial peer
            initial_peer = next(m for m in started["maddrs"] if m.startswith("/ip4/127.0.0.1/"))
    pids = [process.pid for process, _ in workers]
    memory, gpu, poller = measuring_memory(bench, pids)
    with poller:
        for index, (_, reader) in enumerate(workers):
            reader.next_line(TRAINING_TIMEOUT_S, f"hivemind worker {index} to train")
        start = time.time() + args.warmup_s
        say(f"hivemind: every worker trains; {args.warmup_s:g} s warm-up, then measuring {args.window_s:g} s")
        for process, _ in workers:
            process.stdin.write(f"{start} {start + args.window_s}\n")  # type: ignore[union-attr]
            process.stdin.flush()  # type: ignore[union-attr]
        timeout_s = args.warmup_s + args.window_s + REPORT_MARGIN_S
        results = [
            json.loads(reader.next_line(timeout_s, f"hivemind worker {i}")) for i, (_, reader) in enumerate(workers)
        ]
    for process, _ in workers:
        bench.groups.kill(process)
    progress = results[0].pop("progress")
    for result in results[1:]:
        result.pop("progress")
    computed = sum(result["samples_per_second"] for result in results)
    from_progress = progress_rate(
        [(t, {"run": {"epoch": 0, "target_batch_size": 1, "samples_accumulated": p}}) for t, p in progress]
    )
    return {
        "samples_per_second": computed if from_progress is None else from_progress,
        "samples_per_second_computed": computed,
        "num_global_steps_in_window": max(r["epochs"][1] for r in results) - min(r["epochs"][0] for r in results),
        "per_worker": results,
        "memory": memory_result(memory, gpu, pids),
    }


def measure_crowdtrain(bench: Bench, num_peers: int) -> dict[str, Any]:
    args = bench.args
    say(f"crowdtrain: {num_peers} daemons, one process each")
    env = processes.child_env(
        CROWDTRAIN_DEVICE=args.device,
        CROWDTRAIN_MICRO_BATCH_SIZE=str(args.micro_batch),
        CROWDTRAIN_NUM_THREADS=str(args.threads),
        CROWDTRAIN_STATUS_INTERVAL_S=f"{STATUS_INTERVAL_S:g}",
        CROWDTRAIN_VERBOSE=str(args.daemon_verbose),
        CROWDTRAIN_ROLE=args.daemon_role,
    )
    root = bench.root / f"crowdtrain-{num_peers}peers"
    nodes = start_swarm(bench.groups, root, num_peers, ["--run-file", str(bench.run_file)], env)
    peer_ids = [node.node_info["peer_id"] for node in nodes]
    watcher = StatusWatcher(bench.groups, nodes[0].address, STATUS_INTERVAL_S, root / "status.log")
    pids = [node.process.pid for node in nodes]
    memory, gpu, poller = measuring_memory(bench, pids)
    with poller:
        settled = SwarmSettled(nodes, watcher, peer_ids, lambda line: say(f"crowdtrain: {line}"))
        processes.await_condition(settled, TRAINING_TIMEOUT_S, "every daemon to probe and every trainer to train")
        say(f"crowdtrain: the swarm trains; {args.warmup_s:g} s warm-up, then measuring {args.window_s:g} s")
        time.sleep(args.warmup_s)  # a warm-up interval, not a synchronisation: the other arms get the same
        started = time.monotonic()
        while (left_s := started + args.window_s - time.monotonic()) > 0:  # fail if a node dies
            for node in nodes:
                node.check_alive()
            time.sleep(min(POLL_S, left_s))
        snapshots = watcher.between(started, time.monotonic())
    for process in [watcher.process, *(node.process for node in nodes)]:
        bench.groups.kill(process)
    return {**swarm_result(snapshots, peer_ids), "memory": memory_result(memory, gpu, pids)}


def swarm_result(snapshots: list[tuple[float, dict[str, Any]]], peer_ids: list[str]) -> dict[str, Any]:
    """The window's samples/s from the progress slope, and what the status records say about its rounds and plan."""
    complete = [(t, s) for t, s in snapshots if {p["peer_id"] for p in s["peers"]} >= set(peer_ids)]
    if not complete:
        raise processes.HarnessError("no status snapshot of the measured window listed every daemon")
    first, last = complete[0][1], complete[-1][1]

    def per_peer(snapshot: dict[str, Any], key: str) -> dict[str, Any]:
        return {peer["peer_id"]: peer.get(key) for peer in snapshot["peers"] if peer["peer_id"] in peer_ids}

    solo_first, solo_last = per_peer(first, "local_steps"), per_peer(last, "local_steps")
    agreement = [plan_agreement(snapshot, peer_ids) for _, snapshot in complete]
    progress = [[t - snapshots[0][0], s["run"]["epoch"], s["run"]["samples_accumulated"]] for t, s in snapshots]
    result = {
        "samples_per_second": progress_rate(snapshots),
        "progress": progress,  # the slope's points: (seconds into the window, epoch, samples accumulated)
        "num_status_samples": len(snapshots),
        "num_global_steps_in_window": last["run"]["epoch"] - first["run"]["epoch"],
        "partial_averages_in_window": last["run"]["partial_averages"] - first["run"]["partial_averages"],
        "partial_averages_at_end": per_peer(last, "partial_averages"),
        "solo_steps_in_window": sum((solo_last[p] or 0) - (solo_first[p] or 0) for p in peer_ids),
        "solo_steps_at_end": solo_last,
        "plan_agrees_fraction": sum(item["agrees"] for item in agreement) / len(agreement),
        "plan_at_end": agreement[-1],
        "loss_at_end": per_peer(last, "loss"),
        "samples_per_second_reported_at_end": last["run"]["samples_per_second"],
    }
    for key in ("phase_times_s", "plan_digest"):  # fields other engineers are adding to status
        values = per_peer(last, key)
        result[f"{key}_at_end"] = values if any(value is not None for value in values.values()) else None
    return result


def plan_agreement(snapshot: dict[str, Any], peer_ids: list[str]) -> dict[str, Any]:
    """Whether the peers' published plan is one plan: shares sum to 1, aggregators are those with a share, and
    every peer publishes the same plan digest (when status has one)."""
    peers = [peer for peer in snapshot["peers"] if peer["peer_id"] in peer_ids]
    shares = {peer["peer_id"]: peer["aggregation_share"] for peer in peers}
    roles = {peer["peer_id"]: peer["roles"] for peer in peers}
    share_sum = sum(shares.values())
    roles_match = all(("aggregator" in roles[p]) == (shares[p] > 0) for p in shares)
    digests = {peer.get("plan_digest") for peer in peers}
    digests_match = None if digests == {None} else len(digests) == 1
    agrees = abs(share_sum - 1.0) <= SHARE_SUM_TOLERANCE and roles_match and digests_match is not False
    return {"agrees": agrees, "share_sum": share_sum, "shares": shares, "roles": roles,
            "roles_match_shares": roles_match, "plan_digests_match": digests_match,
            "status_plans_agree": snapshot["run"].get("plans_agree")}  # fmt: skip


# --- The benchmark ----------------------------------------------------------------------------------------------


def run_arms(bench: Bench, results: dict[str, Any], save: Callable[[], None]) -> None:
    """The plain loop, then hivemind and crowdtrain at each peer count; a failed arm is recorded, the next runs."""
    arms: list[tuple[str, int, Callable[[], dict[str, Any]]]] = [("plain", 1, lambda: measure_plain(bench))]
    for num_peers in bench.args.peers:
        arms.append(("hivemind", num_peers, lambda n=num_peers: measure_hivemind(bench, n)))
        arms.append(("crowdtrain", num_peers, lambda n=num_peers: measure_crowdtrain(bench, n)))
    for name, num_peers, measure in arms:
        if name not in bench.args.arms:
            continue
        began = time.monotonic()
        try:
            result = measure()
        except Exception as e:  # the other arms' numbers are still worth having
            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}", "samples_per_second": None}
        finally:
            bench.groups.kill_all()
        result["arm_seconds"] = time.monotonic() - began  # start-up included
        if name == "plain":
            results["plain"] = result
        else:
            results[name][str(num_peers)] = result
        save()


def add_ratios(results: dict[str, Any]) -> None:
    plain = results["plain"].get("samples_per_second")
    results["plain"]["ratio_to_plain"] = 1.0 if plain else None
    for num_peers, crowdtrain in results["crowdtrain"].items():
        hivemind = results["hivemind"].get(num_peers, {}).get("samples_per_second")
        crowdtrain["speedup_vs_hivemind"] = _ratio(crowdtrain.get("samples_per_second"), hivemind)
        crowdtrain["ratio_to_plain"] = _ratio(crowdtrain.get("samples_per_second"), plain)
    for hivemind in results["hivemind"].values():
        hivemind["ratio_to_plain"] = _ratio(hivemind.get("samples_per_second"), plain)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not denominator > 0 or not math.isfinite(numerator):
        return None
    return numerator / denominator


def print_results(results: dict[str, Any]) -> None:
    settings = results["settings"]
    rows: list[list[Any]] = []
    arms = [("plain torch loop", "1", results["plain"])]
    arms += [(f"{name}", n, result) for name in ("hivemind", "crowdtrain") for n, result in results[name].items()]
    for name, num_peers, result in arms:
        memory = result.get("memory", {})
        plan = result.get("plan_agrees_fraction")
        rows.append([name, num_peers, result.get("samples_per_second"), result.get("speedup_vs_hivemind"),
                     result.get("ratio_to_plain"),
                     result.get("num_global_steps_in_window"), result.get("partial_averages_in_window"),
                     result.get("solo_steps_in_window"), None if plan is None else f"{plan:.0%}",
                     memory.get("peak_rss_mib_max"), memory.get("gpu_memory_used_peak_mib"),
                     "FAILED" if "error" in result else "ok"])  # fmt: skip
    print_table(
        f"{settings['model']} ({settings['num_parameters'] / 1e6:.1f}M parameters) on {settings['device']}, "
        f"{settings['precision']}: sequence {settings['sequence_length']}, micro-batch {settings['micro_batch']}, "
        f"target batch {settings['target_batch']}, matchmaking {settings['matchmaking_time_s']:g} s, "
        f"{settings['window_s']:g} s windows",
        ["arm", "peers", "samples/s", "× hivemind", "× plain", "global steps", "partial avgs", "solo steps",
         "plan agrees", "peak RSS MiB", "GPU MiB", "result"],
        rows,
    )  # fmt: skip
    for name, num_peers, result in arms:
        if "error" in result:
            print(f"{name}, {num_peers} peer(s), failed: {result['error']}")
    cuda_memory = results["plain"].get("cuda_max_memory_allocated_mib")
    if cuda_memory is not None:
        print(f"plain loop: torch.cuda.max_memory_allocated = {cuda_memory:.0f} MiB")


def plot(results: dict[str, Any], path: Path) -> bool:
    """Grouped bars per peer count, the plain loop as a line; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axes = plt.subplots(figsize=(7, 4.5))
    counts = [str(n) for n in results["settings"]["peers"]]
    positions = range(len(counts))
    heights = []
    for offset, name, color in ((-0.2, "hivemind", "C1"), (0.2, "crowdtrain", "C0")):
        values = [results[name].get(n, {}).get("samples_per_second") or 0.0 for n in counts]
        bars = axes.bar([p + offset for p in positions], values, width=0.4, label=name, color=color)
        heights += values
    speedups = [results["crowdtrain"].get(n, {}).get("speedup_vs_hivemind") for n in counts]
    axes.bar_label(bars, labels=["" if s is None else f"×{s:.2f}" for s in speedups])  # crowdtrain / hivemind
    plain = results["plain"].get("samples_per_second")
    if plain:
        axes.axhline(plain, color="grey", linestyle="--", label="plain torch loop")
    axes.set_ylim(top=1.25 * max([*heights, plain or 0.0, 1e-9]))  # room for the legend above the bars
    settings = results["settings"]
    axes.set_xticks(list(positions), counts)
    axes.set(xlabel="peers (processes on one machine)", ylabel="swarm samples/s",
             title=f"{settings['model']} on {settings['device']} ({settings['precision']})")  # fmt: skip
    axes.legend(loc="upper center", ncol=3)
    return save_figure(plt, figure, path)


def prepare(args: argparse.Namespace, groups: processes.ProcessGroups, root: Path) -> tuple[Bench, dict[str, Any]]:
    """The run file, the data cache and the settings every arm shares."""
    manifest = bench_manifest(args)
    run_file = root / "realmodel.toml"
    write_run_file(manifest, run_file)
    tokenizer = load_tokenizer(manifest.model)
    load_token_stream(manifest.data, tokenizer, root / "data-cache")  # tokenise once, not per worker
    precision = resolve_precision(args.precision or manifest.model.precision, args.device)
    bench = Bench(args=args, groups=groups, root=root, run_file=run_file, manifest=manifest, precision=precision)
    settings = {
        "model": args.model,
        "num_parameters": count_parameters(initial_model(manifest)),
        "device": args.device,
        "precision": precision,
        "crowdtrain_precision_setting": manifest.model.precision,
        "sequence_length": args.sequence_length,
        "micro_batch": args.micro_batch,
        "target_batch": args.target_batch,
        "matchmaking_time_s": manifest.averaging.matchmaking_time_s,
        "torch_threads_per_process": args.threads,
        "peers": args.peers,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "run_file": run_file.read_text(),
    }
    return bench, settings


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every arm trains (cpu)")
    parser.add_argument("--model", help="a run preset (default llama-85m)")
    parser.add_argument("--peers", type=int, nargs="+", help="peer counts (default cpu: 1 2; cuda: 1 2 4)")
    parser.add_argument("--sequence-length", type=int, help="tokens per sample (default cpu 32, cuda 512)")
    parser.add_argument("--micro-batch", type=int, help="samples per forward/backward (default cpu 2, cuda 16)")
    parser.add_argument("--target-batch", type=int, help="samples per global step (default cpu 32, cuda 512)")
    parser.add_argument("--threads", type=int, help="torch threads per process, 0: torch's default (cpu 1, cuda 0)")
    parser.add_argument("--window-s", type=float, help="measured seconds per arm (default cpu 120, cuda 90)")
    parser.add_argument("--warmup-s", type=float, help="seconds of training before each window (default 30)")
    parser.add_argument(
        "--arms", nargs="+", choices=ARMS, default=list(ARMS), help="the arms to run (default: all; ratios need all)"
    )
    parser.add_argument(
        "--daemon-verbose", type=int, default=0, choices=(0, 1, 2), help="the daemons' -v count (2: debug logs)"
    )
    parser.add_argument("--matchmaking-s", type=float, help="matchmaking time of both swarms (default: the preset's)")
    parser.add_argument(
        "--daemon-role", choices=ROLES, default=AUTO, help="every daemon's --role (default auto: measurement decides)"
    )
    parser.add_argument(
        "--precision", choices=("auto", "fp32", "bf16", "fp16"), help="the loops' precision (default: crowdtrain's)"
    )
    for hidden in ("--plain-worker", "--hivemind-worker"):
        parser.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--run-file", "--initial-peer"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.model not in PRESETS and not (args.plain_worker or args.hivemind_worker):  # workers read the run file
        parser.error(f"--model {args.model} is not a run preset; presets: {', '.join(PRESETS)}")
    if min(args.peers) < 1 or args.micro_batch < 1 or args.target_batch < 1 or args.window_s <= 0:
        parser.error("--peers, --micro-batch, --target-batch and --window-s must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plain_worker or args.hivemind_worker:
        threading.Thread(target=processes.exit_when_orphaned, daemon=True).start()
        (run_plain_worker if args.plain_worker else run_hivemind_worker)(args)
        return 0
    torch.set_num_threads(1)  # this process only coordinates
    signal.signal(signal.SIGTERM, processes.raise_keyboard_interrupt)
    print(NOISE_CAVEAT, flush=True)
    results: dict[str, Any] = {"caveat": NOISE_CAVEAT, "environment": environment_json(False)}
    results.update({"plain": {}, "hivemind": {}, "crowdtrain": {}})
    json_path = args.out / "realmodel.json"

    def measure(groups: processes.ProcessGroups, root: Path) -> None:
        bench, results["settings"] = prepare(args, groups, root)
        run_arms(bench, results, lambda: write_json(json_path, results))

    try:
        with_children("crowdtrain-bench-realmodel-", args.out / "logs" / "realmodel", measure)
    except KeyboardInterrupt:
        print("interrupted; every child process was killed", file=sys.stderr)
        return 130
    except Exception as e:  # the JSON records the failure, so bench_all reports it
        results["error"] = f"{type(e).__name__}: {e}"
        write_json(json_path, results)
        raise
    results["environment"]["load_average_at_end"] = os.getloadavg()
    add_ratios(results)
    arms = [results["plain"], *results["hivemind"].values(), *results["crowdtrain"].values()]
    results["failed_arms"] = sum("error" in arm for arm in arms)
    write_json(json_path, results)
    print_results(results)
    png = args.out / "realmodel.png"
    say_written(json_path, png, plot(results, png))
    print(NOISE_CAVEAT)
    return 1 if results["failed_arms"] else 0


if __name__ == "__main__":
    sys.exit(main())
