"""One node's SkipPipe iteration: the schedule, the microbatches, the stage's gradient summed over its replicas, a step.

Every node computes the iteration's schedule from the same inputs (`schedule.schedule_microbatches`:
the swarm's nodes, seeded by the iteration), so no message carries it. An iteration on a node of stage s:

1. open the iteration: forwards of it are served from now on, from the roster's stage-0 nodes only, in the run's wire
   dtype (`StageService.open_iteration`, `hop_callers`);
2. a stage-0 node runs the routes whose source it is (`PipelineDriver`, up to `in_flight` at once), then tells
   every other node it is done with the iteration (`rpc_stage_done`);
3. every node waits until its share of the iteration's gradient is whole: the backwards of the routes the
   schedule sends through it have run here (a stage-0 node: at once, its share is its own microbatches'), or
   each source of the schedule said it is done (or `done_timeout_s`; a source that does not answer a ping while
   it is waited for is gone, and not waited for; a node of stages 1.. given no microbatch pings its sources once
   before it goes on). Done early, a node goes on to step 4 while the last
   microbatches still run elsewhere: the replicas of a stage exchange as each finishes, not all at once after
   the slowest source, and their step is off the iteration's critical path. A node that suspects a peer waits
   for the done messages (its schedule may differ from the sources'); a backward that runs here after it has
   summed its share is lost to the stage's gradient (logged: the sources' schedules differed from this node's)
   and one of an iteration it has finished is refused (its source goes to another replica, or skips the stage);
   a peer that failed a hop, a done message or the exchange is *suspected* and left out of this node's later
   schedules (nodes may then differ on a schedule; only the balance suffers: every source tells every node);
4. the stage's gradient: each microbatch's gradient landed on exactly one replica of each stage it visited, so the
   iteration's gradient is the *sum* of the replicas' `.grad`, which they publish and fetch (`gradient_exchange`);
5. the optimizer's step (it clips to the run's `max_grad_norm`: `crowdtrain.optimizer`), gradients zeroed, the
   iteration closed; an iteration that no source finished (every stage-0 node gone) trained nothing and takes no
   step (AdamW would still move the parameters on its momentum and weight decay); with `overlap_exchange`, steps 4
   and 5 part: the exchange of iteration t runs in the background during iteration t + 1, and the node computes on
   a look-ahead of the stage's true state (`gradient_exchange`);
6. drift: a replica whose parameters drifted apart from the others' (`drift`) takes a replica's state right after
   its step (`stage_state`).

Each microbatch's loss counts 1/M of the iteration's gradient (M microbatches in the iteration), as in one
process with gradient accumulation.

A peer that failed a hop, a done message, a ping or the exchange is suspected for SUSPICION_S (or until the next
`set_nodes`), then gets another chance: a replica left out for good would part from the others for good.

The caller passes the nodes, the same list on every node (`set_nodes` between iterations; in a run, the roster of
`pipeline.membership`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from crowdtrain.modes.skippipe.hops.driver import MicrobatchOutcome, PipelineDriver
from crowdtrain.modes.skippipe.hops.hop_callers import IterationCallers
from crowdtrain.modes.skippipe.hops.stage_service import StageService
from crowdtrain.modes.skippipe.replicas.drift import fingerprint_positions
from crowdtrain.modes.skippipe.replicas.gradient_exchange import BACKGROUND_SHARE, Gathered, GradientExchange
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo, Schedule, SkipPipeProblem, schedule_microbatches

logger = logging.getLogger(__name__)

PING_EVERY_S = 2.0
"""While waiting for the sources, how often the ones not done yet are asked whether they are still there."""
PING_TIMEOUT_S = 2.0
SUSPICION_S = 60.0
"""How long a suspected peer is left out of this node's schedules and gradient sums."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationReport:
    """What one node saw of one iteration."""

    iteration: int
    outcomes: tuple[MicrobatchOutcome, ...]
    """The microbatches this node drove (stage-0 nodes only)."""
    sources_done: int
    """Sources that said they were done (by this node's step), of `sources`."""
    sources: int
    replicas_summed: int
    """Replicas of this node's stage whose gradient went into the step, this one included."""
    replicas: int
    seconds: float
    phase_seconds: dict[str, float]
    """Where the time went: microbatches, waiting for sources, the gradient exchange, the step."""
    loss: float | None = None
    """The mean loss of the iteration's microbatches, as the sources that said they were done (and this node, if a
    source) reported them; where none had by this node's step (it was done early), the iteration before's, as its
    sources reported it; None if none did."""
    samples: int = 0
    """Sequences this node computed in the iteration: those it drove (a source) or ran forward (other stages)."""
    adopted_from: str | None = None
    """The replica whose state this node took after its step, its parameters having drifted from it; None."""
    early: bool = False
    """Whether this node summed its share of the gradient once the backwards its schedule routed through it had run
    (a stage-0 node: once its own microbatches were done), before every source said it was done."""


@dataclass(kw_only=True)
class SkipPipeNode(GradientExchange):
    """Runs SkipPipe iterations on one node serving `service.stage`; its stage state is `StageState`'s, the sum of
    its stage's gradient over the replicas `GradientExchange`'s."""

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
    gradient_dtype: str = "bfloat16"
    """How this node publishes its stage's gradient to the other replicas (`SkipPipeSpec.gradient_dtype`)."""
    in_flight: int = 2
    """How many of its microbatches a stage-0 node runs at once: the daemon's is its `memory_microbatches`, as the
    schedule's timeline counts it (a source holds each microbatch's activations until its backward). In the WAN
    lab's benchmark SkipPipe took 7.1-7.3 s an iteration with 2 in flight (and 2 held per node), 6.5-6.6 s with 4."""
    hop_timeout_s: float = 30.0
    done_timeout_s: float = 120.0
    exchange_timeout_s: float = 30.0
    overlap_exchange: bool = False
    """Exchange the stage's gradient during the next iteration and step on the one before (`SkipPipeSpec`)."""
    upload_bytes_per_s: float | None = None
    download_bytes_per_s: float | None = None
    """This node's measured link (None: not measured): with overlap_exchange the background exchange is paced to
    BACKGROUND_SHARE of it."""
    schedule_around_exchange: bool = True
    """With overlap_exchange: the schedule costs each hop at the link the background exchange leaves
    (`SkipPipeProblem.background_share`); every node of a run must set it alike (they compute the same schedule)."""
    scheduler: Callable[[SkipPipeProblem], Schedule] = schedule_microbatches
    """SkipPipe's scheduler; the benchmarks give a baseline (scripts/skippipe_schedulers.py) instead."""
    parameters: list[torch.nn.Parameter] = field(init=False)
    suspected: set[str] = field(default_factory=set)
    """Peers that failed a hop, a done message, a ping or a gradient exchange: left out of this node's schedules
    and gradient sums for SUSPICION_S."""
    _suspected_at: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if type(self.optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ValueError(f"a SkipPipe node's stage state is AdamW's; got {type(self.optimizer).__name__}")
        self.parameters = self.service.staged.stage_parameters(self.service.stage)
        self._positions = fingerprint_positions(self.parameters)
        self.last_iteration = -1
        """The last iteration this node stepped (or took the state of); -1 before any."""
        self._pending: tuple[int, Future[Gathered]] | None = None
        """With overlap_exchange: the exchange of this node's last iteration, running in the background."""
        self._exchanger: ThreadPoolExecutor | None = None
        self._adopted_at = -1
        """The last iteration after whose step this node took a replica's state (drift repair)."""
        self._unsent: torch.Tensor | None = None
        """With int8 gradients: what rounding left out of the gradient this node last published (error feedback)."""
        self._true: tuple[int, list[torch.Tensor]] | None = None
        """With overlap_exchange, after the first iteration: the stage's true state (AdamW's steps; each parameter,
        then each first moment, then each second moment), the same on every replica, which the parameters this node
        computes on look ahead of. Its tensors are allocated once and copied into in place (`_keep_true`): a
        llama-20m stage's 76 MB taken anew twice per iteration cost a stage node 14% of its CPU, most of it the
        fresh memory's page faults."""
        self._own: torch.Tensor | None = None
        """With overlap_exchange: this node's gradient of the iteration (flat, as computed: the published one is
        rounded to gradient_dtype in the background), for its look-ahead."""
        self.service.set_state_source(self._state, self.state_timeout_s())
        if self.overlap_exchange and self.upload_bytes_per_s:
            self.service.background_bytes_per_s = BACKGROUND_SHARE * self.upload_bytes_per_s
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
        """Run the next iterations with `nodes` (the same list on every node); suspicions start afresh when the
        nodes changed, and stay where only their costs did (`membership.follow_cost`)."""
        same_peers = {node.peer_id for node in nodes} == {node.peer_id for node in self.nodes}
        self.nodes = tuple(nodes)
        self.replicas = _replicas(self.nodes)
        if not same_peers:
            self.suspected, self._suspected_at = set(), {}

    def suspect(self, peer_id: str) -> None:
        """Leave `peer_id` out of this node's schedules and gradient sums for SUSPICION_S."""
        self.suspected.add(peer_id)
        self._suspected_at[peer_id] = time.monotonic()

    def forgive(self) -> None:
        """Give the peers suspected SUSPICION_S ago another chance."""
        now = time.monotonic()
        for peer in [peer for peer, since in self._suspected_at.items() if now - since >= SUSPICION_S]:
            del self._suspected_at[peer]
            self.suspected.discard(peer)

    def run_iteration(self, iteration: int) -> IterationReport:
        started = time.perf_counter()
        self.forgive()
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
                background_share=BACKGROUND_SHARE if self.overlap_exchange and self.schedule_around_exchange else 0.0,
            )
        )
        sources = sorted({route.source for route in schedule.routes})
        stage_zero = [node.peer_id for node in self.nodes if node.stage == 0]
        self.service.open_iteration(
            iteration, IterationCallers.of(iteration, stage_zero, self.num_microbatches, self.wire_dtype)
        )
        outcomes, driven = self._drive(iteration, schedule) if self.driver is not None else ([], 0)
        phases["microbatches"] = time.perf_counter() - started
        mark = time.perf_counter()
        share = self._share(schedule)
        others = [peer for peer in sources if peer != self.peer_id]
        done = self._wait_sources(iteration, others, share)
        early = share is not None and share <= self.service.backwards_run(iteration) and not set(others) <= done
        phases["waiting for sources"] = time.perf_counter() - mark
        samples = driven if self.driver is not None else self.service.rows_served(iteration)
        mark = time.perf_counter()
        ran = len(self.service.backwards_run(iteration))
        # Done early, a replica may still be waiting for its sources: its gradient is waited for as long as that
        # may take. Whether anything trained is then told by the sum (no source's done message says it).
        trained = None if early else self.peer_id in sources or bool(done)
        patience_s = self.done_timeout_s if early else 0.0
        if self.overlap_exchange:
            replicas_summed, reference, stepping = self._overlapped_sum(iteration, trained, patience_s)
        else:
            replicas_summed, reference, stepping = self._sum_gradients(iteration, trained, patience_s)
        phases["gradient exchange"] = time.perf_counter() - mark
        late = len(self.service.backwards_run(iteration)) - ran
        if late > 0:
            logger.warning(
                f"{late} backward(s) of iteration {iteration} ran here after this node had summed its share of the "
                f"gradient: their part of stage {self.service.stage}'s gradient is lost (the sources' schedules "
                "differ from this node's)"
            )
        done |= self.service.wait_sources(iteration, others, 0.0)
        sources_done = len(done) + (self.peer_id in sources)
        losses = [(outcome.loss, 1) for outcome in outcomes] + self.service.sources_losses(iteration)
        if not losses:  # done early, before any source's done message came: the iteration before's loss
            losses = self.service.sources_losses(iteration - 1)
        counted = sum(count for _, count in losses)
        mark = time.perf_counter()
        with self.service.model_lock:
            if self._true is not None:  # overlap_exchange: back to the true state the look-ahead started from
                self._restore_true()
            if stepping:
                self.optimizer.step()  # no source done: no microbatch came, and AdamW's momentum and decay stay put
            if self.overlap_exchange:  # own: the microbatches of the stage's gradient whose part this node holds
                own = sum(0 not in o.backward_lost for o in outcomes) if self.driver is not None else ran
                visits = sum(self.service.stage in route.stages for route in schedule.routes)
                self._look_ahead(visits / own if own else 0.0)
            self.optimizer.zero_grad(set_to_none=False)
            self.last_iteration = iteration
        phases["step"] = time.perf_counter() - mark
        adopted_from = None
        if reference is not None:
            mark = time.perf_counter()
            adopted_from = self._adopt(reference, iteration)
            self._adopted_at = iteration if adopted_from is not None else self._adopted_at
            phases["drift repair"] = time.perf_counter() - mark
        self.service.finish_iteration(iteration)
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
            adopted_from=adopted_from,
            early=early,
        )

    def _drive(self, iteration: int, schedule: Schedule) -> tuple[list[MicrobatchOutcome], int]:
        """A stage-0 node: run the routes whose source it is, then tell every other node it is done; (the
        microbatches' outcomes, the sequences they held)."""
        assert self.driver is not None
        self.driver.new_iteration(self.replicas)
        mine = [route for route in schedule.routes if route.source == self.peer_id]
        batches = [self.batch(iteration, route.microbatch) for route in mine]
        scale_to = len(schedule.routes)
        outcomes = self.driver.run_iteration(
            iteration, mine, batches, in_flight=self.in_flight, loss_scale=1.0 / scale_to
        )
        own_loss = sum(outcome.loss for outcome in outcomes) / len(outcomes) if outcomes else 0.0
        others = [node.peer_id for node in self.nodes if node.peer_id != self.peer_id]
        for peer in self.service.say_done(others, iteration, self.hop_timeout_s, own_loss, len(outcomes)):
            self.suspect(peer)
        for peer in self.driver.failed - self.driver.refused:  # a refusing peer is there: avoided this iteration only
            self.suspect(peer)
        return outcomes, sum(int(batch.shape[0]) for batch in batches)

    def _share(self, schedule: Schedule) -> frozenset[tuple[str, int]] | None:
        """The backwards after which this node's share of the iteration's gradient is whole: (source, microbatch)
        of each route through it in `schedule` (none for a stage-0 node: its share is its own microbatches'). None
        while it suspects a peer: the sources, which may not, may then route microbatches by another schedule."""
        if self.suspected:
            return None
        if self.driver is not None:
            return frozenset()
        routes = schedule.routes
        return frozenset((route.source, route.microbatch) for route in routes if self.peer_id in route.path[1:])

    def _wait_sources(
        self, iteration: int, sources: list[str], share: frozenset[tuple[str, int]] | None = None
    ) -> set[str]:
        """Wait until every one of `sources` said it is done with `iteration`, or the backwards of `share` ran here,
        at most `done_timeout_s`; every PING_EVERY_S, the sources not done yet are pinged: one that does not answer
        is gone (not waited for any more, and suspected), one that serves a later iteration is done (its message
        was lost, or this node is catching up). A node of stages 1.. that the schedule gives no microbatch has its
        share whole at once, and nothing here has shown it that its sources are alive: it pings them once first,
        so that a dead source is suspected here too (its replicas that waited for it found it gone, and hold when
        it was the last of stage 0: a replica that went on alone would step apart from them). The sources done."""
        deadline = time.monotonic() + self.done_timeout_s
        waiting = set(sources)
        done: set[str] = set()
        checked = share is None or bool(share) or self.driver is not None  # evidence enough that they live
        while waiting and (left := deadline - time.monotonic()) > 0:
            done |= self.service.wait_sources(iteration, waiting, min(left, PING_EVERY_S), share)
            waiting -= done
            if checked and share is not None and share <= self.service.backwards_run(iteration):
                break
            checked = True
            for peer in sorted(waiting):
                serving = self.service.ping(peer, PING_TIMEOUT_S)
                if serving is None:
                    logger.warning(f"source {peer[-8:]} is gone: iteration {iteration} goes on without it")
                    self.suspect(peer)
                    waiting.discard(peer)
                elif serving > iteration:
                    done.add(peer)
                    waiting.discard(peer)
        return done


def _replicas(nodes: Sequence[NodeInfo]) -> dict[int, list[str]]:
    """The peer IDs serving each stage, sorted."""
    replicas: dict[int, list[str]] = {}
    for node in nodes:
        replicas.setdefault(node.stage, []).append(node.peer_id)
    return {stage: sorted(peers) for stage, peers in replicas.items()}
