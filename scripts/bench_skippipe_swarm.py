"""Benchmark SkipPipe across processes: stage nodes with their own p2p daemons against one process, and a node killed.

The model (the 8-layer demo LLaMA, or `--model llama-20m`: 25.4M parameters, 8 layers) is cut into 4 stages of 2
layers; 8 node processes hold them, 2 replicas per stage, each node its own hivemind DHT and p2pd on loopback,
torch on one thread. Every iteration, every node computes the same schedule (`planning.skippipe`, k = 0.25:
each microbatch visits 2 of stages 1..3, reordered) over the nodes' measured costs (in the WAN lab their links'
too: `hop_seconds`), the two stage-0 nodes drive their microbatches along their routes through the other nodes
(`crowdtrain.modes.skippipe`: fp16 hidden states on the wire), each stage sums its gradient over its replicas
(exchanged in bfloat16, `--gradient-dtype`) and steps AdamW.
With `--scenario scripts/scenarios/skippipe.toml` every node runs in a WAN-lab host of its own (network namespaces
with token-bucket caps: the first replica of each stage on 100 Mbit/s, the second on 25; run as root) instead of
on loopback. Arms, one after the other, same data:

    one-process   the same routes in one process: gradient accumulation over the iteration's microbatches, one
                  step; torch on one thread, and again on every core (`one-process-all-cores`): the best
                  alternative on this machine, against which the swarm's ratio is taken
    swarm         the 8 node processes, SkipPipe's scheduler (`schedule_microbatches`)
    swarm-in-order-overlap  `swarm-overlap` with the greedy's routes started in the greedy's order
                  (`greedy_in_order`): SkipPipe before it started the microbatches through the slowest visits first
    swarm-unlinked  the same with the links left out of the nodes' published costs: the greedy as it was before it
                  weighed each node's link (the same as `swarm` on loopback)
    swarm-planned the same with the better of the greedy's and prioritized planning's routes in the model
                  (`planned`; not what nodes run)
    swarm-searched  the same with the greedy's routes improved by local search against the timeline model
                  (`searched`; not what nodes run: in the model its iterations are shorter)
    swarm-cbs     the same with the paper's conflict-based search and A* (`conflict_based`), and
    swarm-prioritized  with its prioritized planning alone (no split); neither is what nodes run
    swarm-kill    the same, with one replica of stage 2 SIGKILLed (its whole session, p2pd included) after
                  iteration `--kill-at`: its microbatches are rerouted to the other replica, then left out of the
                  schedule; `swarm-kill-overlap` so with `overlap_exchange`
    swarm-random  the same k and reordering, stages and replicas drawn at random (`random_skipping`)
    swarm-full    the 8 node processes as a standard pipeline (`full_pipeline`): k = 0, every microbatch through
                  every stage in order, each stage's replicas in turn
    swarm-full-greedy-overlap  the full pipeline with SkipPipe's greedy choosing each hop's replica by cost
                  (`schedule_microbatches` at k = 0), overlapped: the strongest full pipeline here, which
                  sends fewer microbatches through the slow node than a round-robin one
    one-process-full  the full pipeline's routes in one process (every core): what `swarm-full` must train like
                  (a standard pipeline is gradient accumulation over the microbatches through every layer)
    swarm-float32 `swarm` with the replicas' gradients exchanged in float32 (twice the bytes)
    swarm-overlap `swarm` with the exchange overlapped (`overlap_exchange`): the replicas' sum of each iteration
                  is exchanged during the next, the true state steps on it at that one's end, and each node
                  computes on a look-ahead (the true state stepped on its own gradient); in the WAN lab the
                  exchange is paced to half of each node's link (`BACKGROUND_SHARE`); `swarm-overlap-unpaced` the
                  same with no node's link known (the exchange at full speed); `swarm-overlap-unshared` the
                  same with the schedule costing hops at the whole link, not at what the exchange leaves
                  (`SkipPipeProblem.background_share`); `swarm-full-overlap` the full pipeline so
    one-process-eager  one process (every core) doing what swarm-overlap does: each replica's look-ahead, the
                  true state stepping on the iteration before's sum; the overlap's effect on the loss, no network
    one-process-stale  one process (every core) stepping on the iteration before's gradient, as overlap_exchange
                  did before the look-ahead: what the stale step alone does to the loss
    swarm-int8, swarm-full-int8  `swarm` and `swarm-full` with the replicas' gradients exchanged as int8 blocks
                  with error feedback (a quarter of float32's bytes)
    one-process-int8  one process (every core) stepping on each stage's gradient rounded to int8 blocks with
                  error feedback, as one replica per stage would send it: the rounding alone, without any network

Node 7 (stage 3's second replica) is `--slowdown` times slower (default 4): whatever it computes under its model
lock (forwards, backwards, its step) is followed by a sleep of (slowdown - 1) times the compute, busy for anything
else (`SlowDevice`), and the schedule knows its cost (as from its published measurement). A sleeping node takes no
core here, as a slow remote node would take none.

Reported per arm: seconds per iteration (median after the first two), training samples per second, the mean
training loss of the last iterations, the held-out loss along the full path every `--eval-every` iterations
against samples and against training seconds (for a swarm, the first replica of each stage put together: it is
never the killed one), the trained model's held-out perplexity with 1 and 2 of stages 1..3 removed (25% and 50%
of the stages; the mean over the paths), and for the swarms: rerouted and skipped hops, lost backwards, bytes
sent per iteration by the stage nodes, where the time went (per node: microbatches, waiting for sources,
gradient exchange, step), the timeline model's makespan for the arm's own schedules beside the measured one, and
from every node's trace of its hops (`TracedStageService`) where a hop's seconds went (`HOP_STEPS`) and how long
each node's device was held. `--cost-scale C` multiplies the compute costs the nodes publish and schedule by (the
trace found the devices 1.3-1.4x slower in the swarm than measured alone). Writes skippipe_swarm.json and
skippipe_swarm.png (the curves and the perplexities), and each swarm arm's node logs and iteration reports to
logs/<arm>/.

On this 2-core machine 8 processes (and their 8 p2pd) share two cores, so the swarm's seconds per iteration
measure the protocol's overhead under contention, not a pipeline's speed-up: that needs a core (or a machine) per
node. The swarm's ratio is taken against the faster of the two one-process arms. `--device-slowdown F` reads the
schedules as on machines of their own: every node's compute is followed by a sleep of F - 1 times it (node 7's by
F x slowdown - 1), so at F = 4 the eight nodes' compute fills the two cores only while all eight compute at once
(they were 36-52% busy in the WAN lab), they mostly stop slowing each other down, and the arms differ in how their
schedules use the devices, not in how much of the two cores they take. Its seconds are those of slower devices,
not of this machine.

With `--draws N` the swarm arms run N times, each with new identities (the first with the one-process arms): a
node's peer ID decides ties in the schedule, the order of a reordered path and which replicas the full pipeline
pairs, so one draw's ratio between two arms is one sample (two runs of `swarm-overlap` against `swarm-full` gave
-42.8% and -24.5%); the table at the end gives each draw's seconds per iteration and the median ratio.

    python scripts/bench_skippipe_swarm.py [--model demo|llama-20m] [--iterations 30] [--kill-at 10]
        [--scenario scripts/scenarios/skippipe.toml] [--arms ...] [--draws 1]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
import threading
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import bench_skippipe
import hivemind
import torch
from bench_skippipe import Data, RemovedStages, held_out_loss, removed_stages
from benchlib import (
    bench_parser,
    environment_json,
    plot_to_png,
    print_table,
    say,
    say_plotted,
    write_json,
)
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr
from lab.look_ahead import LookAheadReference
from lab.processes import ProcessGroups, await_condition
from lab.wanlab import Lab, Scenario
from skippipe_schedulers import conflict_based, full_pipeline, greedy_in_order, planned, random_skipping, searched

from crowdtrain import proto
from crowdtrain.codecs.compression import decode_int8_blocks, encode_int8_blocks
from crowdtrain.manifest import RunManifest, llama_20m
from crowdtrain.models import ByteTokenizer, build_model
from crowdtrain.modes.skippipe.hops import HopLimits, StageService
from crowdtrain.modes.skippipe.iteration import IterationReport, SkipPipeNode
from crowdtrain.modes.skippipe.replicas.gradient_exchange import BACKGROUND_SHARE
from crowdtrain.modes.skippipe.roster.costs import seconds_per_hop
from crowdtrain.modes.skippipe.roster.membership import follow_cost
from crowdtrain.modes.skippipe.roster.schedule import (
    NodeInfo,
    Schedule,
    SkipPipeProblem,
    schedule_microbatches,
)
from crowdtrain.modes.skippipe.stages import StagedModel
from crowdtrain.node.logs import setup_logging
from crowdtrain.planning.plan import BYTES_PER_MEGABIT

NUM_STAGES = 4
REPLICAS = 2
SKIP_RATIO = 0.25
LEARNING_RATE = 1e-3
KILLED_STAGE = 2
"""The stage one of whose replicas the swarm-kill arm kills (its second replica, never a source)."""
SLOW_NODE = 7
"""The node `--slowdown` times slower than the others: stage 3's second replica."""
SCHEDULERS: dict[str, Callable[[SkipPipeProblem], Schedule]] = {
    "skippipe": schedule_microbatches,
    "planned": planned,
    "searched": searched,
    "cbs": conflict_based,
    "prioritized": functools.partial(conflict_based, expansions=0),
    "random": random_skipping,
    "full": full_pipeline,
    "in-order": greedy_in_order,
}
CONTENTION = NUM_STAGES * REPLICAS / (os.cpu_count() or 1)
"""How many node processes share each of this machine's cores (8 on 2 here)."""
STARTUP_TIMEOUT_S = 120.0
DIAL_TRIES = 5
"""How often a node tries to dial each other node at the start (`_dial`)."""
ARMS = (
    "swarm",
    "swarm-unlinked",
    "swarm-in-order-overlap",
    "swarm-planned",
    "swarm-searched",
    "swarm-cbs",
    "swarm-prioritized",
    "swarm-kill",
    "swarm-kill-overlap",
    "swarm-random",
    "swarm-full",
    "swarm-float32",
    "swarm-overlap",
    "swarm-overlap-unpaced",
    "swarm-overlap-unshared",
    "swarm-full-overlap",
    "swarm-full-greedy-overlap",
    "one-process-stale",
    "one-process-eager",
    "swarm-int8",
    "swarm-full-int8",
    "one-process-int8",
    "one-process-full",
)
BASELINES = ("one-process", "one-process-all-cores")
"""The arms every swarm's ratio is taken against."""


def bench_run(model: str) -> RunManifest:
    """The run whose model is cut: bench_skippipe.py's (the demo LLaMA made 8 layers deep), or llama-20m (8 layers
    already)."""
    if model == "llama-20m":
        return llama_20m()
    return dataclasses.replace(bench_skippipe.bench_run(), run_id="bench-skippipe-swarm")


def staged_model(run: RunManifest, sizes: Sequence[int] | None = None) -> StagedModel:
    """The run's model in NUM_STAGES stages; `sizes`: each stage's layers (`--stage-layers`), else even."""
    return StagedModel(build_model(run.model, ByteTokenizer().vocab_size, seed=0), NUM_STAGES, sizes)


def stage_seconds(run: RunManifest, data: Data, sizes: Sequence[int] | None = None) -> list[float]:
    """Median seconds of one microbatch's forward and backward over each stage (stage 0 with embeddings and head)."""
    staged = staged_model(run, sizes)
    batch = data.batch(0, 0)
    seconds = []
    for stage in range(NUM_STAGES):
        timings = []
        for _ in range(4):
            began = time.perf_counter()
            if stage == 0:
                staged.loss(batch, (0,)).backward()
            else:
                hidden = staged.embed(batch).hidden_states.detach().requires_grad_()
                began = time.perf_counter()
                out = staged.run_stage(stage, staged.activations(hidden)).hidden_states
                out.backward(torch.ones_like(out))
            timings.append(time.perf_counter() - began)
        seconds.append(statistics.median(timings[1:]))
    return seconds


def topology(
    peer_ids: Sequence[str],
    seconds: Sequence[float],
    memory: int,
    slowdown: float,
    hop_s: Sequence[float] = (),
    device: float = 1.0,
) -> list[NodeInfo]:
    """The nodes in index order, stage = index // REPLICAS, at their stage's measured cost; SLOW_NODE `slowdown`
    times slower (as it would publish its own measurement); `hop_s`: each node's seconds per hop (`hop_seconds`),
    none: not measured. With link costs, the compute is what a node gets of this machine when all 8 compute
    (`CONTENTION` times the measurement alone): the greedy weighs it against the links' seconds. With `device`
    (`--device-slowdown`) every node is that many times slower than a core alone, or CONTENTION times where that
    is more (a device slower than its share of the cores is not slowed further by the sharing)."""
    contention = CONTENTION if any(hop_s) else 1.0
    return [
        NodeInfo(peer_id=peer, stage=index // REPLICAS, memory_microbatches=memory,
                 seconds_per_microbatch=seconds[index // REPLICAS] * max(contention, device)
                 * (slowdown if index == SLOW_NODE else 1.0),
                 seconds_per_hop=hop_s[index] if hop_s else 0.0)
        for index, peer in enumerate(peer_ids)
    ]  # fmt: skip


def hop_seconds(args: argparse.Namespace, run: RunManifest) -> list[float]:
    """Each node's seconds to send or receive one microbatch's fp16 hidden states at the slower of its host's caps in
    `--scenario` (a node's measured links, as it would publish them); zeros on loopback."""
    if not args.scenario:
        return [0.0] * (NUM_STAGES * REPLICAS)
    payload_bytes = 2 * args.micro_batch_size * run.data.sequence_length * int(run.model.config["hidden_size"])
    hosts = [spec for spec in Scenario.load(args.scenario).hosts for _ in range(spec.count)]
    return [seconds_per_hop(payload_bytes, host.upload_mbps, host.download_mbps) for host in hosts]


class SlowDevice:
    """A node's model lock (`StageService.model_lock`, held around all of its compute: the stage's forwards and
    backwards, its step) that holds on `factor` times as long as the compute under it took: a device that much
    slower than this machine, busy for anything else meanwhile. Its sleep takes no core here, as a slow remote
    device would take none. Every node's lock is one (factor 1: no sleep), so that it keeps when each hold was asked
    for, began and ended (`spans`, time.monotonic(); the last one of each thread in `last`) for the hop trace."""

    def __init__(self, factor: float) -> None:
        self.factor, self._lock, self._began = factor, threading.Lock(), 0.0
        self.spans: list[tuple[float, float, float]] = []
        self._thread = threading.local()

    def __enter__(self) -> None:
        asked = time.monotonic()
        self._lock.acquire()
        self._began = time.perf_counter()
        self._thread.asked, self._thread.acquired = asked, time.monotonic()

    def __exit__(self, *exc: object) -> None:
        try:
            if self.factor > 1.0:
                time.sleep((self.factor - 1.0) * (time.perf_counter() - self._began))
        finally:
            self._thread.last = (self._thread.asked, self._thread.acquired, time.monotonic())
            self.spans.append(self._thread.last)
            self._lock.release()

    def last(self) -> tuple[float, float, float]:
        """This thread's last hold: asked for, began, ended."""
        return typing.cast(tuple[float, float, float], self._thread.last)


class TracedStageService(StageService):
    """A StageService that keeps when each hop it sent or served reached each point, time.monotonic() (one clock for
    all nodes of this machine, the WAN lab's namespaces included), for `hop_trace`. Served hops: the stream opened,
    its payload in, a memory slot taken (forwards), the model lock asked for, taken and let go, the last answer
    frame handed on; sent hops: the call's start and end (answer decoded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hops: list[dict[str, Any]] = []
        self._pending: dict[tuple[str, int, int, str], dict[str, Any]] = {}
        self._backward_keys: dict[int, tuple[str, int, int, str]] = {}
        self._open_waits: dict[int, float] = {}  # by id(context): how long a forward waited for its iteration

    def call(
        self, peer_id: str, call: str, header: proto.StageHop, tensor: torch.Tensor, timeout_s: float
    ) -> torch.Tensor:
        began, ok = time.monotonic(), False
        try:
            answer = super().call(peer_id, call, header, tensor, timeout_s)
            ok = True
            return answer
        finally:
            self.hops.append({"side": "sent", "call": call, "iteration": header.iteration, "microbatch":
                              header.microbatch, "stage": header.stage, "peer": peer_id, "began": began,
                              "ended": time.monotonic(), "ok": ok})  # fmt: skip

    async def _receive(
        self, requests: typing.AsyncIterator[proto.StageHop], call: str, context: P2PContext, *, wait_open: bool = False
    ) -> tuple[proto.StageHop, torch.Tensor]:
        opened, arrived = time.monotonic(), [0.0]

        async def timed() -> typing.AsyncIterator[proto.StageHop]:
            async for frame in requests:
                arrived[0] = arrived[0] or time.monotonic()
                yield frame

        header, tensor = await super()._receive(timed(), call, context, wait_open=wait_open)
        key = (context.remote_id.to_base58(), header.iteration, header.microbatch, call)
        self._pending[key] = {"side": "served", "call": call, "iteration": header.iteration, "microbatch":
                              header.microbatch, "stage": header.stage, "source": key[0], "opened": opened,
                              "header": arrived[0], "open_wait": self._open_waits.pop(id(context), 0.0),
                              "received": time.monotonic()}  # fmt: skip
        if call == "backward" and (held := self._held.get(key[:3])) is not None:
            self._backward_keys[id(held)] = key
        return header, tensor

    async def _wait_open(self, iteration: int, context: P2PContext) -> None:
        began = time.monotonic()
        await super()._wait_open(iteration, context)
        self._open_waits[id(context)] = time.monotonic() - began

    async def _reserve(self, key: tuple[str, int, int], context: P2PContext) -> None:
        await super()._reserve(key, context)
        if (hop := self._pending.get((*key, "forward"))) is not None:
            hop["reserved"] = time.monotonic()

    def _forward(self, key: tuple[str, int, int], inputs: torch.Tensor) -> torch.Tensor:
        outputs = super()._forward(key, inputs)
        self._locked((*key, "forward"))
        return outputs

    def _backward(self, held: Any, grad_outputs: torch.Tensor) -> torch.Tensor:
        grad_inputs = super()._backward(held, grad_outputs)
        if (key := self._backward_keys.pop(id(held), None)) is not None:
            self._locked(key)
        return grad_inputs

    def _locked(self, key: tuple[str, int, int, str]) -> None:
        if (hop := self._pending.get(key)) is not None:
            hop["asked"], hop["acquired"], hop["computed"] = typing.cast(SlowDevice, self.model_lock).last()

    async def rpc_stage_forward(
        self, requests: typing.AsyncIterator[proto.StageHop], context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        async for frame in self._answered(super().rpc_stage_forward(requests, context), context, "forward"):
            yield frame

    async def rpc_stage_backward(
        self, requests: typing.AsyncIterator[proto.StageHop], context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        async for frame in self._answered(super().rpc_stage_backward(requests, context), context, "backward"):
            yield frame

    async def _answered(
        self, frames: typing.AsyncIterator[proto.StageHop], context: P2PContext, call: str
    ) -> typing.AsyncIterator[proto.StageHop]:
        hop: dict[str, Any] = {}  # kept at the first frame: the caller closes the stream once it has the answer
        async for frame in frames:
            if not hop and (found := self._pending.pop((context.remote_id.to_base58(), frame.iteration,
                                                        frame.microbatch, call), None)) is not None:  # fmt: skip
                hop = found
                self.hops.append(hop)
            hop["replied"] = time.monotonic()
            yield frame
            hop["replied"] = time.monotonic()

    def drain(self) -> dict[str, Any]:
        """The hops and lock holds kept since the last drain."""
        lock = typing.cast(SlowDevice, self.model_lock)
        hops, self.hops = self.hops, []
        spans, lock.spans = lock.spans, []
        return {"hops": hops, "device": spans}


def device_factor(args: argparse.Namespace, index: int) -> float:
    """How many times slower than this machine node `index` computes: `--device-slowdown`, and SLOW_NODE
    `--slowdown` times that."""
    return args.device_slowdown * (args.slowdown if index == SLOW_NODE else 1.0)


# ----- one process -----


def one_process(
    args: argparse.Namespace,
    run: RunManifest,
    data: Data,
    seconds: Sequence[float],
    threads: int,
    stale: bool = False,
    int8: bool = False,
    full: bool = False,
    eager: bool = False,
) -> dict[str, Any]:
    """The swarm's routes (the schedule over its 8 peer IDs, `identities`) in one process, torch on `threads` threads;
    `stale`: each iteration steps on the gradient of the iteration before (none at the first), as overlap_exchange;
    `int8`: on each stage's gradient rounded to int8 blocks, the rounding's error carried to the next iteration;
    `full`: the full pipeline's routes (k = 0, every stage in order) instead of SkipPipe's."""
    torch.set_num_threads(threads)
    nodes = topology(args.peer_ids, seconds, args.memory, args.slowdown, args.hop_s, args.device_slowdown)
    staged = staged_model(run, args.stage_layers)
    optimizers = [
        torch.optim.AdamW(staged.stage_parameters(stage), lr=args.learning_rate) for stage in range(NUM_STAGES)
    ]
    previous: list[torch.Tensor | None] | None = None
    unsent: list[torch.Tensor | None] = [None] * NUM_STAGES
    iteration_s, losses, curve = [], [], Curve()
    curve.add(0, 0.0, held_out_loss(staged, data, staged.full_path))
    if eager:
        return _one_process_eager(args, data, nodes, staged, optimizers, curve, threads)
    for iteration in range(args.iterations):
        began = time.perf_counter()
        problem = _problem(args, nodes, iteration, skip_ratio=0.0 if full else SKIP_RATIO)
        schedule = full_pipeline(problem) if full else schedule_microbatches(problem)
        iteration_losses = []
        for route in schedule.routes:
            loss = staged.loss(data.batch(iteration, route.microbatch), route.stages)
            (loss / len(schedule.routes)).backward()
            iteration_losses.append(float(loss.detach()))
        if int8:
            round_to_int8(staged, unsent)
        if stale:
            current = [p.grad.clone() if p.grad is not None else None for p in staged.model.parameters()]
            for parameter, gradient in zip(staged.model.parameters(), previous or current, strict=True):
                parameter.grad = gradient
        for stage, optimizer in enumerate(optimizers):
            torch.nn.utils.clip_grad_norm_(staged.stage_parameters(stage), 1.0)
            if not stale or previous is not None:
                optimizer.step()
            optimizer.zero_grad()
        previous = current if stale else None
        iteration_s.append(time.perf_counter() - began)
        losses.append(statistics.fmean(iteration_losses))
        if evaluated(args, iteration + 1):
            curve.add(iteration + 1, sum(iteration_s), held_out_loss(staged, data, staged.full_path))
    result = {"iteration_s": iteration_s, "train_loss": losses, "held_out_loss": curve.held_out_loss[-1]}
    result.update(
        curve=dataclasses.asdict(curve), removed=[dataclasses.asdict(r) for r in removed_stages(staged, data)]
    )
    torch.set_num_threads(1)
    return {**result, "torch_threads": threads}


def _one_process_eager(
    args: argparse.Namespace,
    data: Data,
    nodes: Sequence[NodeInfo],
    staged: StagedModel,
    optimizers: Sequence[torch.optim.Optimizer],
    curve: Curve,
    threads: int,
) -> dict[str, Any]:
    """`one_process` with overlap_exchange as the nodes do it (`LookAheadReference`): each microbatch's stage runs on
    the look-ahead of the replica its route took there, and the true state steps on the replicas' sum one iteration
    late; evaluated on the true state with the pending sum's step taken, as the nodes will hold it."""
    index_of = {node.peer_id: index for index, node in enumerate(nodes)}
    reference = LookAheadReference(staged, optimizers)
    iteration_s, losses = [], []
    for iteration in range(args.iterations):
        began = time.perf_counter()
        routes = schedule_microbatches(_problem(args, nodes, iteration)).routes
        microbatches = [
            (data.batch(iteration, route.microbatch),
             [(stage, index_of[peer] % REPLICAS) for stage, peer in zip(route.stages, route.path, strict=True)])
            for route in routes
        ]  # fmt: skip
        losses.append(statistics.fmean(reference.iteration(microbatches, scale=1.0 / len(routes))))
        iteration_s.append(time.perf_counter() - began)
        if evaluated(args, iteration + 1):
            stepped = reference.stepped()
            curve.add(iteration + 1, sum(iteration_s), held_out_loss(stepped, data, stepped.full_path))
    final = reference.stepped()  # the state the replicas end with
    result = {"iteration_s": iteration_s, "train_loss": losses, "held_out_loss": curve.held_out_loss[-1]}
    result.update(curve=dataclasses.asdict(curve), removed=[dataclasses.asdict(r) for r in removed_stages(final, data)])
    torch.set_num_threads(1)
    return {**result, "torch_threads": threads}


def round_to_int8(staged: StagedModel, unsent: list[torch.Tensor | None]) -> None:
    """Replace each stage's gradient with it rounded to int8 blocks as a replica publishes it, plus `unsent[stage]`,
    what the rounding left out the iteration before (error feedback; updated)."""
    for stage in range(NUM_STAGES):
        parameters = staged.stage_parameters(stage)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in parameters])
        if (carried := unsent[stage]) is not None:
            flat += carried
        sent = decode_int8_blocks(encode_int8_blocks(flat), flat.numel())
        unsent[stage] = flat - sent
        offset = 0
        for parameter in parameters:
            parameter.grad = sent[offset : offset + parameter.numel()].view_as(parameter).clone()
            offset += parameter.numel()


@dataclasses.dataclass
class Curve:
    """Held-out loss along the full path after some iterations, and the training seconds spent by then."""

    iterations: list[int] = dataclasses.field(default_factory=list)
    train_s: list[float] = dataclasses.field(default_factory=list)
    held_out_loss: list[float] = dataclasses.field(default_factory=list)

    def add(self, iterations: int, train_s: float, loss: float) -> None:
        self.iterations.append(iterations)
        self.train_s.append(train_s)
        self.held_out_loss.append(loss)


def identities(folder: Path, count: int) -> tuple[list[Path], list[str]]:
    """`count` private key files in `folder` and their peer IDs: node i of every swarm arm runs as peer i, and the
    one-process arms schedule over the same peer IDs. The schedule breaks ties and orders reordered paths by peer
    ID, so over stand-in names about half of the runs trained the swarm on other stage orders than one process
    (the held-out loss 8% apart after 5 iterations, equal again by 10, in three runs before this)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"identity{index}.key" for index in range(count)]
    for path in paths:
        P2P.generate_identity(str(path))
    return paths, [PeerID.from_identity(path.read_bytes()).to_base58() for path in paths]


def evaluated(args: argparse.Namespace, iterations: int) -> bool:
    """Whether the held-out loss is measured after `iterations` iterations (every `--eval-every`, and the last)."""
    return iterations % args.eval_every == 0 or iterations == args.iterations


def _problem(
    args: argparse.Namespace, nodes: Sequence[NodeInfo], iteration: int, skip_ratio: float = SKIP_RATIO
) -> SkipPipeProblem:
    return SkipPipeProblem(num_stages=NUM_STAGES, nodes=tuple(nodes), num_microbatches=args.microbatches,
                           skip_ratio=skip_ratio, reorder=skip_ratio > 0, seed=iteration)  # fmt: skip


# ----- a node process -----


def node_main(args: argparse.Namespace) -> int:
    """One stage node: start, publish its address, wait for the topology, run the iterations (the first replica of
    each stage saves its parameters at every evaluation)."""
    setup_logging("text", 0)  # what the node saw, kept in logs/<arm>/ (INFO: states taken, drift repaired, ...)
    torch.set_num_threads(1)
    folder, index = Path(args.folder), args.index
    run = bench_run(args.model)
    stage = index // REPLICAS
    with TemporaryDirectory() as cache:
        data = Data(run, args.micro_batch_size, Path(cache))
        initial = json.loads((folder / "node0.json").read_text())["maddrs"] if index else []
        dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.host}/tcp/0"], initial_peers=initial,
                           identity_path=args.identity, check_if_identity_free=False)  # fmt: skip
        staged = staged_model(run, args.stage_layers)
        hidden = run.model.config["hidden_size"]
        limits = HopLimits(max_batch=args.micro_batch_size, max_sequence=run.data.sequence_length, hidden_size=hidden)
        service = TracedStageService(dht, staged, stage, limits, memory_microbatches=args.memory)
        service.model_lock = SlowDevice(device_factor(args, index))  # type: ignore[assignment]
        service.start()
        me = {"peer_id": service.peer_id, "maddrs": [str(m) for m in dht.get_visible_maddrs()]}
        _write_atomically(folder / f"node{index}.json", me)
        swarm = await_condition(lambda: _read(folder / "topology.json"), STARTUP_TIMEOUT_S, "the topology")
        for other in swarm["nodes"]:  # dial every node once, so that hops and exchanges find each other at once
            if other["peer_id"] != me["peer_id"]:
                _dial(service, other)
        peer_ids = [node["peer_id"] for node in swarm["nodes"]]
        nodes = topology(
            peer_ids, swarm["stage_seconds"], args.memory, args.slowdown, swarm["hop_seconds"], args.device_slowdown
        )
        runner = SkipPipeNode(
            service=service, nodes=nodes, num_microbatches=args.microbatches, skip_ratio=args.skip_ratio,
            reorder=args.skip_ratio > 0, scheduler=SCHEDULERS[args.scheduler],
            optimizer=torch.optim.AdamW(staged.stage_parameters(stage), lr=args.learning_rate), batch=data.batch,
            in_flight=args.memory, hop_timeout_s=60.0, done_timeout_s=300.0, exchange_timeout_s=60.0,
            gradient_dtype=args.gradient_dtype, overlap_exchange=args.overlap,
            schedule_around_exchange=not args.unshared,
            upload_bytes_per_s=args.upload_mbps and args.upload_mbps * BYTES_PER_MEGABIT,
            download_bytes_per_s=args.download_mbps and args.download_mbps * BYTES_PER_MEGABIT,
        )  # fmt: skip
        with (folder / f"node{index}.jsonl").open("a") as log:
            for iteration in range(args.iterations):
                if iteration in args.follow_at:
                    nodes = _follow_devices(folder, index, service, nodes, iteration)
                    runner.set_nodes(nodes)
                report = runner.run_iteration(iteration)
                if index % REPLICAS == 0 and evaluated(args, iteration + 1):  # the first replica of each stage
                    parameters = [p.detach().clone() for p in staged.stage_parameters(stage)]
                    torch.save(parameters, folder / f"snapshot{iteration + 1}-stage{stage}.pt")
                log.write(json.dumps({**_report_json(report, service), **service.drain()}) + "\n")
                log.flush()
        (folder / f"node{index}.finished").touch()
        # stay until every node finished: a node that left early would fail the others' last gradient fetches
        await_condition(lambda: (folder / "all-finished").exists(), 600.0, "every node to finish")
        service.close()
        dht.shutdown()
    return 0


def _follow_points(args: argparse.Namespace, kill: bool) -> list[int]:
    """The iterations before which every node follows the devices: `--follow-device`, then every `--follow-every`;
    in a kill arm only before `--kill-at` (the killed node would publish nothing, and the others wait for it)."""
    if not args.follow_device:
        return []
    last = args.kill_at if kill else args.iterations
    return list(range(args.follow_device, last, args.follow_every or args.iterations))


def _follow_devices(
    folder: Path, index: int, service: StageService, nodes: Sequence[NodeInfo], iteration: int
) -> list[NodeInfo]:
    """What a running swarm's roster does (`membership.follow_cost`), between two iterations at once on every node:
    publish this node's device seconds per microbatch since the last time (`StageService.device`, then cleared, as
    `SkipPipeMode._follow_device` clears them), wait for every node's, and schedule each at its own where it
    drifted from the cost it is scheduled at."""
    _write_atomically(folder / f"device{index}-{iteration}.json", service.device.median(at_least=1))
    service.device.clear()
    followed = _followed(folder, nodes, iteration, STARTUP_TIMEOUT_S)
    assert followed is not None
    return followed


def _followed(folder: Path, nodes: Sequence[NodeInfo], iteration: int, timeout_s: float) -> list[NodeInfo] | None:
    """`nodes` at the device seconds every node published before `iteration` (`_follow_devices`) where drifted,
    waiting up to `timeout_s` for them; None (with no wait) where a node published none."""
    paths = [folder / f"device{index}-{iteration}.json" for index in range(len(nodes))]
    if timeout_s:
        await_condition(lambda: all(path.exists() for path in paths), timeout_s, "every node's device seconds")
    elif not all(path.exists() for path in paths):
        return None
    seconds = [_read(path) for path in paths]  # null: a node that timed no microbatch keeps its published cost
    return [
        follow_cost(node, dataclasses.replace(node, seconds_per_microbatch=device)) if device else node
        for node, device in zip(nodes, seconds, strict=True)
    ]


def _costs_followed(folder: Path, published: list[NodeInfo], points: Sequence[int]) -> dict[int, list[NodeInfo]]:
    """The nodes as scheduled from each follow point on (`_follow_devices`), from the device seconds they wrote."""
    followed, costs = {}, published
    for point in points:
        costs = _followed(folder, costs, point, 0.0) or costs
        followed[point] = costs
    return followed


def _report_json(report: IterationReport, service: StageService) -> dict[str, Any]:
    return {
        "iteration": report.iteration,
        "seconds": report.seconds,
        "phases": report.phase_seconds,
        "losses": [o.loss for o in report.outcomes],
        "rerouted": sum(o.rerouted for o in report.outcomes),
        "skipped": sum(len(o.skipped) for o in report.outcomes),
        "backward_lost": sum(bool(o.backward_lost) for o in report.outcomes),
        "replicas_summed": report.replicas_summed,
        "sources_done": report.sources_done,  # fewer than "sources", not "early": a stage stepped without some
        "sources": report.sources,  # source's backwards
        "early": report.early,  # the node summed its share once its backwards ran, before the done messages
        "adopted_from": report.adopted_from,  # a replica whose state this node took: they had drifted apart
        "bytes_sent": service.bytes_sent,
        "microbatches": len(report.outcomes),
    }


def _write_atomically(path: Path, value: Any) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value))
    temporary.replace(path)


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# ----- a swarm arm -----


def swarm_arm(
    args: argparse.Namespace, run: RunManifest, data: Data, seconds: Sequence[float], arm: str
) -> dict[str, Any]:
    """One swarm arm (`ARMS`), on loopback or, with `--scenario`, each node in a WAN-lab host of its own."""
    kill = arm.startswith("swarm-kill")
    points = _follow_points(args, kill)
    full = arm.startswith("swarm-full")
    skip_ratio = 0.0 if full else SKIP_RATIO
    schedulers = {
        "swarm-random": "random",
        "swarm-searched": "searched",
        "swarm-cbs": "cbs",
        "swarm-planned": "planned",
        "swarm-prioritized": "prioritized",
        "swarm-full-greedy-overlap": "skippipe",
        "swarm-in-order-overlap": "in-order",
    }
    scheduler = schedulers.get(arm, "full" if full else "skippipe")
    gradient_dtype = {"swarm-float32": "float32", "swarm-int8": "int8", "swarm-full-int8": "int8"}.get(
        arm, args.gradient_dtype
    )
    groups = ProcessGroups()
    num_nodes = NUM_STAGES * REPLICAS
    victim = KILLED_STAGE * REPLICAS + 1
    with TemporaryDirectory(prefix="skippipe-swarm-") as directory, contextlib.ExitStack() as stack:
        folder = Path(directory)
        hosts = stack.enter_context(Lab(Scenario.load(args.scenario))).hosts if args.scenario else []
        if hosts and len(hosts) != num_nodes:
            raise SystemExit(f"the scenario has {len(hosts)} hosts; this benchmark runs {num_nodes} nodes")
        try:
            processes = []
            for index in range(num_nodes):
                where = ["ip", "netns", "exec", hosts[index].namespace] if hosts else []
                command = [*where, sys.executable, __file__, "--node", "--folder", directory, "--index", str(index),
                           "--model", args.model, "--iterations", str(args.iterations), "--microbatches",
                           str(args.microbatches), "--micro-batch-size", str(args.micro_batch_size),
                           "--memory", str(args.memory), "--skip-ratio", str(skip_ratio), "--scheduler", scheduler,
                           "--slowdown", str(args.slowdown), "--device-slowdown", str(args.device_slowdown),
                           *(["--stage-layers", *map(str, args.stage_layers)] if args.stage_layers else []),
                           "--eval-every", str(args.eval_every), "--follow-at", *map(str, points),
                           "--gradient-dtype", gradient_dtype, *(["--overlap"] if "overlap" in arm else []),
                           *(["--unshared"] if "unshared" in arm else []),
                           "--learning-rate", str(args.learning_rate), "--identity", str(args.identities[index]),
                           "--host", hosts[index].address if hosts else "127.0.0.1",
                           *(["--upload-mbps", str(hosts[index].upload_mbps), "--download-mbps",
                              str(hosts[index].download_mbps)] if hosts and "unpaced" not in arm else [])]  # fmt: skip
                log = (folder / f"node{index}.log").open("w")
                processes.append(groups.start(command, stdout=log, stderr=log))
                if index == 0:
                    await_condition(lambda: _read(folder / "node0.json"), STARTUP_TIMEOUT_S, "node 0")
            peers = [
                await_condition(lambda i=index: _read(folder / f"node{i}.json"), STARTUP_TIMEOUT_S, f"node {index}")
                for index in range(num_nodes)
            ]
            hop_s = [] if arm == "swarm-unlinked" else args.hop_s
            _write_atomically(
                folder / "topology.json", {"nodes": peers, "stage_seconds": list(seconds), "hop_seconds": hop_s}
            )
            began = time.monotonic()
            if kill:
                await_condition(lambda: len(_lines(folder / "node0.jsonl")) >= args.kill_at, 1800.0, "the kill")
                groups.kill(processes[victim])
                say(f"killed node {victim} (stage {KILLED_STAGE}) after iteration {args.kill_at}")
            living = [index for index in range(num_nodes) if not (kill and index == victim)]
            _await_nodes(folder, {index: processes[index] for index in living})
            wall_s = time.monotonic() - began
            (folder / "all-finished").touch()
            for index in living:
                processes[index].wait(timeout=60)
            reports = {index: _lines(folder / f"node{index}.jsonl") for index in living}
            staged = staged_model(run, args.stage_layers)
            evaluations = {0: held_out_loss(staged, data, staged.full_path)}
            for iterations in range(1, args.iterations + 1):
                if evaluated(args, iterations):  # the snapshots of each stage's first replica (never the victim)
                    for stage in range(NUM_STAGES):
                        _load(staged, stage, folder / f"snapshot{iterations}-stage{stage}.pt")
                    evaluations[iterations] = held_out_loss(staged, data, staged.full_path)
            removed = removed_stages(staged, data)
            published = topology([peer["peer_id"] for peer in peers], seconds, args.memory, args.slowdown, hop_s,
                                 args.device_slowdown)  # fmt: skip
            followed = _costs_followed(folder, published, points)
        finally:
            groups.kill_all()
            _keep_logs(folder, args.out / "logs" / (f"draw{args.draw}" if args.draw else "") / arm)
    peer_ids = [node.peer_id for node in published]
    share = BACKGROUND_SHARE if "overlap" in arm and "unshared" not in arm else 0.0

    def scheduled(iteration: int) -> list[NodeInfo]:
        in_force = [point for point in followed if point <= iteration]
        return followed[in_force[-1]] if in_force else published

    return {
        **_swarm_json(reports, wall_s, evaluations, removed, victim if kill else None),
        "hop_trace": hop_trace(reports, peer_ids),
        "model_s": [  # what every node's schedule expected of each iteration (no node suspected)
            SCHEDULERS[scheduler](
                dataclasses.replace(_problem(args, scheduled(iteration), iteration, skip_ratio), background_share=share)
            ).makespan_s
            for iteration in range(args.iterations)
        ],
        "seconds_per_microbatch": {  # as published at the start, and as scheduled from each follow point on
            "published": [node.seconds_per_microbatch for node in published],
            "followed": {point: [node.seconds_per_microbatch for node in nodes] for point, nodes in followed.items()},
        },
    }


def _dial(service: StageService, other: dict[str, Any]) -> None:
    """Connect to `other` ({"peer_id", "maddrs"}) ahead of the first hop. Two nodes that dial each other at once may
    both fail ("dial backoff": a WAN-lab run lost two nodes at the start so): tried DIAL_TRIES times; a node still
    not reached is dialed again by the first hop or exchange that needs it."""
    peer = PeerID.from_base58(other["peer_id"])
    maddrs = [Multiaddr(m).decapsulate(Multiaddr(f"/p2p/{other['peer_id']}")) for m in other["maddrs"]]
    for attempt in range(1, DIAL_TRIES + 1):
        try:
            service.run(service.require_p2p()._client.connect(peer, maddrs), 30.0)
            return
        except Exception as e:
            say(f"could not dial {other['peer_id'][-8:]} (try {attempt} of {DIAL_TRIES}): {str(e).splitlines()[0]}")
            if attempt < DIAL_TRIES:
                time.sleep(attempt)


def _await_nodes(folder: Path, processes: dict[int, Any]) -> None:
    """Wait until every node of `processes` (index: process) has finished its iterations; a node that exits before
    ends the arm with a sentence (the others would wait for it an hour)."""

    def finished() -> bool:
        running = [index for index in processes if not (folder / f"node{index}.finished").exists()]
        for index in running:
            if (code := processes[index].poll()) is not None:
                raise SystemExit(f"node {index} exited ({code}) before its last iteration: see its log")
        return not running

    await_condition(finished, 3600.0, "the run")


def _keep_logs(folder: Path, kept: Path) -> None:
    """Copy the nodes' logs and iteration reports out of the arm's temporary folder (which goes), to read what a
    node saw after the run: a swarm once ended 8% above one process at an early evaluation, and nothing told why."""
    kept.mkdir(parents=True, exist_ok=True)
    for path in [*folder.glob("node*.log"), *folder.glob("node*.jsonl")]:
        shutil.copy(path, kept / path.name)


def _load(staged: StagedModel, stage: int, path: Path) -> None:
    saved = torch.load(path, weights_only=True)
    with torch.no_grad():
        for parameter, value in zip(staged.stage_parameters(stage), saved, strict=True):
            parameter.copy_(value)


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _swarm_json(
    reports: dict[int, list[dict[str, Any]]],
    wall_s: float,
    evaluations: dict[int, float],
    removed: list[RemovedStages],
    killed: int | None,
) -> dict[str, Any]:
    sources = [index for index in reports if index // REPLICAS == 0]
    iterations = len(reports[sources[0]])
    iteration_s = [max(reports[i][n]["seconds"] for i in sources) for n in range(iterations)]
    curve = Curve()
    for done, loss in evaluations.items():
        curve.add(done, sum(iteration_s[:done]), loss)
    train_loss = [
        statistics.fmean(loss for i in sources for loss in reports[i][n]["losses"]) for n in range(iterations)
    ]
    phases = {
        index: {phase: statistics.fmean(r["phases"][phase] for r in lines[2:] or lines) for phase in lines[0]["phases"]}
        for index, lines in reports.items()
    }
    served = [lines[-1]["bytes_sent"] for index, lines in reports.items() if index // REPLICAS != 0]
    return {
        "iteration_s": iteration_s,
        "train_loss": train_loss,
        "held_out_loss": curve.held_out_loss[-1],
        "curve": dataclasses.asdict(curve),
        "removed": [dataclasses.asdict(r) for r in removed],
        "wall_s": wall_s,
        "killed_node": killed,
        "rerouted": [sum(reports[i][n]["rerouted"] for i in sources) for n in range(iterations)],
        "skipped": [sum(reports[i][n]["skipped"] for i in sources) for n in range(iterations)],
        "backward_lost": [sum(reports[i][n]["backward_lost"] for i in sources) for n in range(iterations)],
        "bytes_served_per_iteration": statistics.fmean(served) / iterations,
        "phase_s": phases,
    }


HOP_STEPS = ("request", "slot", "to lock", "lock wait", "device", "answer", "whole hop")
"""A traced hop's steps, in order: the source's call to the payload in at the node (stream set-up, encoding,
the link); waiting for a memory slot (forwards); to the lock (the thread hand-off); waiting for the node's device
(other hops' compute, its step); the compute itself (on an emulated device, its sleep too); the answer back to
the source, decoded; and the whole call."""


def hop_trace(reports: dict[int, list[dict[str, Any]]], peer_ids: Sequence[str]) -> dict[str, Any]:
    """Where the hops' seconds went, after the first two iterations, from the nodes' traces (TracedStageService):
    per call (forward, backward), the mean seconds of each of HOP_STEPS over the hops both sides traced; per node,
    the mean device seconds per forward and per backward it served and the share of its iterations its device was
    held (a source's includes its own stage-0 compute)."""
    index_of = {peer: index for index, peer in enumerate(peer_ids)}
    served: dict[tuple[Any, ...], tuple[int, dict[str, Any]]] = {}
    for index, lines in reports.items():
        for line in lines[2:]:
            for hop in line.get("hops", []):
                if hop["side"] == "served" and "computed" in hop:
                    key = (index_of.get(hop["source"]), hop["iteration"], hop["microbatch"], hop["stage"], hop["call"])
                    served[key] = (index, hop)
    calls = ("forward", "backward")
    steps: dict[str, dict[str, list[float]]] = {call: {step: [] for step in HOP_STEPS} for call in calls}
    device: dict[int, dict[str, list[float]]] = {index: {call: [] for call in calls} for index in reports}
    for index, lines in reports.items():
        for line in lines[2:]:
            for hop in line.get("hops", []):
                key = (index, hop["iteration"], hop["microbatch"], hop["stage"], hop["call"])
                if hop["side"] != "sent" or not hop["ok"] or key not in served:
                    continue
                node, at = served[key]
                reserved = at.get("reserved", at["received"])
                for step, seconds in zip(HOP_STEPS, (
                    at["received"] - hop["began"], reserved - at["received"], at["asked"] - reserved,
                    at["acquired"] - at["asked"], at["computed"] - at["acquired"], hop["ended"] - at["computed"],
                    hop["ended"] - hop["began"],
                ), strict=True):  # fmt: skip
                    steps[hop["call"]][step].append(seconds)
                device[node][hop["call"]].append(at["computed"] - at["acquired"])
    held = {
        index: statistics.fmean(
            sum(ended - began for _, began, ended in line.get("device", [])) / line["seconds"] for line in lines[2:]
        )
        for index, lines in reports.items()
        if lines[2:]
    }
    return {
        "hops": {call: {step: statistics.fmean(values) if values else None for step, values in by_step.items()}
                 | {"count": len(by_step["whole hop"])} for call, by_step in steps.items()},
        "nodes": {index: {"forward_s": statistics.fmean(d["forward"]) if d["forward"] else None,
                          "backward_s": statistics.fmean(d["backward"]) if d["backward"] else None,
                          "device_held": held.get(index)} for index, d in device.items()},
    }  # fmt: skip


def show(args: argparse.Namespace, results: dict[str, Any]) -> None:
    rows = []
    samples = args.microbatches * args.micro_batch_size
    base = min(
        statistics.median(result["iteration_s"][2:]) for arm, result in results["arms"].items() if arm in BASELINES
    )
    for arm, result in results["arms"].items():
        per_iteration = statistics.median(result["iteration_s"][2:])
        tail = result["train_loss"][-5:]
        everything, one, two = (statistics.fmean(group["perplexities"]) for group in result["removed"])
        rows.append([arm, per_iteration, samples / per_iteration, base / per_iteration, statistics.fmean(tail),
                     result["held_out_loss"], everything, one / everything - 1, two / everything - 1,
                     sum(result.get("rerouted", [0])), sum(result.get("skipped", [0])),
                     sum(result.get("backward_lost", [0])), result.get("bytes_served_per_iteration")])  # fmt: skip
    print_table(
        f"SkipPipe, {results['model']} in {NUM_STAGES} stages x {REPLICAS} replicas, {args.iterations} iterations of "
        f"{args.microbatches} x {args.micro_batch_size} windows, k = {SKIP_RATIO}, reordered (swarm-full: k = 0)",
        ["arm", "s/iteration", "samples/s", "x best one process", "train loss (last 5)", "held-out loss", "ppl",
         "ppl -25% stages", "ppl -50% stages", "rerouted", "skipped", "backward lost", "bytes/iter/stage node"],
        rows,
    )  # fmt: skip
    first = next(iter(results["arms"].values()))["curve"]
    print_table(
        "held-out loss along the full path (training seconds in brackets)",
        ["iterations", *results["arms"]],
        [[done, *(f"{r['curve']['held_out_loss'][i]:.4f} ({r['curve']['train_s'][i]:.0f} s)"
                  for r in results["arms"].values())] for i, done in enumerate(first["iterations"])],
    )  # fmt: skip
    for arm, result in results["arms"].items():
        if "phase_s" in result:
            print_table(f"{arm}: mean seconds per iteration by phase, per node (stage = node // {REPLICAS})",
                        ["node", *next(iter(result["phase_s"].values()))],
                        [[node, *phases.values()] for node, phases in result["phase_s"].items()])  # fmt: skip
        for point, followed in result.get("seconds_per_microbatch", {}).get("followed", {}).items():
            published = result["seconds_per_microbatch"]["published"]
            say(f"{arm}: seconds per microbatch by node, published -> scheduled from iteration {point}: "
                + ", ".join(f"{a:.2f} -> {b:.2f}" for a, b in zip(published, followed, strict=True)))  # fmt: skip
        if "model_s" in result:
            measured, model = statistics.median(result["iteration_s"][2:]), statistics.median(result["model_s"][2:])
            say(f"{arm}: {measured:.2f} s per iteration against the timeline model's {model:.2f} s "
                f"({measured / model:.2f}x; medians after the first two)")  # fmt: skip
        if "hop_trace" in result:
            trace = result["hop_trace"]
            print_table(f"{arm}: mean seconds of a hop, step by step (HOP_STEPS)", ["call", "hops", *HOP_STEPS],
                        [[call, steps["count"], *(steps[step] for step in HOP_STEPS)]
                         for call, steps in trace["hops"].items()])  # fmt: skip
            print_table(f"{arm}: each node's device: mean seconds per hop served, share of its iterations held",
                        ["node", "forward s", "backward s", "held"],
                        [[node, n["forward_s"], n["backward_s"], n["device_held"]]
                         for node, n in trace["nodes"].items()])  # fmt: skip


def _more_draws(
    args: argparse.Namespace, run: RunManifest, data: Data, seconds: Sequence[float], cache: Path
) -> list[dict[str, Any]]:
    """The swarm arms again with new identities, `--draws` - 1 times: each draw's `_draw_summary`."""
    draws = []
    for draw in range(1, args.draws):
        args.draw = draw
        args.identities, args.peer_ids = identities(cache / f"draw{draw}", NUM_STAGES * REPLICAS)
        again = {}
        for arm in (arm for arm in args.arms if arm.startswith("swarm")):
            say(f"arm {arm}, identity draw {draw + 1} of {args.draws}")
            again[arm] = swarm_arm(args, run, data, seconds, arm)
        draws.append(_draw_summary(args.peer_ids, again))
    return draws


def _draw_summary(peer_ids: Sequence[str], arms: dict[str, Any]) -> dict[str, Any]:
    """One identity draw's swarm arms: median seconds per iteration (after the first two), wall time, held-out loss."""
    return {
        "peer_ids": list(peer_ids),
        "arms": {
            arm: {
                "s_per_iteration": statistics.median(result["iteration_s"][2:]),
                "wall_s": result["wall_s"],
                "held_out_loss": result["held_out_loss"],
            }
            for arm, result in arms.items()
            if arm.startswith("swarm")
        },
    }


def show_draws(results: dict[str, Any]) -> None:
    """Seconds per iteration of every swarm arm in each identity draw, and the first arm's against the others'."""
    draws = results["draws"]
    names = list(draws[0]["arms"])
    first, others = names[0], names[1:]
    rows = []
    for index, draw in enumerate(draws):
        seconds = {arm: draw["arms"][arm]["s_per_iteration"] for arm in names}
        rows.append([index + 1, *(seconds[arm] for arm in names),
                     *(f"{seconds[first] / seconds[arm] - 1:+.1%}" for arm in others)])  # fmt: skip
    ratios = {arm: [d["arms"][first]["s_per_iteration"] / d["arms"][arm]["s_per_iteration"] - 1 for d in draws]
              for arm in others}  # fmt: skip
    rows.append(["median", *(statistics.median(d["arms"][arm]["s_per_iteration"] for d in draws) for arm in names),
                 *(f"{statistics.median(ratios[arm]):+.1%}" for arm in others)])  # fmt: skip
    print_table(
        f"seconds per iteration (median after the first two) over {len(draws)} draws of the 8 nodes' identities "
        "(each draw: other peer IDs, so other routes and pairings)",
        ["draw", *names, *(f"{first} vs {arm}" for arm in others)],
        rows,
    )


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A sentence and exit 2 for arguments the arms can't run with."""
    if args.iterations < 3:
        parser.error("--iterations must be at least 3: the median iteration leaves out the first two")
    if args.draws < 1:
        parser.error("--draws must be at least 1")
    if args.follow_device and not 0 < args.follow_device < args.iterations:
        parser.error("--follow-device must be between 1 and --iterations - 1 (0: off)")
    if args.follow_device >= args.kill_at and any(arm.startswith("swarm-kill") for arm in args.arms):
        parser.error("--follow-device must be below --kill-at: every node publishes its device's seconds then")
    if args.follow_every < 0:
        parser.error("--follow-every must be at least 0 (0: once, at --follow-device)")


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", choices=("demo", "llama-20m"), default="demo")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=8, help="M per iteration (default 8)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--memory", type=int, default=2, help="microbatches a node holds at once, and in flight")
    parser.add_argument("--kill-at", type=int, default=10, help="swarm-kill: iterations before the kill")
    parser.add_argument("--skip-ratio", type=float, default=SKIP_RATIO, help=argparse.SUPPRESS)  # a node's k
    parser.add_argument("--slowdown", type=float, default=4.0, help=f"how much slower node {SLOW_NODE} is (4)")
    parser.add_argument(
        "--stage-layers",
        type=int,
        nargs=NUM_STAGES,
        metavar="L",
        help="each stage's number of the 8 layers (default 2 2 2 2): e.g. 1 2 2 3, a lighter stage 0",
    )
    parser.add_argument(
        "--device-slowdown",
        type=float,
        default=1.0,
        help="every node computes as a device this many times slower than one core here (1: as fast; the 8 share "
        "the cores); at 4 or more the sleeping devices leave this machine's cores idle enough that the nodes no "
        "longer slow each other, as nodes on machines of their own would not",
    )
    parser.add_argument(
        "--cost-scale",
        type=float,
        default=1.0,
        help="multiply the compute cost every node publishes (its stage's seconds measured alone) by this: the hop "
        "trace found the devices of the WAN lab's nodes 1.3-1.4x slower than that, all eight computing at once",
    )
    parser.add_argument(
        "--follow-device",
        type=int,
        default=0,
        metavar="N",
        help="after N iterations every node schedules every other at the seconds per microbatch its device took "
        "(StageService.device) where they differ from the published by more than COST_DRIFT, as a running swarm's "
        "roster does (0: the published costs throughout)",
    )
    parser.add_argument(
        "--follow-every",
        type=int,
        default=0,
        metavar="M",
        help="with --follow-device N: follow again every M iterations from N on, each time from the device seconds "
        "since the last, as a running swarm's nodes declare drifted costs again (FOLLOW_EVERY_S); in a kill arm "
        "only before --kill-at (0: once, at N)",
    )
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="skippipe", help=argparse.SUPPRESS)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS),
                        help="the swarm arms (the one-process arms always run)")  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=5, help="iterations between held-out evaluations (5)")
    parser.add_argument(
        "--gradient-dtype",
        choices=("bfloat16", "float32", "int8"),
        default="bfloat16",
        help="how a stage's replicas exchange gradients (bfloat16; the swarm-float32 arm: float32)",
    )
    parser.add_argument(
        "--scenario",
        type=Path,
        help="a WAN-lab scenario of 8 hosts (scripts/scenarios/skippipe.toml): node i runs in host i",
    )
    parser.add_argument(
        "--learning-rate", type=float, default=LEARNING_RATE, help=f"AdamW's (default {LEARNING_RATE:g})"
    )
    parser.add_argument(
        "--draws",
        type=int,
        default=1,
        help="run the swarm arms again with this many draws of the nodes' identities in all (1): each draw has "
        "other peer IDs, so other routes and pairings; prints each draw's iteration times and the first arm's ratio",
    )
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)  # a node's overlap_exchange
    parser.add_argument("--unshared", action="store_true", help=argparse.SUPPRESS)  # not schedule_around_exchange
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)  # a node's address
    parser.add_argument("--upload-mbps", type=float, help=argparse.SUPPRESS)  # a node's link, in the WAN lab
    parser.add_argument("--download-mbps", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--identity", help=argparse.SUPPRESS)  # a node's private key file: its peer ID
    parser.add_argument("--follow-at", type=int, nargs="*", default=[], help=argparse.SUPPRESS)  # _follow_points
    args = parser.parse_args()
    if args.node:
        return node_main(args)
    _check(parser, args)
    args.draw = 0
    torch.set_num_threads(1)
    run = bench_run(args.model)
    environment = environment_json(quick=False)
    with TemporaryDirectory() as cache:
        data = Data(run, args.micro_batch_size, Path(cache))
        args.identities, args.peer_ids = identities(Path(cache), NUM_STAGES * REPLICAS)
        seconds = [measured * args.cost_scale for measured in stage_seconds(run, data, args.stage_layers)]
        say("seconds per microbatch by stage: " + ", ".join(f"{s:.3f}" for s in seconds))
        args.hop_s = hop_seconds(args, run)
        if any(args.hop_s):
            say("seconds per hop by node: " + ", ".join(f"{s:.3f}" for s in args.hop_s))
        arms: dict[str, Any] = {}
        for threads in (1, os.cpu_count() or 1):  # the baselines every ratio is taken against
            arm = "one-process" if threads == 1 else "one-process-all-cores"
            say(f"arm {arm} ({threads} torch threads)")
            arms[arm] = one_process(args, run, data, seconds, threads)
        for arm in args.arms:
            say(f"arm {arm}")
            if arm.startswith("one-process"):
                arms[arm] = one_process(
                    args,
                    run,
                    data,
                    seconds,
                    os.cpu_count() or 1,
                    stale=arm.endswith("stale"),
                    eager=arm.endswith("eager"),
                    int8=arm.endswith("int8"),
                    full=arm.endswith("full"),
                )
            else:
                arms[arm] = swarm_arm(args, run, data, seconds, arm)
        draws = [_draw_summary(args.peer_ids, arms), *_more_draws(args, run, data, seconds, Path(cache))]
    parameters = sum(p.numel() for p in staged_model(run).model.parameters())
    results = {
        "environment": {**environment, "load_average_at_end": os.getloadavg()},
        "model": f"{args.model} ({parameters / 1e6:.1f}M parameters, 8 layers)",
        "stage_seconds_per_microbatch": seconds,
        "seconds_per_hop": args.hop_s,
        "arguments": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
            if key
            not in (
                "node",
                "folder",
                "index",
                "out",
                "host",
                "identity",
                "identities",
                "peer_ids",
                "draw",
                "upload_mbps",
                "download_mbps",
            )
        },
        "scenario": Scenario.load(args.scenario).name if args.scenario else None,
        "arms": arms,
        "draws": draws,
    }
    show(args, results)
    if args.draws > 1:
        show_draws(results)
    write_json(args.out / "skippipe_swarm.json", results)
    say_plotted(args.out, "skippipe_swarm", plot_results, results)
    return 0


@plot_to_png(1, 3, figsize=(16, 4.5))
def plot_results(results: dict[str, Any], axes: Any) -> None:
    samples_per_iteration = results["arguments"]["microbatches"] * results["arguments"]["micro_batch_size"]
    for arm, result in results["arms"].items():
        curve = result["curve"]
        samples = [done * samples_per_iteration for done in curve["iterations"]]
        axes[0].plot(samples, curve["held_out_loss"], label=arm, marker=".")
        axes[1].plot(curve["train_s"], curve["held_out_loss"], label=arm, marker=".")
        counts = [group["num_removed"] for group in result["removed"]]
        perplexities = [statistics.fmean(group["perplexities"]) for group in result["removed"]]
        axes[2].plot(counts, perplexities, label=arm, marker="o")
    axes[0].set_xlabel("training windows")
    axes[1].set_xlabel("seconds of training (the swarm's iterations; one process: its own)")
    for axis in axes[:2]:
        axis.set_ylabel("held-out loss (full path)")
    axes[2].set_xlabel(f"stages of 1..{NUM_STAGES - 1} removed at evaluation (mean over the paths)")
    axes[2].set_ylabel("held-out perplexity")
    axes[2].set_xticks(range(NUM_STAGES - 1))
    axes[0].set_title(results["model"] + (f", WAN lab {results['scenario']}" if results.get("scenario") else ""))
    axes[1].legend()


if __name__ == "__main__":
    sys.exit(main())
