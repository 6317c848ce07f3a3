"""What a SkipPipe node declares of itself: its stage, and what its device, memory and link take per microbatch.

A node takes one stage (`membership.choose_stage`: fewest replicas first, weighted by compute; two joiners that
chose the same one at once choose again, `membership.restage`) and declares it in the DHT with its measured
compute, the microbatches its memory holds and its link (`_seconds_per_hop`: its bandwidth as the probes before
training found it; the scheduler weighs both; a node re-probes every `bandwidth_probe_interval_s`, but its
declaration keeps the first measurement of its link). A thread of its own renews the declaration while the node
runs (`_keep_declared`).

Its compute is measured once at start (`_measure_stage`), then followed: a node whose device took more than
COST_DRIFT more or less per microbatch lately than it declared (`device_clock`: the holds of its model lock, per
visit it served or microbatch it drove) declares the new figure (`_follow_device`), and the leader's next roster
schedules it so (`membership.follow_cost`), on every node from one iteration on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from crowdtrain.manifest import SkipPipeSpec
from crowdtrain.models.device import available_memory_bytes
from crowdtrain.modes.base import ModeContext
from crowdtrain.modes.skippipe.hops.device_clock import FOLLOW_EVERY_S
from crowdtrain.modes.skippipe.hops.hop_wire import WIRE_DTYPES
from crowdtrain.modes.skippipe.hops.stage_service import StageService
from crowdtrain.modes.skippipe.roster.costs import seconds_per_hop
from crowdtrain.modes.skippipe.roster.membership import DECLARATION_RENEW_S, StageDirectory, choose_stage, restage
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo
from crowdtrain.modes.skippipe.stages import StagedModel

logger = logging.getLogger(__name__)

MAX_MEMORY_MICROBATCHES = 16
"""The most microbatches' activations a node holds at once (its scheduler's `memory_microbatches`)."""
MEMORY_SHARE = 0.25
"""The share of the device's free memory a node gives to held activations."""
ACTIVATION_FLOATS = 24
"""Floats a decoder layer keeps per token and hidden unit for its backward (attention, MLP, norms): an estimate."""
DECLARATION_CHECK_S = 1.0
"""How often the declaration's thread looks whether it is due (DECLARATION_RENEW_S) for renewal."""
STAGE_SETTLE_S = 2.0
"""After declaring a stage, how long a joiner waits before it looks whether another joiner chose the same."""
STAGE_SETTLE_TRIES = 3


class StageDeclaration:
    """A `SkipPipeMode`'s declaration of itself (see the module's doc); the mode sets what it reads."""

    context: ModeContext
    spec: SkipPipeSpec
    staged: StagedModel
    directory: StageDirectory
    service: StageService
    me: NodeInfo
    """This node as the scheduler knows it: the stage it declares, and its costs."""
    _declaring: threading.Lock
    _declared_at: float
    _followed_at: float
    _closing: threading.Event

    @property
    def stage(self) -> int:
        """The stage this node serves now (`me.stage` is the one it declares: another while it moves)."""
        return self.service.stage

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
                self._read_in_background()
            except Exception as e:  # a DHT shutting down under it; while it runs, the next look tries again
                logger.debug(f"could not renew this node's stage declaration or read the others': {e!r}")

    def _read_in_background(self) -> None:
        """DHT reads made in the declaration's thread, so no iteration waits for them (`Rostering`'s)."""

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
