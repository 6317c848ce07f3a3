"""The state directory: one daemon at a time (a lock), and node.json for local tools to find it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from crowdtrain.errors import BadInputError, SwarmUnreachableError

NODE_FILE = "node.json"
LOCK_FILE = "daemon.lock"


@contextlib.contextmanager
def exclusive_state_dir(path: Path) -> Iterator[Path]:
    """Hold the state dir's lock for the daemon's lifetime; refuse if another daemon holds it."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise BadInputError(
            f"Cannot use state dir {path}: {e.strerror}; pass --state-dir with a writable directory."
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = read_node_file(path)
            who = f" (pid {owner['pid']})" if owner and "pid" in owner else ""
            raise BadInputError(
                f"Another crowdtrain daemon{who} is already using state dir {path}; "
                "stop it first, or pass --state-dir to run a second node."
            ) from None
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def write_node_file(path: Path, info: dict[str, Any]) -> None:
    """Write node.json atomically (temp file, fsync, rename)."""
    temporary = path / f".{NODE_FILE}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(info, file, indent=2)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path / NODE_FILE)


def read_node_file(path: Path) -> dict[str, Any] | None:
    """node.json as a dict, or None when missing or unreadable."""
    try:
        info = json.loads((path / NODE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def remove_node_file(path: Path) -> None:
    """Remove `node.json` from the state dir, if it is there: the daemon is no longer up."""
    (path / NODE_FILE).unlink(missing_ok=True)


def find_local_daemon(path: Path) -> dict[str, Any]:
    """The running daemon's node.json; raises SwarmUnreachableError when none runs here."""
    info = read_node_file(path)
    if info is None:
        raise SwarmUnreachableError(
            f"No crowdtrain daemon runs with state dir {path} (no {NODE_FILE}); "
            "start one with `crowdtrain run`, or pass --initial-peers to inspect a remote swarm."
        )
    pid = info.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid) or not info.get("multiaddrs"):
        raise SwarmUnreachableError(
            f"The daemon recorded in {path / NODE_FILE} (pid {pid}) is not running; "
            "start one with `crowdtrain run`, or pass --initial-peers."
        )
    return info


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # kill(0 or -1) would signal a whole process group, and succeed
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
