"""`skippipe`: the model's layers cut into stages on different nodes; microbatches skip and reorder stages.

A node takes one stage (`pipeline.membership.choose_stage`: fewest replicas first, weighted by compute), declares it in
the DHT with its measured compute and link (`_seconds_per_hop`: its bandwidth as the probes before training found it;
the scheduler weighs both; a node re-probes every `bandwidth_probe_interval_s`, but its declaration keeps the first
measurement of its link), and serves that stage's layers to the stage-0 nodes (`pipeline.StageService`). The run goes in
iterations, the same numbers on every node: each call of `train_micro_batch` runs one iteration on this node
(`pipeline.SkipPipeNode`): a stage-0 node drives its microbatches along the schedule's paths (the loop's micro-batch is
its first, the node's own data the rest), every node waits for the sources to be done, the stage's replicas sum their
gradients, and each stage steps its AdamW. Which nodes an iteration counts comes from the roster the stage-0 leader
announces two iterations ahead (`pipeline.membership`); a node not in it yet (a joiner) keeps serving and declaring, and
takes its stage's state from a replica just before its first iteration.

Its compute is measured once at start (`_measure_stage`), then followed: a node whose device took more than
COST_DRIFT more or less per microbatch lately than it declared (`pipeline.device_clock`: the holds of its model
lock, per visit it served or microbatch it drove) declares the new figure (`_follow_device`), and the leader's next
roster schedules it so (`membership.follow_cost`), on every node from one iteration on.

The micro-batch size is the node's (`--micro-batch-size`), the iteration's number of microbatches the run's
(`skippipe.microbatches`); `target_batch_size` and the averaging settings are not used. A loss the loop
publishes is the iteration's mean over the sources that reported theirs.

A node peers can't dial (client mode) is refused with a sentence: every node of an iteration is called by others
(hops, done messages, pings, its replicas' gradient fetches).

Replicas that drifted apart (a lost gradient exchange) are made one again by `SkipPipeNode` (those that differ
from the majority's fingerprint, or from the lower peer ID's of two, take that replica's state). A stage 1..S-1
that has had no node for REBALANCE_AFTER_S (its last node left; every path skips its layers meanwhile) takes one
from the stage with the most nodes (`spare_for_empty_stage`): the spare declares the empty stage, the leader
announces the move two iterations ahead like any change, and the spare serves the new stage from that iteration
on, from its own copy of the stage's layers (no node serves a trained one).
A joiner's download is checked by the same repair in its first iteration (a state that differs from the majority
of its stage's replicas is replaced; with one other replica nothing checks it).

A swarm whose stage 0 lost every node has no source and no leader: its nodes hold (`_hold_without_sources`: no
iteration, no step) and, once the stage-0 nodes' declarations have been gone for REBALANCE_AFTER_S, a joiner that
declared stage 0 (the lowest peer ID of them) or else the node `spare_for_empty_stage` names takes stage 0 and
founds the roster again (`_refound_stage_zero`), from LOOKAHEAD iterations past the swarm's; the others follow it
(`StageDirectory.roster` trusts its publisher once the old stage 0 is gone) and jump to its first iteration.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch

from crowdtrain.dht.records import owner_marker
from crowdtrain.errors import CrowdtrainError
from crowdtrain.manifest import skippipe_spec
from crowdtrain.models.device import available_memory_bytes
from crowdtrain.modes.base import ModeContext, SwarmView, TrainingMode
from crowdtrain.modes.progress import Progress
from crowdtrain.modes.skippipe import HopFailedError, HopLimits, StageService
from crowdtrain.modes.skippipe.device_clock import FOLLOW_EVERY_S
from crowdtrain.modes.skippipe.hop_wire import WIRE_DTYPES
from crowdtrain.modes.skippipe.iteration import IterationReport, SkipPipeNode
from crowdtrain.modes.skippipe.membership import (
    DECLARATION_RENEW_S,
    DECLARATION_TTL_S,
    LOOKAHEAD,
    ROSTER_RENEW_S,
    Membership,
    StageDirectory,
    choose_stage,
    cost_changes,
    leader_of,
    membership_at,
    next_members,
    restage,
    spare_for_empty_stage,
    stage_zero_gone,
)
from crowdtrain.modes.skippipe.schedule import NodeInfo, seconds_per_hop
from crowdtrain.modes.skippipe.stage_ledger import MAX_ITERATIONS_AHEAD
from crowdtrain.modes.skippipe.stages import StagedModel
from crowdtrain.optimizer import build_optimizer, set_scheduled_learning_rate
from crowdtrain.planning.plan import BYTES_PER_MEGABIT

logger = logging.getLogger(__name__)

MAX_MICROBATCH_ROWS = 64
"""The most sequences one hop may carry (a node's micro-batch size must not exceed it)."""
MAX_MEMORY_MICROBATCHES = 16
"""The most microbatches' activations a node holds at once (its scheduler's `memory_microbatches`)."""
MEMORY_SHARE = 0.25
"""The share of the device's free memory a node gives to held activations."""
ACTIVATION_FLOATS = 24
"""Floats a decoder layer keeps per token and hidden unit for its backward (attention, MLP, norms): an estimate."""
DECLARATION_CHECK_S = 1.0
"""How often the declaration's thread looks whether it is due (DECLARATION_RENEW_S) for renewal."""
WAIT_FOR_ROSTER_S = 1.0
"""A node not in the roster yet reads it again after this long (it serves its stage meanwhile)."""
JOIN_TIMEOUT_S = 120.0
"""How long a joiner looks for a replica serving the iteration before its first (then gets the time one download of
its stage's state may take, `SkipPipeNode.state_timeout_s`, to take that state)."""
STAGE_SETTLE_S = 2.0
"""After declaring a stage, how long a joiner waits before it looks whether another joiner chose the same."""
STAGE_SETTLE_TRIES = 3
MISSING_READS = 3
"""A member whose declaration is missing from this many of the leader's reads in a row is gone (or expired)."""
PING_AT_MOST = 8
"""Nodes a joiner asks for the iteration they serve."""
REBALANCE_AFTER_S = 300.0
"""A stage without a node for this long takes a node from the stage with the most (`spare_for_empty_stage`); a
node that restarts within it finds its stage free and keeps its trained layers (the mover's would replace them)."""


class SkipPipeMode(TrainingMode):
    """SkipPipe behind the training-mode seam (see the module's doc)."""

    name = "skippipe"
    holds_whole_model = False

    def __init__(self, context: ModeContext):
        super().__init__(context)
        if context.compute is None or context.sampler is None:
            raise ValueError("a SkipPipe node computes its stage: it can't be an auxiliary aggregator")
        if context.client_mode:
            raise CrowdtrainError(
                "Peers can't dial this node, and every node of a SkipPipe run is called by the others (pipeline "
                "hops, done messages, its replicas' gradients); forward a port and pass --announce, or join "
                "another run."
            )
        if context.micro_batch_size > MAX_MICROBATCH_ROWS:
            raise ValueError(f"a SkipPipe microbatch holds at most {MAX_MICROBATCH_ROWS} sequences")
        manifest, self.sampler = context.manifest, context.sampler
        self.spec = skippipe_spec(manifest)
        self.staged = StagedModel(context.compute.model, self.spec.stages)
        self.directory = StageDirectory(
            dht=context.dht,
            run_id=manifest.run_id,
            owner=owner_marker(context.private_key),
            num_stages=self.spec.stages,
        )
        self.me = self._take_stage()
        limits = HopLimits(
            max_batch=MAX_MICROBATCH_ROWS,
            max_sequence=manifest.data.sequence_length,
            hidden_size=int(manifest.model.config["hidden_size"]),
        )
        self.service = StageService(
            context.dht, self.staged, self.me.stage, limits, memory_microbatches=self.me.memory_microbatches
        )
        # No forward is served before this node runs its first iteration: one served then (a source ahead of it)
        # would be stepped over before its backward ("modified by an inplace operation", seen in a test run).
        self.service.hold(-1)
        self.service.start()
        self._first_batch: torch.Tensor | None = None
        self.runner = self._stage_runner()
        self.history: list[Membership] = []
        self.iteration: int | None = None
        """The next iteration this node runs; None while it is not in the roster."""
        self.last_report: IterationReport | None = None
        self._declared_at = -float("inf")
        self._followed_at = -float("inf")
        """When this node last declared its cost again (`_follow_device`, monotonic)."""
        self._published_at = -float("inf")
        """When this node last wrote the roster (monotonic), as its leader."""
        self._missing: dict[str, int] = {}
        """As the leader: reads in a row that missed each member's declaration."""
        self._empty_since: dict[int, float] = {}
        """Stages 1..S-1 that the newest membership leaves without a node, since when (monotonic)."""
        self._stage_zero_gone_since: float | None = None
        """Since when (monotonic) every stage-0 node of the newest membership has been gone; None while one is there."""
        self._holding = False
        """Whether this node is waiting for a stage-0 node (`_hold_without_sources`), said once."""
        self._given_up: dict[str, float] = {}
        """Peers this node found gone (a failed hop, done message, exchange or ping), until when (monotonic): as the
        leader it leaves them out of the rosters it announces, though their declarations may last a while."""
        self._declaring = threading.Lock()
        self._closing = threading.Event()
        self._renew_declaration()
        # Renewed from a thread of its own: an iteration may block longer than a declaration lasts (waiting for its
        # sources, or for a replica's gradient), and a node whose declaration expired meanwhile would be left out
        # of the roster a spare founds again, or given up on by the leader, while it serves.
        threading.Thread(target=self._keep_declared, name="skippipe-declaration", daemon=True).start()
        link = (
            f"its link {self.me.seconds_per_hop * 1000:.1f} ms a hop"
            if self.me.seconds_per_hop > 0
            else "its link not measured"
        )
        logger.info(
            f"serving SkipPipe stage {self.stage} of {self.spec.stages} "
            f"({self.me.seconds_per_microbatch * 1000:.0f} ms per microbatch measured, {link})"
        )

    @property
    def stage(self) -> int:
        """The stage this node serves now (`me.stage` is the one it declares: another while it moves)."""
        return self.service.stage

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The served stage's AdamW (its runner's)."""
        return self.runner.optimizer

    def _stage_runner(self) -> SkipPipeNode:
        """The iterations' runner of the served stage, stepping a fresh optimizer (the run's AdamW) over its
        parameters."""
        optimizer = build_optimizer(self.staged.stage_parameters(self.stage), self.context.manifest.optimizer)
        return SkipPipeNode(
            service=self.service,
            nodes=[self.me],
            num_microbatches=self.spec.microbatches,
            skip_ratio=self.spec.skip_ratio,
            reorder=self.spec.reorder,
            optimizer=optimizer,
            batch=self._batch,
            wire_dtype=self.spec.wire_dtype,
            gradient_dtype=self.spec.gradient_dtype,
            in_flight=self.me.memory_microbatches,
            overlap_exchange=self.spec.overlap_exchange,
            upload_bytes_per_s=_bytes_per_s(self.context.upload_mbps),
            download_bytes_per_s=_bytes_per_s(self.context.download_mbps),
        )

    @property
    def compression(self) -> str:
        return self.spec.wire_dtype

    @property
    def epoch(self) -> int:
        return self.runner.last_iteration + 1

    def train_micro_batch(self, batch: torch.Tensor) -> float | None:
        self.history = self.directory.roster(self.history, self.iteration) or self.history
        if self.iteration is None and not self._take_place():
            time.sleep(WAIT_FOR_ROSTER_S)
            return None
        iteration = self.iteration
        assert iteration is not None
        membership = membership_at(self.history, iteration)
        if membership is None or self.me.peer_id not in membership.peers():
            logger.warning(f"left out of the SkipPipe roster at iteration {iteration}; waiting to be taken back")
            self.service.hold(self.runner.last_iteration)
            self.iteration = None
            return None
        if leader_of(membership, self.runner.suspected) is None:  # no stage-0 node left to drive microbatches
            newest = self.history[-1]
            # Only the sources found gone count against the newest roster's: a node that moved to stage 0 to found
            # it again may be suspected from its time on another stage (a replica's gradient that did not come
            # while it held), and suspicions start afresh with the new membership anyway (`set_nodes`).
            gone = self.runner.suspected & {node.peer_id for node in membership.members if node.stage == 0}
            if newest.from_iteration <= iteration or leader_of(newest, gone) is None:
                self._hold_without_sources(iteration)
                return None
            logger.warning(f"iteration {iteration}: no stage-0 node was left; on to iteration "
                           f"{newest.from_iteration}, where the roster founded again has one")  # fmt: skip
            iteration, membership = newest.from_iteration, newest
            self.iteration = iteration
        listed = membership.stage_of(self.me.peer_id)
        if listed != self.stage and listed == self.me.stage:
            self._move(listed, iteration)  # the move this node declared (`_offer_to_move`) is in force
        elif listed != self.stage:
            logger.warning(f"the roster lists this node at stage {listed}, which it neither serves nor declares")
        if set(self.runner.nodes) != set(membership.members):
            self.runner.set_nodes(membership.members)
            logger.info(f"iteration {iteration}: {len(membership.members)} nodes, {self._describe(membership)}")
        self._lead(iteration, membership)
        self._offer_to_move()
        self._first_batch, self._holding = batch, False
        set_scheduled_learning_rate(self.optimizer, self.context.manifest.optimizer, iteration)
        report = self.runner.run_iteration(iteration)
        self.last_report, self.iteration = report, iteration + 1
        self._follow_device()
        return report.loss

    def samples_of_last_call(self, micro_batch_size: int) -> int:
        """The samples this node drove through the pipeline in its last iteration: a source's; 0 on the other
        stages, which serve the sources' samples (the swarm's samples/s, a sum over nodes, counts each once)."""
        return self.last_report.samples if self.last_report is not None and self.stage == 0 else 0

    def _take_place(self) -> bool:
        """Find this node's first iteration in the roster (found the roster if none exists and this node serves
        stage 0); take its stage's state from a replica if the stage has one. Whether it has a place now."""
        serving = self.directory.declarations(serving_only=True) if not self.history and self.stage == 0 else {}
        if not self.history and self.stage == 0 and set(serving) <= {self.me.peer_id}:
            # no roster and no other node serving: the run's first node (else the roster is on its way: wait)
            founding = Membership(0, (self.me,))
            if self.directory.publish_roster([founding]):
                self.history = [founding]
                self._published_at = time.monotonic()
                logger.info("founded the SkipPipe roster")
        orphan = self.history and self.me.peer_id not in self.history[-1].peers() and self.stage == 0
        if orphan and self._refound_stage_zero(0):  # a joiner on stage 0 of a swarm that lost its stage 0
            self.iteration = self.history[-1].from_iteration  # no replica of its stage is left to take a state from
            logger.info(f"taking part in SkipPipe iterations from iteration {self.iteration} on")
            return True
        if not self.history or self.me.peer_id not in self.history[-1].peers():
            return False
        index = len(self.history) - 1
        while index > 0 and self.me.peer_id in self.history[index - 1].peers():
            index -= 1  # the first membership of the newest run of memberships that list this node
        first = self.history[index].from_iteration
        swarm = self._swarm_iteration()
        if swarm > first + MAX_ITERATIONS_AHEAD:  # restarted while its place lasted: too far behind to catch up
            first = swarm
        before = membership_at(self.history, first - 1)
        replicas = sorted(
            node.peer_id
            for node in (before.members if before else ())
            if node.stage == self.stage and node.peer_id != self.me.peer_id
        )
        self.iteration = self._join(replicas, first) if replicas else first
        logger.info(f"taking part in SkipPipe iterations from iteration {self.iteration} on")
        return True

    def _swarm_iteration(self) -> int:
        """The iteration the newest membership's other nodes serve (the highest that answered; 0 if none did)."""
        others = [node.peer_id for node in self.history[-1].members if node.peer_id != self.me.peer_id]
        answers = [self.service.ping(peer, timeout_s=2.0) for peer in others[:PING_AT_MOST]]
        return max((answer for answer in answers if answer is not None), default=0)

    def _join(self, replicas: list[str], first: int) -> int:
        """Take the stage's state of iteration `first - 1` from one of `replicas`; the iteration to run next."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S + self.runner.state_timeout_s()
        while time.monotonic() < deadline:
            for peer in replicas:
                serving = self.service.ping(peer, timeout_s=2.0)
                if serving is None or serving < first:
                    continue  # gone, or still stepping an earlier iteration: a state is a whole stage, ask once
                try:
                    self.runner.join(peer)
                except HopFailedError as e:
                    logger.warning(f"could not take stage {self.stage}'s state: {e}")
                    continue
                if self.runner.last_iteration >= first - 1:
                    if self.runner.last_iteration >= first:  # gradients served meanwhile are in the state taken
                        self.optimizer.zero_grad(set_to_none=False)
                    return self.runner.last_iteration + 1
            time.sleep(0.2)
        logger.warning(f"no replica of stage {self.stage} served its state of iteration {first - 1}; starting as is")
        return first

    def _lead(self, iteration: int, membership: Membership) -> None:
        """As the leader, announce the membership of iteration + LOOKAHEAD when the declared nodes differ."""
        now = time.monotonic()
        self._given_up.update({peer: now + DECLARATION_TTL_S for peer in self.runner.suspected})
        self._given_up = {peer: until for peer, until in self._given_up.items() if until > now}
        if leader_of(membership, self._given_up) != self.me.peer_id:
            return
        newest = self.history[-1] if self.history else membership
        if time.monotonic() - self._published_at >= ROSTER_RENEW_S and self.directory.publish_roster(self.history):
            self._published_at = time.monotonic()  # renewed: a roster left alone would expire
        if newest.from_iteration > iteration:
            return  # a change is announced already
        members = next_members(newest, self._live_declarations(newest), self._given_up)
        if set(members) == set(newest.members) or not any(node.stage == 0 for node in members):
            return
        announced = Membership(iteration + LOOKAHEAD, members)
        if self.directory.publish_roster([*self.history, announced]):
            self.history, self._published_at = [*self.history, announced], time.monotonic()
            costs = cost_changes(newest, members)
            logger.info(
                f"announced {len(members)} SkipPipe nodes from iteration {announced.from_iteration}"
                + (f" (seconds per microbatch: {', '.join(costs)})" if costs else "")
            )

    def _follow_device(self) -> None:
        """Declare this node's cost again when its device's median over the microbatches it computed lately
        (`StageService.device`) differs from the declared one by more than COST_DRIFT: the leader's next roster
        schedules it at the new one (`follow_cost`). At most every FOLLOW_EVERY_S; not while it moves (its samples
        are of the stage it leaves)."""
        now = time.monotonic()
        if now - self._followed_at < FOLLOW_EVERY_S or self.me.stage != self.stage:
            return
        measured = self.service.device.to_declare(self.me.seconds_per_microbatch)
        if measured is None:
            return
        declared = self.me.seconds_per_microbatch
        self.me = dataclasses.replace(self.me, seconds_per_microbatch=measured)
        self.service.device.clear()  # the next figure from the microbatches of the schedules at the new one
        self._declared_at, self._followed_at = -float("inf"), now
        self._renew_declaration()
        logger.info(
            f"stage {self.stage}: the device took {measured * 1000:.0f} ms per microbatch lately, "
            f"{declared * 1000:.0f} ms declared; declared again"
        )

    def _offer_to_move(self) -> None:
        """When a stage has had no node for REBALANCE_AFTER_S and this node is the one to spare
        (`spare_for_empty_stage`) and no joiner declared that stage meanwhile, declare it: the leader announces the
        move two iterations ahead, and every node makes it at the same iteration (`_move`)."""
        newest, now = self.history[-1], time.monotonic()
        empty = set(range(1, self.spec.stages)) - {node.stage for node in newest.members}
        self._empty_since = {stage: self._empty_since.get(stage, now) for stage in empty}
        spare = spare_for_empty_stage(newest, self.spec.stages)
        if self.me.stage != self.stage or spare is None or spare[0] != self.me.peer_id:
            return  # already moving, or not this node's to do
        stage = spare[1]
        if now - self._empty_since[stage] < REBALANCE_AFTER_S:
            return
        known = set().union(*(membership.peers() for membership in self.history))
        if any(node.stage == stage and node.peer_id not in known for node in self.directory.declarations().values()):
            return  # a joiner took it: it enters with the next membership (a gone member's declaration lingers)
        self.me = self._node(stage)
        self._declared_at = -float("inf")
        self._renew_declaration()
        logger.warning(
            f"stage {stage} has had no node for {now - self._empty_since[stage]:.0f} s: this node moves there from "
            f"stage {self.stage} (declared; the leader announces the move)"
        )

    def _hold_without_sources(self, iteration: int) -> None:
        """No stage-0 node is left to drive microbatches: run no iteration (nothing would be trained), give the
        suspected ones another chance after their suspicion ends, and found the roster again where it is this
        node's to do (`_refound_stage_zero`)."""
        if not self._holding:
            logger.warning(f"iteration {iteration}: no stage-0 node is left to drive microbatches; waiting for one "
                           f"(after {REBALANCE_AFTER_S:.0f} s a node of another stage takes stage 0)")  # fmt: skip
        self._holding = True
        self.service.hold(self.runner.last_iteration)
        self.runner.forgive()
        self._refound_stage_zero(iteration)
        time.sleep(WAIT_FOR_ROSTER_S)

    def _refound_stage_zero(self, iteration: int) -> bool:
        """When every stage-0 node of the newest membership has been gone (no live declaration) for
        REBALANCE_AFTER_S, and this node is the one to take stage 0 (a joiner that declared stage 0, the lowest
        peer ID of them; else the node `spare_for_empty_stage` spares, while no joiner declares stage 0), take
        stage 0 and found the roster again: a membership of the live nodes, from LOOKAHEAD iterations past the
        swarm's, that every node follows (`StageDirectory.roster`: its publisher's stage-0 predecessors are gone).
        Stage 0's layers start from this node's copy of them. Whether it did."""
        newest, now = self.history[-1], time.monotonic()
        declared = self.directory.declarations(serving_only=True)
        absent = {node.peer_id for node in newest.members if node.peer_id not in declared}
        if not stage_zero_gone(newest, declared.keys()):
            self._stage_zero_gone_since = None
            return False
        since = self._stage_zero_gone_since = self._stage_zero_gone_since or now
        joiners = sorted(peer for peer, node in declared.items() if node.stage == 0 and peer not in newest.peers())
        if self.stage == 0:
            ours = bool(joiners) and joiners[0] == self.me.peer_id
        else:
            ours = not joiners and spare_for_empty_stage(newest, self.spec.stages, absent) == (self.me.peer_id, 0)
        if not ours or now - since < REBALANCE_AFTER_S:
            return False
        if self.me.stage != 0:
            self.me = self._node(0)
            self._declared_at = -float("inf")
            self._renew_declaration()
        members = next_members(newest, {**declared, self.me.peer_id: self.me}, absent)
        start = max(iteration, newest.from_iteration, self._swarm_iteration()) + LOOKAHEAD  # no node is past it
        announced = Membership(start, members)
        if not self.directory.publish_roster([*self.history, announced]):
            return False
        self.history, self._published_at = [*self.history, announced], now
        logger.warning(
            f"every stage-0 node has been gone for {now - since:.0f} s: this node takes stage 0 and founds the roster "
            f"again, {len(members)} nodes from iteration {announced.from_iteration}; stage 0's layers start from "
            "this node's copy of them"
        )
        return True

    def _move(self, stage: int, iteration: int) -> None:
        """Serve `stage` from `iteration` on, as the roster says: a fresh optimizer over its layers, which start
        from this node's own copy of them (no node serves a trained one: that is why it moves)."""
        old, last = self.stage, self.runner.last_iteration
        self.service.set_stage(stage, self.me.memory_microbatches)
        self.runner.close()
        self.runner = self._stage_runner()
        self.runner.last_iteration = last
        logger.warning(
            f"iteration {iteration}: moved from stage {old} to stage {stage}, which had no node; its layers start "
            "from this node's copy of them"
        )

    def _live_declarations(self, newest: Membership) -> dict[str, NodeInfo]:
        """The serving nodes' declarations, and the members' whose declaration was missing from fewer than
        MISSING_READS reads in a row: one read that misses records (a DHT node slow to answer) drops no one."""
        declared = self.directory.declarations(serving_only=True)
        for node in newest.members:
            self._missing[node.peer_id] = 0 if node.peer_id in declared else self._missing.get(node.peer_id, 0) + 1
        kept = {node.peer_id: node for node in newest.members if 0 < self._missing[node.peer_id] < MISSING_READS}
        return {**kept, **declared}

    def _batch(self, iteration: int, microbatch: int) -> torch.Tensor:
        """The token ids of this source's microbatch: the loop's micro-batch first, then the node's own data."""
        if self._first_batch is not None:
            batch, self._first_batch = self._first_batch, None
            return batch
        return self.sampler.batch(iteration, self.context.micro_batch_size, microbatch)

    def _memory_microbatches(self, stage: int) -> int:
        """How many microbatches' activations this node can hold: MEMORY_SHARE of the device's free memory over
        one microbatch's (an estimate from the stage's layers and the microbatch's shape), 1 to 16."""
        config = self.context.manifest.model.config
        tokens = self.context.micro_batch_size * self.context.manifest.data.sequence_length
        per_microbatch = len(self.staged.stages[stage]) * tokens * int(config["hidden_size"]) * ACTIVATION_FLOATS * 4
        free = available_memory_bytes(str(self.staged.device))
        if free is None:
            return 4
        return max(1, min(MAX_MEMORY_MICROBATCHES, int(free * MEMORY_SHARE // max(per_microbatch, 1))))

    def _take_stage(self) -> NodeInfo:
        """Choose a stage (`choose_stage`) and declare it, not serving yet; after STAGE_SETTLE_S, if a node with a
        lower peer ID declared the same stage while another stage has none (two joiners chose at once), choose
        again among the others' declarations. This node as the scheduler will know it."""
        peer_id, declared = self.context.peer_id, self.directory.declarations()
        node = self._node(choose_stage(declared.values(), self.spec.stages, peer_id))
        for _ in range(STAGE_SETTLE_TRIES):
            self.directory.declare(node, serving=False)
            time.sleep(STAGE_SETTLE_S)  # for the other joiners' declarations to reach the DHT
            stage = restage(self.directory.declarations().values(), node.stage, self.spec.stages, peer_id)
            if stage is None:
                break
            node = self._node(stage)
        return node

    def _node(self, stage: int) -> NodeInfo:
        return NodeInfo(
            peer_id=self.context.peer_id,
            stage=stage,
            seconds_per_microbatch=self._measure_stage(stage),
            memory_microbatches=self._memory_microbatches(stage),
            seconds_per_hop=self._seconds_per_hop(),
        )

    def _seconds_per_hop(self) -> float:
        """Seconds this node's link takes to send or receive one microbatch's hidden states in the run's wire dtype,
        at the slower of its measured upload and download (probed before training); 0 where either is not measured
        (the scheduler then counts latencies only)."""
        config, data = self.context.manifest.model.config, self.context.manifest.data
        values = self.context.micro_batch_size * data.sequence_length * int(config["hidden_size"])
        payload_bytes = values * WIRE_DTYPES[self.spec.wire_dtype].itemsize
        return seconds_per_hop(payload_bytes, self.context.upload_mbps, self.context.download_mbps)

    def _measure_stage(self, stage: int) -> float:
        """Seconds of one forward and backward of `stage` on a microbatch of this node's size (one warm-up); stage 0
        with the embeddings, the head and the loss, as a source runs it. Only a start: a running node declares
        what its device takes (`_follow_device`)."""
        config, data = self.context.manifest.model.config, self.context.manifest.data
        shape = (self.context.micro_batch_size, data.sequence_length, int(config["hidden_size"]))
        seconds = 0.0
        for _ in range(2):
            started = time.perf_counter()
            if stage == 0:
                vocab = self.staged.model.get_input_embeddings().num_embeddings
                self.staged.loss(torch.randint(vocab, shape[:2], device=self.staged.device), (0,)).backward()
            else:
                hidden = torch.randn(shape, device=self.staged.device, requires_grad=True)
                self.staged.run_stage(stage, self.staged.activations(hidden)).hidden_states.sum().backward()
            seconds = time.perf_counter() - started
        for parameter in self.staged.stage_parameters(stage):
            parameter.grad = None
        return max(seconds, 1e-3)

    def _renew_declaration(self) -> None:
        with self._declaring:
            due = time.monotonic() - self._declared_at >= DECLARATION_RENEW_S
            if due and self.directory.declare(self.me, serving=True):
                self._declared_at = time.monotonic()

    def _keep_declared(self) -> None:
        while not self._closing.wait(DECLARATION_CHECK_S):
            try:
                self._renew_declaration()
            except Exception as e:  # a DHT shutting down under it; while it runs, the next look tries again
                logger.debug(f"could not renew this node's stage declaration: {e!r}")

    def _describe(self, membership: Membership) -> str:
        counts = [sum(node.stage == stage for node in membership.members) for stage in range(self.spec.stages)]
        return ", ".join(f"stage {stage}: {count}" for stage, count in enumerate(counts))

    def assist(self) -> None:
        raise NotImplementedError("SkipPipe has no auxiliary aggregators")

    def apply_swarm_view(self, view: SwarmView) -> None:
        """The roster, not the peer statuses, says who takes part in an iteration."""

    def report(self, progress: Progress) -> None:
        progress.epoch = self.epoch
        progress.skippipe_stage = self.stage
        progress.skippipe_iteration = max(self.runner.last_iteration, 0)
        membership = membership_at(self.history, self.iteration) if self.iteration is not None else None
        progress.num_peers = len(membership.members) if membership else 1
        progress.averaging_bytes_sent = self.service.bytes_sent  # hops and the replicas' gradient exchange
        progress.averaging_bytes_received = self.service.bytes_received

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "iteration": self.runner.last_iteration, "optimizer": self.optimizer.state_dict()}

    def checkpoint_model_state(self, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage's true parameters in place of the look-ahead this node computes on (overlap_exchange): what its
        AdamW moments go with and its replicas hold, so that a node resumed from the checkpoint starts there."""
        true = {
            parameter.data_ptr(): value
            for parameter, value in zip(self.runner.parameters, self.runner.true_parameters(), strict=True)
            if parameter.numel()
        }
        return {
            key: true.get(tensor.data_ptr(), tensor) if tensor.numel() else tensor
            for key, tensor in model_state.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("stage") != self.stage:
            logger.info(
                f"the checkpoint's optimizer state is of stage {state.get('stage')}, not {self.stage}: not used"
            )
            return
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        self._closing.set()
        self.runner.close()
        self.service.close()


def _bytes_per_s(mbps: float | None) -> float | None:
    """A link's measured megabits per second in bytes per second; None where not measured."""
    return mbps * BYTES_PER_MEGABIT if mbps else None
