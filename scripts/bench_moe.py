"""Benchmark DMoE: expert calls served by crowdtrain against hivemind-server, and training as 25% of experts die.

On loopback, one part at a time:
1. serving   one demo-moe expert (crowdtrain.moe.experts.FeedForwardExpert) hosted (i) by a `crowdtrain run
             --role expert-host` daemon serving one expert, then (ii) by hivemind's own `hivemind-server` with
             the same class loaded through --custom_module_path (scripts/moe_hivemind_expert.py), one torch
             thread each. This process joins the server's DHT as a client, finds the expert with hivemind's
             get_experts, and times forward+backward of one batch through RemoteExpert: p50/p99 of sequential
             calls, and calls/s of several concurrent callers (threads).
2. training  demo-moe on 4 expert hosts, each serving a quarter of the grid, and 1 trainer: the trainer's
             samples/s with every expert live, then, after one host is SIGKILLed, with 25% of the experts gone.
             (--smoke: a tiny DMoE run on 2 hosts, so half the experts die.)
Prints tables; writes <out>/moe.json and <out>/moe.png.
"""

from __future__ import annotations

import argparse
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import benchlib as bench
import hivemind
import torch
from hivemind.moe import RemoteExpert, get_experts
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from lab.fixtures import TINY_MODEL_TOML
from lab.processes import (
    HarnessError,
    ProcessGroups,
    await_condition,
    child_env,
    log_tail,
    raise_keyboard_interrupt,
)
from lab.swarm import LOOPBACK, START_TIMEOUT_S, Daemon, StatusWatcher, start_daemon
from moe_hivemind_expert import EXPERT_CLASS

from crowdtrain.manifest import PRESETS, RunManifest, expert_uids, load_run_file
from crowdtrain.moe.experts import MAX_BATCH_SEQUENCES
from crowdtrain.moe.hosting import NUM_CONNECTION_HANDLERS

T = TypeVar("T")

SCRIPTS = Path(__file__).resolve().parent
PRESET = "demo-moe"
BATCH_SEQUENCES = 16
"""Sequences in the batch each expert call carries: [16, sequence_length, hidden]."""
SERVER_THREADS = "1"
"""torch threads of either server (CROWDTRAIN_NUM_THREADS, OMP_NUM_THREADS)."""
CALL_TIMEOUT_S = 60.0
"""A RemoteExpert call has no timeout of its own: one still running after this long fails the part."""
FIND_TIMEOUT_S = 60.0
NUM_KILLED_HOSTS = 1
MICRO_BATCH_SIZE = 8
STATUS_INTERVAL_S = 2.0
STATUS_TTL_S = 10.0
"""A killed host's status and expert announcements expire after this long."""
SWARM_TIMEOUT_S = 300.0
"""For the DMoE swarm to cover its grid and train, or to notice a killed host."""
SMOKE_RUN_FILE = (
    """
run_id = "bench-moe-smoke"
target_batch_size = 100000  # no global step inside the short windows
"""
    + TINY_MODEL_TOML
    + """
[moe]
grid = [2, 2]
expert_hidden_size = 64
k = 2
"""
)
"""Smoke mode only: a tiny DMoE run (2 layers of a 2x2 grid: 8 experts, 4 on each of 2 hosts) for a quick start."""

HIVEMIND_SERVER = """
import sys
import configargparse
from hivemind.hivemind_cli import run_server

# hivemind 1.1.12 declares --host_maddrs and --announce_maddrs with type=list, which splits an address into its
# characters, so the shipped CLI can only listen on its default /ip4/0.0.0.0/tcp/0. Read them as strings.
add_argument = configargparse.ArgumentParser.add_argument


def add_argument_reading_lists_as_strings(self, *names, **options):
    if options.get("type") is list:
        options["type"] = str
    return add_argument(self, *names, **options)


configargparse.ArgumentParser.add_argument = add_argument_reading_lists_as_strings
sys.argv[0] = "hivemind-server"
run_server.main()
"""
"""hivemind-server's own main(), with the one flag-parsing fix that lets it listen on loopback only."""

DIFFERENCES = (
    "optimizer: crowdtrain steps torch.optim.AdamW (lr 1e-3, weight decay 0.01, from the demo-moe manifest); "
    "hivemind-server --optimizer adam steps torch.optim.Adam (lr 1e-3, no weight decay): the same work per step, "
    "but for one multiply per parameter",
    "initial weights: crowdtrain derives them from the run and the uid; hivemind-server draws them at random "
    "(same shapes, same arithmetic)",
    "process: the crowdtrain daemon also heartbeats its status, re-checks placement every few seconds and "
    "checkpoints its expert every 60 s; hivemind-server (no --checkpoint_dir) only serves",
    "hivemind-server's --host_maddrs is declared with type=list in hivemind 1.1.12, which splits an address into "
    "characters; it runs as hivemind's own run_server.main() with that flag read as a string, so that it "
    "listens on loopback only; nothing else of the CLI is changed",
    f"same: expert uid, class and sample input [*, sequence_length, hidden], {NUM_CONNECTION_HANDLERS} connection "
    f"handlers, batches of at most {MAX_BATCH_SEQUENCES} sequences, 1 torch thread, CPU, no tensor compression",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizes:
    """How much each part measures in one mode."""

    num_warmup_calls: int
    num_sequential_calls: int
    num_callers: int
    """Concurrent callers (threads) of the throughput measurement."""
    concurrent_s: float
    """Seconds the concurrent callers call."""
    num_hosts: int
    """Expert hosts of the DMoE swarm, each serving 1 / num_hosts of the grid; one of them is killed."""
    warmup_s: float
    """Seconds of training before each measured window."""
    window_s: float
    """Seconds of each measured window of training."""


MODES = {
    "full": Sizes(
        num_warmup_calls=5,
        num_sequential_calls=200,
        num_callers=4,
        concurrent_s=30,
        num_hosts=4,
        warmup_s=20,
        window_s=120,
    ),
    "quick": Sizes(
        num_warmup_calls=3,
        num_sequential_calls=20,
        num_callers=4,
        concurrent_s=6,
        num_hosts=4,
        warmup_s=3,
        window_s=15,
    ),
    "smoke": Sizes(
        num_warmup_calls=1, num_sequential_calls=8, num_callers=2, concurrent_s=3, num_hosts=2, warmup_s=0, window_s=8
    ),
}


def run_bounded(function: Callable[[], T], timeout_s: float, what: str) -> T:
    """`function()` on a daemon thread; HarnessError if it has not returned after `timeout_s`."""
    box: queue.Queue[tuple[bool, Any]] = queue.Queue(1)

    def target() -> None:
        try:
            box.put((True, function()))
        except BaseException as e:  # handed to the caller below
            box.put((False, e))

    threading.Thread(target=target, name="bounded-call", daemon=True).start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise HarnessError(f"timed out after {timeout_s:g} s waiting for {what}") from None
    if not ok:
        raise value
    return value


# --- Part 1: one expert, two servers -----------------------------------------------------------------------------


def serving_env() -> dict[str, str]:
    pythonpath = os.pathsep.join([str(bench.REPO_ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")])
    threads = {name: SERVER_THREADS for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return child_env(PYTHONPATH=pythonpath, CROWDTRAIN_NUM_THREADS=SERVER_THREADS, **threads)


def start_crowdtrain_host(groups: ProcessGroups, root: Path) -> tuple[str, str]:
    """A demo-moe expert-host daemon serving one expert; (its multiaddr, the expert's uid)."""
    args = ["--run-file", PRESET, "--role", "expert-host"]
    node = start_daemon(groups, root / "crowdtrain-host", *args, env={**serving_env(), "CROWDTRAIN_MAX_EXPERTS": "1"})
    await_condition(node.ready, START_TIMEOUT_S, "the crowdtrain expert host to start")

    def served_uid() -> str | None:
        node.check_alive()
        found = re.search(r"serving 1 experts: (\S+)", node.log_path.read_text(errors="replace"))
        return found.group(1) if found else None

    return node.address, await_condition(served_uid, START_TIMEOUT_S, "the crowdtrain host to serve its expert")


def start_hivemind_server(groups: ProcessGroups, root: Path, uid: str, hidden_size: int) -> str:
    """hivemind-server hosting `uid` as crowdtrain's expert class; its multiaddr."""
    command = [sys.executable, "-c", HIVEMIND_SERVER, "--expert_uids", uid, "--expert_cls", EXPERT_CLASS]
    command += ["--hidden_dim", str(hidden_size), "--custom_module_path", str(SCRIPTS / "moe_hivemind_expert.py")]
    command += ["--host_maddrs", LOOPBACK, "--num_handlers", str(NUM_CONNECTION_HANDLERS), "--device", "cpu"]
    command += ["--min_batch_size", "1", "--max_batch_size", str(MAX_BATCH_SEQUENCES), "--optimizer", "adam"]
    log_path = root / "hivemind-server.log"
    with open(log_path, "wb") as log:
        process = groups.start(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=serving_env()
        )

    def address() -> str | None:
        if process.poll() is not None:
            raise HarnessError(f"hivemind-server exited with code {process.returncode}:\n{log_tail(log_path)}")
        found = re.search(r"Running DHT node on \['(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)'", log_path.read_text())
        return found.group(1) if found else None

    return await_condition(address, START_TIMEOUT_S, "hivemind-server to start its DHT")


def find_expert(dht: hivemind.DHT, uid: str) -> RemoteExpert:
    """Once the server announced `uid`, hivemind's own lookup of it, as any hivemind client does it."""
    await_condition(lambda: dht.get(uid, latest=True), FIND_TIMEOUT_S, f"{uid} announced in the DHT", poll_s=1)
    (expert,) = get_experts(dht, [uid])
    if expert is None:
        raise HarnessError(f"hivemind's get_experts did not find {uid}, although the DHT holds its announcement")
    return expert


class ExpertCaller:
    """Forward+backward of one fixed batch through a RemoteExpert; the backward makes the server step its optimizer."""

    def __init__(self, expert: RemoteExpert, sequence_length: int, hidden_size: int):
        generator = torch.Generator().manual_seed(0)
        self.expert = expert
        self.inputs = torch.randn(BATCH_SEQUENCES, sequence_length, hidden_size, generator=generator)
        self.output_grad = torch.randn(BATCH_SEQUENCES, sequence_length, hidden_size, generator=generator)
        self.failures: list[str] = []
        """Each failed call's error, in order."""

    def call(self) -> float:
        """Milliseconds of one forward and backward."""
        began = time.perf_counter()
        inputs = self.inputs.clone().requires_grad_(True)
        outputs = self.expert(inputs)
        outputs.backward(self.output_grad)
        elapsed_ms = (time.perf_counter() - began) * 1000
        if outputs.shape != inputs.shape or inputs.grad is None:
            raise HarnessError(f"the expert answered {tuple(outputs.shape)} for {tuple(inputs.shape)}, or no gradient")
        return elapsed_ms

    def attempt(self) -> float | None:
        """call(), or None once its error is recorded: a failed call counts as failed, it does not end the part."""
        try:
            return self.call()
        except Exception as e:  # whatever hivemind's client raised on a lost, refused or short answer
            self.failures.append(f"{type(e).__name__}: {e}")
            return None

    def warm_up(self, num_calls: int) -> None:
        """A few untimed calls; the first ones may land before the server's handlers listen, so a few may fail."""
        failures = 0
        while num_calls > 0:
            try:
                run_bounded(self.call, CALL_TIMEOUT_S, "a warm-up call")
                num_calls -= 1
            except Exception as e:
                failures += 1
                if failures > 5:
                    raise HarnessError(f"warm-up calls keep failing: {e}") from e
                time.sleep(1.0)

    def sequential(self, num_calls: int) -> list[float]:
        """Latencies of the calls of `num_calls` that succeeded, one after the other."""
        results = [run_bounded(self.attempt, CALL_TIMEOUT_S, "a sequential call") for _ in range(num_calls)]
        return [ms for ms in results if ms is not None]

    def concurrent(self, num_callers: int, duration_s: float) -> tuple[list[float], float]:
        """(latencies of the calls that succeeded, elapsed seconds) of `num_callers` threads calling back to back."""
        latencies: list[float] = []
        began = time.perf_counter()
        stop_at = began + duration_s

        def caller() -> None:
            while time.perf_counter() < stop_at:
                if (elapsed_ms := self.attempt()) is not None:
                    latencies.append(elapsed_ms)

        threads = [threading.Thread(target=caller, name="caller", daemon=True) for _ in range(num_callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(stop_at + CALL_TIMEOUT_S - time.perf_counter(), 0))
        if any(thread.is_alive() for thread in threads):
            raise HarnessError(f"a concurrent call ran past {CALL_TIMEOUT_S:g} s")
        return latencies, time.perf_counter() - began


def latency_stats(latencies_ms: Sequence[float]) -> dict[str, Any]:
    ordered = sorted(latencies_ms)
    return {
        "num_calls": len(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)],
        "mean_ms": statistics.fmean(ordered),
        "max_ms": ordered[-1],
    }


def measure_server(address: str, uid: str, manifest: RunManifest, sizes: Sizes) -> dict[str, Any]:
    """Join the server's DHT as a client, find `uid`, and time calls to it."""
    dht = hivemind.DHT(initial_peers=[address], start=True, client_mode=True, host_maddrs=[LOOPBACK])
    expert = None
    try:
        expert = find_expert(dht, uid)
        hidden_size = int(manifest.model.config["hidden_size"])
        caller = ExpertCaller(expert, manifest.data.sequence_length, hidden_size)
        caller.warm_up(sizes.num_warmup_calls)
        sequential = caller.sequential(sizes.num_sequential_calls)
        num_failed_sequential = len(caller.failures)
        concurrent, elapsed_s = caller.concurrent(sizes.num_callers, sizes.concurrent_s)
        num_failed_concurrent = len(caller.failures) - num_failed_sequential
    finally:
        if expert is not None:  # its own connection to the p2p daemon, closed in the loop that opened it
            RemoteExpertWorker.run_coroutine(expert.p2p.shutdown())
        dht.shutdown()
    if len(sequential) < num_failed_sequential or len(concurrent) < num_failed_concurrent or not concurrent:
        raise HarnessError(f"most calls failed; the first failure: {caller.failures[0]}")
    return {
        "sequential": {
            **latency_stats(sequential),
            "num_failed": num_failed_sequential,
            "calls_per_s": 1000 / statistics.fmean(sequential),
        },
        "concurrent": {
            **latency_stats(concurrent),
            "num_failed": num_failed_concurrent,
            "num_callers": sizes.num_callers,
            "elapsed_s": elapsed_s,
            "calls_per_s": len(concurrent) / elapsed_s,
        },
        "failures": caller.failures[:10],
        "sequential_latencies_ms": [round(ms, 3) for ms in sequential],
    }


def bench_serving(groups: ProcessGroups, root: Path, sizes: Sizes) -> dict[str, Any]:
    manifest = PRESETS[PRESET]()
    hidden_size = int(manifest.model.config["hidden_size"])
    bench.say("serving: a crowdtrain expert-host daemon serving one demo-moe expert")
    address, uid = start_crowdtrain_host(groups, root)
    crowdtrain = measure_server(address, uid, manifest, sizes)
    groups.kill_all()  # one server at a time
    bench.say(f"serving: hivemind-server hosting {uid} as the same expert class")
    address = start_hivemind_server(groups, root, uid, hidden_size)
    hivemind_server = measure_server(address, uid, manifest, sizes)
    groups.kill_all()
    return serving_summary(manifest, uid, sizes, crowdtrain, hivemind_server)


def serving_summary(
    manifest: RunManifest, uid: str, sizes: Sizes, crowdtrain: dict[str, Any], hivemind_server: dict[str, Any]
) -> dict[str, Any]:
    def ratio(part: str, key: str) -> float:
        return crowdtrain[part][key] / hivemind_server[part][key]

    assert manifest.moe is not None
    hidden_size = int(manifest.model.config["hidden_size"])
    return {
        "expert_uid": uid,
        "expert": f"FeedForwardExpert({hidden_size}, {manifest.moe.expert_hidden_size})",
        "batch_shape": [BATCH_SEQUENCES, manifest.data.sequence_length, hidden_size],
        "order": "crowdtrain first, then hivemind-server, each alone on the machine (but for other users' load)",
        "sizes": asdict(sizes),
        "server_threads": int(SERVER_THREADS),
        "differences": list(DIFFERENCES),
        "crowdtrain": crowdtrain,
        "hivemind_server": hivemind_server,
        "ratios_crowdtrain_over_hivemind": {
            "sequential_p50_ms": ratio("sequential", "p50_ms"),
            "sequential_p99_ms": ratio("sequential", "p99_ms"),
            "sequential_calls_per_s": ratio("sequential", "calls_per_s"),
            "concurrent_calls_per_s": ratio("concurrent", "calls_per_s"),
        },
        "moe_expert_calls_per_s": crowdtrain["concurrent"]["calls_per_s"],
        "moe_expert_p50_ms": crowdtrain["sequential"]["p50_ms"],
        "moe_expert_p99_ms": crowdtrain["sequential"]["p99_ms"],
        "moe_speedup_vs_hivemind_server": ratio("concurrent", "calls_per_s"),
    }


# --- Part 2: a DMoE swarm that loses a quarter of its experts ----------------------------------------------------


@dataclass
class Swarm:
    hosts: list[Daemon]
    trainer: Daemon
    watcher: StatusWatcher

    def check_alive(self) -> None:
        for node in [*self.hosts, self.trainer]:
            node.check_alive()

    def latest(self) -> dict[str, Any]:
        self.check_alive()
        return self.watcher.latest() or {"run": {}, "peers": []}


def peers_by_id(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {peer["peer_id"]: peer for peer in snapshot["peers"]}


def grid(snapshot: dict[str, Any]) -> dict[str, Any]:
    return snapshot["run"].get("expert_grid") or {"live": 0, "total": 0, "max_replicas": 0}


def training_run(root: Path, smoke: bool) -> tuple[str, RunManifest]:
    """The `--run-file` argument of the founder, and its manifest: demo-moe, or a tiny run for the smoke mode."""
    if not smoke:
        return PRESET, PRESETS[PRESET]()
    path = root / "bench-moe-smoke.toml"
    path.write_text(SMOKE_RUN_FILE)
    return str(path), load_run_file(str(path))


def start_dmoe_swarm(groups: ProcessGroups, root: Path, run_file: str, env: dict[str, str], num_hosts: int) -> Swarm:
    """The founder host, the trainer (its start-up overlaps the hosts'), then the other hosts one by one.

    Each host starts once the previous one is up (wrote node.json): the previous one serves its experts within a
    few seconds and publishes them with its next heartbeat (within STATUS_INTERVAL_S), before the new host's
    imports and join are done and it places itself around them. Hosts started together would pick overlapping
    experts and re-place (each re-placement restarts a host's expert server), which is start-up churn, not
    what this benchmark measures; were the margin lost on a loaded machine, the churn ends in a re-check, and
    the measurement waits for every host to serve its own share (await_training).
    """
    founder = start_daemon(groups, root / "host0", "--run-file", run_file, "--role", "expert-host", env=env)
    await_condition(founder.ready, START_TIMEOUT_S, "the founding expert host to start")
    joining = ["--initial-peers", founder.address]
    trainer = start_daemon(groups, root / "trainer", *joining, "--role", "trainer", env=env)
    swarm = Swarm([founder], trainer, StatusWatcher(groups, founder.address, STATUS_INTERVAL_S, root / "status.log"))
    await_condition(partial(num_server_starts, founder), START_TIMEOUT_S, "the founding host to serve experts")
    for index in range(1, num_hosts):
        host = start_daemon(groups, root / f"host{index}", *joining, "--role", "expert-host", env=env)
        swarm.hosts.append(host)
        await_condition(host.ready, START_TIMEOUT_S, f"expert host {index} to start")
        bench.say(f"training: expert host {index} is up")
    await_condition(trainer.ready, START_TIMEOUT_S, "the trainer to start")
    return swarm


def num_server_starts(host: Daemon) -> int:
    """How often the host has (re)started its expert server so far, from its log."""
    host.check_alive()
    return len(re.findall(r"\] serving \d+ experts: ", host.log_path.read_text(errors="replace")))


def trainer_rate(swarm: Swarm, snapshot: dict[str, Any]) -> float | None:
    peer = peers_by_id(snapshot).get(swarm.trainer.node_info["peer_id"])
    return None if peer is None else peer["samples_per_second"]


def measure_window(swarm: Swarm, duration_s: float, zero: float) -> dict[str, Any]:
    """The trainer's samples/s over `duration_s`: from the run's progress, and as it reports it itself.

    Also how often each host restarted its expert server meanwhile (each restart fails the calls in flight).
    """
    starts_before = [num_server_starts(host) for host in swarm.hosts]
    started = time.monotonic()
    while (left_s := started + duration_s - time.monotonic()) > 0:
        swarm.check_alive()
        time.sleep(min(bench.POLL_S, left_s))
    snapshots = swarm.watcher.between(started, time.monotonic())
    restarts = [num_server_starts(host) - before for host, before in zip(swarm.hosts, starts_before, strict=True)]
    reported = [rate for _, snapshot in snapshots if (rate := trainer_rate(swarm, snapshot)) is not None]
    from_progress = bench.progress_rate(snapshots)
    self_reported = statistics.fmean(reported) if reported else None
    samples_per_s = from_progress if from_progress else self_reported
    if not samples_per_s:
        raise HarnessError(f"the trainer reported no progress in {duration_s:g} s ({len(snapshots)} status samples)")
    live = [grid(snapshot)["live"] for _, snapshot in snapshots]
    return {
        "duration_s": duration_s,
        "window_s": [round(started - zero, 2), round(started + duration_s - zero, 2)],
        "num_status_samples": len(snapshots),
        "samples_per_s": samples_per_s,
        "source": "progress" if from_progress else "trainer's own samples_per_second",
        "samples_per_s_from_progress": from_progress,
        "samples_per_s_self_reported": self_reported,
        "live_experts_min_max": [min(live), max(live)] if live else None,
        "expert_server_restarts_per_host": restarts,
    }


def await_training(swarm: Swarm, total: int, per_host: int) -> None:
    """Until every expert has one host, every host serves `per_host` experts, and the trainer trains."""
    host_ids = [host.node_info["peer_id"] for host in swarm.hosts]

    def ready() -> bool:
        snapshot = swarm.latest()
        peers = peers_by_id(snapshot)
        hosting = all(peer_id in peers and len(peers[peer_id]["experts"]) == per_host for peer_id in host_ids)
        covered = grid(snapshot)["live"] == total and grid(snapshot)["max_replicas"] == 1
        return hosting and covered and (trainer_rate(swarm, snapshot) or 0) > 0

    what = f"{len(host_ids)} hosts to serve {per_host} experts each, once each, and the trainer to train"
    await_condition(ready, SWARM_TIMEOUT_S, what)


def settle(swarm: Swarm, seconds: float) -> None:
    """Train for `seconds` unmeasured (a warm-up), failing early if a daemon dies."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        swarm.check_alive()
        time.sleep(bench.POLL_S)


def kill_hosts(groups: ProcessGroups, swarm: Swarm, total: int, per_host: int, zero: float) -> dict[str, Any]:
    """SIGKILL the last host(s); wait until their experts leave the grid and their status the listing."""
    victims = swarm.hosts[len(swarm.hosts) - NUM_KILLED_HOSTS :]
    victim_ids = {victim.node_info["peer_id"] for victim in victims}
    killed = [uid for peer_id in victim_ids for uid in peers_by_id(swarm.latest())[peer_id]["experts"]]
    killed_at = time.monotonic()
    for victim in victims:
        groups.kill(victim.process)
        swarm.hosts.remove(victim)
    survivors = total - NUM_KILLED_HOSTS * per_host

    def shrunk() -> bool:
        snapshot = swarm.latest()
        return grid(snapshot)["live"] == survivors and not victim_ids & peers_by_id(snapshot).keys()

    await_condition(shrunk, SWARM_TIMEOUT_S, f"the grid to shrink to {survivors} live experts")
    return {
        "killed_experts": sorted(killed),
        "killed_at_s": round(killed_at - zero, 2),
        "seconds_until_grid_shrank": time.monotonic() - killed_at,
    }


def progress_series(watcher: StatusWatcher, zero: float) -> list[list[float]]:
    """[seconds since `zero`, epoch * B + accumulated] of every status sample: the plot's curve."""
    return [
        [round(read_at - zero, 2), run["epoch"] * run["target_batch_size"] + run["samples_accumulated"]]
        for read_at, run in ((read_at, snapshot["run"]) for read_at, snapshot in watcher.between(0, math.inf))
        if run.get("target_batch_size")
    ]


def swarm_env(per_host: int) -> dict[str, str]:
    """Every daemon of the swarm: hosts serve `per_host` experts at most, one torch thread, fast heartbeats."""
    return child_env(
        PYTHONPATH=os.pathsep.join([str(bench.REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        CROWDTRAIN_MAX_EXPERTS=str(per_host),
        CROWDTRAIN_NUM_THREADS="1",
        CROWDTRAIN_MICRO_BATCH_SIZE=str(MICRO_BATCH_SIZE),
        CROWDTRAIN_STATUS_INTERVAL_S=f"{STATUS_INTERVAL_S:g}",
        CROWDTRAIN_STATUS_TTL_S=f"{STATUS_TTL_S:g}",
    )


def bench_training(groups: ProcessGroups, root: Path, sizes: Sizes, smoke: bool) -> dict[str, Any]:
    run_file, manifest = training_run(root, smoke)
    total = len(expert_uids(manifest))
    num_hosts = sizes.num_hosts
    per_host = total // num_hosts
    env = swarm_env(per_host)
    bench.say(f"training: {num_hosts} expert hosts of {per_host} experts each ({total} in all), then 1 trainer")
    began = time.monotonic()
    swarm = start_dmoe_swarm(groups, root, run_file, env, sizes.num_hosts)
    await_training(swarm, total, per_host)
    startup_s = time.monotonic() - began
    bench.say(
        f"training: every expert live after {startup_s:.0f} s; {sizes.warmup_s:g} s warm-up, then {sizes.window_s:g} s"
    )
    settle(swarm, sizes.warmup_s)
    zero = time.monotonic()
    before = measure_window(swarm, sizes.window_s, zero)
    bench.say(f"training: SIGKILL {NUM_KILLED_HOSTS} of {num_hosts} hosts ({NUM_KILLED_HOSTS * per_host} experts)")
    kill = kill_hosts(groups, swarm, total, per_host, zero)
    bench.say(
        f"training: the grid shrank after {kill['seconds_until_grid_shrank']:.0f} s; measuring {sizes.window_s:g} s"
    )
    settle(swarm, sizes.warmup_s)
    after = measure_window(swarm, sizes.window_s, zero)
    live_at_end = grid(swarm.latest())["live"]
    return {
        "run": run_file if not smoke else "bench-moe-smoke (a tiny DMoE run; smoke mode)",
        "num_hosts": num_hosts,
        "killed_fraction_of_experts": NUM_KILLED_HOSTS * per_host / total,
        "num_experts": total,
        "max_experts_per_host": per_host,
        "micro_batch_size": MICRO_BATCH_SIZE,
        "status_ttl_s": STATUS_TTL_S,
        "startup_s": startup_s,
        "warmup_s": sizes.warmup_s,
        "all_live": before,
        **kill,
        "after_kill": after,
        "live_experts_at_end": live_at_end,
        "taken_over": live_at_end > total - NUM_KILLED_HOSTS * per_host,
        "takeover_note": (
            f"every host may serve at most {per_host} = total / {num_hosts} experts, so the survivors have no spare "
            "capacity and the killed host's experts stay dead; with spare capacity their supervisors would take "
            "them over"
        ),
        "progress": progress_series(swarm.watcher, zero),
        "moe_samples_per_s": before["samples_per_s"],
        "moe_samples_per_s_after_kill": after["samples_per_s"],
        "moe_samples_per_s_after_kill_ratio": after["samples_per_s"] / before["samples_per_s"],
    }


# --- Output and the entry point ----------------------------------------------------------------------------------


def print_serving(result: dict[str, Any]) -> None:
    crowdtrain, hivemind_server = result["crowdtrain"], result["hivemind_server"]
    callers = crowdtrain["concurrent"]["num_callers"]
    rows = [
        [label, crowdtrain[part][key], hivemind_server[part][key], crowdtrain[part][key] / hivemind_server[part][key]]
        for label, part, key in (
            ("sequential p50 ms", "sequential", "p50_ms"),
            ("sequential p99 ms", "sequential", "p99_ms"),
            ("sequential calls/s", "sequential", "calls_per_s"),
            (f"{callers} concurrent callers: calls/s", "concurrent", "calls_per_s"),
            (f"{callers} concurrent callers: p50 ms", "concurrent", "p50_ms"),
        )
    ]
    rows += [
        [f"failed calls ({part})", crowdtrain[part]["num_failed"], hivemind_server[part]["num_failed"], None]
        for part in ("sequential", "concurrent")
    ]
    shape = " x ".join(str(size) for size in result["batch_shape"])
    bench.print_table(
        f"Expert serving: {result['expert']} ({result['expert_uid']}), forward+backward of [{shape}], "
        f"{result['server_threads']} torch thread per server",
        ["", "crowdtrain", "hivemind-server", "crowdtrain / hivemind"],
        rows,
    )
    for key in ("moe_expert_calls_per_s", "moe_expert_p50_ms", "moe_expert_p99_ms", "moe_speedup_vs_hivemind_server"):
        print(f"{key} = {result[key]:.3f}")
    for name, server in (("crowdtrain", crowdtrain), ("hivemind-server", hivemind_server)):
        if server["failures"]:
            print(f"{name}: failed calls count as failed, not timed; the first one: {server['failures'][0]}")
    print("What differs between the two servers:")
    for difference in result["differences"]:
        print(f"  - {difference}")


def print_training(result: dict[str, Any]) -> None:
    windows = (("every expert live", result["all_live"]), ("after the SIGKILL", result["after_kill"]))
    rows = [
        [
            label,
            window["samples_per_s"],
            window["source"],
            window["live_experts_min_max"],
            sum(window["expert_server_restarts_per_host"]),
        ]
        for label, window in windows
    ]
    bench.print_table(
        f"DMoE training: {result['run']}, {result['num_hosts']} hosts x {result['max_experts_per_host']} experts, "
        f"1 trainer, {result['all_live']['duration_s']:g} s windows",
        ["", "trainer samples/s", "from", "live experts (min, max)", "expert server restarts"],
        rows,
    )
    print(f"moe_samples_per_s = {result['moe_samples_per_s']:.3f}")
    print(f"moe_samples_per_s_after_kill_ratio = {result['moe_samples_per_s_after_kill_ratio']:.3f}")
    print(
        f"{len(result['killed_experts'])} of {result['num_experts']} experts died with their host; the grid showed "
        f"them gone after {result['seconds_until_grid_shrank']:.0f} s (status TTL {result['status_ttl_s']:g} s)."
    )
    outcome = "yet some were taken over" if result["taken_over"] else "so none was taken over"
    print(
        f"Each surviving host already serves its max_experts = {result['max_experts_per_host']} (total / "
        f"{result['num_hosts']}) and has no spare capacity, {outcome}: {result['live_experts_at_end']} experts live at "
        "the end. The killed host's CPU goes to the survivors on this one machine, which can lift the ratio."
    )
    if any(sum(window["expert_server_restarts_per_host"]) for _, window in windows):
        print(
            "WARNING: hosts restarted their expert servers inside a measured window (see their logs): calls in "
            "flight fail then, and the trainer's samples/s is not the steady state."
        )


@bench.plot_to_png(1, 2, figsize=(12, 4.5))
def plot(results: dict[str, Any], axes: Any) -> None:
    left, right = axes
    serving = results.get("serving", {})
    for name, label in (("crowdtrain", "crowdtrain expert-host"), ("hivemind_server", "hivemind-server")):
        latencies = sorted(serving.get(name, {}).get("sequential_latencies_ms", []))
        left.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))], label=label)
    left.set(xlabel="forward+backward latency, ms (sequential calls)", ylabel="fraction of calls")
    left.set_title("One expert, two servers")
    left.grid(alpha=0.3)
    left.legend()
    training = results.get("training", {})
    if training.get("progress"):
        seconds, samples = zip(*training["progress"], strict=True)
        right.plot(seconds, samples, marker=".", label="trainer's progress (epoch × B + accumulated)")
        dead = f"{training['killed_fraction_of_experts']:.0%} dead"
        for name, color, label in (("all_live", "C2", "every expert live"), ("after_kill", "C1", dead)):
            right.axvspan(*training[name]["window_s"], color=color, alpha=0.15, label=f"measured: {label}")
        killed = f"SIGKILL of {NUM_KILLED_HOSTS} of {training['num_hosts']} hosts"
        right.axvline(training["killed_at_s"], color="C3", linestyle="--", label=killed)
        right.legend()
    right.set(xlabel="seconds since the first measured window began", ylabel="samples")
    right.set_title(f"DMoE training as {training.get('killed_fraction_of_experts', 0.25):.0%} of experts die")
    right.grid(alpha=0.3)


def run_parts(args: argparse.Namespace, groups: ProcessGroups, root: Path, *, results: dict[str, Any]) -> bool:
    """Each part in turn; a failed part is recorded and the next one still runs."""
    sizes = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    ok = True
    parts: list[tuple[str, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = [
        ("serving", lambda: bench_serving(groups, root, sizes), print_serving),
        ("training", lambda: bench_training(groups, root, sizes, args.smoke), print_training),
    ]
    for name, run_part, print_part in parts:
        if args.part not in (None, name):
            continue
        try:
            results[name] = run_part()
        except Exception as e:  # the other part's numbers are still worth having
            bench.record_failure(results, name, e)
            ok = False
        finally:
            bench.say(f"{name}: stopping its processes")
            groups.kill_all()
        if "error" not in results[name]:
            print_part(results[name])
        results["environment"]["load_average_at_end"] = os.getloadavg()
        bench.write_json(args.out / "moe.json", results)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench.bench_parser(__doc__, "fewer calls and shorter training windows (~3 minutes)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run of every part (~85 s)")
    parser.add_argument("--part", choices=("serving", "training"), help="run only this part (default: both)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the client, like the servers: more threads only spin on two busy cores
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    results: dict[str, Any] = {
        "caveat": bench.NOISE_CAVEAT,
        "mode": mode,
        "environment": bench.environment_json(args.quick),
    }
    log_dir = args.out / "logs" / "moe"
    try:
        ok = bench.with_children("crowdtrain-bench-moe-", log_dir, partial(run_parts, args, results=results))
    except KeyboardInterrupt:
        print("interrupted; every child process was killed", file=sys.stderr)
        return 130
    bench.say_plotted(args.out, "moe", plot, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
