"""The kernel's view of processes, from /proc: sessions, process groups, children, CPU time and memory.

Every reading of /proc/<pid>/stat goes through crowdtrain.dht.swarm.process_stats, the daemon's own reader.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from crowdtrain.dht.swarm import process_stats

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
Unit = Literal["pgrp", "session"]
"""What counts as one unit of processes: a process group, or a session (a daemon and all it started)."""


@dataclass(frozen=True, slots=True)
class ProcStat:
    """What tests and benchmarks read of one process's /proc/<pid>/stat."""

    pid: int
    state: str
    """R, S, D, Z (a zombie: exited, not yet reaped), ..."""
    ppid: int
    pgrp: int
    session: int
    cpu_seconds: float
    """User + system CPU time so far, all threads."""

    @property
    def live(self) -> bool:
        return self.state != "Z"


def processes() -> list[ProcStat]:
    """Every process there is now."""
    return [_parse(pid, fields) for pid, fields in process_stats()]


def _parse(pid: int, fields: list[bytes]) -> ProcStat:
    # Fields 3 to 6, 14 and 15 of stat: state, ppid, pgrp, session, utime, stime.
    ticks = int(fields[11]) + int(fields[12])
    return ProcStat(pid, fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), ticks / CLOCK_TICKS_PER_S)


def live_members(unit_id: int, by: Unit) -> list[int]:
    """Pids of the running processes (not zombies) whose process group or session is `unit_id`."""
    return [stat.pid for stat in processes() if getattr(stat, by) == unit_id and stat.live]


def session_members(sid: int) -> list[int]:
    """Live processes of the session `sid`: a daemon started in a session of its own and everything it started."""
    return live_members(sid, "session")


def session_alive(sid: int) -> bool:
    """Whether anything of session `sid` still runs (its DHT process, p2pd, averagers); zombies don't count."""
    return bool(session_members(sid))


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies don't count)."""
    return bool(live_members(pgid, "pgrp"))


def children(pid: int) -> list[int]:
    """The live child processes of `pid`."""
    return [stat.pid for stat in processes() if stat.ppid == pid and stat.live]


def descendants(pid: int) -> list[int]:
    """The live processes below `pid`: its children, theirs, and so on (one read of /proc)."""
    by_parent: dict[int, list[int]] = {}
    for stat in processes():
        if stat.live:
            by_parent.setdefault(stat.ppid, []).append(stat.pid)
    found, pending = [], list(by_parent.get(pid, []))
    while pending:
        child = pending.pop()
        found.append(child)
        pending.extend(by_parent.get(child, []))
    return found


def command_name(pid: int) -> str | None:
    """The process's command name (comm), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def command_line(pid: int) -> bytes:
    """The process's NUL-separated arguments; empty when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB; 0 where it can't be read. PSS splits the pages shared with other processes."""
    return _field_kib(f"/proc/{pid}/status", "VmRSS:"), _field_kib(f"/proc/{pid}/smaps_rollup", "Pss:")


def peak_rss_kib(pid: int) -> int:
    """The process's peak RSS (VmHWM) in KiB, 0 where it can't be read. Unlike getrusage's ru_maxrss, which a child
    inherits from its parent across fork and exec, it counts only the process's own memory since its exec."""
    return _field_kib(f"/proc/{pid}/status", "VmHWM:")


def _field_kib(path: str, name: str) -> int:
    try:
        with open(path) as file:
            return next((int(line.split()[1]) for line in file if line.startswith(name)), 0)
    except (OSError, ValueError):
        return 0


def cpu_seconds_by_process(sids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """User + system CPU seconds so far (all threads) of every process of the sessions, by (sid, pid)."""
    found: dict[tuple[int, int], tuple[str, float]] = {}
    for stat in processes():
        name = command_name(stat.pid) if stat.session in sids else None
        if name is not None:
            found[stat.session, stat.pid] = (name, stat.cpu_seconds)
    return found


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo; "unknown" where it can't be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
