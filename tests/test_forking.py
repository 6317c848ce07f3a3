"""Forked children leave what they inherit to their parent: garbage and MPFuture buffers (crowdtrain/forking.py)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys

import crowdtrain  # noqa: F401  (installs the fork hooks)


class Marked:
    """A cycle's member that reports, through a pipe, the process that finalized it."""

    def __init__(self, pipe: object):
        self.pipe = pipe
        self.cycle = self

    def __del__(self) -> None:
        self.pipe.send(os.getpid())  # type: ignore[attr-defined]


def _collect_in_child(done: object) -> None:
    gc.collect()
    done.send("collected")  # type: ignore[attr-defined]


def test_garbage_at_a_fork_is_left_to_the_parent_and_never_collected_by_the_child() -> None:
    receiver, sender = mp.Pipe(duplex=False)
    gc.disable()  # keep the cycle uncollected until the fork, as between two automatic collections
    try:
        Marked(sender)  # unreachable at once: garbage waiting for a collection
        child_receiver, child_sender = mp.Pipe(duplex=False)
        child = mp.get_context("fork").Process(target=_collect_in_child, args=(child_sender,))
        child.start()
        assert child_receiver.poll(30) and child_receiver.recv() == "collected"
        child.join(30)
        # the child's collector ran and left it alone
        assert not receiver.poll(0.5)
        gc.collect()  # the parent's collector, after the fork, is the one that frees it
        assert receiver.poll(5) and receiver.recv() == os.getpid()
        assert not receiver.poll(0.5)
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0, "the parent's objects are unfrozen after the fork"


SHARED_BYTES_SCENARIO = """
import gc, multiprocessing as mp, sys
if sys.argv[1] == "hooks":
    import crowdtrain  # noqa: F401
from multiprocessing.reduction import ForkingPickler
from hivemind.utils.mpfuture import MPFuture, SharedBytes

done = MPFuture()  # the parent's shared buffer of MPFuture states, referenced by SharedBytes alone
done.set_result(None)
del done
child = mp.get_context("fork").Process(target=MPFuture)  # a child's first MPFuture replaces the inherited buffer
child.start()
child.join(30)
later = MPFuture()  # the next byte of the parent's buffer, shared with a process that never reads it
ForkingPickler.dumps(later._shared_state_code)
later.set_result(None)
del later
SharedBytes._buffer = None  # the parent's last reference to the buffer
gc.collect()
print("the parent outlived its shared buffer")
"""


def _shared_bytes_scenario(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SHARED_BYTES_SCENARIO, mode], capture_output=True, text=True, timeout=120
    )


def test_a_child_never_frees_the_parents_mpfuture_buffer_so_the_parent_does_not_abort() -> None:
    without = _shared_bytes_scenario("plain")
    # the crash this guards against: the child unlinked the buffer's file, the parent's last drop aborts
    assert without.returncode == -signal.SIGABRT, without.stdout + without.stderr[-2000:]
    assert "could not unlink the shared memory file" in without.stderr
    hooked = _shared_bytes_scenario("hooks")
    assert hooked.returncode == 0, hooked.stderr[-2000:]
    assert "the parent outlived its shared buffer" in hooked.stdout


THREAD_POOL_SCENARIO = """
import multiprocessing as mp, sys, threading
if sys.argv[1] == "hooks":
    import crowdtrain  # noqa: F401
import torch

def first_parallel_ops_at_once(failures):
    barrier = threading.Barrier(4)
    def op():
        barrier.wait()
        try:
            torch.nonzero(torch.ones(1000))  # as SparseFloat16 does in an averager's threads
        except RuntimeError as e:
            failures.put(str(e).splitlines()[0])
    threads = [threading.Thread(target=op) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures.put(None)

torch.set_num_threads(2)  # as the daemon's throughput probe does, before it trains
torch.nonzero(torch.ones(1000))
context = mp.get_context("fork")
failed = []
for _ in range(40):
    failures = context.Queue()
    child = context.Process(target=first_parallel_ops_at_once, args=(failures,))
    child.start()
    reasons = [reason for reason in iter(failures.get, None)]
    child.join(30)
    failed += reasons[:1]
print(f"{len(failed)} of 40 children failed", *failed[:1])
"""


def _thread_pool_scenario(mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", THREAD_POOL_SCENARIO, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_child_makes_its_own_torch_thread_pool_before_its_threads_race_for_it() -> None:
    # Without the hooks about 3 children in 10 fail: torch replaces the inherited pool at a thread's first
    # parallel op, and two threads doing that at once can find none. All 40 pass by chance about once in 10^6.
    without = _thread_pool_scenario("plain")
    assert "Invalid thread pool" in without and not without.startswith("0 of 40"), without
    hooked = _thread_pool_scenario("hooks")
    assert hooked.startswith("0 of 40 children failed"), hooked
