"""Benchmark crowdtrain's training: convergence against one process, throughput, and memory per node.

Runs one after another, printing a table for each:
1. convergence  3 daemons train a tiny LLaMA; from the founder's first checkpoint after all of them train
                together, E more global steps are scored on held-out windows against a plain in-process torch
                loop with the same global batch resumed from that checkpoint (and one from the initial weights)
2. throughput   N standalone torch loops (one thread each) against N daemons of the demo preset
3. memory       each daemon's peak RSS summed over its session (p2pd, DHT, averagers), during (2)
Writes <out>/training.json, <out>/convergence.png when matplotlib is installed (`pip install -e '.[bench]'`), and
the daemons' logs to <out>/logs/.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib as bench
import torch
from lab import processes
from lab.fixtures import tiny_run_file
from lab.swarm import START_TIMEOUT_S, Daemon, StatusWatcher, start_swarm

from crowdtrain.data import WindowSampler, load_token_stream, peer_seed_from_peer_id
from crowdtrain.manifest import RunManifest, demo, load_run_file
from crowdtrain.models import build_model, load_tokenizer, model_kind, training_loss
from crowdtrain.models.build import ModelKind
from crowdtrain.optimizer import learning_rate_factor
from crowdtrain.training.checkpoint import Checkpoint, list_checkpoints, load_checkpoint
from crowdtrain.training.loop import run_seed

MICRO_BATCH_SIZE = 8
EVAL_BATCH_SIZE, NUM_EVAL_BATCHES = 8, 8
NUM_CONVERGENCE_NODES = 3
EPOCH_TIMEOUT_S = 300.0
"""The longest the tiny swarm may go without a new global step."""
TRAINING_TIMEOUT_S = 300.0
"""For every demo daemon to report a nonzero samples/s."""
SWARM_STATUS_INTERVAL_S = 2.0
"""Heartbeat period of the demo daemons and of the status reader: fresh progress, little overhead."""
WARMUP_S = 10.0
"""Standalone workers train this long before their measured interval starts."""
THROUGHPUT_TARGET_RATIO = 0.8
MEMORY_TARGET_MIB = 1000.0


class CheckpointClock:
    """When each of a node's checkpoints appeared (file mtimes), remembered after old ones are pruned."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.times: dict[int, float] = {}
        """Epoch -> unix seconds its checkpoint was written."""

    def poll(self) -> None:
        for path in list_checkpoints(self.directory):
            epoch = int(path.stem.split("-")[1])
            if epoch not in self.times:
                try:
                    self.times[epoch] = path.stat().st_mtime
                except OSError:
                    pass  # pruned between listing and stat


# --- Plain torch training, the reference ---------------------------------------------------------------------


def load_sampler(manifest: RunManifest, cache_dir: Path, peer_name: str) -> WindowSampler:
    tokenizer = load_tokenizer(manifest.model)
    tokens = load_token_stream(manifest.data, tokenizer, cache_dir)
    return WindowSampler(tokens, manifest.data.sequence_length, peer_seed_from_peer_id(peer_name))


def initial_model(manifest: RunManifest) -> torch.nn.Module:
    """The weights every peer of the run starts from."""
    return build_model(manifest.model, load_tokenizer(manifest.model).vocab_size, seed=run_seed(manifest))


class LocalTrainer:
    """Plain torch: AdamW and the run's schedule, gradients accumulated over the global batch in micro-batches.

    From the run's initial weights, or from a swarm checkpoint: its weights, AdamW moments and global step.
    """

    def __init__(self, manifest: RunManifest, sampler: WindowSampler, start: Checkpoint | None = None) -> None:
        self.sampler, self.kind = sampler, model_kind(manifest.model)
        self.model = initial_model(manifest)
        spec = manifest.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.learning_rate, weight_decay=spec.weight_decay
        )
        self.step = self.micro_step = 0
        if start is not None:
            self.model.load_state_dict(start.model_state)
            state = copy.deepcopy(start.optimizer_state)
            state["state"].pop("local_epoch", None)  # hivemind.Optimizer's addition to torch's state dict
            self.optimizer.load_state_dict(state)
            self.step = start.epoch
        factor = functools.partial(learning_rate_factor, spec=spec)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor, last_epoch=self.step - 1)
        self.num_micro_batches = math.ceil(manifest.target_batch_size / MICRO_BATCH_SIZE)
        self.generator = torch.Generator().manual_seed(0)

    def train_micro_batch(self) -> None:
        """One forward/backward of MICRO_BATCH_SIZE samples; an optimizer step once the global batch is full."""
        batch = self.sampler.batch(self.step, MICRO_BATCH_SIZE, self.micro_step)
        loss = training_loss(self.model, batch, self.kind, generator=self.generator)
        (loss / self.num_micro_batches).backward()  # the mean gradient over the global batch, as the swarm's
        self.micro_step += 1
        if self.micro_step == self.num_micro_batches:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.step, self.micro_step = self.step + 1, 0


def mean_eval_loss(model: torch.nn.Module, batches: list[torch.Tensor], kind: ModelKind) -> float:
    """The mean loss over `batches`, without gradients, in eval mode."""
    model.eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        losses = [training_loss(model, batch, kind, generator=generator).item() for batch in batches]
    model.train()
    return sum(losses) / len(losses)


def run_standalone_worker(cache_dir: Path) -> None:
    """Hidden mode: train the demo model until the measured window the parent sends on stdin has passed.

    Protocol: print `ready` after the first micro-batch; read `<start> <end>` (unix seconds); print one
    JSON line with the samples of the micro-batches that ran entirely inside the window.
    """
    torch.set_num_threads(1)
    manifest = demo()
    trainer = LocalTrainer(manifest, load_sampler(manifest, cache_dir, f"standalone-{os.getpid()}"))
    trainer.train_micro_batch()
    print("ready", flush=True)
    window: list[float] = []
    parent_gone = threading.Event()

    def read_window() -> None:
        line = sys.stdin.readline()
        if line:
            window.extend(tuple(map(float, line.split())))  # both at once: the trainer reads it unlocked
        else:
            parent_gone.set()

    threading.Thread(target=read_window, daemon=True).start()
    num_samples, first_began, last_ended, cpu_began, cpu_ended = 0, math.inf, 0.0, 0.0, 0.0
    while not parent_gone.is_set():
        began, cpu = time.time(), time.process_time()
        trainer.train_micro_batch()
        ended = time.time()
        if len(window) == 2 and ended > window[1]:
            break
        if len(window) == 2 and began >= window[0]:
            if num_samples == 0:
                first_began, cpu_began = began, cpu
            num_samples, last_ended, cpu_ended = num_samples + MICRO_BATCH_SIZE, ended, time.process_time()
    if parent_gone.is_set():
        raise SystemExit("the benchmark that started this worker is gone")
    seconds = max(last_ended - first_began, 1e-9)
    result = {"samples": num_samples, "seconds": seconds, "samples_per_second": num_samples / seconds}
    print(json.dumps({**result, "cpu_cores": (cpu_ended - cpu_began) / seconds}))


# --- 1. Convergence ---------------------------------------------------------------------------------------------


def bench_convergence(
    groups: processes.ProcessGroups, root: Path, num_steps: int, target_batch_size: int
) -> dict[str, Any]:
    run_file = root / "tiny.toml"
    run_file.write_text(tiny_run_file("bench-tiny", target_batch_size))
    run = run_tiny_swarm(groups, root, run_file, num_steps)
    bench.say("convergence: scoring the founder's checkpoints, then training the single-process references")
    # The seed hashes created_at, which the founder stamps when it publishes the run.
    manifest = dataclasses.replace(load_run_file(str(run_file)), created_at=run.created_at)
    sampler = load_sampler(manifest, root / "data-cache", "bench-single-process")
    eval_batches = sampler.eval_batches(EVAL_BATCH_SIZE, NUM_EVAL_BATCHES)
    swarm = score_checkpoints(manifest, run.clock.directory, run.final_epoch, eval_batches)
    start = load_checkpoint(run.clock.directory / f"epoch-{run.start_epoch:08d}.pt", initial_model(manifest))
    single = train_reference(manifest, sampler, eval_batches, run.final_epoch, start)
    from_initial = train_reference(manifest, sampler, eval_batches, run.final_epoch, None)
    swarm_final = swarm["eval_loss"][swarm["steps"].index(run.final_epoch)]
    seconds_to_epoch = {epoch: written - run.started for epoch, written in sorted(run.clock.times.items())}
    # A founder that falls behind (e.g. stuck in an averaging round until its timeout) downloads the others'
    # state and jumps to their epoch, leaving no checkpoint of the epochs in between.
    skipped = [epoch for epoch in range(run.start_epoch, run.final_epoch) if epoch not in run.clock.times]
    return {
        "num_nodes": NUM_CONVERGENCE_NODES,
        "num_steps": run.final_epoch - run.start_epoch,
        "start_epoch": run.start_epoch,
        "final_epoch": run.final_epoch,
        "target_batch_size": target_batch_size,
        "micro_batch_size": MICRO_BATCH_SIZE,
        "eval_windows": EVAL_BATCH_SIZE * NUM_EVAL_BATCHES,
        "run_file": run_file.read_text(),
        "created_at": manifest.created_at,
        "seed": run_seed(manifest),
        "peer_epochs_at_end": run.peer_epochs_at_end,
        "epochs_the_founder_skipped": skipped,
        "swarm": {**swarm, "seconds_to_epoch": seconds_to_epoch},
        "single_process": single,
        "single_process_from_initial_weights": from_initial,
        "final_loss_ratio": swarm_final / single["eval_loss"][-1],
        "final_loss_ratio_vs_reference_from_initial_weights": swarm_final / from_initial["eval_loss"][-1],
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class TinySwarmRun:
    """What the tiny swarm left behind: the founder's checkpoints and the epochs to compare."""

    clock: CheckpointClock
    created_at: float
    """The run's created_at as published by the founder (unix seconds)."""
    started: float
    """Unix seconds when the first daemon was started."""
    start_epoch: int
    """The first checkpoint after which every daemon computed every global step."""
    final_epoch: int
    peer_epochs_at_end: dict[str, int]


def run_tiny_swarm(groups: processes.ProcessGroups, root: Path, run_file: Path, num_steps: int) -> TinySwarmRun:
    """Train the tiny run with 3 daemons until `num_steps` global steps after all of them train together."""
    env = processes.child_env(
        CROWDTRAIN_MICRO_BATCH_SIZE=str(MICRO_BATCH_SIZE),
        CROWDTRAIN_NUM_THREADS="1",
        CROWDTRAIN_CHECKPOINT_KEEP="1000000",
        CROWDTRAIN_CHECKPOINT_INTERVAL_S="0.001",  # every epoch: the convergence arm scores each global step
        CROWDTRAIN_STATUS_INTERVAL_S="1",
    )
    bench.say(f"convergence: starting {NUM_CONVERGENCE_NODES} daemons on {run_file.name}")
    started = time.time()
    nodes = start_swarm(groups, root / "convergence", NUM_CONVERGENCE_NODES, ["--run-file", str(run_file)], env)
    peer_ids = [node.node_info["peer_id"] for node in nodes]
    watcher = StatusWatcher(groups, nodes[0].address, 2.0, root / "status-convergence.log")
    # The founder trains alone while the joiners start, for many of the tiny run's short epochs on a busy
    # machine: compare from the first epoch all of them computed together.
    together = processes.await_condition(
        lambda: _training_together(nodes, watcher, peer_ids), TRAINING_TIMEOUT_S, "all daemons at the same epoch"
    )
    bench.say(f"convergence: all daemons train at epoch {together['run']['epoch']}; {num_steps} global steps to go")
    clock = CheckpointClock(nodes[0].state_dir / "checkpoints" / together["run"]["run_id"])
    start_epoch, final_epoch = await_founder_epochs(nodes, clock, together["run"]["epoch"] + 1, num_steps, started)
    peer_epochs_at_end = {peer["peer_id"]: peer["epoch"] for peer in (watcher.latest() or {}).get("peers", [])}
    groups.kill_all()
    return TinySwarmRun(
        clock=clock,
        created_at=float(together["run"]["created_at"]),
        started=started,
        start_epoch=start_epoch,
        final_epoch=final_epoch,
        peer_epochs_at_end=peer_epochs_at_end,
    )


def _training_together(nodes: list[Daemon], watcher: StatusWatcher, peer_ids: list[str]) -> dict[str, Any] | None:
    """The status snapshot in which every daemon trains (samples/s > 0) at one and the same epoch, if any."""
    for node in nodes:
        node.check_alive()
    snapshot = watcher.latest()
    peers = {peer["peer_id"]: peer for peer in (snapshot or {}).get("peers", [])}
    if snapshot is None or snapshot["run"].get("created_at") is None or not set(peer_ids) <= peers.keys():
        return None
    training = all(peers[peer_id]["samples_per_second"] > 0 for peer_id in peer_ids)
    return snapshot if training and len({peers[peer_id]["epoch"] for peer_id in peer_ids}) == 1 else None


def await_founder_epochs(
    nodes: list[Daemon], clock: CheckpointClock, first_epoch: int, num_steps: int, started: float
) -> tuple[int, int]:
    """Wait, at most EPOCH_TIMEOUT_S per global step, until the founder checkpointed `num_steps` epochs past
    `first_epoch`; returns the (start, final) checkpoints to compare: exact unless the founder skipped one."""
    reached = 0
    while reached < first_epoch + num_steps:

        def newer_epoch(since: int = reached) -> int | None:
            for node in nodes:
                node.check_alive()
            clock.poll()
            latest = max(clock.times, default=0)
            return latest if latest > since else None

        reached = processes.await_condition(
            newer_epoch, EPOCH_TIMEOUT_S, f"global epoch {reached + 1} of the tiny swarm"
        )
        bench.say(f"convergence: founder at epoch {reached} after {clock.times[reached] - started:.0f} s")
    start = min(epoch for epoch in clock.times if epoch >= first_epoch)
    return start, min(epoch for epoch in clock.times if epoch >= start + num_steps)


def score_checkpoints(
    manifest: RunManifest, directory: Path, final_epoch: int, eval_batches: list[torch.Tensor]
) -> dict[str, Any]:
    """Held-out loss of the initial weights and of every founder checkpoint up to `final_epoch`."""
    model, kind = initial_model(manifest), model_kind(manifest.model)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    steps, losses = [0], [mean_eval_loss(model, eval_batches, kind)]
    checkpoints = [load_checkpoint(path, model) for path in list_checkpoints(directory)]
    checkpoints = [checkpoint for checkpoint in checkpoints if checkpoint.epoch <= final_epoch]
    if not checkpoints:
        raise processes.HarnessError(f"the founder left no checkpoint in {directory}")
    for checkpoint in checkpoints:
        model.load_state_dict(checkpoint.model_state)
        steps.append(checkpoint.epoch)
        losses.append(mean_eval_loss(model, eval_batches, kind))
    # Adam moves a weight by at most about lr per step, so the first checkpoint lies that close to the
    # reference's initial weights only if both started from the same seed.
    first = checkpoints[0]
    first_distance = max((initial[name] - tensor).abs().max().item() for name, tensor in first.model_state.items())
    bound = 2 * first.epoch * manifest.optimizer.learning_rate
    same_start = {"max_abs_difference": first_distance, "bound": bound, "ok": first_distance <= bound}
    return {"steps": steps, "eval_loss": losses, "initial_weights_match_first_checkpoint": same_start}


def train_reference(
    manifest: RunManifest,
    sampler: WindowSampler,
    eval_batches: list[torch.Tensor],
    final_epoch: int,
    start: Checkpoint | None,
) -> dict[str, Any]:
    """Held-out loss after every step of a plain torch loop from `start` (or the initial weights) to `final_epoch`."""
    trainer = LocalTrainer(manifest, sampler, start)
    steps, losses = [trainer.step], [mean_eval_loss(trainer.model, eval_batches, trainer.kind)]
    started = time.monotonic()
    while trainer.step < final_epoch:
        trainer.train_micro_batch()
        if trainer.micro_step == 0:
            steps.append(trainer.step)
            losses.append(mean_eval_loss(trainer.model, eval_batches, trainer.kind))
    return {"steps": steps, "eval_loss": losses, "seconds": time.monotonic() - started}


def print_convergence(result: dict[str, Any]) -> None:
    swarm = dict(zip(result["swarm"]["steps"], result["swarm"]["eval_loss"], strict=True))
    single = dict(zip(result["single_process"]["steps"], result["single_process"]["eval_loss"], strict=True))
    reference = result["single_process_from_initial_weights"]
    from_initial = dict(zip(reference["steps"], reference["eval_loss"], strict=True))
    rows = [
        [step, swarm.get(step), single[step], swarm[step] / single[step] if step in swarm else None, from_initial[step]]
        for step in sorted(single)
    ]
    bench.print_table(
        f"Convergence: held-out loss, {result['num_nodes']} daemons vs one process (B={result['target_batch_size']})",
        ["global step", "swarm", "single process", "swarm / single", "single from step 0"],
        rows,
    )
    start = result["start_epoch"]
    print(
        f"Until epoch {start} the founder trained alone or with joiners still starting, so both runs above start\n"
        f"from the founder's checkpoint of epoch {start} (weights and AdamW state). The last column is the plain\n"
        f"loop from the run's initial weights (seed {result['seed']}), to compare the swarm's whole history with."
    )
    print(f"final_loss_ratio = swarm_final / single_final = {result['final_loss_ratio']:.4f}")
    print(
        "  against the plain loop from the initial weights: "
        f"{result['final_loss_ratio_vs_reference_from_initial_weights']:.4f}"
    )
    if result["epochs_the_founder_skipped"]:
        print(
            f"  the founder has no checkpoint of epochs {result['epochs_the_founder_skipped']}: it fell behind "
            "and downloaded the others' state"
        )
    check = result["swarm"]["initial_weights_match_first_checkpoint"]
    print(f"  the swarm started from the reference's initial weights: {'yes' if check['ok'] else 'NO'}")


@bench.plot_to_png(figsize=(7, 4.5))
def plot_convergence(result: dict[str, Any], axes: Any) -> None:
    """Draw the curves against the global step."""
    from matplotlib.ticker import MaxNLocator

    swarm, single = result["swarm"], result["single_process"]
    from_initial = result["single_process_from_initial_weights"]
    axes.plot(swarm["steps"], swarm["eval_loss"], marker="o", label=f"crowdtrain, {result['num_nodes']} daemons")
    axes.plot(single["steps"], single["eval_loss"], marker="s", linestyle="--", label="single process, from the swarm")
    axes.plot(from_initial["steps"], from_initial["eval_loss"], linestyle=":", label="single process, from step 0")
    start = result["start_epoch"]
    axes.axvline(start, color="grey", linewidth=0.8, label=f"all daemons train together from step {start}")
    axes.set(xlabel="global step", ylabel="held-out loss", title=f"B = {result['target_batch_size']} samples/step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend()


# --- 2 and 3. Throughput and memory ---------------------------------------------------------------------------


def bench_throughput(
    groups: processes.ProcessGroups, root: Path, num_processes: int, duration_s: float
) -> dict[str, Any]:
    cache_dir = root / "data-cache"
    load_token_stream(demo().data, load_tokenizer(demo().model), cache_dir)  # tokenise once, not per worker
    standalone = measure_standalone(groups, root, cache_dir, num_processes, duration_s)
    swarm = measure_swarm(groups, root / "throughput", num_processes, duration_s)
    ratio = swarm["samples_per_second"] / standalone["samples_per_second"]
    from_progress = swarm["samples_per_second_from_progress"]
    return {
        "num_processes": num_processes,
        "duration_s": duration_s,
        "micro_batch_size": MICRO_BATCH_SIZE,
        "torch_threads_per_process": 1,
        "standalone": standalone,
        "swarm": swarm,
        "throughput_ratio": ratio,
        "throughput_ratio_from_progress": (
            None if from_progress is None else from_progress / standalone["samples_per_second"]
        ),
        "target_ratio": THROUGHPUT_TARGET_RATIO,
    }


def measure_standalone(
    groups: processes.ProcessGroups,
    root: Path,
    cache_dir: Path,
    num_processes: int,
    duration_s: float,
    warmup_s: float = WARMUP_S,
) -> dict[str, Any]:
    bench.say(f"throughput: {num_processes} standalone torch loops, {warmup_s:g} s warm-up, then {duration_s:g} s")
    command = [sys.executable, str(Path(__file__).resolve()), "--standalone-worker", "--cache-dir", str(cache_dir)]
    workers, readers = [], []
    for index in range(num_processes):
        with open(root / f"standalone{index}.log", "wb") as log:
            worker = groups.start(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        workers.append(worker)
        readers.append(processes.LineReader(worker.stdout))  # type: ignore[arg-type]
    memory = bench.MemoryPeaks([worker.pid for worker in workers])
    with processes.Poller([memory.poll], period_s=1.0):
        for index, reader in enumerate(readers):
            reader.next_line(START_TIMEOUT_S, f"standalone worker {index} to start")
        start = time.time() + warmup_s
        for worker in workers:
            worker.stdin.write(f"{start} {start + duration_s}\n")  # type: ignore[union-attr]
            worker.stdin.flush()  # type: ignore[union-attr]
        timeout_s = warmup_s + duration_s + START_TIMEOUT_S
        results = [
            json.loads(reader.next_line(timeout_s, f"standalone worker {i}")) for i, reader in enumerate(readers)
        ]
    for worker in workers:
        groups.kill(worker)
    peak_rss = [memory.groups[worker.pid].peak_rss_bytes / bench.MIB for worker in workers]
    return {
        "warmup_s": warmup_s,
        "per_process": results,
        "samples_per_second": sum(result["samples_per_second"] for result in results),
        "peak_rss_mib_per_process": peak_rss,
    }


def measure_swarm(groups: processes.ProcessGroups, root: Path, num_nodes: int, duration_s: float) -> dict[str, Any]:
    env = processes.child_env(
        CROWDTRAIN_MICRO_BATCH_SIZE=str(MICRO_BATCH_SIZE),
        CROWDTRAIN_NUM_THREADS="1",
        CROWDTRAIN_STATUS_INTERVAL_S=f"{SWARM_STATUS_INTERVAL_S:g}",
    )
    bench.say(f"throughput: starting {num_nodes} daemons on the demo preset")
    nodes = start_swarm(groups, root, num_nodes, ["--run-file", "demo"], env)
    peer_ids = [node.node_info["peer_id"] for node in nodes]
    memory = bench.MemoryPeaks([node.process.pid for node in nodes])
    with processes.Poller([memory.poll], period_s=1.0):
        watcher = StatusWatcher(groups, nodes[0].address, SWARM_STATUS_INTERVAL_S, root / "status.log")
        processes.await_condition(
            lambda: _all_training(nodes, watcher, peer_ids), TRAINING_TIMEOUT_S, "every daemon to report samples/s"
        )
        bench.say(f"throughput: every daemon trains; measuring {duration_s:g} s")
        pgids = [process.pid for process in (watcher.process, *(node.process for node in nodes))]
        started, ended, cpu_before, cpu_after = bench.measured_window(nodes, duration_s, pgids)
        snapshots = watcher.between(started, ended)
    for process in [watcher.process, *(node.process for node in nodes)]:
        groups.kill(process)
    return {
        **bench.summarize_snapshots([snapshot for _, snapshot in snapshots], peer_ids),
        "samples_per_second_from_progress": bench.progress_rate(snapshots),
        "status_interval_s": SWARM_STATUS_INTERVAL_S,
        "cpu_per_node": [bench.cpu_use(cpu_before, cpu_after, pgid, ended - started) for pgid in pgids[1:]],
        "cpu_status_reader": bench.cpu_use(cpu_before, cpu_after, pgids[0], ended - started)["cores"],
        "memory_per_node": [bench.memory_json(memory.groups[node.process.pid]) for node in nodes],
    }


def _all_training(nodes: list[Daemon], watcher: StatusWatcher, peer_ids: list[str]) -> bool:
    for node in nodes:
        node.check_alive()
    snapshot = watcher.latest()
    peers = {peer["peer_id"]: peer for peer in (snapshot or {}).get("peers", [])}
    return all(
        peer_id in peers and peers[peer_id]["epoch"] >= 0 and peers[peer_id]["samples_per_second"] > 0
        for peer_id in peer_ids
    )


def print_throughput(result: dict[str, Any]) -> None:
    standalone, swarm = result["standalone"], result["swarm"]
    rows: list[list[Any]] = [
        [f"standalone {index}", item["samples_per_second"], item["cpu_cores"], None, None]
        for index, item in enumerate(standalone["per_process"])
    ]
    rows.append(["standalone sum", standalone["samples_per_second"], None, None, None])
    for (peer_id, rate), cpu in zip(swarm["samples_per_second_per_peer"].items(), swarm["cpu_per_node"], strict=True):
        rows.append(
            [f"daemon …{peer_id[-8:]}", rate, cpu["cores"], cpu["cores_daemon_process"], cpu["cores_other_processes"]]
        )
    rows.append([f"swarm sum (mean of {swarm['num_status_samples']} status samples)", swarm["samples_per_second"]])
    rows.append(["swarm, from its progress (epoch × B + accumulated)", swarm["samples_per_second_from_progress"]])
    rows.append(["status reader (measurement overhead)", None, swarm["cpu_status_reader"], None, None])
    bench.print_table(
        f"Throughput: {result['num_processes']} processes for {result['duration_s']:g} s (CPU in cores kept busy)",
        ["", "samples/s", "CPU", "CPU daemon process", "CPU p2pd, DHT, averagers"],
        [row + [None] * (5 - len(row)) for row in rows],
    )
    print(
        f"throughput_ratio = swarm / standalone_sum = {result['throughput_ratio']:.3f} "
        f"(target >= {THROUGHPUT_TARGET_RATIO}; a plain hivemind.Optimizer loop reached 0.34 on this machine)"
    )
    from_progress = result["throughput_ratio_from_progress"]
    if from_progress is not None:
        print(f"  the same from the swarm's progress instead of its peers' samples/s: {from_progress:.3f}")
    if swarm["num_global_steps_in_window"] == 0:
        print("  no global step (averaging round) fell in the measured interval: a longer --duration includes one")


def memory_summary(throughput: dict[str, Any]) -> dict[str, Any]:
    nodes = throughput["swarm"]["memory_per_node"]
    peak = max(node["peak_rss_mib"] for node in nodes)
    return {
        "per_node": nodes,
        "peak_rss_mib_max": peak,
        "target_mib": MEMORY_TARGET_MIB,
        "meets_target": peak <= MEMORY_TARGET_MIB,
        "standalone_peak_rss_mib_per_process": throughput["standalone"]["peak_rss_mib_per_process"],
    }


def print_memory(memory: dict[str, Any]) -> None:
    rows = [
        [f"node{index}", node["peak_rss_mib"], node["pss_at_peak_mib"], node["num_processes_at_peak"]]
        for index, node in enumerate(memory["per_node"])
    ]
    rows += [[f"standalone {i}", rss, None, 1] for i, rss in enumerate(memory["standalone_peak_rss_mib_per_process"])]
    bench.print_table(
        "Memory: peak RSS per daemon session (all its processes) during the throughput run",
        ["", "peak RSS MiB", "PSS at peak MiB", "processes"],
        rows,
    )
    verdict = "meets" if memory["meets_target"] else "MISSES"
    print(
        f"max peak RSS per node = {memory['peak_rss_mib_max']:.0f} MiB: {verdict} the target <= {MEMORY_TARGET_MIB:g}"
    )


# --- Output and the entry point ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench.bench_parser(__doc__, "a reduced run of a few minutes")
    parser.add_argument("--epochs", type=int, help="convergence: global steps E (default 12, quick 6)")
    parser.add_argument("--batch", type=int, help="convergence: target batch size B (default 1024, quick 512)")
    parser.add_argument("--processes", type=int, help="throughput: processes and daemons N (default 4, quick 3)")
    parser.add_argument("--duration", type=float, help="throughput: measured seconds T (default 60, quick 30)")
    parser.add_argument("--standalone-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.standalone_worker and args.cache_dir is None:
        parser.error("--standalone-worker needs --cache-dir")
    args.epochs = args.epochs or (6 if args.quick else 12)
    args.batch = args.batch or (512 if args.quick else 1024)
    args.processes = args.processes or (3 if args.quick else 4)
    args.duration = args.duration or (30.0 if args.quick else 60.0)
    return args


def run_phases(
    args: argparse.Namespace, groups: processes.ProcessGroups, root: Path, *, results: dict[str, Any]
) -> bool:
    """Each phase in turn, results saved after each; a failed phase is recorded and the next one still runs."""
    json_path = args.out / "training.json"
    ok = True
    phases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("convergence", lambda: bench_convergence(groups, root, args.epochs, args.batch)),
        ("throughput", lambda: bench_throughput(groups, root, args.processes, args.duration)),
    ]
    for name, run_phase in phases:
        try:
            results[name] = run_phase()
        except Exception as e:  # record the failure and go on: the other phase's numbers are still worth having
            bench.record_failure(results, name, e)
            ok = False
        finally:
            groups.kill_all()
        if name == "convergence" and "error" not in results[name]:
            print_convergence(results[name])
            png = args.out / "convergence.png"
            results[name]["plot"] = str(png) if plot_convergence(results[name], png) else None
            print(f"wrote {png}" if results[name]["plot"] else "convergence.png skipped: matplotlib is not installed")
        if name == "throughput" and "error" not in results[name]:
            print_throughput(results[name])
            results["memory"] = memory_summary(results[name])
            print_memory(results["memory"])
        results["environment"]["load_average_at_end"] = os.getloadavg()
        bench.write_json(json_path, results)
    print(f"wrote {json_path}\n{bench.NOISE_CAVEAT}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.standalone_worker:
        run_standalone_worker(args.cache_dir)
        return 0

    # One torch thread for the in-process reference: on two busy cores more threads only spin (25x slower).
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, processes.raise_keyboard_interrupt)
    print(bench.NOISE_CAVEAT, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"caveat": bench.NOISE_CAVEAT, "environment": bench.environment_json(args.quick)}
    try:
        ok = bench.with_children(
            "crowdtrain-bench-", args.out / "logs", functools.partial(run_phases, args, results=results)
        )
    except KeyboardInterrupt:
        print("interrupted; every child process was killed", file=sys.stderr)
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
