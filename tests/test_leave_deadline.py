"""A daemon asked to stop exits within LEAVE_DEADLINE_S whatever hangs, before or after it has left the swarm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# A process whose main thread never returns, as a daemon's does when hivemind's shutdown or the interpreter's exit
# (joining hivemind's processes and threads) hangs: before leaving the swarm ("stuck") or after ("left").
HANGING_DAEMON = """
import sys, threading
from pathlib import Path
from crowdtrain.node import daemon
daemon.LEAVE_DEADLINE_S = 1.0
stop, left = threading.Event(), threading.Event()
watchdog = threading.Thread(
    target=daemon._enforce_leave_deadline, args=(stop, left, Path(sys.argv[2])), daemon=True
)
watchdog.start()
stop.set()
if sys.argv[1] == "left":
    left.set()
threading.Event().wait()
"""


@pytest.mark.parametrize(
    ("where", "code", "said"),
    [("stuck", 1, "could not leave the swarm cleanly"), ("left", 0, "left the swarm, but its processes")],
)
def test_a_hang_before_or_after_leaving_ends_at_the_deadline(tmp_path: Path, where: str, code: int, said: str) -> None:
    (tmp_path / "node.json").write_text(json.dumps({"pid": 1}))
    done = subprocess.run(
        [sys.executable, "-c", HANGING_DAEMON, where, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == code, done.stderr
    assert said in done.stderr
    assert not (tmp_path / "node.json").exists(), "node.json goes with the daemon"
