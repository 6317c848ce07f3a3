"""A local demo swarm: N crowdtrain daemons on loopback and `crowdtrain status` live, until Ctrl-C.

Each daemon gets its own state dir and log file under --dir (default .demo-swarm/), so the
swarm resumes with the same identities next time. Ctrl-C stops the status view, then every
daemon leaves the swarm cleanly (SIGTERM), with a hard kill for any that takes over 30 s. Closing the
terminal (SIGHUP) or a SIGTERM stops the swarm the same way: the daemons run in sessions of their own,
so nothing else would stop them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LEAVE_TIMEOUT_S = 30.0
START_TIMEOUT_S = 90.0


def start_daemon(index: int, root: Path, initial_peers: list[str]) -> tuple[subprocess.Popen, Path]:
    state_dir = root / f"node{index}"
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "node.json").unlink(missing_ok=True)
    command = [sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(state_dir)]
    command += ["--listen", "/ip4/127.0.0.1/tcp/0"]
    if initial_peers:
        command += ["--initial-peers", *initial_peers]
    log = open(root / f"node{index}.log", "ab")
    # One torch thread per daemon: N daemons share this machine's cores instead of oversubscribing them.
    env = {**os.environ, "CROWDTRAIN_NUM_THREADS": os.environ.get("CROWDTRAIN_NUM_THREADS", "1")}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return process, state_dir


def await_ready(process: subprocess.Popen, state_dir: Path, log_path: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"daemon in {state_dir} exited with code {process.returncode}; see {log_path}")
        try:
            info = json.loads((state_dir / "node.json").read_text())
            if info.get("pid") == process.pid:
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"daemon in {state_dir} did not start within {START_TIMEOUT_S:.0f} s; see {log_path}")


def stop_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + LEAVE_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _say(line: str) -> None:
    """Print, unless the terminal is gone (closed after SIGHUP): the swarm must still be stopped."""
    try:
        print(line, flush=True)
    except OSError:
        pass


def main() -> None:
    for signum in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, _interrupt)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=3, help="number of daemons (default: 3)")
    parser.add_argument("--dir", type=Path, default=Path(".demo-swarm"), help="state dirs and logs")
    parser.add_argument("--watch", type=float, default=2.0, help="status refresh period in seconds")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen] = []
    try:
        first, first_dir = start_daemon(0, args.dir, [])
        processes.append(first)
        print(f"starting {args.peers} daemons; logs in {args.dir}/node*.log", flush=True)
        founder = await_ready(first, first_dir, args.dir / "node0.log")
        joiners = [start_daemon(index, args.dir, founder["multiaddrs"]) for index in range(1, args.peers)]
        processes += [process for process, _ in joiners]
        for index, (process, state_dir) in enumerate(joiners, start=1):
            await_ready(process, state_dir, args.dir / f"node{index}.log")
        print("all daemons are up; Ctrl-C stops the swarm", flush=True)
        status = [
            sys.executable,
            "-m",
            "crowdtrain",
            "status",
            "--state-dir",
            str(first_dir),
            "--watch",
            str(args.watch),
        ]
        subprocess.run(status)
    except KeyboardInterrupt:
        pass
    finally:
        for signum in (signal.SIGHUP, signal.SIGTERM):  # a second signal must not cut the daemons' leave short
            signal.signal(signum, signal.SIG_IGN)
        _say("stopping the swarm…")
        stop_all(processes)


if __name__ == "__main__":
    main()
