"""One node's SkipPipe iteration: the schedule, the microbatches, the stage's gradient summed over its replicas, a step.

Every node computes the iteration's schedule from the same inputs (`planning.skippipe.schedule_microbatches`:
the swarm's nodes, seeded by the iteration), so no message carries it. An iteration on a node of stage s:

1. open the iteration: forwards of it are served from now on (`StageService.open_iteration`);
2. a stage-0 node runs the routes whose source it is (`PipelineDriver`, up to `in_flight` at once), then tells
   every other node it is done with the iteration (`rpc_stage_done`);
3. every node waits until each source of the schedule said it is done (or `done_timeout_s`; a source that does
   not answer a ping while it is waited for is gone, and not waited for);
   a peer that failed a hop, a done message or the exchange is *suspected* and left out of this node's later
   schedules (nodes may then differ on a schedule; only the balance suffers: step 3 waits for done messages,
   not for counts, and every source tells every node);
4. the stage's gradient: each microbatch's gradient landed on exactly one replica of each stage it visited, so the
   iteration's gradient is the *sum* of the replicas' `.grad`. Each replica publishes its own and fetches the
   others' (`rpc_stage_gradient`), and adds them in peer-ID order, so every replica that heard from all of them
   holds the same bits; a replica that does not answer within `exchange_timeout_s` is left out (its share of
   microbatches is lost for the others this iteration, and the replicas may differ until they average again);
5. clip to `max_grad_norm`, the optimizer's step, gradients zeroed, the iteration closed.

Each microbatch's loss counts 1/M of the iteration's gradient (M microbatches in the iteration), as in one
process with gradient accumulation. Replicas that summed the same gradients hold the same parameters and AdamW
moments; a joining replica takes them from one (`join`, `rpc_stage_state`), checked: the stage's exact number of
float32 values, finite, second moments not negative.

The caller passes the nodes, the same list on every node (`set_nodes` between iterations; in a run, the roster of
`pipeline.membership`). Not done yet (issue 17): average weights between replicas that drifted apart (a replica that
missed another's gradient steps differently from then on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from crowdtrain.pipeline.driver import MicrobatchOutcome, PipelineDriver
from crowdtrain.pipeline.stage_service import HopFailedError, StageService
from crowdtrain.planning.skippipe import NodeInfo, Schedule, SkipPipeProblem, schedule_microbatches

logger = logging.getLogger(__name__)

PING_EVERY_S = 2.0
"""While waiting for the sources, how often the ones not done yet are asked whether they are still there."""
PING_TIMEOUT_S = 2.0
STATE_PARTS = 3
"""A stage's state for a joiner: its parameters, AdamW's first moments, its second moments."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationReport:
    """What one node saw of one iteration."""

    iteration: int
    outcomes: tuple[MicrobatchOutcome, ...]
    """The microbatches this node drove (stage-0 nodes only)."""
    sources_done: int
    """Sources that said they were done, of `sources`."""
    sources: int
    replicas_summed: int
    """Replicas of this node's stage whose gradient went into the step, this one included."""
    replicas: int
    seconds: float
    phase_seconds: dict[str, float]
    """Where the time went: microbatches, waiting for sources, the gradient exchange, the step."""
    loss: float | None = None
    """The mean loss of the iteration's microbatches, as the sources that said they were done (and this node, if a
    source) reported them; None if none did."""
    samples: int = 0
    """Sequences this node computed in the iteration: those it drove (a source) or ran forward (other stages)."""


@dataclass(kw_only=True)
class SkipPipeNode:
    """Runs SkipPipe iterations on one node serving `service.stage`."""

    service: StageService
    nodes: Sequence[NodeInfo]
    """Every node of the swarm, this one included (the same list on every node)."""
    num_microbatches: int
    skip_ratio: float
    reorder: bool
    optimizer: torch.optim.Optimizer
    batch: Callable[[int, int], torch.Tensor]
    """The token ids [batch, sequence] of microbatch m of iteration i, `batch(i, m)`, for a stage-0 node."""
    wire_dtype: str = "float16"
    in_flight: int = 2
    max_grad_norm: float = 1.0
    hop_timeout_s: float = 30.0
    done_timeout_s: float = 120.0
    exchange_timeout_s: float = 30.0
    scheduler: Callable[[SkipPipeProblem], Schedule] = schedule_microbatches
    """SkipPipe's scheduler, or a baseline of `planning.skippipe` (`full_pipeline`, `random_skipping`)."""
    parameters: list[torch.nn.Parameter] = field(init=False)
    suspected: set[str] = field(default_factory=set)
    """Peers that failed a hop, a done message or a gradient exchange: left out of later schedules."""

    def __post_init__(self) -> None:
        if type(self.optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(f"a SkipPipe node's stage state is AdamW's; got {type(self.optimizer).__name__}")
        self.parameters = self.service.staged.stage_parameters(self.service.stage)
        self.last_iteration = -1
        """The last iteration this node stepped (or took the state of); -1 before any."""
        self.service.set_state_source(self._state)
        self.peer_id = self.service.peer_id
        self.replicas = _replicas(self.nodes)
        self.driver = (
            PipelineDriver(
                service=self.service,
                replicas=self.replicas,
                wire_dtype=self.wire_dtype,
                hop_timeout_s=self.hop_timeout_s,
            )
            if self.service.stage == 0
            else None
        )

    def set_nodes(self, nodes: Sequence[NodeInfo]) -> None:
        """Run the next iterations with `nodes` (the same list on every node); suspicions start afresh."""
        self.nodes = tuple(nodes)
        self.replicas = _replicas(self.nodes)
        self.suspected = set()

    def join(self, peer_id: str, timeout_s: float = 60.0) -> int:
        """Take the stage's state from `peer_id`, a replica of it: parameters and AdamW moments, so that this node
        steps as the replica does from now on; the iteration to run next. HopFailedError if it is not had."""
        numel = sum(parameter.numel() for parameter in self.parameters)
        header, values = self.service.fetch_state(peer_id, STATE_PARTS * numel, timeout_s)
        params, exp_avg, exp_avg_sq = values.split(numel)
        if bool((exp_avg_sq < 0).any()):
            raise HopFailedError(f"peer {peer_id[-8:]} sent a stage state with negative second moments")
        with self.service.model_lock, torch.no_grad():
            offset = 0
            for parameter in self.parameters:
                count = parameter.numel()
                parameter.copy_(params[offset : offset + count].view_as(parameter))
                self.optimizer.state[parameter] = {
                    "step": torch.tensor(float(header.optimizer_steps)),
                    "exp_avg": exp_avg[offset : offset + count].view_as(parameter).to(parameter.device, copy=True),
                    "exp_avg_sq": exp_avg_sq[offset : offset + count]
                    .view_as(parameter)
                    .to(parameter.device, copy=True),
                }
                offset += count
        self.last_iteration = header.iteration
        logger.info(f"took stage {self.service.stage}'s state of iteration {header.iteration} from {peer_id[-8:]}")
        return header.iteration + 1

    def _state(self) -> tuple[int, int, torch.Tensor]:
        """(the last finished iteration, AdamW's steps, parameters then first then second moments), float32."""
        parts: list[list[torch.Tensor]] = [[], [], []]
        steps = 0
        for parameter in self.parameters:
            state = self.optimizer.state.get(parameter, {})
            steps = int(state.get("step", 0))
            parts[0].append(parameter.detach().reshape(-1).cpu())
            for index, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                parts[index].append(state[key].reshape(-1).cpu() if key in state else torch.zeros(parameter.numel()))
        return self.last_iteration, steps, torch.cat([torch.cat(part) for part in parts]).float()

    def run_iteration(self, iteration: int) -> IterationReport:
        started = time.perf_counter()
        phases: dict[str, float] = {}
        schedule = self.scheduler(
            SkipPipeProblem(
                num_stages=self.service.staged.num_stages,
                nodes=tuple(self.nodes),
                num_microbatches=self.num_microbatches,
                skip_ratio=self.skip_ratio,
                reorder=self.reorder,
                seed=iteration,
                exclude=frozenset(self.suspected),
            )
        )
        sources = sorted({route.source for route in schedule.routes})
        self.service.open_iteration(iteration)
        outcomes: list[MicrobatchOutcome] = []
        batches: list[torch.Tensor] = []
        if self.driver is not None:
            self.driver.new_iteration(self.replicas)
            mine = [route for route in schedule.routes if route.source == self.peer_id]
            batches = [self.batch(iteration, route.microbatch) for route in mine]
            scale_to = len(schedule.routes)
            outcomes = self.driver.run_iteration(
                iteration, mine, batches, in_flight=self.in_flight, loss_scale=1.0 / scale_to
            )
            own_loss = sum(outcome.loss for outcome in outcomes) / len(outcomes) if outcomes else 0.0
            for node in self.nodes:
                if node.peer_id != self.peer_id:
                    try:
                        self.service.say_done(node.peer_id, iteration, self.hop_timeout_s, own_loss, len(outcomes))
                    except HopFailedError as e:
                        logger.info(str(e))
                        self.suspected.add(node.peer_id)
            self.suspected |= self.driver.failed
        phases["microbatches"] = time.perf_counter() - started
        mark = time.perf_counter()
        done = self._wait_sources(iteration, [peer for peer in sources if peer != self.peer_id])
        sources_done = len(done) + (self.peer_id in sources)
        phases["waiting for sources"] = time.perf_counter() - mark
        losses = [(outcome.loss, 1) for outcome in outcomes] + self.service.sources_losses(iteration)
        counted = sum(count for _, count in losses)
        driven = sum(int(batch.shape[0]) for batch in batches)
        samples = driven if self.driver is not None else self.service.rows_served(iteration)
        mark = time.perf_counter()
        replicas_summed = self._sum_gradients(iteration)
        phases["gradient exchange"] = time.perf_counter() - mark
        mark = time.perf_counter()
        with self.service.model_lock:
            torch.nn.utils.clip_grad_norm_(self.parameters, self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
            self.last_iteration = iteration
        self.service.finish_iteration(iteration)
        phases["step"] = time.perf_counter() - mark
        return IterationReport(
            iteration=iteration,
            outcomes=tuple(outcomes),
            sources_done=sources_done,
            sources=len(sources),
            replicas_summed=replicas_summed,
            replicas=len(self.replicas[self.service.stage]),
            seconds=time.perf_counter() - started,
            phase_seconds=phases,
            loss=sum(loss * count for loss, count in losses) / counted if counted else None,
            samples=samples,
        )

    def _wait_sources(self, iteration: int, sources: list[str]) -> set[str]:
        """Wait until every one of `sources` said it is done with `iteration`, at most `done_timeout_s`; every
        PING_EVERY_S, the sources not done yet are pinged: one that does not answer is gone (not waited for any
        more, and suspected), one that serves a later iteration is done (its message was lost, or this node is
        catching up). The sources done."""
        deadline = time.monotonic() + self.done_timeout_s
        waiting = set(sources)
        done: set[str] = set()
        while waiting and (left := deadline - time.monotonic()) > 0:
            done |= self.service.wait_sources(iteration, waiting, min(left, PING_EVERY_S))
            waiting -= done
            for peer in sorted(waiting):
                serving = self.service.ping(peer, PING_TIMEOUT_S)
                if serving is None:
                    logger.warning(f"source {peer[-8:]} is gone: iteration {iteration} goes on without it")
                    self.suspected.add(peer)
                    waiting.discard(peer)
                elif serving > iteration:
                    done.add(peer)
                    waiting.discard(peer)
        return done

    def _sum_gradients(self, iteration: int) -> int:
        """Replace each parameter's `.grad` with the sum over the stage's replicas; how many were summed."""
        with self.service.model_lock:
            own = torch.cat([_grad(p).reshape(-1) for p in self.parameters])
        replicas = self.replicas[self.service.stage]
        if len(replicas) == 1:
            return 1
        self.service.publish_gradient(iteration, own)
        total = torch.zeros_like(own)
        summed = 0
        for peer in replicas:  # peer-ID order: the same sum, bit for bit, on every replica
            if peer == self.peer_id:
                gradient = own
            elif peer in self.suspected:
                continue
            else:
                try:
                    gradient = self.service.fetch_gradient(peer, iteration, own.numel(), self.exchange_timeout_s)
                except HopFailedError as e:
                    logger.warning(f"{e}; the stage's step goes on without it")
                    self.suspected.add(peer)
                    continue
            total += gradient.to(total.device)
            summed += 1
        with self.service.model_lock:
            offset = 0
            for parameter in self.parameters:
                count = parameter.numel()
                _grad(parameter).copy_(total[offset : offset + count].view_as(parameter))
                offset += count
        return summed


def _replicas(nodes: Sequence[NodeInfo]) -> dict[int, list[str]]:
    """The peer IDs serving each stage, sorted."""
    replicas: dict[int, list[str]] = {}
    for node in nodes:
        replicas.setdefault(node.stage, []).append(node.peer_id)
    return {stage: sorted(peers) for stage, peers in replicas.items()}


def _grad(parameter: torch.nn.Parameter) -> torch.Tensor:
    if parameter.grad is None:
        parameter.grad = torch.zeros_like(parameter)
    return parameter.grad
