"""`skippipe`: the model's layers cut into stages on different nodes; microbatches skip and reorder stages.

A node takes one stage and declares it in the DHT with its measured compute and link (`declaration`), and serves
that stage's layers to the stage-0 nodes (`stage_service.StageService`). The run goes in iterations, the same numbers
on every node: each call of `train_micro_batch` runs one iteration on this node (`iteration.SkipPipeNode`): a
stage-0 node drives its microbatches along the schedule's paths (the loop's micro-batch is its first, the node's own
data the rest), every node waits for the sources to be done, the stage's replicas sum their gradients, and each
stage steps its AdamW. Which nodes an iteration counts comes from the roster the stage-0 leader announces two
iterations ahead (`membership`); a node not in it yet (a joiner) keeps serving and declaring, and takes its stage's
state from a replica just before its first iteration (`rostering`).

The micro-batch size is the node's (`--micro-batch-size`), the iteration's number of microbatches the run's
(`skippipe.microbatches`); `target_batch_size` and the averaging settings are not used. A loss the loop
publishes is the iteration's mean over the sources that reported theirs.

Every node of an iteration is called by others (hops, done messages, pings, its replicas' gradient fetches). A node
peers can't dial (client mode: behind a NAT) is called over connections it opens itself: it pings each other node of
the newest roster every REACH_BACK_S (`_reach_back`), and libp2p carries their calls back over that connection. Two
such nodes can't reach each other: a hop between them fails and is rerouted or skipped like any failed hop.

Replicas that drifted apart (a lost gradient exchange) are made one again by `SkipPipeNode` (those that differ
from the majority's fingerprint, or from the lower peer ID's of two, take that replica's state). A stage that has had
no node for a while takes one from the stage with the most, and a swarm whose stage 0 lost every node founds the
roster again (`rostering`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from crowdtrain.dht.records import owner_marker
from crowdtrain.modes.base import ModeContext, SwarmView, TrainingMode
from crowdtrain.modes.progress import Progress
from crowdtrain.modes.skippipe.hops import HopLimits, StageService
from crowdtrain.modes.skippipe.iteration import IterationReport, SkipPipeNode
from crowdtrain.modes.skippipe.roster.membership import PipelineMembers, StageDirectory, leader_of, membership_at
from crowdtrain.modes.skippipe.roster.rostering import WAIT_FOR_ROSTER_S, Rostering
from crowdtrain.modes.skippipe.settings import skippipe_spec
from crowdtrain.modes.skippipe.stages import StagedModel
from crowdtrain.optimizer import build_optimizer, set_scheduled_learning_rate
from crowdtrain.planning.plan import BYTES_PER_MEGABIT

logger = logging.getLogger(__name__)

MAX_MICROBATCH_ROWS = 64
"""The most sequences one hop may carry (a node's micro-batch size must not exceed it)."""
REACH_BACK_S = 5.0
"""How often a node peers can't dial pings each other node of its roster, opening a connection they can call it
over where none is open (or one closed) and keeping it in use."""
REACH_BACK_AT_MOST = 64
"""The most roster nodes one round of `_reach_back` pings."""


class SkipPipeMode(Rostering, TrainingMode):
    """SkipPipe behind the training-mode seam (see the module's doc)."""

    name = "skippipe"
    holds_whole_model = False

    def __init__(self, context: ModeContext):
        super().__init__(context)
        if context.compute is None or context.sampler is None:
            raise ValueError("a SkipPipe node computes its stage: it can't be an auxiliary aggregator")
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
            context.dht,
            self.staged,
            self.me.stage,
            limits,
            memory_microbatches=self.me.memory_microbatches,
            stop=context.stop,
        )
        # No forward is served before this node runs its first iteration: one served then (a source ahead of it)
        # would be stepped over before its backward ("modified by an inplace operation", seen in a test run).
        self.service.hold(-1)
        self.service.set_members((), -1)  # no hop or done message is taken from anyone before a roster is read
        self.service.start()
        self._first_batch: torch.Tensor | None = None
        self.runner = self._stage_runner()
        self.history: list[PipelineMembers] = []
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
        self._unseen: dict[str, int] = {}
        """As a follower: reads in a row that missed each member's declaration (`_check_members`)."""
        self._members_read_at = -float("inf")
        """When this node last read the declarations to check the members, as a follower (monotonic)."""
        self._members_read: tuple[int, frozenset[str]] | None = None
        """The newest such read, numbered: the declaration's thread writes it, the next iteration checks it."""
        self._members_checked = 0
        """The number of the read the members were last checked against."""
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
        if context.client_mode:
            logger.info(
                "peers can't dial this node: it keeps a connection open to each node of its SkipPipe roster, and "
                "they call it over those"
            )
            threading.Thread(target=self._reach_back, name="skippipe-reach-back", daemon=True).start()
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
        if self.history:
            members = {peer for membership in self.history for peer in membership.peers()}
            self.service.set_members(members, self.history[-1].from_iteration)
        if self.iteration is None and not self._take_place():
            self.context.stop.wait(WAIT_FOR_ROSTER_S)
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
        self._check_members(membership)
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

    def _batch(self, iteration: int, microbatch: int) -> torch.Tensor:
        """The token ids of this source's microbatch: the loop's micro-batch first, then the node's own data."""
        if self._first_batch is not None:
            batch, self._first_batch = self._first_batch, None
            return batch
        return self.sampler.batch(iteration, self.context.micro_batch_size, microbatch)

    def _describe(self, membership: PipelineMembers) -> str:
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

    def _reach_back(self) -> None:
        """For a node peers can't dial: ping each other node of the newest roster (the one it waits to enter, before
        it is in one), now and every REACH_BACK_S, so each holds a connection to it to call it over."""
        while not self._closing.is_set():
            newest = self.history[-1] if self.history else None  # replaced, never changed, by the main thread
            others = [node.peer_id for node in (newest.members if newest else ()) if node.peer_id != self.me.peer_id]
            for peer in others[:REACH_BACK_AT_MOST]:
                if self._closing.is_set():
                    return
                try:
                    self.service.ping(peer, timeout_s=2.0)
                except Exception as e:  # the service closing under it; the next round tries again
                    logger.debug(f"could not reach {peer} to keep a connection open: {e!r}")
            self._closing.wait(REACH_BACK_S)

    def close(self) -> None:
        self._closing.set()
        self.runner.close()
        self.service.close()


def _bytes_per_s(mbps: float | None) -> float | None:
    """A link's measured megabits per second in bytes per second; None where not measured."""
    return mbps * BYTES_PER_MEGABIT if mbps else None
