"""What a stage node keeps of its iterations, and the calls a node's iteration makes on it between hops.

A node keeps the forwards it ran until their backward comes (`HeldForward`, at most `memory_microbatches`), and per
iteration: the backwards run here, the sources that said they are done and their losses, the sequences it ran
forward, and the last two gradients it published for its stage's other replicas. `StageService`'s handlers fill it;
the node's iteration (`iteration.SkipPipeNode`) opens and holds iterations on it, waits on it for its sources, and
forgets an iteration once it has stepped. Done messages are kept for at most MAX_ITERATIONS_AHEAD iterations at
once, so that no peer can make a node keep a crowd of them, and only from the roster's nodes, for iterations at
most MAX_ITERATIONS_AHEAD past the node's own or, while it is held, past the newest roster's (`hop_callers`).
"""

from __future__ import annotations

import threading
import time
import typing
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from crowdtrain import proto
from crowdtrain.modes.skippipe.hops.device_clock import DeviceClock
from crowdtrain.modes.skippipe.hops.hop_callers import IterationCallers
from crowdtrain.modes.skippipe.hops.hop_wire import GRADIENT_DTYPES, MAX_FINGERPRINT, wire_bytes, wire_values

MAX_ITERATIONS_AHEAD = 64
"""Done messages are kept for at most this many iterations at once, from the open one on (the rest are dropped)."""

PublishedGradient = tuple[int, bytes, torch.Tensor, str]
"""A published gradient: how many values, their wire bytes, the fingerprint, the wire dtype."""


@dataclass(slots=True)
class HeldForward:
    """A forward this node ran and whose backward it waits for."""

    inputs: torch.Tensor
    outputs: torch.Tensor
    since: float
    forward_s: float = 0.0
    """Seconds the forward held the device (`DeviceClock`)."""


class StageLedger:
    """A stage node's record of its iterations (see the module's doc); `StageService` sets its state."""

    stage: int
    memory_microbatches: int
    model_lock: threading.Lock
    device: DeviceClock
    _held: OrderedDict[tuple[str, int, int], HeldForward]
    _held_lock: threading.Lock
    _backwards: dict[int, set[tuple[str, int]]]
    _backwards_changed: threading.Condition
    _open: int | None
    _done_from: int | None
    _done: dict[int, set[str]]
    _losses: dict[int, dict[str, tuple[float, int]]]
    _rows: Counter[int]
    _gradients: OrderedDict[int, PublishedGradient]
    _callers: IterationCallers | None
    _members: frozenset[str] | None
    _done_ceiling: int | None

    def set_stage(self, stage: int, memory_microbatches: int) -> None:
        """Serve `stage` from now on (between iterations: forwards held and gradients published are dropped)."""
        if memory_microbatches < 1:
            raise ValueError(f"memory_microbatches must be >= 1, got {memory_microbatches}")
        with self.model_lock, self._held_lock:
            self.stage, self.memory_microbatches = stage, memory_microbatches
            self._held.clear()
            self.device.clear()
            self._gradients.clear()

    def open_iteration(self, iteration: int, callers: IterationCallers | None = None) -> None:
        """Serve forwards of `iteration` from now on (and refuse those of others), its hops only from `callers`
        (None: from any peer, in any wire dtype: a tool's service, not a daemon's)."""
        with self._held_lock:
            self._open = self._done_from = iteration
            self._callers = callers

    def set_members(self, members: typing.Collection[str], newest_iteration: int) -> None:
        """Keep done messages only from `members` (every node of the rosters this node knows) and, while held, of
        iterations at most MAX_ITERATIONS_AHEAD past `newest_iteration` (the newest roster's first iteration)."""
        with self._held_lock:
            self._members, self._done_ceiling = frozenset(members), newest_iteration + MAX_ITERATIONS_AHEAD

    def hold(self, iteration: int) -> None:
        """While this node runs no iteration (starting, joining, or left out of the roster) and does not know its
        next one: serve no forward past `iteration` (those of later ones wait, then are refused), and keep the done
        messages of the newest MAX_ITERATIONS_AHEAD iterations, whichever its next turns out to be. Before, a node
        held at iteration -1 kept only iterations -1..63: a joiner entering a swarm at iteration 487 dropped the
        other sources' done messages, waited for them until its replica gave up on it, and was dropped from the
        roster (a fresh-clone CI run)."""
        with self._held_lock:
            self._open, self._done_from = iteration, None

    def wait_sources(
        self,
        iteration: int,
        sources: typing.Collection[str],
        timeout_s: float,
        backwards: typing.Collection[tuple[str, int]] | None = None,
    ) -> set[str]:
        """Wait until every one of `sources` said it is done with `iteration`, or the backwards of every one of
        `backwards` ((source, microbatch); None: not these) ran here, or `timeout_s`; the sources that said so."""
        deadline = time.monotonic() + timeout_s
        with self._backwards_changed:
            while (
                not set(sources) <= self._done.get(iteration, set())
                and not (backwards is not None and set(backwards) <= self._backwards.get(iteration, set()))
                and (left := deadline - time.monotonic()) > 0
            ):
                self._backwards_changed.wait(left)
            return self._done.get(iteration, set()) & set(sources)

    def publish_gradient(
        self, iteration: int, gradient: torch.Tensor, fingerprint: torch.Tensor, dtype: str = "float32"
    ) -> torch.Tensor:
        """Serve `gradient` (flattened) as this replica's of `iteration`, sent as `dtype` (one of GRADIENT_DTYPES),
        with the `fingerprint` of its parameters before the iteration's step (float32, at most MAX_FINGERPRINT
        values); the last two are kept. The float32 values the other replicas will receive (where every replica
        must sum the same bits, this node's own term is these)."""
        if fingerprint.numel() > MAX_FINGERPRINT:
            raise ValueError(f"a fingerprint holds at most {MAX_FINGERPRINT} values")
        if dtype not in GRADIENT_DTYPES:
            raise ValueError(f"a gradient travels as one of {sorted(GRADIENT_DTYPES)}, not {dtype!r}")
        payload = wire_bytes(gradient.reshape(-1), dtype)
        sent = wire_values(payload, [gradient.numel()], dtype)
        with self._held_lock:
            self._gradients[iteration] = (gradient.numel(), payload, fingerprint.detach().float().cpu(), dtype)
            while len(self._gradients) > 2:
                self._gradients.popitem(last=False)
        return sent

    def backwards_run(self, iteration: int) -> set[tuple[str, int]]:
        """(source, microbatch) of each backward of `iteration` run here (until it finishes)."""
        with self._held_lock:
            return set(self._backwards.get(iteration, ()))

    def finish_iteration(self, iteration: int) -> int:
        """Forget `iteration`'s held forwards and backward count (its step is taken); how many forwards were still
        held without their backward."""
        with self._held_lock:
            stale = [key for key in self._held if key[1] <= iteration]
            for key in stale:
                del self._held[key]
            for old in [old for old in self._backwards if old <= iteration]:
                del self._backwards[old]
            for old in [old for old in self._done if old <= iteration]:
                del self._done[old]
            for old in [old for old in self._losses if old < iteration]:  # its own: for late done messages
                del self._losses[old]
            for old in [old for old in self._rows if old <= iteration]:
                del self._rows[old]
        return len(stale)

    def sources_losses(self, iteration: int) -> list[tuple[float, int]]:
        """(mean loss, microbatches) of each source that said it is done with `iteration` (until the next one
        finishes)."""
        with self._held_lock:
            return list(self._losses.get(iteration, {}).values())

    def rows_served(self, iteration: int) -> int:
        """Sequences whose hidden states this node ran forward in `iteration` (until it finishes)."""
        with self._held_lock:
            return self._rows[iteration]

    @property
    def held_microbatches(self) -> int:
        with self._held_lock:
            return len(self._held)

    def _keeps_done(self, iteration: int) -> bool:
        """Whether a done message of `iteration` is kept: while this node runs iterations, from the open one on,
        within MAX_ITERATIONS_AHEAD; before its first one and while it is held (`hold`), the newest
        MAX_ITERATIONS_AHEAD iterations' (older ones are dropped), none past the newest roster's first iteration by
        more than MAX_ITERATIONS_AHEAD (`set_members`). Under the lock."""
        if self._done_from is not None:
            return self._done_from <= iteration <= self._done_from + MAX_ITERATIONS_AHEAD
        if self._done_ceiling is not None and iteration > self._done_ceiling:
            return False
        if iteration in self._done or len(self._done) < MAX_ITERATIONS_AHEAD:
            return True
        oldest = min(self._done)
        if oldest > iteration:
            return False
        self._done.pop(oldest)
        self._losses.pop(oldest, None)
        return True

    def _published(self, request: proto.StageHop) -> PublishedGradient | typing.Literal[False] | None:
        """This node's gradient that `request` asks for, as published; None: not yet; False: none will come (of
        another stage than this node's, or older than those kept)."""
        with self._held_lock:
            if request.stage != self.stage:
                return False
            if request.iteration in self._gradients:
                return self._gradients[request.iteration]
            return False if self._gradients and request.iteration < next(iter(self._gradients)) else None
