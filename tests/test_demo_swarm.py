"""`make demo`'s script: closing its terminal (SIGHUP) stops its daemons, which run in sessions of their own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from lab.processes import await_condition

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

DEMO = Path(__file__).resolve().parent.parent / "scripts" / "demo_swarm.py"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _daemon_pid(root: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(json.loads((root / "node0" / "node.json").read_text())["pid"])
    return None


def test_a_hangup_stops_the_demo_swarms_daemons(tmp_path: Path) -> None:
    output = tmp_path / "demo.out"
    command = [sys.executable, str(DEMO), "--peers", "1", "--dir", str(tmp_path / "swarm"), "--watch", "5"]
    with output.open("wb") as out:
        demo = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    daemon_pid = None
    try:
        await_condition(lambda: "all daemons are up" in output.read_text(errors="replace"), 90, "the demo swarm up")
        daemon_pid = _daemon_pid(tmp_path / "swarm")
        assert daemon_pid is not None and _alive(daemon_pid)
        demo.send_signal(signal.SIGHUP)
        assert demo.wait(timeout=60) == 0
        assert not _alive(daemon_pid), "the daemon left with the demo"
        assert "stopping the swarm" in output.read_text(errors="replace")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        if daemon_pid is not None and _alive(daemon_pid):
            os.killpg(daemon_pid, signal.SIGKILL)
