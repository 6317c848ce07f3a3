"""The replicas of a stage sum their gradients of an iteration: each publishes its own and fetches the others'.

Each microbatch's gradient landed on exactly one replica of each stage it visited, so the iteration's gradient is
the *sum* of the replicas' `.grad`. Each replica publishes its own, rounded to `gradient_dtype` (bfloat16 by
default: half of float32's bytes, and this exchange is most of what a stage node sends; int8 blocks: a quarter,
with error feedback: what rounding left out of this node's gradient is added to its next one), fetches the others'
(`rpc_stage_gradient`) and adds them, its own as rounded, in peer-ID order, so every replica that heard from all of
them holds the same bits; a replica whose gradient is not had within `exchange_timeout_s` (and `done_timeout_s`
more where this node was done early: the replica may still be waiting for its sources) is left out (its share of
microbatches is lost for the others this iteration, and from then on the replicas differ). Each gradient carries
its replica's fingerprint (`drift`), from which the sum names the replica whose state a drifted node takes.

With `overlap_exchange` the exchange and the step part: the node publishes its gradient of iteration t and fetches
the others' in the background while iteration t + 1 runs. The stage's *true* state (parameters and AdamW's
moments, bit-identical on every replica: `stage_state`) takes the replicas' exact sum of iteration t - 1 at the end
of iteration t (none at the first). The node does not compute on that state but on a look-ahead of it
(`_look_ahead`, the "eager" update of overlapped DiLoCo): the true state stepped by this node's own gradient of
iteration t times the stage's microbatches over its own (its estimate of the sum still in flight), AdamW's moments
left as they were. Stepping on the iteration before's sum alone (the stale step this mode took before) trained
8-19% worse in 20 iterations of llama-20m; the look-ahead computes each gradient near where the exact step will
have moved the state. A joiner, holding the true state of the iteration before its first, fetches the other
replicas' gradients of that iteration for its first step, so it steps as they do. The exchange in the background is
paced to BACKGROUND_SHARE of the links where they are measured (sent at a link's full speed it filled the queue in
front of that link, and the hops behind it waited the whole queue), and its thread, which encodes this node's
gradient and decodes and sums the others', runs BACKGROUND_NICE lower than the rest of the node, so that it takes
the cores the pipeline leaves idle.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from crowdtrain.modes.skippipe.hops.hop_wire import HopFailedError
from crowdtrain.modes.skippipe.replicas.drift import drifted, fingerprint, reference_replica
from crowdtrain.modes.skippipe.replicas.stage_state import StageState

logger = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""With overlap_exchange: how much lower (in nice values) the thread of the background exchange runs than the rest
of the node. Its work (encoding this node's gradient, decoding and summing the others', 6.3M values each for a
llama-20m stage) waits for the cores the pipeline leaves idle instead of delaying the microbatches' compute."""
BACKGROUND_SHARE = 0.5
"""With overlap_exchange: the share of a link the background exchange of the replicas' gradients may take (paced by
the answering node at the slower of its upload's and the caller's download's share, `hop_wire.paced`), so that
the pipeline's hops, which share those links meanwhile, never wait behind a queue it filled."""


@dataclass(frozen=True, slots=True)
class Gathered:
    """A stage's gradient of one iteration, summed over the replicas that published it."""

    total: torch.Tensor
    fingerprints: dict[str, torch.Tensor | None]
    """The fingerprint each summed replica sent with its gradient (this node's own included, if it had one)."""
    failed: tuple[str, ...]
    """Replicas whose gradient was not had: to be suspected."""
    trained: bool
    """Whether the iteration trained anything (a source finished it): its sum is worth a step."""


class GradientExchange(StageState):
    """Sums a `SkipPipeNode`'s stage gradient over the stage's replicas (see the module's doc); the node sets what
    it reads."""

    gradient_dtype: str
    exchange_timeout_s: float
    download_bytes_per_s: float | None
    replicas: dict[int, list[str]]
    suspected: set[str]
    suspect: Callable[[str], None]
    """Leave a peer out of this node's schedules and gradient sums for a while (`SkipPipeNode.suspect`)."""
    peer_id: str
    _positions: list[torch.Tensor]
    _exchanger: ThreadPoolExecutor | None
    _adopted_at: int
    _unsent: torch.Tensor | None
    _own: torch.Tensor | None

    def _sum_gradients(self, iteration: int, trained: bool | None, patience_s: float) -> tuple[int, str | None, bool]:
        """Replace each parameter's `.grad` with the sum over the stage's replicas (each waited for `patience_s` on
        top of `exchange_timeout_s`); (how many were summed, the replica whose state to take after the step because
        this node's parameters drifted from its, or None, whether to step: `trained`, None: whether the sum is not
        zero)."""
        replicas = self.replicas[self.service.stage]
        if len(replicas) == 1:
            with self.service.model_lock:
                alone = any(bool(_grad(parameter).any()) for parameter in self.parameters)
            return 1, None, alone if trained is None else trained
        own, own_fingerprint = self._publish_own(iteration)
        gathered = self._gather(
            iteration, own, own_fingerprint, tuple(replicas), frozenset(self.suspected), trained, patience_s
        )
        return len(gathered.fingerprints), self._take(gathered, own_fingerprint), gathered.trained

    def _overlapped_sum(self, iteration: int, trained: bool | None, patience_s: float) -> tuple[int, str | None, bool]:
        """With overlap_exchange: publish this iteration's gradient and start summing the replicas' in the
        background (each waited for `patience_s` on top of `exchange_timeout_s`); replace `.grad` with the
        replicas' sum of the iteration before. (How many replicas that sum has, the replica whose state to take
        after the step (or None), whether to step.)"""
        replicas = tuple(self.replicas[self.service.stage])
        own, own_fingerprint = self._own_gradient()
        self._own = own  # the look-ahead's estimate of the replicas' sum: this node's gradient as it is
        if self._exchanger is None:
            self._exchanger = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="skippipe-exchange", initializer=lower_priority
            )
        suspected = frozenset(self.suspected)
        background = BACKGROUND_SHARE * self.download_bytes_per_s if self.download_bytes_per_s else math.inf
        exchange = self._exchanger.submit(
            self._publish_and_gather,
            iteration,
            own,
            own_fingerprint,
            replicas,
            suspected,
            trained,
            patience_s,
            background,
        )
        previous, self._pending = self._pending, (iteration, exchange)
        if previous is not None and previous[0] == iteration - 1:
            # fingerprints taken before a state this node has since taken tell nothing of its parameters now
            gathered, fingerprint_then = previous[1].result(), previous[0] > self._adopted_at
        elif iteration > 0 and self.last_iteration == iteration - 1 and len(replicas) > 1:
            # A joiner (or a node whose exchange was cut short) holds the state of the iteration before: its first
            # step is on the other replicas' sum of that iteration, the one they step on now.
            gathered = self._gather(iteration - 1, None, None, replicas, suspected, None)
            fingerprint_then = False
        else:
            return 0, None, False  # the first iteration: nothing summed yet
        reference = self._take(gathered, gathered.fingerprints.get(self.peer_id) if fingerprint_then else None)
        return len(gathered.fingerprints), reference, gathered.trained

    def _look_ahead(self, scale: float) -> None:
        """With overlap_exchange, right after the true step: keep the true state, then step the parameters (not
        AdamW's state) on this node's own gradient times `scale` (the microbatches that visit the stage over those
        this node holds the gradient of: its estimate of the replicas' sum, whose exchange runs during the next
        iteration); 0: none to estimate with, the parameters stay the true ones. The caller holds the model lock."""
        self._keep_true()
        own, self._own = self._own, None
        if own is None or scale <= 0:
            return
        offset = 0
        for parameter in self.parameters:
            count = parameter.numel()
            _grad(parameter).copy_(own[offset : offset + count].view_as(parameter)).mul_(scale)
            offset += count
        self.optimizer.step()
        self._restore_true(parameters=False)

    def _publish_own(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's gradient of `iteration` as published for the other replicas (`_publish`) and the
        fingerprint of its parameters."""
        own, own_fingerprint = self._own_gradient()
        return self._publish(iteration, own, own_fingerprint), own_fingerprint

    def _own_gradient(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's gradient of the iteration (flattened, a copy) and the fingerprint of its (true)
        parameters."""
        with self.service.model_lock:
            own = torch.cat([_grad(p).reshape(-1) for p in self.parameters])
            return own, fingerprint(self.true_parameters(), self._positions)

    def _publish(self, iteration: int, own: torch.Tensor, own_fingerprint: torch.Tensor) -> torch.Tensor:
        """Publish `own` as this replica's gradient of `iteration`, with its fingerprint; what the others receive
        (rounded to gradient_dtype: every replica sums what each one published, so this node's own term is that).
        In int8 the rounding's error is carried to the next iteration's gradient (error feedback): int8 blocks
        round a value under 1/254 of its block's largest to zero, and without it a parameter whose gradient stays
        that small would never move. Touches nothing but the error carried: it may run in the background."""
        if self.gradient_dtype == "int8" and self._unsent is not None:
            own = own + self._unsent
        if not bool(torch.isfinite(own).all()):
            return self._publish_none(iteration, own, own_fingerprint, "holds NaN or infinite values")
        try:
            sent = self.service.publish_gradient(iteration, own, own_fingerprint, self.gradient_dtype)
        except ValueError as e:  # finite values past the wire dtype's range (rounded to infinity)
            return self._publish_none(iteration, own, own_fingerprint, str(e))
        self._unsent = own - sent if self.gradient_dtype == "int8" else None
        return sent

    def _publish_none(
        self, iteration: int, own: torch.Tensor, own_fingerprint: torch.Tensor, reason: str
    ) -> torch.Tensor:
        """Publish zeros in place of a gradient of `iteration` that can't be sent (`reason`): the replicas, this
        one included, sum the others' gradients and never this one's, and none waits for it."""
        logger.warning(
            f"this node's gradient of iteration {iteration} is not published ({reason}): the stage's replicas "
            "step on the others' gradients"
        )
        self._unsent = None
        zeros = torch.zeros_like(own)
        return self.service.publish_gradient(iteration, zeros, own_fingerprint, self.gradient_dtype)

    def _publish_and_gather(
        self,
        iteration: int,
        own: torch.Tensor,
        own_fingerprint: torch.Tensor,
        replicas: tuple[str, ...],
        suspected: frozenset[str],
        trained: bool | None,
        patience_s: float,
        max_bytes_per_s: float,
    ) -> Gathered:
        """With overlap_exchange, in the background: `_publish` then `_gather`."""
        sent = self._publish(iteration, own, own_fingerprint)
        return self._gather(iteration, sent, own_fingerprint, replicas, suspected, trained, patience_s, max_bytes_per_s)

    def _gather(
        self,
        iteration: int,
        own: torch.Tensor | None,
        own_fingerprint: torch.Tensor | None,
        replicas: tuple[str, ...],
        suspected: frozenset[str],
        trained: bool | None,
        patience_s: float = 0.0,
        max_bytes_per_s: float = 0.0,
    ) -> Gathered:
        """The sum of `replicas`' gradients of `iteration`, in peer-ID order (the same bits on every replica that
        heard from the same ones): this node's `own` (None: none of its own, as a joiner's), the others' fetched
        (each waited for `exchange_timeout_s` and `patience_s`; `max_bytes_per_s` > 0: in the background, paced,
        `StageService.fetch_gradient`), `suspected` ones left out. `trained` None: whether the sum is not zero (a
        joiner can't know otherwise). Touches no state of this node: it may run in the background."""
        numel = sum(parameter.numel() for parameter in self.parameters)
        total = torch.zeros(numel)
        summed: dict[str, torch.Tensor | None] = {}
        failed: list[str] = []
        for peer in replicas:  # peer-ID order: the same sum, bit for bit, on every replica
            if peer == self.peer_id:
                if own is None:
                    continue
                gradient, summed[peer] = own, own_fingerprint
            elif peer in suspected:
                continue
            else:
                try:
                    gradient, summed[peer] = self.service.fetch_gradient(
                        peer, iteration, numel, self.exchange_timeout_s + patience_s, max_bytes_per_s
                    )
                except HopFailedError as e:
                    logger.warning(f"{e}; the stage's step goes on without it")
                    failed.append(peer)
                    continue
            total += gradient.to(total.device)
        trained = bool(total.any()) if trained is None else trained
        return Gathered(total=total, fingerprints=summed, failed=tuple(failed), trained=trained)

    def _take(self, gathered: Gathered, own_fingerprint: torch.Tensor | None) -> str | None:
        """Make `gathered`'s sum each parameter's `.grad` and suspect the replicas it lacks; the replica whose state
        to take after the step because this node's parameters (`own_fingerprint`, None: not known) drifted from
        its, or None."""
        for peer in gathered.failed:
            self.suspect(peer)
        with self.service.model_lock:
            offset = 0
            for parameter in self.parameters:
                count = parameter.numel()
                _grad(parameter).copy_(gathered.total[offset : offset + count].view_as(parameter))
                offset += count
        reference = reference_replica(gathered.fingerprints)
        theirs = gathered.fingerprints.get(reference) if reference is not None else None
        if own_fingerprint is None or reference == self.peer_id or theirs is None:
            return None
        return reference if drifted(own_fingerprint, theirs) else None

    def close(self) -> None:
        """Stop the background exchange (overlap_exchange), if any."""
        if self._exchanger is not None:
            self._exchanger.shutdown(wait=False, cancel_futures=True)


def lower_priority() -> None:
    """Run the calling thread BACKGROUND_NICE lower than the rest of the node (Linux: a thread's own nice value;
    elsewhere nothing)."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICE)
    except OSError as e:
        logger.debug(f"the background exchange runs at the node's priority: {e}")


def _grad(parameter: torch.nn.Parameter) -> torch.Tensor:
    if parameter.grad is None:
        parameter.grad = torch.zeros_like(parameter)
    return parameter.grad
