"""A forked child does not garbage-collect the objects it inherited (crowdtrain/forking.py)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os

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
