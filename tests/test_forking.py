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


def test_garbage_at_a_fork_is_collected_by_the_parent_and_never_by_the_child() -> None:
    receiver, sender = mp.Pipe(duplex=False)
    gc.disable()  # keep the cycle uncollected until the fork, as between two automatic collections
    try:
        Marked(sender)  # unreachable at once: garbage waiting for a collection
        child_receiver, child_sender = mp.Pipe(duplex=False)
        child = mp.get_context("fork").Process(target=_collect_in_child, args=(child_sender,))
        child.start()
        assert child_receiver.poll(30) and child_receiver.recv() == "collected"
        child.join(30)
        finalized_by = [receiver.recv() for _ in range(1) if receiver.poll(5)]
        # the parent collected it just before forking; the child, whose collector ran, never finalized it
        assert finalized_by == [os.getpid()]
        assert not receiver.poll(0.5)
    finally:
        gc.enable()
    assert gc.get_freeze_count() == 0, "the parent's objects are unfrozen after the fork"
