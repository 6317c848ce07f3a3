"""What the benchmarks share beyond daemons and children: memory and CPU peaks, progress rates, tables, the
environment a number was measured on, JSON, plots, kept logs, and the frame of a benchmark's main().

Used by scripts/bench_*.py; nothing here starts a network of its own.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lab.processes import HarnessError, ProcessGroups, await_condition, child_env
from lab.procfs import Unit, command_name, cpu_model, cpu_seconds_by_process, memory_kib, processes
from lab.swarm import START_TIMEOUT_S, Daemon, start_daemon

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.5
"""How often a measured window checks that its children still run."""
MIB = 1024 * 1024
NOISE_CAVEAT = (
    "Numbers are noisy: this machine has few cores and other engineers may be running tests on it at the same "
    "time; compare runs taken back to back, and look at the load averages recorded in the JSON."
)


_started_at = time.monotonic()


def say(message: str) -> None:
    """A progress line with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _started_at:5.0f}s] {message}", flush=True)


@dataclass
class GroupMemory:
    """Peak memory of one session (or process group)."""

    peak_rss_bytes: int = 0
    pss_at_peak_bytes: int = 0
    processes_at_peak: list[dict[str, Any]] = field(default_factory=list)
    """Each member at the peak: command name, RSS and PSS in MiB."""
    max_num_processes: int = 0


class MemoryPeaks:
    """Samples RSS per session (by="pgrp": per process group), and PSS, which splits the pages forked
    children share instead of counting them once in every child."""

    def __init__(self, unit_ids: Sequence[int], by: Unit = "session") -> None:
        self.groups = {unit_id: GroupMemory() for unit_id in unit_ids}
        self.by = by

    def poll(self) -> None:
        """One sample of every unit's members; a unit's peak is kept when its RSS sum is the highest yet."""
        members: dict[int, list[dict[str, Any]]] = {unit_id: [] for unit_id in self.groups}
        for stat in processes():
            unit_id = getattr(stat, self.by)
            name = command_name(stat.pid) if unit_id in members and stat.live else None
            if name is not None:
                rss_kib, pss_kib = memory_kib(stat.pid)
                members[unit_id].append({"name": name, "rss_mib": rss_kib / 1024, "pss_mib": pss_kib / 1024})
        for unit_id, unit in members.items():
            memory = self.groups[unit_id]
            memory.max_num_processes = max(memory.max_num_processes, len(unit))
            rss = sum(round(process["rss_mib"] * MIB) for process in unit)
            if rss > memory.peak_rss_bytes:
                memory.peak_rss_bytes = rss
                memory.pss_at_peak_bytes = sum(round(process["pss_mib"] * MIB) for process in unit)
                memory.processes_at_peak = unit


def measured_window(
    nodes: Sequence[Daemon], duration_s: float, pgids: list[int]
) -> tuple[float, float, dict[tuple[int, int], tuple[str, float]], dict[tuple[int, int], tuple[str, float]]]:
    """Wait out a measured window of `duration_s`, failing as soon as a node dies: its start and end
    (monotonic seconds) and the CPU seconds of `pgids`' sessions at each (for cpu_use)."""
    started, cpu_before = time.monotonic(), cpu_seconds_by_process(pgids)
    while (left_s := started + duration_s - time.monotonic()) > 0:
        for node in nodes:
            node.check_alive()
        time.sleep(min(POLL_S, left_s))
    ended, cpu_after = time.monotonic(), cpu_seconds_by_process(pgids)
    return started, ended, cpu_before, cpu_after


def cpu_use(
    before: dict[tuple[int, int], tuple[str, float]],
    after: dict[tuple[int, int], tuple[str, float]],
    pgid: int,
    elapsed_s: float,
) -> dict[str, Any]:
    """Cores each process of session `pgid` kept busy between two samples; the session leader is the daemon itself."""
    processes: list[dict[str, Any]] = [
        {"name": name, "leader": pid == pgid, "cores": (seconds - before[group, pid][1]) / elapsed_s}
        for (group, pid), (name, seconds) in after.items()
        if group == pgid and (group, pid) in before
    ]
    leader = sum(process["cores"] for process in processes if process["leader"])
    total = sum(process["cores"] for process in processes)
    return {
        "cores": total,
        "cores_daemon_process": leader,
        "cores_other_processes": total - leader,
        "processes": processes,
    }


def summarize_snapshots(snapshots: list[dict[str, Any]], peer_ids: list[str]) -> dict[str, Any]:
    """Per peer and in sum, the mean of the samples/s that the status snapshots reported."""
    per_peer: dict[str, list[float]] = {peer_id: [] for peer_id in peer_ids}
    sums: list[float] = []
    for snapshot in snapshots:
        reported = {peer["peer_id"]: peer["samples_per_second"] for peer in snapshot["peers"]}
        if all(peer_id in reported for peer_id in peer_ids):
            sums.append(sum(reported[peer_id] for peer_id in peer_ids))
            for peer_id in peer_ids:
                per_peer[peer_id].append(reported[peer_id])
    if not sums:
        raise HarnessError("no status snapshot of the measured interval listed every peer")
    return {
        "num_status_samples": len(sums),
        "samples_per_second": sum(sums) / len(sums),
        "samples_per_second_per_peer": {peer_id: sum(rates) / len(rates) for peer_id, rates in per_peer.items()},
        "samples_per_second_sums": sums,
        "epochs": [snapshot["run"]["epoch"] for snapshot in snapshots],
        "num_global_steps_in_window": snapshots[-1]["run"]["epoch"] - snapshots[0]["run"]["epoch"],
    }


def progress_rate(snapshots: list[tuple[float, dict[str, Any]]]) -> float | None:
    """Samples the swarm really processed per second: least-squares slope of epoch * B + accumulated over time.

    A cross-check of the peers' own samples/s, an average of per-micro-batch rates that barely
    feels the seconds a peer spends blocked in matchmaking and all-reduce at the end of each epoch.
    """
    points = [
        (read_at, run["epoch"] * run["target_batch_size"] + run["samples_accumulated"])
        for read_at, run in ((read_at, snapshot["run"]) for read_at, snapshot in snapshots)
        if run["target_batch_size"]
    ]
    if len(points) < 3:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_p = sum(p for _, p in points) / len(points)
    variance = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (p - mean_p) for t, p in points) / variance if variance else None


def memory_json(memory: GroupMemory) -> dict[str, Any]:
    """A unit's memory peak as the JSON records it, in MiB."""
    return {
        "peak_rss_mib": memory.peak_rss_bytes / MIB,
        "pss_at_peak_mib": memory.pss_at_peak_bytes / MIB,
        "num_processes_at_peak": len(memory.processes_at_peak),
        "processes_at_peak": memory.processes_at_peak,
        "max_num_processes": memory.max_num_processes,
    }


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A titled table on stdout: the first column left-aligned, the others right-aligned, None as a dash."""

    def cell(value: Any) -> str:
        if value is None:
            return "—"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    cells = [list(header), *([cell(value) for value in row] for row in rows)]
    widths = [max(len(row[column]) for row in cells) for column in range(len(header))]

    def line(texts: Sequence[str]) -> str:  # the first column left-aligned, numbers right-aligned
        numbers = (text.rjust(width) for text, width in zip(texts[1:], widths[1:], strict=True))
        aligned = [texts[0].ljust(widths[0]), *numbers]
        return "  " + "  ".join(aligned)

    print(f"\n{title}\n{line(cells[0])}\n{line(['-' * width for width in widths])}")
    for row in cells[1:]:
        print(line(row))
    print()


def environment_json(quick: bool) -> dict[str, Any]:
    """Commit, machine and versions: what a number was measured on."""

    def git(*git_args: str) -> str:
        try:
            result = subprocess.run(
                ["git", *git_args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, start_new_session=True
            )
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return result.stdout.strip() if result.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "--short", "HEAD") or "unknown",
        "uncommitted_changes": bool(git("status", "--porcelain")),
        **machine_json(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "hivemind": _version("hivemind"),
        "quick": quick,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_at_start": os.getloadavg(),
    }


def machine_json() -> dict[str, Any]:
    """Cores this process may use, RAM and the CPU model, from the kernel."""
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3,
        "cpu_model": cpu_model(),
    }


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` as indented JSON at `path`, its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; None without matplotlib (`pip install -e '.[bench]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_to_png(
    *grid: int, figsize: tuple[float, float]
) -> Callable[[Callable[[Any, Any], None]], Callable[[Any, Path], bool]]:
    """Make `draw(results, axes)` a plot function `(results, path) -> bool`: it draws a figure of `grid`
    subplots and saves it to `path` (True), or does nothing without matplotlib (False)."""

    def decorate(draw: Callable[[Any, Any], None]) -> Callable[[Any, Path], bool]:
        @functools.wraps(draw)
        def plot(results: Any, path: Path) -> bool:
            plt = pyplot()
            if plt is None:
                return False
            figure, axes = plt.subplots(*grid, figsize=figsize)
            draw(results, axes)
            return save_figure(plt, figure, path)

        return plot

    return decorate


def save_logs(root: Path, destination: Path) -> None:
    """Keep the daemons' and workers' logs: they explain a bad number (e.g. averaging rounds that failed)."""
    shutil.rmtree(destination, ignore_errors=True)
    for log in root.rglob("*.log"):
        target = destination / log.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    print(f"logs in {destination}/")


def save_figure(plt: Any, figure: Any, path: Path) -> bool:
    """Lay a figure out, write it to `path` (120 dpi) and close it; True, as a plot function returns once saved."""
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def say_written(json_path: Path, png: Path, saved: bool) -> None:
    """The line naming what a benchmark wrote."""
    print(f"wrote {json_path}" + (f" and {png}" if saved else " (no matplotlib: no plot)"))


def say_plotted(out: Path, name: str, plot: Callable[[Any, Path], bool], results: Any) -> None:
    """Plot `results` into <out>/<name>.png, name it and <out>/<name>.json as written, then the noise caveat."""
    png = out / f"{name}.png"
    say_written(out / f"{name}.json", png, plot(results, png))
    print(NOISE_CAVEAT)


def bench_parser(doc: str | None, quick_help: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first line, --quick (where `quick_help` is given) and --out."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    if quick_help is not None:
        parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="results folder (bench-results/)")
    return parser


def arms_parser(doc: str | None, arms: Sequence[str], window_s: float) -> argparse.ArgumentParser:
    """A benchmark's parser (`bench_parser`) with --window-s, the seconds measured per arm, and --arms, those to run."""
    parser = bench_parser(doc)
    parser.add_argument("--window-s", type=float, default=window_s, help=f"measured seconds per arm ({window_s:g})")
    parser.add_argument("--arms", nargs="+", choices=arms, default=list(arms), help="arms to run (all)")
    return parser


def record_failure(results: dict[str, Any], name: str, error: Exception) -> None:
    """Print the traceback and keep the error as the part's result: the other parts' numbers are still worth having."""
    traceback.print_exc()
    print(f"\n{name} failed: {error}", file=sys.stderr)
    results[name] = {"error": f"{type(error).__name__}: {error}"}


def with_children(prefix: str, log_dir: Path, body: Callable[[ProcessGroups, Path], T]) -> T:
    """`body(children, folder)` in a temporary folder; however it ends, every child it started is killed (before the
    folder goes) and the logs in the folder are kept in `log_dir`."""
    groups = ProcessGroups()
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as directory:
            try:
                return body(groups, Path(directory))
            finally:
                groups.kill_all()
                save_logs(Path(directory), log_dir)
    finally:
        groups.kill_all()


@dataclass(frozen=True)
class Report:
    """How a one-part benchmark's main() shows its result, under `name` in <out>/<name>.json."""

    name: str
    show: Callable[[dict[str, Any]], None]
    plot: Callable[[dict[str, Any], Path], bool]
    interrupted: str = "every child process was killed"
    """What the line on Ctrl-C or SIGTERM says was cleaned up."""
    caveat_at_end: bool = True


def run_benchmark(report: Report, out: Path, quick: bool, measure: Callable[[], dict[str, Any]]) -> int:
    """main() of a one-part benchmark: measure, record a failure in the JSON too, then table, JSON and plot."""
    json_path, png = out / f"{report.name}.json", out / f"{report.name}.png"
    results: dict[str, Any] = {"caveat": NOISE_CAVEAT, "environment": environment_json(quick)}
    try:
        results[report.name] = measure()
    except KeyboardInterrupt:
        print(f"interrupted; {report.interrupted}", file=sys.stderr)
        return 130
    except Exception as e:  # the JSON records the failure, so bench_all reports it
        results[report.name] = {"error": f"{type(e).__name__}: {e}"}
        write_json(json_path, results)
        raise
    results["environment"]["load_average_at_end"] = os.getloadavg()
    report.show(results[report.name])
    write_json(json_path, results)
    say_written(json_path, png, report.plot(results[report.name], png))
    if report.caveat_at_end:
        print(NOISE_CAVEAT)
    return 0


def await_window() -> list[float]:
    """In a worker, after its first micro-batch: print the `ready` line, then read the measured window
    `<start> <end>` (unix seconds) from stdin; exit when the benchmark that started it is gone."""
    print(json.dumps({"ready": True}), flush=True)
    window = [float(value) for value in sys.stdin.readline().split()]
    if len(window) != 2:
        raise SystemExit("the benchmark that started this worker is gone")
    return window


def train_counting_window(
    train: Callable[[], None], window: list[float], counted: dict[str, int], samples: int
) -> None:
    """Call `train` (one micro-batch of `samples`) forever; counted["samples"] adds up those that began and ended
    inside the window. The worker reports from another thread and is killed after."""
    while True:
        began = time.time()
        train()
        if began >= window[0] and time.time() <= window[1]:
            counted["samples"] += samples


def scrape_metrics(port: int) -> dict[str, float]:
    """A daemon's crowdtrain_* gauges and counters without labels from its Prometheus endpoint on 127.0.0.1 (a
    counter's `_total` suffix dropped)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse_metrics(response.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """The crowdtrain_* gauges and counters without labels of a Prometheus text page (a counter's `_total` dropped)."""
    values = {}
    for line in text.splitlines():
        if line.startswith("crowdtrain_") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name.removesuffix("_total")] = float(value)
    return values


def start_metered_daemons(
    groups: ProcessGroups,
    folder: Path,
    run_file: Path,
    count: int,
    *,
    micro_batch: int,
    metrics_port: int,
    launchers: dict[int, list[str]] | None = None,
) -> list[Daemon]:
    """`count` daemons of one run on loopback, one torch thread each, daemon i serving its Prometheus metrics on
    `metrics_port + i`, no checkpoints during the benchmark; daemon 0 founds the run from `run_file`, the others
    dial it; daemon i is started through `launchers[i]` where given. Returns once every daemon is up."""
    nodes: list[Daemon] = []
    for index in range(count):
        env = child_env(
            CROWDTRAIN_MICRO_BATCH_SIZE=str(micro_batch),
            CROWDTRAIN_NUM_THREADS="1",
            CROWDTRAIN_METRICS_PORT=str(metrics_port + index),
            CROWDTRAIN_CHECKPOINT_INTERVAL_S="100000",
        )
        peers = ["--run-file", str(run_file)] if index == 0 else ["--initial-peers", nodes[0].address]
        launcher = (launchers or {}).get(index, [])
        node = start_daemon(groups, folder / f"node{index}", *peers, env=env, launcher=launcher)
        await_condition(node.ready, START_TIMEOUT_S, f"daemon {index} of {folder.name} to start")
        nodes.append(node)
    return nodes
