"""Forked processes never free what their parent owns in shared memory, and make their own torch thread pool.

hivemind starts its DHT, averagers and expert handlers as forked processes, and shares tensors (averaged tensors,
MPFuture states) through torch's `file_system` strategy, which hivemind sets at import: each shared storage keeps a
reference count in its shared-memory file and unlinks the file when the count reaches zero. A forked child inherits
the parent's Python objects, storages included, without adding to those counts. When the child's garbage collector
then frees an inherited object that holds such a storage (garbage the parent had not collected yet at the fork), the
count drops for a reference the child never took: the file is unlinked while the parent still uses it, and whichever
process frees it next fails to unlink it, throws from a C++ destructor and aborts ("Fatal Python error: Aborted",
`could not unlink the shared memory file`; petals met the same crash on hivemind servers). A test run showed it: a
DHT process forked by pytest aborted while "Garbage-collecting" right after the fork.

So, around every fork (os.register_at_fork, which multiprocessing's fork start method goes through): the parent
freezes its objects first, and the child keeps them frozen, out of its collector's reach; the parent unfreezes
after the fork, and its own collector frees that garbage later, as it would have without the fork. (An earlier
version collected before freezing: a full collection of a large test process before each of its many forks cost
minutes of a test run, and freezing alone already keeps the child off the garbage.) This is the pattern the
`gc.freeze` documentation gives for forking servers.

The child can still free an inherited storage by reference count when it drops the last reference, and one such
drop happens in every hivemind child: hivemind.utils.mpfuture.SharedBytes hands out the bytes of MPFuture states
from a shared buffer per process, and a child's first MPFuture replaces the inherited buffer. The child then
unlinks the buffer's file while the parent keeps handing out its bytes; once the parent has shared one more of
them (pickling increments the count, and the receiver cannot open the file to balance it), its own last drop
counts down to zero again, fails to unlink the file and aborts the parent: `could not unlink the shared memory
file`, a daemon (or the test process) gone with "Fatal Python error: Aborted" and no Python frame to blame
(tests/test_forking.py reproduces it). So the child also keeps the inherited buffer referenced for its lifetime:
it costs nothing (the pages are mapped anyway) and leaves the file to the parent.

Third, torch's thread pool. A child inherits the parent's pool object but not its threads; torch marks it at the
fork and replaces it at the next call that asks for it, which every thread's first parallel op makes once
`torch.set_num_threads` was called in the parent (the daemon's throughput probe and `--num-threads` call it). That
replacement is not thread-safe: two threads of a child making their first parallel op at once can see no pool, and
the op raises "pool INTERNAL ASSERT FAILED ... Invalid thread pool!". An averager's all-reduce compresses its parts
in such threads: the part was lost, the round "received 0.0% results" and found no group on retry (test_diloco_outer
after any test that had set the thread count, about every other run; 12 of 40 children in a two-line repro). So the
child replaces the pool at once, in its only thread, before any other starts.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

_installed = False
_kept_from_parent: list[Any] = []
"""In a forked child: shared storages of the parent that the child must never free."""


def _before_fork() -> None:
    gc.freeze()  # garbage included: the parent, whose references it holds, frees it after the fork


def _after_fork_in_parent() -> None:
    gc.unfreeze()


def _after_fork_in_child() -> None:
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")  # never imported here: only if the parent had it
    if mpfuture is not None and mpfuture.SharedBytes._buffer is not None:
        _kept_from_parent.append(mpfuture.SharedBytes._buffer)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())  # a new pool now, while this is the child's only thread


def install() -> None:
    """Register the fork hooks once per interpreter (a forked child inherits them)."""
    global _installed
    if not _installed:
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
        )
        _installed = True
