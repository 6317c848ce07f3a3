"""One node's SkipPipe iteration: the schedule, the microbatches, the stage's gradient summed over its replicas, a step.

Every node computes the iteration's schedule from the same inputs (`schedule.schedule_microbatches`:
the swarm's nodes, seeded by the iteration), so no message carries it. An iteration on a node of stage s:

1. open the iteration: forwards of it are served from now on (`StageService.open_iteration`);
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
   iteration's gradient is the *sum* of the replicas' `.grad`. Each replica publishes its own, rounded to
   `gradient_dtype` (bfloat16 by default: half of float32's bytes, and this exchange is most of what a stage node
   sends; int8 blocks: a quarter, with error feedback: what rounding left out of this node's gradient is added to
   its next one), fetches the others' (`rpc_stage_gradient`) and adds them, its own as rounded, in peer-ID order,
   so every replica that heard from all of them holds the same bits; a replica whose gradient is not had within
   `exchange_timeout_s` (and `done_timeout_s` more where this node was done early: the replica may still be
   waiting for its sources) is left out (its share of microbatches is lost for the others this iteration, and from
   then on the replicas differ);
5. the optimizer's step (it clips to the run's `max_grad_norm`: `crowdtrain.optimizer`), gradients zeroed, the
   iteration closed; an iteration that no source finished (every stage-0 node gone) trained nothing and takes no
   step (AdamW would still move the parameters on its momentum and weight decay);
   with `overlap_exchange`, steps 4 and 5 part: the node publishes its gradient of iteration t and fetches the
   others' in the background while iteration t + 1 runs. The stage's *true* state (parameters and AdamW's
   moments, bit-identical on every replica) takes the replicas' exact sum of iteration t - 1 at the end of
   iteration t (none at the first). The node does not compute on that state but on a look-ahead of it
   (`_look_ahead`, the "eager" update of overlapped DiLoCo): the true state stepped by this node's own gradient
   of iteration t times the stage's microbatches over its own (its estimate of the sum still in flight), AdamW's
   moments left as they were. Stepping on the iteration before's sum alone (the stale step this mode took before)
   trained 8-19% worse in 20 iterations of llama-20m; the look-ahead computes each gradient near where the exact
   step will have moved the state. A joiner, holding the true state of the iteration before its first, fetches
   the other replicas' gradients of that iteration for its first step, so it steps as they do. The state a
   replica serves (a joiner's download, drift repair) and the fingerprint it sends are the true state's. The
   exchange in the background is paced to BACKGROUND_SHARE of the links where they are measured (sent at a
   link's full speed it filled the queue in front of that link, and the hops behind it waited the whole queue),
   and its thread, which encodes this node's gradient and decodes and sums the others', runs BACKGROUND_NICE
   lower than the rest of the node, so that it takes the cores the pipeline leaves idle;
6. drift: each gradient carries a fingerprint of its replica's parameters before the step (`fingerprint`: the
   parameters at MAX_FINGERPRINT fixed positions). A replica whose fingerprint differs by more than
   DRIFT_TOLERANCE (relative; the last bits of different hardware differ by far less, a missed gradient by far
   more) from that of the replica most of the summed fingerprints agree with (`reference_replica`: ties, and
   two replicas, to the lowest peer ID) takes that replica's state of the iteration
   (parameters and AdamW moments, as a joiner does) right after its step: replicas that parted (a lost exchange)
   are one again within an iteration of seeing each other's gradients. The work the other replica did alone
   since they parted is dropped (it was done on a copy that no other replica follows).

Each microbatch's loss counts 1/M of the iteration's gradient (M microbatches in the iteration), as in one
process with gradient accumulation. Replicas that summed the same gradients hold the same parameters and AdamW
moments; a joining replica takes them from one (`join`, `rpc_stage_state`), checked: the stage's exact number of
float32 values, finite, second moments not negative.

A peer that failed a hop, a done message, a ping or the exchange is suspected for SUSPICION_S (or until the next
`set_nodes`), then gets another chance: a replica left out for good would part from the others for good.

The caller passes the nodes, the same list on every node (`set_nodes` between iterations; in a run, the roster of
`pipeline.membership`).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from crowdtrain import proto
from crowdtrain.modes.skippipe.driver import MicrobatchOutcome, PipelineDriver
from crowdtrain.modes.skippipe.hop_wire import MAX_FINGERPRINT, HopFailedError
from crowdtrain.modes.skippipe.schedule import NodeInfo, Schedule, SkipPipeProblem, schedule_microbatches
from crowdtrain.modes.skippipe.stage_service import StageService

logger = logging.getLogger(__name__)

PING_EVERY_S = 2.0
"""While waiting for the sources, how often the ones not done yet are asked whether they are still there."""
PING_TIMEOUT_S = 2.0
STATE_PARTS = 3
"""A stage's state for a joiner: its parameters, AdamW's first moments, its second moments."""
STATE_RATE_FLOOR = 500_000
"""Bytes per second a stage's state download is given time for at least (4 Mbit/s, a slow home uplink): the state
of one of a 25M-parameter model's 4 stages (6.3M parameters and two moments, float32) is 76 MB, 2.5 minutes at
this rate, where a fixed 30-s bound needed 20 Mbit/s and a joiner behind a slower replica never got in."""
STATE_TIMEOUT_FLOOR_S = 30.0
DRIFT_TOLERANCE = 1e-4
"""Replicas whose fingerprints differ by more than this, relative to the fingerprint's norm, have drifted apart.
An AdamW step moves each parameter by about the learning rate (1e-4 to 1e-3 of a typical weight's 0.02 or more,
so a missed gradient shows as ~1e-2); rounding differences between devices stay near 1e-7 per step."""
SUSPICION_S = 60.0
"""How long a suspected peer is left out of this node's schedules and gradient sums."""
BACKGROUND_NICE = 10
"""With overlap_exchange: how much lower (in nice values) the thread of the background exchange runs than the rest
of the node. Its work (encoding this node's gradient, decoding and summing the others', 6.3M values each for a
llama-20m stage) waits for the cores the pipeline leaves idle instead of delaying the microbatches' compute."""
BACKGROUND_SHARE = 0.5
"""With overlap_exchange: the share of a link the background exchange of the replicas' gradients may take (paced by
the answering node at the slower of its upload's and the caller's download's share, `hop_wire.paced`), so that
the pipeline's hops, which share those links meanwhile, never wait behind a queue it filled."""


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
        self.service.set_state_source(self._state)
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

    def state_timeout_s(self) -> float:
        """How long this stage's state may take to download (`state_timeout_s`)."""
        return state_timeout_s(STATE_PARTS * sum(parameter.numel() for parameter in self.parameters))

    def join(self, peer_id: str, timeout_s: float | None = None) -> int:
        """Take the stage's state from `peer_id`, a replica of it: parameters and AdamW moments, so that this node
        steps as the replica does from now on; the iteration to run next. HopFailedError if it is not had within
        `timeout_s` (default: what the state's size may take, `state_timeout_s`)."""
        header, values = self._fetch_state(peer_id, self.state_timeout_s() if timeout_s is None else timeout_s)
        self._load_state(header, values)
        self._pending = None  # its first step sums the others' gradients of the iteration it took the state of
        logger.info(f"took stage {self.service.stage}'s state of iteration {header.iteration} from {peer_id[-8:]}")
        return header.iteration + 1

    def _fetch_state(self, peer_id: str, timeout_s: float, since: int = 0) -> tuple[proto.StageHop, torch.Tensor]:
        numel = sum(parameter.numel() for parameter in self.parameters)
        header, values = self.service.fetch_state(peer_id, STATE_PARTS * numel, timeout_s, since=since)
        if bool((values[2 * numel :] < 0).any()):
            raise HopFailedError(f"peer {peer_id[-8:]} sent a stage state with negative second moments")
        return header, values

    def _load_state(self, header: proto.StageHop, values: torch.Tensor) -> None:
        """Make `values` (parameters, first moments, second moments) this node's stage state, of `header`'s
        iteration and optimizer steps (with overlap_exchange its true state too: no look-ahead until its next step)."""
        with self.service.model_lock:
            self._set_state(header.optimizer_steps, values)
            if self.overlap_exchange:
                self._keep_true()
        self.last_iteration = header.iteration

    def _set_state(self, steps: int, values: torch.Tensor, parameters: bool = True) -> None:
        """Make `values` (parameters, first moments, second moments) the stage's parameters (unless `parameters` is
        False) and AdamW's state after `steps` steps; the caller holds the model lock."""
        numel = sum(parameter.numel() for parameter in self.parameters)
        params, exp_avg, exp_avg_sq = values.split(numel)
        with torch.no_grad():
            offset = 0
            for parameter in self.parameters:
                count = parameter.numel()
                if parameters:
                    parameter.copy_(params[offset : offset + count].view_as(parameter))
                self.optimizer.state[parameter] = {
                    "step": torch.tensor(float(steps)),
                    "exp_avg": exp_avg[offset : offset + count].view_as(parameter).to(parameter.device, copy=True),
                    "exp_avg_sq": exp_avg_sq[offset : offset + count]
                    .view_as(parameter)
                    .to(parameter.device, copy=True),
                }
                offset += count

    def _state(self) -> tuple[int, int, torch.Tensor]:
        """(the last finished iteration, AdamW's steps, parameters then first then second moments), float32: with
        overlap_exchange the true state, not the look-ahead the node computes on."""
        if self._true is not None:
            steps, tensors = self._true
            return self.last_iteration, steps, torch.cat([tensor.reshape(-1).cpu() for tensor in tensors]).float()
        return self.last_iteration, *self._live_state()

    def _live_state(self) -> tuple[int, torch.Tensor]:
        """(AdamW's steps, the stage's parameters then first then second moments as they are now), float32."""
        parts: list[list[torch.Tensor]] = [[], [], []]
        steps = 0
        for parameter in self.parameters:
            state = self.optimizer.state.get(parameter, {})
            steps = int(state.get("step", 0))
            parts[0].append(parameter.detach().reshape(-1).cpu())
            for index, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
                parts[index].append(state[key].reshape(-1).cpu() if key in state else torch.zeros(parameter.numel()))
        return steps, torch.cat([torch.cat(part) for part in parts]).float()

    def _keep_true(self) -> None:
        """With overlap_exchange: make the stage's state now (parameters and AdamW's) its true state, copied into
        the true state's tensors (allocated the first time). The caller holds the model lock."""
        steps, live = 0, [parameter.detach() for parameter in self.parameters]
        for key in ("exp_avg", "exp_avg_sq"):
            for parameter in self.parameters:
                state = self.optimizer.state.get(parameter, {})
                steps = int(state.get("step", 0))
                live.append(state[key] if key in state else torch.zeros_like(parameter))
        if self._true is None:
            self._true = (steps, [tensor.clone() for tensor in live])
        else:
            torch._foreach_copy_(self._true[1], live)
            self._true = (steps, self._true[1])

    def _restore_true(self, parameters: bool = True) -> None:
        """With overlap_exchange: make the true state the stage's parameters (unless `parameters` is False) and
        AdamW's state, copied in place. The caller holds the model lock."""
        assert self._true is not None
        steps, tensors = self._true
        count = len(self.parameters)
        with torch.no_grad():
            if parameters:
                torch._foreach_copy_([parameter.detach() for parameter in self.parameters], tensors[:count])
            for parameter, exp_avg, exp_avg_sq in zip(
                self.parameters, tensors[count : 2 * count], tensors[2 * count :], strict=True
            ):
                state = self.optimizer.state.get(parameter)
                if state and "exp_avg" in state and "exp_avg_sq" in state:
                    state["step"] = torch.tensor(float(steps))
                    state["exp_avg"].copy_(exp_avg)
                    state["exp_avg_sq"].copy_(exp_avg_sq)
                else:
                    self.optimizer.state[parameter] = {
                        "step": torch.tensor(float(steps)),
                        "exp_avg": exp_avg.clone(),
                        "exp_avg_sq": exp_avg_sq.clone(),
                    }

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
        self.service.open_iteration(iteration)
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
        for peer in self.driver.failed:
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

    def true_parameters(self) -> list[torch.Tensor]:
        """The stage's parameters of its true state: the state its replicas agree on and its AdamW moments go with
        (with overlap_exchange the node computes on a look-ahead of them; the parameters otherwise)."""
        if self._true is None:
            return [parameter.detach() for parameter in self.parameters]
        return self._true[1][: len(self.parameters)]

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
        sent = self.service.publish_gradient(iteration, own, own_fingerprint, self.gradient_dtype)
        self._unsent = own - sent if self.gradient_dtype == "int8" else None
        return sent

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

    def _adopt(self, peer_id: str, iteration: int) -> str | None:
        """Take `peer_id`'s state of `iteration` (this node's drifted from it); `peer_id`, or None if it was not
        had (this node goes on with its own, and tries again when it next sees the drift)."""
        stage = self.service.stage
        try:
            header, values = self._fetch_state(peer_id, self.state_timeout_s(), since=iteration)
        except HopFailedError as e:
            logger.warning(f"stage {stage}'s replicas have drifted apart, and {e}: going on with this node's own")
            return None
        if header.iteration != iteration:
            logger.warning(
                f"stage {stage}'s replicas have drifted apart, but peer {peer_id[-8:]} sent its state of iteration "
                f"{header.iteration}, not {iteration}: going on with this node's own"
            )
            return None
        self._load_state(header, values)
        logger.warning(
            f"stage {stage}'s replicas had drifted apart (a gradient exchange was lost): took peer "
            f"{peer_id[-8:]}'s state of iteration {iteration}"
        )
        return peer_id


def state_timeout_s(num_values: int) -> float:
    """How long a download of `num_values` float32 values of a stage's state may take: STATE_TIMEOUT_FLOOR_S, and
    the time the bytes take at STATE_RATE_FLOOR."""
    return STATE_TIMEOUT_FLOOR_S + 4 * num_values / STATE_RATE_FLOOR


def fingerprint_positions(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """For each parameter, the flat positions of it that `fingerprint` reads: MAX_FINGERPRINT spread over the
    stage at random, the same on every replica (seeded by the stage's size)."""
    sizes = [parameter.numel() for parameter in parameters]
    total = sum(sizes)
    generator = torch.Generator().manual_seed(total)
    chosen = torch.randint(total, (min(MAX_FINGERPRINT, total),), generator=generator).sort().values
    positions, offset = [], 0
    for size in sizes:
        inside = chosen[(chosen >= offset) & (chosen < offset + size)] - offset
        positions.append(inside)
        offset += size
    return positions


def fingerprint(parameters: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' values at `positions` (float32, on the CPU): replicas with the same parameters have the
    same fingerprint; replicas that drifted apart differ in nearly every value."""
    values = [
        parameter.detach().reshape(-1)[where.to(parameter.device)]
        for parameter, where in zip(parameters, positions, strict=True)
    ]
    return torch.cat(values).float().cpu()


def reference_replica(fingerprints: Mapping[str, torch.Tensor | None]) -> str | None:
    """The replica whose state the others follow, from the fingerprints of those summed (by peer ID; None: sent
    none): the lowest peer ID among those the most fingerprints agree with (`drifted`). With two replicas that is
    the lower; with more, a replica whose parameters differ from the others' is outvoted, drifted or lying."""
    known = {peer: mine for peer, mine in fingerprints.items() if mine is not None}
    support = {peer: sum(not drifted(mine, theirs) for theirs in known.values()) for peer, mine in known.items()}
    if not support:
        return None
    most = max(support.values())
    return min(peer for peer, count in support.items() if count == most)


def drifted(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
    """Whether two replicas' fingerprints show parameters that drifted apart (DRIFT_TOLERANCE); a fingerprint of
    another size (a replica of another version) shows nothing."""
    if mine.shape != theirs.shape or mine.numel() == 0:
        return False
    scale = float(mine.norm())
    return float((mine - theirs).norm()) > DRIFT_TOLERANCE * max(scale, 1e-12)


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
