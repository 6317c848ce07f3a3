"""Benchmark a daemon's footprint: peak RSS, PSS and CPU of every process of its session, idle and training.

On loopback, two daemons of two separate runs (neither knows the other), both measured in the same
window once both settled (each session's processes are counted apart; the machine has 2 cores, and the
training daemon uses one torch thread):
1. idle      `crowdtrain run --role aggregator` alone in its run: it computes nothing and, with no trainer
             in the run, has nothing to aggregate; measured after its start-up throughput probe finished
2. training  `crowdtrain run` of the demo preset training alone in its run (one torch thread)
3. dht node  (full run only) for reference, a bare crowdtrain DHT node (join_swarm with crowdtrain's
             validators, a record stored every 5 s) in a process of its own: the floor of a daemon's networking side
Every process of the session counts: the daemon, its DHT process, p2pd and hivemind's averager processes;
CPU is also split into the daemon's own process and the others. Writes <out>/footprint.json and .png.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchlib as bench
from bench_training import MICRO_BATCH_SIZE
from lab.processes import (
    LineReader,
    Poller,
    ProcessGroups,
    await_condition,
    child_env,
    raise_keyboard_interrupt,
)
from lab.procfs import cpu_seconds_by_process
from lab.swarm import START_TIMEOUT_S, StatusWatcher, start_daemon

TRAINING_TIMEOUT_S = 300.0
PREFIX = "crowdtrain-bench-footprint-"
HEARTBEAT_INTERVAL_S = 5.0
"""The daemon's default status interval: the idle node stores a record this often."""

IDLE_NODE = """
import sys, time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from crowdtrain.dht.swarm import SwarmOptions, join_swarm
from crowdtrain.dht.validator import make_validators
dht = join_swarm(SwarmOptions(), make_validators(RSAPrivateKey()))
print("ready", flush=True)
while True:  # a heartbeat-sized record every interval, as an idle daemon's status would be
    dht.store("bench-footprint-idle", b"x" * 512, get_dht_time() + 30)
    time.sleep(float(sys.argv[1]))
"""


def measure(pgids: Sequence[int], duration_s: float, check_alive: Any) -> dict[int, dict[str, Any]]:
    """Peak memory and mean CPU of each process group in `pgids` over the same `duration_s` seconds."""
    memory = bench.MemoryPeaks(list(pgids))
    with Poller([memory.poll], period_s=1.0):
        started, before = time.monotonic(), cpu_seconds_by_process(list(pgids))
        while (left_s := started + duration_s - time.monotonic()) > 0:
            check_alive()
            time.sleep(min(bench.POLL_S, left_s))
        ended, after = time.monotonic(), cpu_seconds_by_process(list(pgids))
    return {
        pgid: {
            "duration_s": duration_s,
            "memory": bench.memory_json(memory.groups[pgid]),
            "cpu": bench.cpu_use(before, after, pgid, ended - started),
        }
        for pgid in pgids
    }


def measure_dht_node(groups: ProcessGroups, duration_s: float) -> dict[str, Any]:
    bench.say(f"footprint: a bare crowdtrain DHT node for {duration_s:g} s")
    command = [sys.executable, "-c", IDLE_NODE, str(HEARTBEAT_INTERVAL_S)]
    process = groups.start(command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=child_env(), text=True)
    LineReader(process.stdout).next_line(START_TIMEOUT_S, "the idle DHT node to start")  # type: ignore[arg-type]

    def check_alive() -> None:
        if process.poll() is not None:
            raise RuntimeError(f"the idle DHT node exited with code {process.returncode}")

    result = measure([process.pid], duration_s, check_alive)[process.pid]
    groups.kill(process)
    return {"what": "join_swarm + crowdtrain validators, a 512-byte store every 5 s (DHT process + p2pd)", **result}


def measure_daemons(groups: ProcessGroups, root: Path, duration_s: float) -> dict[str, Any]:
    """An idle (`--role aggregator`) and a training daemon of the demo preset, each founding its own run,
    measured in the same window once both settled."""
    roles = {"idle": "aggregator", "training": "trainer"}
    bench.say(f"footprint: an idle and a training daemon (demo preset, separate runs) for {duration_s:g} s")
    env = child_env(
        CROWDTRAIN_MICRO_BATCH_SIZE=str(MICRO_BATCH_SIZE), CROWDTRAIN_NUM_THREADS="1", CROWDTRAIN_STATUS_INTERVAL_S="2"
    )
    nodes = {
        state: start_daemon(groups, root / role, "--run-file", "demo", "--role", role, env=env)
        for state, role in roles.items()
    }
    for state, node in nodes.items():
        await_condition(node.ready, START_TIMEOUT_S, f"the {state} daemon to start")
    watchers = {
        state: StatusWatcher(groups, node.address, 2.0, root / f"status-{roles[state]}.log")
        for state, node in nodes.items()
    }

    def settled(state: str) -> bool:
        # A trainer reports samples/s; an aggregator has run its start-up throughput probe once it reports one.
        for node in nodes.values():
            node.check_alive()
        field = "samples_per_second" if state == "training" else "measured_samples_per_second"
        return any((peer.get(field) or 0) > 0 for peer in (watchers[state].latest() or {}).get("peers", []))

    for state in roles:
        await_condition(lambda state=state: settled(state), TRAINING_TIMEOUT_S, f"the {state} daemon to settle")
    for watcher in watchers.values():
        groups.kill(watcher.process)  # their own DHT clients are not the daemons' footprint

    def check_alive() -> None:
        for node in nodes.values():
            node.check_alive()

    measured = measure([node.process.pid for node in nodes.values()], duration_s, check_alive)
    for node in nodes.values():
        groups.kill(node.process)
    return {
        state: {
            "what": f"crowdtrain run --run-file demo --role {roles[state]}, alone in its run, 1 torch thread",
            **measured[node.process.pid],
        }
        for state, node in nodes.items()
    }


def print_footprint(result: dict[str, Any]) -> None:
    rows = []
    for name in [name for name in ("idle", "training", "dht_node") if name in result]:
        item = result[name]
        memory, cpu = item["memory"], item["cpu"]
        names = sorted({process["name"] for process in memory["processes_at_peak"]})
        rows.append([name, memory["peak_rss_mib"], memory["pss_at_peak_mib"], cpu["cores"],
                     cpu["cores_daemon_process"], cpu["cores_other_processes"], ", ".join(names)])  # fmt: skip
    bench.print_table(
        "Footprint: all processes of the session (CPU in cores kept busy)",
        ["", "peak RSS MiB", "PSS at peak MiB", "CPU", "CPU leader", "CPU others", "processes"],
        rows,
    )


@bench.plot_to_png(1, 2, figsize=(10, 4))
def plot(result: dict[str, Any], axes: Any) -> None:
    left, right = axes
    names = [name for name in ("idle", "training", "dht_node") if name in result]
    left.bar(names, [result[n]["memory"]["peak_rss_mib"] for n in names], label="peak RSS")
    left.bar(names, [result[n]["memory"]["pss_at_peak_mib"] for n in names], width=0.5, label="PSS at peak")
    left.set(ylabel="MiB", title="memory, all processes")
    left.legend()
    right.bar(names, [result[n]["cpu"]["cores"] for n in names])
    right.set(ylabel="cores", title="CPU")


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench.bench_parser(__doc__, "shorter windows")
    parser.add_argument("--duration", type=float, help="seconds measured in each state (default 60, quick 10)")
    args = parser.parse_args(argv)
    duration_s = args.duration or (10.0 if args.quick else 60.0)
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)

    def measure_all(groups: ProcessGroups, root: Path) -> dict[str, Any]:
        result = measure_daemons(groups, root, duration_s)
        if not args.quick:  # a reference row: left out of the 10-minute quick run
            result["dht_node"] = measure_dht_node(groups, duration_s)
        return result

    report = bench.Report("footprint", print_footprint, plot, caveat_at_end=False)
    log_dir = args.out / "logs" / "footprint"
    return bench.run_benchmark(report, args.out, args.quick, lambda: bench.with_children(PREFIX, log_dir, measure_all))


if __name__ == "__main__":
    sys.exit(main())
