"""SkipPipe's source side: a stage-0 node runs its microbatches along their paths, hop by hop, and back.

For a microbatch with route (0, p_1, ..., p_V) (`planning.skippipe.Route`), the source embeds the tokens and runs
stage 0's first layers, then sends the hidden states to the node scheduled for p_1, its answer to the node for
p_2, and so on (`StageService.call`, source-routed: each hop returns to the source). The last answer goes through
the head and the loss here; the loss's gradient then goes back along the same nodes in reverse, each answering
the gradient of what it was sent, and finally through stage 0's layers and the embeddings here. Every node's
parameters collect their share of the iteration's gradient in `.grad`. The source's three holds of its model
lock for a microbatch whose backward came back whole count as one sample of its `DeviceClock`.

Failures within the iteration, as SkipPipe's paper leaves them out and a volunteer swarm needs them:
- a forward hop that fails (refused, busy, timed out, unreachable, malformed answer) goes to the stage's other
  live replicas in peer-ID order; with none left the stage is skipped for this microbatch (SkipPipe trains
  models to tolerate skipped stages) and the next hop takes the same hidden states;
- a backward hop that fails is run again on another replica from what was sent to the failed one (a forward to
  recompute, then the backward): same weights after the stage's averaging, so the same gradient; with none
  left, the stages before it on the path (stage 0 included) get no gradient from this microbatch, the stages
  after it already have theirs; the outcome says which;
- a node that failed a hop is avoided for the rest of the iteration (`failed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from crowdtrain import proto
from crowdtrain.modes.skippipe.hops.hop_wire import WIRE_DTYPES, HopFailedError
from crowdtrain.modes.skippipe.hops.stage_service import StageService
from crowdtrain.modes.skippipe.roster.schedule import Route

logger = logging.getLogger(__name__)

DEFAULT_HOP_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True, slots=True)
class MicrobatchOutcome:
    """What happened to one microbatch on its path."""

    microbatch: int
    loss: float
    """Its loss (unscaled)."""
    stages: tuple[int, ...]
    """The stages that ran its forward, in order, 0 first."""
    peers: tuple[str, ...]
    """The node of each of `stages` (this node for stage 0)."""
    rerouted: int
    """Hops (forward or backward) served by another replica than the one scheduled."""
    skipped: tuple[int, ...]
    """Scheduled stages no replica ran: the microbatch went on without them."""
    backward_lost: tuple[int, ...]
    """Stages of `stages` whose layers got no gradient from this microbatch (a backward found no replica)."""
    seconds: float


@dataclass(slots=True)
class _Hop:
    stage: int
    peer: str
    sent: torch.Tensor


@dataclass(kw_only=True)
class PipelineDriver:
    """Runs a stage-0 node's microbatches along their routes through `service` (this node's, serving stage 0)."""

    service: StageService
    replicas: Mapping[int, Sequence[str]]
    """Peer IDs serving each stage 1..S-1 (this iteration's swarm): where a failed hop goes instead."""
    wire_dtype: str = "float16"
    hop_timeout_s: float = DEFAULT_HOP_TIMEOUT_S
    failed: set[str] = field(default_factory=set)
    """Peers that failed a hop in this iteration: not asked again until `new_iteration`."""
    refused: set[str] = field(default_factory=set)
    """Of `failed`, those whose handler answered with a refusal: they are there, and are not suspected of being gone."""

    def __post_init__(self) -> None:
        if self.service.stage != 0:
            raise ValueError(f"a pipeline driver runs on a stage-0 node, not on one of stage {self.service.stage}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {self.wire_dtype!r}")

    def new_iteration(self, replicas: Mapping[int, Sequence[str]]) -> None:
        """Take the next iteration's swarm; failed peers get another chance."""
        self.replicas = replicas
        self.failed, self.refused = set(), set()

    def run_iteration(
        self,
        iteration: int,
        routes: Sequence[Route],
        batches: Sequence[torch.Tensor],
        *,
        in_flight: int = 1,
        loss_scale: float | None = None,
    ) -> list[MicrobatchOutcome]:
        """Run each route with its batch of token ids, up to `in_flight` microbatches at once; each one's loss counts
        `loss_scale` (default 1/len(routes)) of the iteration's gradient."""
        if len(routes) != len(batches):
            raise ValueError(f"{len(routes)} routes for {len(batches)} batches")
        if not routes:
            return []
        scale = 1.0 / len(routes) if loss_scale is None else loss_scale
        if in_flight <= 1:
            return [
                self.run_microbatch(iteration, route, batch, scale)
                for route, batch in zip(routes, batches, strict=True)
            ]
        with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="skippipe-microbatch") as pool:
            futures = [
                pool.submit(self.run_microbatch, iteration, route, batch, scale)
                for route, batch in zip(routes, batches, strict=True)
            ]
            return [future.result() for future in futures]

    def run_microbatch(
        self, iteration: int, route: Route, input_ids: torch.Tensor, loss_scale: float = 1.0
    ) -> MicrobatchOutcome:
        """Forward `input_ids` [batch, sequence] along `route`, the loss here, and the backward back; the
        gradients of every stage it ran, times `loss_scale`, are added to their nodes' `.grad`."""
        started = time.perf_counter()
        staged, lock, clock = self.service.staged, self.service.model_lock, self.service.device
        spent: list[float] = []  # the device's holds for this microbatch (`DeviceClock`)
        with clock.timed(lock, spent):
            first = staged.run_stage(0, staged.embed(input_ids)).hidden_states
        hops: list[_Hop] = []
        skipped: list[int] = []
        rerouted = 0
        hidden = first.detach()
        for stage, peer in zip(route.stages[1:], route.path[1:], strict=True):
            for candidate in self._candidates(stage, peer):
                try:
                    answer = self._hop(candidate, "forward", iteration, route.microbatch, stage, hidden)
                except HopFailedError as e:
                    self._fail(candidate, e)
                    continue
                hops.append(_Hop(stage, candidate, hidden))
                rerouted += candidate != peer
                hidden = answer
                break
            else:
                skipped.append(stage)
        last = hidden.requires_grad_(True) if hops else first
        with clock.timed(lock, spent):
            loss = staged.head_loss(last, input_ids)
            (loss * loss_scale).backward()
        lost: list[int] = []
        grad = last.grad if hops else None
        for index in range(len(hops) - 1, -1, -1):
            assert grad is not None
            hop = hops[index]
            answer_and_peer = self._backward(iteration, route.microbatch, hop, grad)
            if answer_and_peer is None:
                lost = [0, *(earlier.stage for earlier in hops[: index + 1])]
                break
            grad, peer_used = answer_and_peer
            rerouted += peer_used != hop.peer
            hop.peer = peer_used
        else:
            if hops:
                assert grad is not None
                with clock.timed(lock, spent):
                    first.backward(grad.to(first.device))
        if not lost:  # a microbatch whose backward stopped short held the device for only part of its cost
            clock.record(sum(spent))
        return MicrobatchOutcome(
            microbatch=route.microbatch,
            loss=float(loss.detach()),
            stages=(0, *(hop.stage for hop in hops)),
            peers=(self.service.peer_id, *(hop.peer for hop in hops)),
            rerouted=rerouted,
            skipped=tuple(skipped),
            backward_lost=tuple(lost),
            seconds=time.perf_counter() - started,
        )

    def _backward(
        self, iteration: int, microbatch: int, hop: _Hop, grad: torch.Tensor
    ) -> tuple[torch.Tensor, str] | None:
        """The gradient of what `hop` was sent, from its node or, recomputed, from another replica; None if none."""
        for candidate in self._candidates(hop.stage, hop.peer):
            try:
                if candidate != hop.peer:  # it holds no forward of this microbatch: run one first
                    self._hop(candidate, "forward", iteration, microbatch, hop.stage, hop.sent)
                return self._hop(candidate, "backward", iteration, microbatch, hop.stage, grad), candidate
            except HopFailedError as e:
                self._fail(candidate, e)
        return None

    def _candidates(self, stage: int, scheduled: str) -> list[str]:
        """Who may run `stage`: the scheduled node first, then the stage's other replicas; none that failed."""
        others = sorted(peer for peer in self.replicas.get(stage, ()) if peer != scheduled)
        return [peer for peer in (scheduled, *others) if peer not in self.failed]

    def _hop(
        self, peer: str, call: str, iteration: int, microbatch: int, stage: int, tensor: torch.Tensor
    ) -> torch.Tensor:
        header = proto.StageHop(iteration=iteration, microbatch=microbatch, stage=stage, dtype=self.wire_dtype)
        return self.service.call(peer, call, header, tensor.detach(), self.hop_timeout_s)

    def _fail(self, peer: str, error: HopFailedError) -> None:
        """A failed peer is not asked again in this iteration; a busy one is, by later microbatches."""
        logger.warning(f"{error}; asking another replica")
        if not error.busy:
            self.failed.add(peer)
        if error.refused:
            self.refused.add(peer)
