"""Child processes of a test or benchmark: each in a session of its own, killed with all it started; waits with
deadlines, for a condition or a child's next line of output."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from lab.procfs import session_members

T = TypeVar("T")

SCRIPTS = Path(__file__).resolve().parent.parent
"""scripts/, the folder holding `lab`: pytest (its `pythonpath`) and `python scripts/<benchmark>.py` put it on the
parent's path, but a child started with `python -m` gets neither."""
_RUN_MODULE = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)

POLL_S = 0.2
"""How often a wait looks again."""
KILL_TIMEOUT_S = 15.0


class HarnessError(RuntimeError):
    """A child died or a wait ran past its deadline: the test fails, the benchmark's phase could not finish."""


def await_condition(check: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """Poll `check` until it returns a truthy value; HarnessError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


class ProcessGroups:
    """The children a test or benchmark starts; each leads its own session, and everything it spawned stays in it.

    A daemon's hivemind DHT process moves to a process group of its own (SupervisedDHT), taking p2pd with
    it, so killing, measuring and waiting go by session, not by process group.
    """

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []

    def start(self, command: Sequence[str], **popen_options: Any) -> subprocess.Popen:
        """Popen `command` as the leader of a new session, remembered until it is killed."""
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
        except HarnessError as e:
            print(f"warning: {e}", file=sys.stderr)

    def kill_all(self) -> None:
        """Kill every child still remembered, with its whole session."""
        for process in list(self.processes):
            self.kill(process)


def child_env(**settings: str) -> dict[str, str]:
    """This environment without any CROWDTRAIN_* the user set, plus `settings`: runs are reproducible."""
    base = {name: value for name, value in os.environ.items() if not name.startswith("CROWDTRAIN_")}
    return {**base, **settings}


def lab_module(module: str) -> list[str]:
    """The command that runs `python -m lab.<module>` in a child, which finds `lab` whatever its environment,
    working directory or launcher (e.g. `ip netns exec`): scripts/ goes first on the child's path.
    Arguments follow the returned command as they would follow `python -m lab.<module>`."""
    return [sys.executable, "-c", _RUN_MODULE, str(SCRIPTS), f"lab.{module}"]


def log_tail(path: Path, num_lines: int = 15) -> str:
    """The last lines of a child's log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return "(no log)"


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
        """The next line, stripped; HarnessError after `timeout_s` or when the child closed its stdout."""
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise HarnessError(f"timed out after {timeout_s:g} s waiting for {what}") from None
        if line is None:
            raise HarnessError(f"{what}: the process ended first")
        return line


class Poller:
    """Calls `functions` every `period_s` on a background thread while in its `with` block."""

    def __init__(self, functions: Sequence[Callable[[], None]], period_s: float) -> None:
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
