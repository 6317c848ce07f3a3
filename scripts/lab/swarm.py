"""Real `crowdtrain run` daemons for tests and benchmarks: start them, await them, read `crowdtrain status`.

Daemons may be started inside a WAN-lab namespace by passing the `ip netns exec <namespace>` prefix as `launcher`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.processes import HarnessError, ProcessGroups, await_condition, child_env, log_tail

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT_S = 120.0
"""For each daemon of a swarm to write node.json, or a worker to report it is ready."""
READY_TIMEOUT_S = 60.0
"""A test's default patience for one daemon to write node.json."""
CROWDTRAIN = (sys.executable, "-m", "crowdtrain")


@dataclass
class Daemon:
    """One `crowdtrain run` process in its own session, with its state dir and log."""

    process: subprocess.Popen
    state_dir: Path
    log_path: Path
    node_info: dict[str, Any] = field(default_factory=dict)
    """node.json (peer_id, multiaddrs, run_id), once ready() saw it."""

    @property
    def info(self) -> dict[str, Any]:
        """node.json as it is now; raises where there is none."""
        info: dict[str, Any] = json.loads((self.state_dir / "node.json").read_text())
        return info

    @property
    def peer_id(self) -> str:
        return str(self.info["peer_id"])

    @property
    def address(self) -> str:
        """The first multiaddr node.json lists."""
        return str((self.node_info or self.info)["multiaddrs"][0])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        """HarnessError, with the end of the log, if the daemon exited."""
        if self.process.poll() is not None:
            raise HarnessError(
                f"daemon {self.state_dir.name} exited with code {self.process.returncode}; its log ends:\n"
                + log_tail(self.log_path)
            )

    def ready(self) -> bool:
        """Whether this daemon (not a previous one of the state dir) wrote node.json; HarnessError if it exited."""
        self.check_alive()
        try:
            info = self.info
        except (OSError, ValueError):
            info = {}
        self.node_info = info if info.get("pid") == self.process.pid else {}
        return bool(self.node_info)

    def await_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Daemon:
        """Wait for ready(); returns the daemon."""
        await_condition(self.ready, timeout_s, f"daemon in {self.state_dir} to write node.json")
        return self

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = 40.0) -> int:
        return self.process.wait(timeout=timeout_s)


def start_daemon(
    groups: ProcessGroups,
    state_dir: Path,
    *args: str,
    env: Mapping[str, str],
    initial_peers: Sequence[str] = (),
    listen: str = LOOPBACK,
    launcher: Sequence[str] = (),
) -> Daemon:
    """`crowdtrain run` listening on `listen`, started through `launcher` (e.g. `ip netns exec NS`) with exactly the
    environment `env`; its log is <state dir>.log beside the state dir. Call ready() or await_ready() to wait."""
    state_dir.mkdir(parents=True, exist_ok=True)
    command = [*launcher, *CROWDTRAIN, "run", "--state-dir", str(state_dir), "--listen", listen]
    if initial_peers:
        command += ["--initial-peers", *initial_peers]
    command += args
    log_path = state_dir.parent / f"{state_dir.name}.log"
    with open(log_path, "ab") as log:
        process = groups.start(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return Daemon(process=process, state_dir=state_dir, log_path=log_path)


def start_swarm(
    groups: ProcessGroups,
    root: Path,
    num_nodes: int,
    founder_args: Sequence[str],
    env: Mapping[str, str],
    placements: Sequence[tuple[str, Sequence[str]]] | None = None,
) -> list[Daemon]:
    """A founder, then `num_nodes - 1` joiners dialling it; returns once every node wrote node.json.

    `placements` gives each node's (listen multiaddr, launcher), e.g. one WAN-lab host each; default loopback.
    """
    where = list(placements or [(LOOPBACK, ())] * num_nodes)
    founder = start_daemon(groups, root / "node0", *founder_args, env=env, listen=where[0][0], launcher=where[0][1])
    await_condition(founder.ready, START_TIMEOUT_S, "the founder to start")
    joiners = [
        start_daemon(
            groups,
            root / f"node{index}",
            env=env,
            initial_peers=[founder.address],
            listen=where[index][0],
            launcher=where[index][1],
        )
        for index in range(1, num_nodes)
    ]
    for joiner in joiners:
        await_condition(joiner.ready, START_TIMEOUT_S, f"daemon {joiner.state_dir.name} to start")
    return [founder, *joiners]


def crowdtrain(
    *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 90.0
) -> subprocess.CompletedProcess:
    """Run a crowdtrain command to completion and capture its output; `env` adds to this environment."""
    return subprocess.run(
        [*CROWDTRAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def status_json(*args: str) -> dict[str, Any]:
    """`crowdtrain status --json` as a dict; HarnessError with its stderr if it fails."""
    result = crowdtrain("status", "--json", *args, timeout_s=60)
    if result.returncode != 0:
        raise HarnessError(f"status failed ({result.returncode}): {result.stderr}")
    snapshot: dict[str, Any] = json.loads(result.stdout)
    return snapshot


def peer_ids(snapshot: dict[str, Any]) -> set[str]:
    """The peer ids a status snapshot lists."""
    return {peer["peer_id"] for peer in snapshot["peers"]}


class StatusWatcher:
    """One long-lived `crowdtrain status --json --watch` reader, instead of a new DHT client per sample."""

    def __init__(
        self,
        groups: ProcessGroups,
        address: str,
        interval_s: float,
        log_path: Path,
        launcher: Sequence[str] = (),
        **settings: str,
    ) -> None:
        """`settings`: CROWDTRAIN_* variables for the reader (e.g. CROWDTRAIN_JOIN_TOKEN)."""
        command = [*launcher, *CROWDTRAIN, "status", "--json", "--initial-peers", address]
        with open(log_path, "ab") as log:
            self.process = groups.start(
                [*command, "--watch", f"{interval_s:g}"],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=child_env(**settings),
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
        """The newest snapshot, None before the first; HarnessError if `crowdtrain status` exited."""
        if self.process.poll() is not None:
            raise HarnessError(
                f"crowdtrain status exited with code {self.process.returncode}:\n{log_tail(self.log_path)}"
            )
        with self._lock:
            return self.snapshots[-1][1] if self.snapshots else None

    def newest_since(self, start: float) -> dict[str, Any] | None:
        """The newest snapshot read after `start` (time.monotonic()), None before one came."""
        with self._lock:
            read_at, snapshot = self.snapshots[-1] if self.snapshots else (-math.inf, None)
        return snapshot if read_at > start else None

    def between(self, start: float, end: float) -> list[tuple[float, dict[str, Any]]]:
        """The snapshots read from `start` to `end` (time.monotonic())."""
        with self._lock:
            return [(read_at, snapshot) for read_at, snapshot in self.snapshots if start <= read_at <= end]


class SwarmSettled:
    """A condition for `await_condition`: true once every daemon is in status with its throughput probed and
    every trainer the plan has compute reports samples/s (the plan may leave a slow host out of computing: it
    then only aggregates). `say` hears what the wait is for whenever that changes: start-up takes long."""

    def __init__(
        self, nodes: Sequence[Daemon], watcher: StatusWatcher, peer_ids: Sequence[str], say: Callable[[str], None]
    ) -> None:
        self.nodes, self.watcher, self.peer_ids, self.say = nodes, watcher, peer_ids, say
        self.waiting_for = ""

    def __call__(self) -> bool:
        for node in self.nodes:
            node.check_alive()
        peers = {peer["peer_id"]: peer for peer in (self.watcher.latest() or {}).get("peers", [])}
        missing = [peer_id for peer_id in self.peer_ids if peer_id not in peers]
        unprobed = [
            p for p in self.peer_ids if p in peers and not (peers[p].get("measured_samples_per_second") or 0) > 0
        ]
        trainers = [peer for peer in peers.values() if "trainer" in peer["roles"]]
        idle = [peer["peer_id"] for peer in trainers if not peer["samples_per_second"] > 0]
        reason = ", ".join(
            f"{len(group)} {what}"
            for group, what in ((missing, "not in status yet"), (unprobed, "not probed"), (idle, "trainers idle"))
            if group
        )
        if reason != self.waiting_for:
            self.waiting_for = reason
            self.say(f"waiting for the swarm: {reason or 'settled'}")
        return not reason and bool(trainers)
