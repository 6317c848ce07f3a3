"""Real daemons on loopback for integration tests: the tests' defaults over lab, and cleanup.

Every daemon a test starts goes into STARTED; conftest kills all of them, with their sessions, after each test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from lab import swarm
from lab.processes import ProcessGroups

FAST_HEARTBEAT_ENV = {"CROWDTRAIN_STATUS_INTERVAL_S": "1", "CROWDTRAIN_STATUS_TTL_S": "30"}
DAEMON_ENV = {**FAST_HEARTBEAT_ENV, "CROWDTRAIN_NUM_THREADS": "1", "CROWDTRAIN_THROUGHPUT_S": "0.5"}
"""What every test daemon gets unless its test says otherwise: one torch thread, as several share 2 cores, and a
throughput probe of 0.5 s instead of 3 (every daemon of a test measures itself at start, all at once)."""

STARTED = ProcessGroups()


def start_daemon(
    state_dir: Path,
    *args: str,
    initial_peers: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> swarm.Daemon:
    """Start `crowdtrain run` on loopback with DAEMON_ENV (and `env`) over this environment; call await_ready()
    on the result to wait for it."""
    full_env = {**os.environ, **DAEMON_ENV, **(env or {})}
    return swarm.start_daemon(STARTED, state_dir, *args, env=full_env, initial_peers=initial_peers)


def watch_status(observer: swarm.Daemon) -> swarm.StatusWatcher:
    """One `crowdtrain status --watch 1` reading the swarm through `observer` until the test ends: a new reader per
    poll starts a DHT client and imports torch each time, seconds of CPU beside the daemons on two cores."""
    log = observer.state_dir.parent / f"{observer.state_dir.name}-status.log"
    return swarm.StatusWatcher(STARTED, observer.address, 1.0, log)


def kill_all_started() -> None:
    """Kill every process of every session this test started (daemons, their DHT processes, p2pd)."""
    STARTED.kill_all()


def averager_group(
    kind: Callable[..., Any], values: Sequence[torch.Tensor], dhts: Sequence[hivemind.DHT], prefix: str, **settings: Any
) -> list[Any]:
    """One started averager of `kind` per DHT, over a copy of its tensor in `values`, each waiting for a group of all of
    them (2 s of matchmaking, 2 s per request); `settings` go to every one."""
    return [
        kind(
            [value.clone()],
            dht=dht,
            prefix=prefix,
            target_group_size=len(dhts),
            min_group_size=len(dhts),
            min_matchmaking_time=2.0,
            request_timeout=2.0,
            start=True,
            **settings,
        )
        for value, dht in zip(values, dhts, strict=True)
    ]


def step_together(averagers: Sequence[Any], timeout_s: float = 60.0) -> list[Any]:
    """Every averager's step at once, each on a thread of its own; the groups they found (None where one found none)."""
    with ThreadPoolExecutor(len(averagers)) as pool:
        return list(pool.map(lambda averager: averager.step(timeout=timeout_s), averagers))


def shut_down(averagers: Iterable[Any], dhts: Iterable[Any]) -> None:
    """Shut down a test's in-process averagers, then the DHTs they talk through."""
    for averager in averagers:
        averager.shutdown()
    for dht in dhts:
        dht.shutdown()


LOG_FILES_SHOWN = 8
WARNINGS_SHOWN = 8
LAST_LINES_SHOWN = 2


def logs_summary(root: Path) -> str:
    """What the logs under `root` (a failed test's tmp_path: its daemons' <state dir>.log, nodes' logs) said: each
    one's last warnings and errors and its last lines, bounded. CI shows a failed test's report, not its folder."""
    parts = []
    for path in sorted(root.rglob("*.log"))[:LOG_FILES_SHOWN]:
        lines = path.read_text(errors="replace").splitlines()
        warnings = [line for line in lines if " WARN " in line or " ERROR " in line or "Traceback" in line]
        shown = [*warnings[-WARNINGS_SHOWN:], "...", *lines[-LAST_LINES_SHOWN:]] if lines else ["(empty)"]
        parts.append(
            f"--- {path.relative_to(root)} ({len(lines)} lines, {len(warnings)} warnings)\n"
            + "\n".join(line[:300] for line in shown)
        )
    return "\n".join(parts)


NEEDS_NAT_LAB = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("nft") is None,
    reason="needs root, iproute2 and nftables (make test installs it)",
)
"""For tests in the WAN lab with masquerading routers (lab/wanlab.py): namespaces, tc and nftables."""
