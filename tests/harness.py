"""Real daemons on loopback for integration tests: the tests' defaults over lab, and cleanup.

Every daemon a test starts goes into STARTED; conftest kills all of them, with their sessions, after each test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from lab import swarm
from lab.processes import ProcessGroups

from crowdtrain.averaging.groups import join_request_timeout_s
from crowdtrain.manifest import AveragingSpec

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


MATCHMAKING_TIME_S = 2.0
JOIN_REQUEST_TIMEOUT_S = join_request_timeout_s(AveragingSpec(matchmaking_time_s=MATCHMAKING_TIME_S))
"""What an in-process averager of a test waits for a leader's answer: below the matchmaking time, as the product's
averagers. At or above it hivemind's matchmaking can deadlock (its warning says so), and a round never ends."""
ALLREDUCE_TIMEOUT_S = 30.0
"""hivemind waits for an all-reduce's parts without end by default: a stalled round must fail its test, not hang it."""


def averager_group(
    kind: Callable[..., Any], values: Sequence[torch.Tensor], dhts: Sequence[hivemind.DHT], prefix: str, **settings: Any
) -> list[Any]:
    """One started averager of `kind` per DHT, over a copy of its tensor in `values`, each waiting for a group of all of
    them (2 s of matchmaking, 1 s per request, an all-reduce bounded); `settings` go to every one."""
    settings = {"allreduce_timeout": ALLREDUCE_TIMEOUT_S, **settings}
    return [
        kind(
            [value.clone()],
            dht=dht,
            prefix=prefix,
            target_group_size=len(dhts),
            min_group_size=len(dhts),
            min_matchmaking_time=MATCHMAKING_TIME_S,
            request_timeout=JOIN_REQUEST_TIMEOUT_S,
            start=True,
            **settings,
        )
        for value, dht in zip(values, dhts, strict=True)
    ]


def step_together(averagers: Sequence[Any], timeout_s: float = 60.0) -> list[Any]:
    """Every averager's step at once; the groups they found (None where one found none). Each wait is bounded: a step
    that neither ends nor fails (an all-reduce without a timeout of its own) raises TimeoutError."""
    controls = [averager.step(timeout=timeout_s, wait=False) for averager in averagers]
    return [control.result(timeout=timeout_s + ALLREDUCE_TIMEOUT_S + 10) for control in controls]


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
