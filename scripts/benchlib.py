"""Pieces every benchmark shares: children killed by process group, waits with deadlines, /proc sampling, tables.

Used by bench_training, bench_averaging, bench_throughput, bench_dht, bench_footprint and bench_all; nothing
here starts a network of its own. Daemons may be started inside a WAN-lab namespace by passing the
`ip netns exec <namespace>` prefix as `launcher`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from crowdtrain.testing.fixtures import TINY_MODEL_TOML as TINY_MODEL_TOML  # one copy for tests and benchmarks

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT_S = 120.0
"""For a daemon to write node.json, or a worker to report it is ready."""
POLL_S = 0.5
KILL_TIMEOUT_S = 15.0
MIB = 1024 * 1024
NOISE_CAVEAT = (
    "Numbers are noisy: this machine has few cores and other engineers may be running tests on it at the same "
    "time; compare runs taken back to back, and look at the load averages recorded in the JSON."
)


class BenchError(RuntimeError):
    """A phase could not finish: a child died or a wait ran past its deadline."""


_started_at = time.monotonic()


def say(message: str) -> None:
    """A progress line with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _started_at:5.0f}s] {message}", flush=True)


def await_condition(check: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """Poll `check` until it returns a truthy value; BenchError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


# --- Children: every one in its own session, killed with everything in it ---------------------------------


class ProcessGroups:
    """The children this benchmark starts; each leads its own session, and everything it spawned stays in it.

    A daemon's hivemind DHT process moves to a process group of its own (SupervisedDHT), taking p2pd with
    it, so killing, measuring and waiting go by session, not by process group.
    """

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def start(self, command: Sequence[str], **popen_options: Any) -> subprocess.Popen:
        process = subprocess.Popen(list(command), start_new_session=True, **popen_options)
        self.processes.append(process)
        return process

    def kill(self, process: subprocess.Popen) -> None:
        """SIGKILL every process of the child's session and wait until none is left running."""
        for pid in [process.pid, *session_members(process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            process.wait(timeout=KILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        if process in self.processes:
            self.processes.remove(process)
        try:
            await_condition(lambda: not session_members(process.pid), KILL_TIMEOUT_S, f"session {process.pid} to end")
        except BenchError as e:
            print(f"warning: {e}", file=sys.stderr)

    def kill_all(self) -> None:
        for process in list(self.processes):
            self.kill(process)


PGRP, SESSION = 1, 2
"""Indexes into read_proc_stat's tuple: which processes count as one unit."""


def read_proc_stat(pid: str) -> tuple[str, int, int] | None:
    """(state, process group, session) of a pid from /proc/<pid>/stat, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[2]), int(fields[3])  # fields 3, 5 and 6 of stat


def live_members(unit_id: int, by: int) -> list[int]:
    """Pids of the running processes (not zombies) whose group (by=PGRP) or session (by=SESSION) is `unit_id`."""
    members = []
    for pid in os.listdir("/proc"):
        stat = read_proc_stat(pid) if pid.isdigit() else None
        if stat is not None and stat[by] == unit_id and stat[0] != "Z":
            members.append(int(pid))
    return members


def session_members(sid: int) -> list[int]:
    return live_members(sid, SESSION)


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies don't count)."""
    return bool(live_members(pgid, PGRP))


def child_env(**settings: str) -> dict[str, str]:
    """This environment without any CROWDTRAIN_* the user set, plus `settings`: runs are reproducible."""
    base = {name: value for name, value in os.environ.items() if not name.startswith("CROWDTRAIN_")}
    return {**base, **settings}


def log_tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


# --- Daemons and the status reader ---------------------------------------------------------------------------


@dataclass
class Node:
    """One `crowdtrain run` daemon with its state dir and log."""

    process: subprocess.Popen
    state_dir: Path
    log_path: Path
    node_info: dict[str, Any] = field(default_factory=dict)
    """node.json (peer_id, multiaddrs, run_id), once ready() saw it."""

    @property
    def address(self) -> str:
        return str(self.node_info["multiaddrs"][0])

    def info(self) -> dict[str, Any] | None:
        """node.json once this daemon (not a previous one) wrote it."""
        try:
            info = json.loads((self.state_dir / "node.json").read_text())
        except (OSError, ValueError):
            return None
        return info if info.get("pid") == self.process.pid else None

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise BenchError(
                f"daemon {self.state_dir.name} exited with code {self.process.returncode}; its log ends:\n"
                + log_tail(self.log_path)
            )

    def ready(self) -> bool:
        self.check_alive()
        self.node_info = self.info() or {}
        return bool(self.node_info)


def start_node(
    groups: ProcessGroups,
    state_dir: Path,
    args: Sequence[str],
    env: dict[str, str],
    *,
    listen: str = LOOPBACK,
    launcher: Sequence[str] = (),
) -> Node:
    """`crowdtrain run` listening on `listen`, started through `launcher` (e.g. `ip netns exec NS`)."""
    state_dir.mkdir(parents=True)
    command = [*launcher, sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(state_dir), "--listen", listen]
    command += args
    log_path = state_dir.parent / f"{state_dir.name}.log"
    with open(log_path, "wb") as log:
        process = groups.start(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return Node(process=process, state_dir=state_dir, log_path=log_path)


def start_swarm(
    groups: ProcessGroups,
    root: Path,
    num_nodes: int,
    founder_args: Sequence[str],
    env: dict[str, str],
    placements: Sequence[tuple[str, Sequence[str]]] | None = None,
) -> list[Node]:
    """A founder, then `num_nodes - 1` joiners dialling it; returns once every node wrote node.json.

    `placements` gives each node's (listen multiaddr, launcher), e.g. one WAN-lab host each; default loopback.
    """
    where = list(placements or [(LOOPBACK, ())] * num_nodes)
    founder = start_node(groups, root / "node0", founder_args, env, listen=where[0][0], launcher=where[0][1])
    await_condition(founder.ready, START_TIMEOUT_S, "the founder to start")
    joiners = [
        start_node(
            groups,
            root / f"node{index}",
            ["--initial-peers", founder.address],
            env,
            listen=where[index][0],
            launcher=where[index][1],
        )
        for index in range(1, num_nodes)
    ]
    for joiner in joiners:
        await_condition(joiner.ready, START_TIMEOUT_S, f"daemon {joiner.state_dir.name} to start")
    return [founder, *joiners]


class StatusWatcher:
    """One long-lived `crowdtrain status --json --watch` reader, instead of a new DHT client per sample."""

    def __init__(
        self, groups: ProcessGroups, address: str, interval_s: float, log_path: Path, launcher: Sequence[str] = ()
    ) -> None:
        command = [*launcher, sys.executable, "-m", "crowdtrain", "status", "--json", "--initial-peers", address]
        with open(log_path, "ab") as log:
            self.process = groups.start(
                [*command, "--watch", f"{interval_s:g}"],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=child_env(),
                text=True,
            )
        self.log_path = log_path
        self.snapshots: list[tuple[float, dict[str, Any]]] = []
        """(time.monotonic() when read, snapshot), oldest first."""
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="status-watcher", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                snapshot = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.snapshots.append((time.monotonic(), snapshot))

    def latest(self) -> dict[str, Any] | None:
        if self.process.poll() is not None:
            raise BenchError(
                f"crowdtrain status exited with code {self.process.returncode}:\n{log_tail(self.log_path)}"
            )
        with self._lock:
            return self.snapshots[-1][1] if self.snapshots else None

    def between(self, start: float, end: float) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return [(read_at, snapshot) for read_at, snapshot in self.snapshots if start <= read_at <= end]


@dataclass
class GroupMemory:
    """Peak memory of one session (or process group)."""

    peak_rss_bytes: int = 0
    pss_at_peak_bytes: int = 0
    processes_at_peak: list[dict[str, Any]] = field(default_factory=list)
    """Each member at the peak: command name, RSS and PSS in MiB."""
    max_num_processes: int = 0


class MemoryPeaks:
    """Samples RSS per session (by=PGRP: per process group), and PSS, which splits the pages forked
    children share instead of counting them once in every child."""

    def __init__(self, unit_ids: Sequence[int], by: int = SESSION) -> None:
        self.groups = {unit_id: GroupMemory() for unit_id in unit_ids}
        self.by = by

    def poll(self) -> None:
        members: dict[int, list[dict[str, Any]]] = {pgid: [] for pgid in self.groups}
        for pid in os.listdir("/proc"):
            stat = read_proc_stat(pid) if pid.isdigit() else None
            if stat is None or stat[self.by] not in members or stat[0] == "Z":
                continue
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            rss_kib = _proc_field_kib(f"/proc/{pid}/status", "VmRSS:")
            pss_kib = _proc_field_kib(f"/proc/{pid}/smaps_rollup", "Pss:")
            members[stat[self.by]].append({"name": name, "rss_mib": rss_kib / 1024, "pss_mib": pss_kib / 1024})
        for pgid, processes in members.items():
            memory = self.groups[pgid]
            memory.max_num_processes = max(memory.max_num_processes, len(processes))
            rss = sum(round(process["rss_mib"] * MIB) for process in processes)
            if rss > memory.peak_rss_bytes:
                memory.peak_rss_bytes = rss
                memory.pss_at_peak_bytes = sum(round(process["pss_mib"] * MIB) for process in processes)
                memory.processes_at_peak = processes


def _proc_field_kib(path: str, name: str) -> int:
    try:
        with open(path) as file:
            return next((int(line.split()[1]) for line in file if line.startswith(name)), 0)
    except (OSError, ValueError):
        return 0


CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds_by_process(sids: Sequence[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """User + system CPU seconds so far (all threads) of every process of the sessions, by (sid, pid)."""
    found: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if int(fields[3]) in sids:  # fields 6, 14 and 15 of stat: session, utime, stime
            found[int(fields[3]), int(pid)] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S)
    return found


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


class Poller:
    """Calls `functions` every `period_s` on a background thread while in its `with` block."""

    def __init__(self, functions: Sequence[Callable[[], None]], period_s: float = POLL_S) -> None:
        self.functions, self.period_s = functions, period_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="poller", daemon=True)

    def _run(self) -> None:
        while True:
            for function in self.functions:
                function()
            if self.stop.wait(self.period_s):
                return

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for function in self.functions:
            function()  # one last sample


class LineReader:
    """Lines of a child's stdout on a queue, so reading them can have a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, timeout_s: float, what: str) -> str:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise BenchError(f"timed out after {timeout_s:g} s waiting for {what}") from None
        if line is None:
            raise BenchError(f"{what}: the process ended first")
        return line


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
        raise BenchError("no status snapshot of the measured interval listed every peer")
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
    return {
        "peak_rss_mib": memory.peak_rss_bytes / MIB,
        "pss_at_peak_mib": memory.pss_at_peak_bytes / MIB,
        "num_processes_at_peak": len(memory.processes_at_peak),
        "processes_at_peak": memory.processes_at_peak,
        "max_num_processes": memory.max_num_processes,
    }


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
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
    model = "unknown"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model)
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "ram_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3,
        "cpu_model": model,
    }


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write_json(path: Path, data: dict[str, Any]) -> None:
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


def save_logs(root: Path, destination: Path) -> None:
    """Keep the daemons' and workers' logs: they explain a bad number (e.g. averaging rounds that failed)."""
    shutil.rmtree(destination, ignore_errors=True)
    for log in root.rglob("*.log"):
        target = destination / log.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
    print(f"logs in {destination}/")


def exit_when_orphaned() -> None:
    """In a benchmark's worker (run on a daemon thread): exit once the benchmark that started it is gone, so a
    worker never trains on forever."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def raise_keyboard_interrupt(*_: object) -> None:
    """A SIGTERM handler: stop like Ctrl-C, so every `finally` cleans up."""
    raise KeyboardInterrupt
