"""Real daemons on loopback for integration tests: start, await, inspect, and always clean up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from crowdtrain.dht.swarm import process_stats
from crowdtrain.testing.fixtures import TINY_MODEL_TOML as TINY_MODEL_TOML  # one copy for tests and benchmarks

T = TypeVar("T")

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT_S = 60.0
FAST_HEARTBEAT_ENV = {"CROWDTRAIN_STATUS_INTERVAL_S": "1", "CROWDTRAIN_STATUS_TTL_S": "30"}
DAEMON_ENV = {**FAST_HEARTBEAT_ENV, "CROWDTRAIN_NUM_THREADS": "1"}
"""What every test daemon gets unless its test says otherwise: one torch thread, as several share 2 cores."""


_started: list[subprocess.Popen] = []


def await_condition(check: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """Poll `check` until it returns a truthy value; fail the test with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def crowdtrain(*args: str, env: dict[str, str] | None = None, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    """Run a crowdtrain command to completion and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "crowdtrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


@dataclass
class Daemon:
    """One `crowdtrain run` process in its own session, with its state dir and log."""

    process: subprocess.Popen
    state_dir: Path
    log_path: Path

    @property
    def info(self) -> dict[str, Any]:
        return json.loads((self.state_dir / "node.json").read_text())

    @property
    def peer_id(self) -> str:
        return str(self.info["peer_id"])

    @property
    def address(self) -> str:
        return str(self.info["multiaddrs"][0])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def await_ready(self, timeout_s: float = START_TIMEOUT_S) -> Daemon:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"daemon exited with {self.process.returncode}:\n{self.log()}")
            try:
                return bool(self.info.get("pid") == self.process.pid)
            except (OSError, ValueError):
                return False

        await_condition(ready, timeout_s, f"daemon in {self.state_dir} to write node.json")
        return self

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = 40.0) -> int:
        return self.process.wait(timeout=timeout_s)


def start_daemon(
    state_dir: Path,
    *args: str,
    initial_peers: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Daemon:
    """Start `crowdtrain run` on loopback; call await_ready() on the result to wait for it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(state_dir), "--listen", LOOPBACK]
    if initial_peers:
        command += ["--initial-peers", *initial_peers]
    command += list(args)
    log_path = state_dir.parent / f"{state_dir.name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: cleanup kills p2pd and the DHT process too
            env={**os.environ, **DAEMON_ENV, **(env or {})},
        )
    _started.append(process)
    return Daemon(process=process, state_dir=state_dir, log_path=log_path)


def status_json(*args: str) -> dict[str, Any]:
    """`crowdtrain status --json` as a dict; fails the test with its stderr if it fails."""
    result = crowdtrain("status", "--json", *args, timeout_s=60)
    assert result.returncode == 0, f"status failed ({result.returncode}): {result.stderr}"
    return json.loads(result.stdout)


def peer_ids(snapshot: dict[str, Any]) -> set[str]:
    return {peer["peer_id"] for peer in snapshot["peers"]}


def session_pids(session_id: int) -> list[int]:
    """Live processes (zombies excluded) of the session `session_id`: a daemon and everything it started."""
    return [pid for pid, fields in process_stats() if int(fields[3]) == session_id and fields[0] != b"Z"]


def group_alive(session_id: int) -> bool:
    """Whether anything a daemon started in its own session still runs (its DHT process, p2pd, averagers)."""
    return bool(session_pids(session_id))


def kill_all_started() -> None:
    """Kill every process of every session this test started (daemons, their DHT processes, p2pd)."""
    for process in _started:
        for pid in session_pids(process.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _started.clear()
