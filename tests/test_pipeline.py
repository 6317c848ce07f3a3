"""SkipPipe's pipeline hops between real p2p daemons: gradients along a path of nodes equal the model's own, a failed
hop goes to another replica or is skipped, and every hostile hop is refused with a sentence."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
import typing
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import hivemind
import pytest
import torch
from hivemind.p2p import P2PContext, PeerID
from lab.diloco import loopback_dht
from lab.look_ahead import LookAheadReference
from lab.processes import await_condition

from crowdtrain import proto
from crowdtrain.codecs.compression import decode_int8_blocks, encode_int8_blocks, int8_blocks_size
from crowdtrain.manifest import OptimizerSpec
from crowdtrain.modes.skippipe.hops import (
    HopFailedError,
    HopLimits,
    HopRefusedError,
    PipelineDriver,
    StageService,
    stage_service,
)
from crowdtrain.modes.skippipe.hops.hop_wire import CHUNK_BYTES, MAX_PACED_S, NAMESPACE, PACED_CHUNK_BYTES, paced_rate
from crowdtrain.modes.skippipe.hops.stage_service import MAX_GRADIENT_WAITS
from crowdtrain.modes.skippipe.iteration import IterationReport, SkipPipeNode
from crowdtrain.modes.skippipe.replicas.drift import drifted, fingerprint, fingerprint_positions, reference_replica
from crowdtrain.modes.skippipe.replicas.gradient_exchange import BACKGROUND_NICE, lower_priority
from crowdtrain.modes.skippipe.replicas.stage_state import STATE_PARTS, STATE_TIMEOUT_FLOOR_S, state_timeout_s
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo, Route, Schedule, SkipPipeProblem, schedule_microbatches
from crowdtrain.modes.skippipe.stages import StagedModel
from crowdtrain.optimizer import build_optimizer
from crowdtrain.rpc.service import NodeStopping
from tests import schedules
from tests.stage_swarm import stage_services, tiny_llama

NUM_STAGES = 4
HIDDEN = 32
LIMITS = HopLimits(max_batch=4, max_sequence=16, hidden_size=HIDDEN)
STAGE_OF_NODE = (0, 1, 1, 2, 3)
"""Node 0 drives (stage 0); nodes 1 and 2 are replicas of stage 1; nodes 3 and 4 hold stages 2 and 3."""


def stage_optimizer(parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A stage's optimizer as a SkipPipe node builds it: the run's AdamW, clipping at 1.0 like the references."""
    return build_optimizer(parameters, OptimizerSpec(learning_rate=1e-2, weight_decay=0.01, max_grad_norm=1.0))


def model() -> torch.nn.Module:
    return tiny_llama(LIMITS, num_layers=NUM_STAGES)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(seed))


class RefusesBackwards(StageService):
    """A replica whose backward hops fail, as a node that died between a microbatch's forward and backward."""

    async def rpc_stage_backward(
        self, requests: typing.AsyncIterator[proto.StageHop], context: P2PContext
    ) -> typing.AsyncIterator[proto.StageHop]:
        async for _ in requests:
            pass
        raise HopRefusedError("stage backward refused: this node is going away")
        yield proto.StageHop()  # an async generator, as hivemind serves streams


@dataclass
class Swarm:
    dhts: list[hivemind.DHT]
    services: list[StageService]
    peers: list[str]

    def peer(self, node: int) -> str:
        return self.peers[node]

    def route(self, nodes: Sequence[int]) -> Route:
        return Route(
            microbatch=0,
            stages=tuple(STAGE_OF_NODE[node] for node in nodes),
            path=tuple(self.peer(node) for node in nodes),
        )

    def driver(self, wire_dtype: str = "float32") -> PipelineDriver:
        replicas: dict[int, list[str]] = {}
        for node, stage in enumerate(STAGE_OF_NODE):
            replicas.setdefault(stage, []).append(self.peer(node))
        return PipelineDriver(service=self.services[0], replicas=replicas, wire_dtype=wire_dtype, hop_timeout_s=20.0)

    def roster(self) -> list[NodeInfo]:
        """Every node as a schedule sees it: its stage, 1 s per microbatch, room for 2 microbatches."""
        return [schedules.node(self.peer(node), stage, memory=2) for node, stage in enumerate(STAGE_OF_NODE)]

    def joiner_dht(self) -> hivemind.DHT:
        """A DHT for a node that joins the swarm."""
        return loopback_dht(self.dhts[0].get_visible_maddrs())


@pytest.fixture
def swarm(request: pytest.FixtureRequest) -> Iterator[Swarm]:
    """Five nodes with their own p2p daemons and the same weights; `refusing` (indirect) names nodes whose backwards
    fail."""
    refusing = getattr(request, "param", ())

    def build(node: int, dht: hivemind.DHT) -> StageService:
        kind = RefusesBackwards if node in refusing else StageService
        staged = StagedModel(model(), NUM_STAGES)
        return kind(dht, staged, STAGE_OF_NODE[node], LIMITS, memory_microbatches=2, slot_wait_s=0.5)

    with stage_services(len(STAGE_OF_NODE), build) as (dhts, services):
        yield Swarm(dhts, services, [service.peer_id for service in services])


def reference_grads(path: Sequence[int], batch: torch.Tensor) -> dict[int, list[torch.Tensor]]:
    """Each stage's parameter gradients of the model's loss along `path`, in one process."""
    staged = StagedModel(model(), NUM_STAGES)
    staged.loss(batch, path).backward()
    return {stage: [grad_of(p) for p in staged.stage_parameters(stage)] for stage in range(NUM_STAGES)}


def grad_of(parameter: torch.nn.Parameter) -> torch.Tensor:
    return parameter.grad.clone() if parameter.grad is not None else torch.zeros_like(parameter)


def node_grads(service: StageService) -> list[torch.Tensor]:
    return [grad_of(p) for p in service.staged.stage_parameters(service.stage)]


def assert_grads(got: list[torch.Tensor], expected: list[torch.Tensor], atol: float) -> None:
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, atol=atol, rtol=1e-2)


@pytest.mark.parametrize(
    ("nodes", "wire_dtype", "atol"),
    [
        ((0, 1, 3, 4), "float32", 1e-6),  # the full pipeline
        ((0, 4, 2), "float32", 1e-6),  # stage 2 skipped, stages 3 and 1 reordered
        ((0, 1, 3, 4), "float16", 2e-3),  # half the bytes on the wire
    ],
)
def test_gradients_along_a_path_of_nodes_are_the_models_own(
    swarm: Swarm, nodes: tuple[int, ...], wire_dtype: str, atol: float
) -> None:
    batch = tokens()
    route = swarm.route(nodes)
    outcome = swarm.driver(wire_dtype).run_microbatch(1, route, batch)
    expected = reference_grads(route.stages, batch)
    staged = StagedModel(model(), NUM_STAGES)
    assert outcome.loss == pytest.approx(float(staged.loss(batch, route.stages).detach()), abs=10 * atol)
    assert outcome.stages == route.stages and outcome.peers == route.path
    assert (outcome.rerouted, outcome.skipped, outcome.backward_lost) == (0, (), ())
    for node in nodes:
        assert_grads(node_grads(swarm.services[node]), expected[STAGE_OF_NODE[node]], atol)
    for node in set(range(len(STAGE_OF_NODE))) - set(nodes):
        assert all(grad.abs().sum() == 0 for grad in node_grads(swarm.services[node])), "a node off the path trained"
    assert all(service.held_microbatches == 0 for service in swarm.services), "a forward was held past its backward"
    # the source sends the hidden states to each stage on the path and the gradient back, and receives as much
    hop_bytes = batch.numel() * HIDDEN * (2 if wire_dtype == "float16" else 4)
    source = swarm.services[0]
    assert source.bytes_sent == source.bytes_received == 2 * (len(nodes) - 1) * hop_bytes
    assert [swarm.services[node].bytes_sent for node in nodes[1:]] == [2 * hop_bytes] * (len(nodes) - 1)


def test_a_dead_replica_is_routed_around_and_a_stage_with_none_left_is_skipped(swarm: Swarm) -> None:
    driver = swarm.driver()
    swarm.services[1].close()  # the replica the route names for stage 1 goes away
    batch = tokens()
    outcome = driver.run_microbatch(1, swarm.route((0, 1, 3, 4)), batch)
    assert outcome.peers == (swarm.peer(0), swarm.peer(2), swarm.peer(3), swarm.peer(4))
    assert (outcome.rerouted, outcome.skipped) == (1, ())
    assert_grads(node_grads(swarm.services[2]), reference_grads((0, 1, 2, 3), batch)[1], 1e-6)
    assert swarm.peer(1) in driver.failed

    swarm.services[2].close()  # now stage 1 has no live replica: the next microbatch goes on without it
    outcome = driver.run_microbatch(2, swarm.route((0, 1, 3, 4)), batch)
    assert (outcome.stages, outcome.skipped, outcome.backward_lost) == ((0, 2, 3), (1,), ())
    staged = StagedModel(model(), NUM_STAGES)
    assert outcome.loss == pytest.approx(float(staged.loss(batch, (0, 2, 3)).detach()), abs=1e-5)


@pytest.mark.parametrize("swarm", [(1,)], indirect=True)
def test_a_backward_that_fails_is_recomputed_on_another_replica(swarm: Swarm) -> None:
    batch = tokens()
    outcome = swarm.driver().run_microbatch(1, swarm.route((0, 1, 3, 4)), batch)
    assert outcome.backward_lost == () and outcome.rerouted == 1
    assert outcome.peers[1] == swarm.peer(2), "the replica that gave the gradient is the one named"
    expected = reference_grads((0, 1, 2, 3), batch)
    assert_grads(node_grads(swarm.services[2]), expected[1], 1e-6)
    assert_grads(node_grads(swarm.services[0]), expected[0], 1e-6)  # stage 0 got its gradient after all
    assert swarm.services[1].held_microbatches == 1  # the failed node's forward waits out its hold time
    # a visit counts on the device's clock once its backward ran: the failed node's forward alone does not
    assert swarm.services[1].device.median(at_least=1) is None
    assert swarm.services[2].device.median(at_least=1) is not None


class SlowHolds:
    """A model lock every hold of which lasts `seconds` longer, as a device that finishes after its caller returned
    (a GPU's queue) would."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.lock = seconds, threading.Lock()

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        time.sleep(self.seconds)  # the device busy, not a wait for anything
        self.lock.release()


def test_each_node_clocks_its_device_per_microbatch_it_computes(swarm: Swarm) -> None:
    for node in (0, 3):
        swarm.services[node].model_lock = SlowHolds(0.1)  # type: ignore[assignment]
    outcome = swarm.driver().run_microbatch(1, swarm.route((0, 1, 3, 4)), tokens())
    assert outcome.backward_lost == ()
    source, slow, fast = (swarm.services[node].device.median(at_least=1) for node in (0, 3, 4))
    assert source is not None and source >= 0.3  # its three holds: stage 0's forward, the head and loss, the backward
    assert slow is not None and slow >= 0.2  # a visit: its forward and its backward
    assert fast is not None and fast < slow
    assert swarm.services[2].device.median(at_least=1) is None  # off the path
    swarm.services[3].set_stage(2, memory_microbatches=2)  # another stage is another cost: the samples go
    assert swarm.services[3].device.median(at_least=1) is None


def hop(stage: int, shape: Sequence[int], dtype: str = "float32", iteration: int = 1) -> proto.StageHop:
    return proto.StageHop(iteration=iteration, microbatch=0, stage=stage, shape=list(shape), dtype=dtype)


async def raw_call(service: StageService, peer: str, call: str, frames: list[proto.StageHop]) -> None:
    async def stream() -> typing.AsyncIterator[proto.StageHop]:
        for frame in frames:
            yield frame

    stub: typing.Any = service.get_stub(service.require_p2p(), PeerID.from_base58(peer), namespace=NAMESPACE)
    answers = await getattr(stub, f"rpc_stage_{call}")(stream())
    async for _ in answers:
        pass


def test_hostile_hops_are_refused_with_a_sentence_and_the_node_keeps_serving(swarm: Swarm) -> None:
    caller, target = swarm.services[0], swarm.peer(3)  # node 3 serves stage 2
    good = torch.randn(2, 8, HIDDEN)
    nan = good.clone()
    nan[0, 0, 0] = float("nan")
    cases: list[tuple[str, list[proto.StageHop], str]] = [
        ("forward", [hop(1, good.shape)], "serves stage 2, not 1"),
        ("forward", [hop(2, (5, 8, HIDDEN))], r"shape \[5, 8, 32\]"),
        ("forward", [hop(2, (2, 17, HIDDEN))], r"shape \[2, 17, 32\]"),
        ("forward", [hop(2, (2, 8, HIDDEN + 1))], r"shape \[2, 8, 33\]"),
        ("forward", [hop(2, (2, 8), "float32")], "2 dimensions"),
        ("forward", [hop(2, good.shape, "int64")], "wire dtype 'int64'"),
        ("forward", [hop(2, good.shape, "int8")], "wire dtype 'int8'"),  # only a stage's gradient travels in int8
        ("forward", [hop(2, good.shape), proto.StageHop(payload=b"\0" * 100)], "ended after 100 of its 2048 bytes"),
        ("forward", [hop(2, good.shape), proto.StageHop(payload=b"\0" * (CHUNK_BYTES + 1))], "more than the 2048"),
        ("forward", [hop(2, good.shape), proto.StageHop(payload=nan.numpy().tobytes())], "NaN or infinite"),
        ("forward", [], "ended before its header"),
        ("backward", [hop(2, good.shape), proto.StageHop(payload=good.numpy().tobytes())], "no forward of"),
    ]
    for call, frames, sentence in cases:
        with pytest.raises(Exception, match=sentence):
            caller.run(raw_call(caller, target, call, frames), 20.0)

    # a node holds at most memory_microbatches (2) forwards: the third is refused as busy, then served once one is done
    for microbatch in range(2):
        header = proto.StageHop(iteration=1, microbatch=microbatch, stage=2, dtype="float32")
        caller.call(target, "forward", header, good, 20.0)
    third = proto.StageHop(iteration=1, microbatch=2, stage=2, dtype="float32")
    with pytest.raises(HopFailedError, match="busy") as refused:
        caller.call(target, "forward", third, good, 20.0)
    assert refused.value.busy
    first = proto.StageHop(iteration=1, microbatch=0, stage=2, dtype="float32")
    caller.call(target, "backward", first, torch.ones_like(good), 20.0)
    assert swarm.services[3].backwards_run(1) == {(caller.peer_id, 0)}  # recorded before the answer
    answer = caller.call(target, "forward", third, good, 20.0)
    assert answer.shape == good.shape and bool(torch.isfinite(answer).all())
    assert swarm.services[3].finish_iteration(1) == 2  # microbatches 1 and 2 never came back


def test_stalled_hops_take_at_most_one_callers_share_and_are_cut_at_their_deadline(
    swarm: Swarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hops announce the largest shape, send one chunk and stall. Each takes a grant before its payload is read: one
    # caller's share (2 x memory_microbatches) is admitted, the rest are refused busy at once; a stalled one is cut
    # at HOP_TIME_S, and another caller is served meanwhile.
    monkeypatch.setattr(stage_service, "HOP_TIME_S", 3.0)
    caller, other, target, node = swarm.services[0], swarm.services[1], swarm.peer(3), swarm.services[3]
    largest = (LIMITS.max_batch, LIMITS.max_sequence, HIDDEN)
    share = node.hops.limits.max_answers_per_peer

    async def stalled() -> typing.AsyncIterator[proto.StageHop]:
        yield hop(2, largest)
        yield proto.StageHop(payload=b"\0" * 64)
        await asyncio.sleep(60)

    async def stall_many(count: int) -> list[BaseException | None]:
        async def one() -> None:
            stub: typing.Any = caller.get_stub(caller.require_p2p(), PeerID.from_base58(target), namespace=NAMESPACE)
            async for _ in await stub.rpc_stage_forward(stalled()):
                pass

        return await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)

    with ThreadPoolExecutor(1) as pool:
        stalling = pool.submit(caller.run, stall_many(share + 2), 60.0)
        await_condition(lambda: node.hops.num_answers == share, 20, "one caller's share of hops to be admitted")
        good = torch.randn(2, 8, HIDDEN)
        answer = other.call(target, "forward", proto.StageHop(iteration=1, stage=2, dtype="float32"), good, 20.0)
        assert answer.shape == good.shape, "another caller is served while they stall"
        outcomes = [str(outcome) for outcome in stalling.result(timeout=60)]
    assert sum("busy" in outcome for outcome in outcomes) == 2, outcomes
    assert sum("did not come within 3 s" in outcome for outcome in outcomes) == share, outcomes
    assert node.hops.refusals["peer"] == 2 and node.hops.num_answers == 0


def test_a_forward_of_the_next_iteration_waits_for_the_stage_the_node_moves_to(swarm: Swarm) -> None:
    """A node that moves from stage 2 to stage 1 at iteration 2 is sent a stage-1 forward of iteration 2 by a source
    already there while it still steps iteration 1: the forward waits for iteration 2 and is served by stage 1 (it
    was refused for its stage, and the leader dropped the moving node: a CI run's stage went unserved)."""
    caller, mover = swarm.services[0], swarm.services[3]  # node 3 serves stage 2
    mover.open_iteration(1)
    forward = proto.StageHop(iteration=2, microbatch=0, stage=1, dtype="float32")
    inputs = torch.randn(2, 8, HIDDEN)
    with ThreadPoolExecutor(max_workers=1) as pool:
        sent = pool.submit(caller.call, swarm.peer(3), "forward", forward, inputs, 20.0)
        # refused at once for its stage before; now it waits (up to OPEN_WAIT_S) while the mover steps iteration 1
        wait([sent], timeout=3.0)
        assert not sent.done(), f"the forward was answered before its iteration opened: {sent.exception()}"
        mover.set_stage(1, memory_microbatches=2)
        mover.open_iteration(2)
        answer = sent.result(timeout=20)
    expected = swarm.services[1].staged.run_stage(1, swarm.services[1].staged.activations(inputs)).hidden_states
    torch.testing.assert_close(answer, expected.detach())

    # a forward of the iteration the node left is refused as busy: its source asks again, and suspects no one
    over = proto.StageHop(iteration=1, microbatch=1, stage=2, dtype="float32")
    with pytest.raises(HopFailedError, match="iteration 1 is over") as refused:
        caller.call(swarm.peer(3), "forward", over, inputs, 20.0)
    assert refused.value.busy


def test_a_stopping_node_cuts_short_a_hop_waiting_on_its_peer_and_calls_no_more(swarm: Swarm) -> None:
    """Ctrl-C mid-iteration: a hop waiting on a peer ends within a moment of the node's stop being set, not at its
    deadline, and later calls are refused at once; the peer that was called keeps serving others."""
    caller, callee = swarm.services[0], swarm.services[3]  # node 3 serves stage 2
    callee.open_iteration(1)
    waits = proto.StageHop(iteration=2, microbatch=0, stage=2, dtype="float32")  # waits for iteration 2 to open
    inputs = torch.randn(2, 8, HIDDEN)
    with ThreadPoolExecutor(max_workers=1) as pool:
        sent = pool.submit(caller.call, swarm.peer(3), "forward", waits, inputs, 30.0)
        wait([sent], timeout=2.0)
        assert not sent.done(), f"the forward was answered before its iteration opened: {sent.exception()}"
        caller.stop.set()
        stopped_at = time.monotonic()
        with pytest.raises(NodeStopping):
            sent.result(timeout=10)
    assert time.monotonic() - stopped_at < 2.0, "the hop waited past the stop"
    started = time.monotonic()
    with pytest.raises(NodeStopping):
        caller.ping(swarm.peer(1), timeout_s=5.0)
    with pytest.raises(NodeStopping):
        caller.say_done([swarm.peer(1)], 1, timeout_s=5.0)
    assert time.monotonic() - started < 1.0, "a stopping node still calls its peers"
    callee.open_iteration(2)
    assert swarm.services[1].ping(swarm.peer(3), timeout_s=5.0) == 2, "the called peer serves on"


def run_iterations(runners: Sequence[SkipPipeNode], iterations: Sequence[int]) -> dict[int, list[IterationReport]]:
    """Run `iterations` on every runner, each in its own thread; each iteration's reports, in the runners' order."""
    reports: dict[int, list[IterationReport]] = {}
    with ThreadPoolExecutor(max_workers=len(runners)) as pool:
        for iteration in iterations:
            futures = [pool.submit(runner.run_iteration, iteration) for runner in runners]
            reports[iteration] = [future.result(timeout=120) for future in futures]
    return reports


def exact_runner(
    service: StageService,
    nodes: list[NodeInfo],
    data: list[torch.Tensor],
    num_microbatches: int,
    overlap: bool = False,
    link_bytes_per_s: float | None = None,
) -> SkipPipeNode:
    """A node of `data`'s iterations whose hops and exchange are float32, one microbatch in flight: its steps can be
    compared with one process's. `link_bytes_per_s`: its measured upload and download (paces an overlapped
    exchange)."""
    return SkipPipeNode(
        service=service,
        nodes=nodes,
        num_microbatches=num_microbatches,
        skip_ratio=0.25,
        reorder=True,
        optimizer=stage_optimizer(service.staged.stage_parameters(service.stage)),
        batch=lambda iteration, microbatch: data[iteration * num_microbatches + microbatch],
        wire_dtype="float32",
        gradient_dtype="float32",
        in_flight=1,
        done_timeout_s=60.0,
        overlap_exchange=overlap,
        upload_bytes_per_s=link_bytes_per_s,
        download_bytes_per_s=link_bytes_per_s,
    )


def stage_vector(runner: SkipPipeNode) -> torch.Tensor:
    return torch.cat([parameter.detach().reshape(-1) for parameter in runner.parameters])


def test_iterations_on_every_node_step_each_stage_as_one_process_would(
    swarm: Swarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two SkipPipe iterations of 6 microbatches on the five nodes, each node in its own thread: every node's stage
    ends where one process ends that runs the same routes with gradient accumulation, clipping and AdamW, and the
    two replicas of stage 1 hold the same bits; a joiner steps as the replica it joined; replicas that drifted apart
    are one again after the next iteration."""
    nodes = swarm.roster()
    # A node that runs no iteration yet (held) keeps other sources' done messages of whatever iteration it will
    # enter at: here 100, past the 64 iterations after the one it is held at.
    swarm.services[1].hold(-1)
    assert swarm.services[0].say_done([swarm.peer(1)], 100, 10.0) == []
    assert swarm.services[1].wait_sources(100, [swarm.peer(0)], 1.0) == {swarm.peer(0)}

    num_microbatches, iterations = 6, 2
    data = [tokens(seed) for seed in range(num_microbatches * (iterations + 1))]
    runners = [exact_runner(service, nodes, data, num_microbatches) for service in swarm.services]
    reports = run_iterations(runners, range(iterations))
    assert all(report.adopted_from is None for reports_of in reports.values() for report in reports_of)

    reference = StagedModel(model(), NUM_STAGES)
    optimizers = {stage: torch.optim.AdamW(reference.stage_parameters(stage), lr=1e-2) for stage in range(NUM_STAGES)}
    for iteration in range(iterations):
        report = reports[iteration][0]
        assert report.sources == report.sources_done == 1
        assert len(report.outcomes) == num_microbatches
        assert all(not (o.skipped or o.backward_lost or o.rerouted) for o in report.outcomes)
        assert all(len(o.stages) == 3 for o in report.outcomes), "k = 0.25 of stages 1..3: each path visits 2"
        assert reports[iteration][1].replicas_summed == reports[iteration][2].replicas_summed == 2
        for outcome in report.outcomes:
            batch = data[iteration * num_microbatches + outcome.microbatch]
            (reference.loss(batch, outcome.stages) / num_microbatches).backward()
        for stage, optimizer in optimizers.items():
            torch.nn.utils.clip_grad_norm_(reference.stage_parameters(stage), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    for service in swarm.services:
        for mine, theirs in zip(
            service.staged.stage_parameters(service.stage),
            reference.stage_parameters(service.stage),
            strict=True,
        ):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
    first, second = (torch.cat([p.reshape(-1) for p in swarm.services[n].staged.stage_parameters(1)]) for n in (1, 2))
    assert torch.equal(first, second), "the replicas of stage 1 stepped on different gradients"
    assert_a_joiner_steps_as_the_replica_it_joined(swarm, nodes, runners[1], iterations)

    # The joiner's check stepped node 1 once more: the replicas of stage 1 have drifted apart, and node 2 also
    # suspects node 1 (a lost exchange) but forgives it by the next iteration. After it, the replica with the
    # higher peer ID holds the lower one's state, bit for bit.
    assert not torch.equal(stage_vector(runners[1]), stage_vector(runners[2]))
    runners[1].optimizer.zero_grad(set_to_none=False)  # the joiner's check left its made-up gradient there
    monkeypatch.setattr("crowdtrain.modes.skippipe.iteration.SUSPICION_S", 0.0)
    runners[2].suspect(swarm.peer(1))
    last = run_iterations(runners, [iterations])[iterations]
    low, high = sorted((1, 2), key=swarm.peer)
    assert last[low].adopted_from is None and last[high].adopted_from == swarm.peer(low)
    assert last[1].replicas_summed == last[2].replicas_summed == 2, "node 2 forgave node 1"
    assert torch.equal(stage_vector(runners[1]), stage_vector(runners[2])), "the replicas are one again"
    assert all(report.adopted_from is None for node, report in enumerate(last) if node not in (1, 2))


def test_stage_nodes_step_once_their_share_has_run_without_waiting_for_the_sources_done(
    swarm: Swarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source's done messages are held back until the other nodes have stepped: each stage node sums its
    gradient and steps once the backwards of the routes through it have run (stage 1's replicas with each other),
    and reports, with no done message of the iteration yet, the loss of the iteration before."""
    nodes = swarm.roster()
    num_microbatches = 4
    data = [tokens(seed) for seed in range(num_microbatches * 2)]
    runners = [exact_runner(service, nodes, data, num_microbatches) for service in swarm.services]
    before = [stage_vector(runner).clone() for runner in runners]
    release = threading.Event()
    say_done = swarm.services[0].say_done

    def held_back(*args: typing.Any, **kwargs: typing.Any) -> list[str]:
        assert release.wait(90), "the stage nodes did not step before the source said it was done"
        return say_done(*args, **kwargs)

    monkeypatch.setattr(swarm.services[0], "say_done", held_back)
    reports: list[list[IterationReport]] = []
    with ThreadPoolExecutor(max_workers=len(runners)) as pool:
        for iteration in range(2):
            release.clear()
            futures = [pool.submit(runner.run_iteration, iteration) for runner in runners]
            stages = [future.result(timeout=60) for future in futures[1:]]  # while the done message is held back
            release.set()
            reports.append([futures[0].result(timeout=60), *stages])
    for iteration, of_nodes in enumerate(reports):
        for node, report in enumerate(of_nodes[1:], start=1):
            assert report.early and report.sources_done == 0, (iteration, node)
            assert report.replicas_summed == (2 if STAGE_OF_NODE[node] == 1 else 1)
            assert report.loss == (None if iteration == 0 else pytest.approx(reports[0][0].loss)), (iteration, node)
    assert all(not torch.equal(stage_vector(runner), start) for runner, start in zip(runners, before, strict=True))
    assert torch.equal(stage_vector(runners[1]), stage_vector(runners[2])), "stage 1's replicas summed alike"


def test_a_stage_node_given_no_microbatch_finds_a_dead_source_gone(swarm: Swarm) -> None:
    """The schedule sends every microbatch of stage 1 through node 1 and none through node 2, and the source is dead:
    node 2, whose share is whole at once, pings the source before it steps and suspects it as the nodes that waited
    for their microbatches do (where that source was the last of stage 0, a replica that went on alone would step
    apart from its twins, which hold)."""
    nodes = swarm.roster()

    def all_through_node_1(problem: SkipPipeProblem) -> Schedule:
        schedule = schedule_microbatches(problem)
        moved = {swarm.peer(2): swarm.peer(1)}
        routes = tuple(replace(r, path=tuple(moved.get(peer, peer) for peer in r.path)) for r in schedule.routes)
        return replace(schedule, routes=routes)

    data = [tokens(seed) for seed in range(4)]
    runners = [exact_runner(service, nodes, data, 4) for service in swarm.services[1:]]
    for runner in runners:
        runner.scheduler = all_through_node_1
    swarm.services[0].close()  # the source, gone before the iteration
    reports = run_iterations(runners, [0])[0]
    for node, (runner, report) in enumerate(zip(runners, reports, strict=True), start=1):
        assert report.sources_done == 0 and not report.outcomes, node
        assert swarm.peer(0) in runner.suspected, f"node {node} did not find the dead source gone"


def test_replicas_sum_the_gradients_as_published_in_the_runs_dtype(swarm: Swarm) -> None:
    """Stage 1's two replicas exchange their gradients in bfloat16 (half of float32's bytes) and both hold the sum,
    in peer-ID order, of what each published, bit for bit; in float32 the sum is of the gradients themselves; in
    int8 blocks (a quarter of float32's bytes) each publishes its gradient plus what rounding left out of its last
    int8 one, and both hold the same bits."""
    nodes = swarm.roster()
    replicas = [
        SkipPipeNode(
            service=swarm.services[node],
            nodes=nodes,
            num_microbatches=2,
            skip_ratio=0.25,
            reorder=True,
            optimizer=stage_optimizer(swarm.services[node].staged.stage_parameters(1)),
            batch=lambda iteration, microbatch: tokens(),
        )
        for node in (1, 2)
    ]
    numel = stage_vector(replicas[0]).numel()
    sizes = {"bfloat16": 2 * numel, "float32": 4 * numel, "int8": int8_blocks_size(numel)}
    unsent: dict[str, torch.Tensor] = {}
    for iteration, dtype in enumerate(["bfloat16", "float32", "int8", "int8"]):
        generator = torch.Generator().manual_seed(iteration)
        published = {}
        for runner in replicas:
            runner.gradient_dtype = dtype
            for parameter in runner.parameters:
                parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-3
            gradient = torch.cat([parameter.grad.reshape(-1) for parameter in runner.parameters])
            if dtype == "int8":
                carried = gradient + unsent.get(runner.peer_id, torch.zeros(numel))
                published[runner.peer_id] = decode_int8_blocks(encode_int8_blocks(carried), numel)
                unsent[runner.peer_id] = carried - published[runner.peer_id]
                assert unsent[runner.peer_id].abs().max() > 0, "int8 rounded nothing away"
            else:
                published[runner.peer_id] = gradient.to(getattr(torch, dtype)).float()
        expected = torch.zeros(numel)
        for peer in sorted(published):
            expected += published[peer]
        sent_before = [runner.service.bytes_sent for runner in replicas]
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(r._sum_gradients, iteration, None, 0.0) for r in replicas]
            summed = [future.result(timeout=60) for future in futures]
        assert summed == [(2, None, True), (2, None, True)]  # trained: the sum is not zero
        for runner, before in zip(replicas, sent_before, strict=True):
            got = torch.cat([parameter.grad.reshape(-1) for parameter in runner.parameters])
            assert torch.equal(got, expected), f"{iteration}, {dtype}: a replica summed other bits than published"
            assert runner.service.bytes_sent - before == sizes[dtype]
    assert not torch.equal(published[swarm.peer(1)], published[swarm.peer(1)].bfloat16().float()), "float32 kept"


def test_a_request_for_a_gradient_not_yet_published_is_held_until_it_is_and_only_a_few_are(
    swarm: Swarm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica done early asks for its twin's gradient before it is published: the request is answered when it is,
    not with none at once; while MAX_GRADIENT_WAITS requests are held, another is answered with none at once."""
    service = swarm.services[1]
    monkeypatch.setattr("crowdtrain.modes.skippipe.hops.stage_service.GRADIENT_WAIT_S", 60.0)

    async def first_answer(iteration: int) -> proto.StageHop:
        request = proto.StageHop(iteration=iteration, stage=1)
        answers = service.rpc_stage_gradient(request, typing.cast(P2PContext, None))
        try:
            return await anext(answers)
        finally:
            await answers.aclose()

    async def scenario() -> None:
        held = asyncio.create_task(first_answer(7))
        await asyncio.sleep(0)  # the request runs until it waits: nothing published yet
        assert not held.done()
        service.publish_gradient(7, torch.ones(10), torch.zeros(3), "float32")
        assert list((await asyncio.wait_for(held, 10.0)).shape) == [10]
        service._gradient_waits = MAX_GRADIENT_WAITS  # as many held as may be
        assert not (await asyncio.wait_for(first_answer(8), 10.0)).shape, "a request past the cap is not held"

    asyncio.run(scenario())


def test_a_background_gradient_request_is_answered_paced_and_the_same(swarm: Swarm) -> None:
    """A replica's request for a gradient in the background (overlap_exchange) names the most it may take of its
    download: the answer comes in PACED_CHUNK_BYTES frames no faster than that, or than the answering node's own
    share of its upload, whichever is slower, and holds the same values as one at full speed."""
    fetcher, answerer = swarm.services[1], swarm.services[2]  # stage 1's replicas
    numel = 100_000  # 400 KB of float32
    gradient = torch.randn(numel)
    answerer.publish_gradient(3, gradient, torch.zeros(4), "float32")
    fast, _ = fetcher.fetch_gradient(answerer.peer_id, 3, numel, 10.0)
    for asked, own in ((1_000_000.0, None), (math.inf, 1_000_000.0), (4_000_000.0, 1_000_000.0)):
        answerer.background_bytes_per_s = own
        began = time.monotonic()
        paced_answer, _ = fetcher.fetch_gradient(answerer.peer_id, 3, numel, 10.0, max_bytes_per_s=asked)
        took = time.monotonic() - began
        assert torch.equal(paced_answer, fast) and torch.equal(fast, gradient)
        assert took >= (4 * numel - PACED_CHUNK_BYTES) / 1_000_000.0, f"{asked}, {own}: not paced ({took:.3f} s)"


def test_the_background_exchange_runs_at_a_lower_priority_than_the_node() -> None:
    """The overlapped exchange's thread (`lower_priority`, its pool's initializer) runs BACKGROUND_NICE nice values
    lower than the node's other threads, so that its encoding, decoding and summing wait for the cores the pipeline
    leaves idle; the thread that started it keeps its own."""
    node_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ThreadPoolExecutor(max_workers=1, initializer=lower_priority) as pool:
        exchange_nice = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert exchange_nice == min(node_nice + BACKGROUND_NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == node_nice


def test_a_paced_rate_is_the_slower_share_and_ends_an_answer_in_bounded_time() -> None:
    """`paced_rate`: a foreground request (0, negative, NaN) is not paced; a background one at the slower of the
    caller's cap and this node's share, not paced where neither is measured, and never slower than what ends the
    answer within MAX_PACED_S (a caller asking for a byte per second holds no stream open for days)."""
    size = 10_000_000
    assert paced_rate(0.0, 1e6, size) is None and paced_rate(-1.0, 1e6, size) is None
    assert paced_rate(math.nan, 1e6, size) is None
    assert paced_rate(math.inf, None, size) is None
    assert paced_rate(2e6, None, size) == 2e6 and paced_rate(math.inf, 3e6, size) == 3e6
    assert paced_rate(2e6, 3e6, size) == 2e6 and paced_rate(3e6, 2e6, size) == 2e6
    assert paced_rate(1.0, None, size) == size / MAX_PACED_S == paced_rate(math.inf, 1.0, size)


def test_a_malformed_int8_gradient_is_refused_with_a_sentence(swarm: Swarm) -> None:
    """A replica's int8 gradient is checked before it is summed: its exact bytes, scales finite and not negative,
    values within ±127, and every decoded value finite; the fetching replica gets a sentence, not a tensor."""
    fetcher, answerer = swarm.services[1], swarm.services[2]  # stage 1's replicas
    numel = 5000  # two blocks
    good = encode_int8_blocks(torch.randn(numel))
    cases = [
        (torch.tensor([-1.0]).numpy().tobytes() + good[4:], "negative or non-finite scale"),
        (torch.tensor([float("nan")]).numpy().tobytes() + good[4:], "negative or non-finite scale"),
        (good[:8] + b"\x80" + good[9:], "outside ±127"),
        (torch.tensor([3e38]).numpy().tobytes() + good[4:], "NaN or infinite"),  # 127 steps of 3e38 overflow
        (good[:-1], f"ended after {len(good) - 1} of its {len(good)} bytes"),
    ]
    for iteration, (payload, sentence) in enumerate(cases):
        with answerer._held_lock:
            answerer._gradients[iteration] = (numel, payload, torch.zeros(4), "int8")
        with pytest.raises(HopFailedError, match=sentence):
            fetcher.fetch_gradient(answerer.peer_id, iteration, numel, 10.0)
    with answerer._held_lock:
        answerer._gradients[len(cases)] = (numel, good, torch.zeros(4), "int8")
    gradient, _ = fetcher.fetch_gradient(answerer.peer_id, len(cases), numel, 10.0)
    assert torch.equal(gradient, decode_int8_blocks(good, numel))


def assert_a_joiner_steps_as_the_replica_it_joined(
    swarm: Swarm, nodes: list[NodeInfo], replica: SkipPipeNode, iterations: int
) -> None:
    # A joining replica of stage 1 takes the stage's state from node 1 and steps exactly as node 1 does from then on.
    joiner_dht = swarm.joiner_dht()
    joiner = StageService(joiner_dht, StagedModel(model(), NUM_STAGES), 1, LIMITS)
    try:
        joiner.start()
        with torch.no_grad():
            for parameter in joiner.staged.stage_parameters(1):
                parameter.add_(1.0)  # whatever it held, the download replaces
        joining = SkipPipeNode(
            service=joiner,
            nodes=nodes,
            num_microbatches=6,
            skip_ratio=0.25,
            reorder=True,
            optimizer=stage_optimizer(joiner.staged.stage_parameters(1)),
            batch=lambda iteration, microbatch: tokens(),
        )
        with pytest.raises(HopFailedError, match=r"not \[5\]"):
            joiner.fetch_state(swarm.peer(1), 5, 10.0)
        assert joining.join(swarm.peer(1)) == iterations
        for runner in (replica, joining):
            for parameter in runner.parameters:
                parameter.grad = torch.full_like(parameter, 0.01)
            runner.optimizer.step()
        for mine, theirs in zip(joining.parameters, replica.parameters, strict=True):
            assert torch.equal(mine, theirs), "the joiner stepped differently from the replica it joined"
    finally:
        joiner.close()
        joiner_dht.shutdown()


def one_process_looking_ahead(
    reports: dict[int, list[IterationReport]], data: list[torch.Tensor], num_microbatches: int
) -> LookAheadReference:
    """One process running the source's routes of each iteration with overlap_exchange (`LookAheadReference`), each
    microbatch's stage on the parameters of the node its route took there."""
    reference = StagedModel(model(), NUM_STAGES)
    optimizers = [torch.optim.AdamW(reference.stage_parameters(stage), lr=1e-2) for stage in range(NUM_STAGES)]
    looking = LookAheadReference(reference, optimizers)
    for iteration in sorted(reports):
        microbatches = []
        for outcome in reports[iteration][0].outcomes:
            assert not (outcome.skipped or outcome.backward_lost or outcome.rerouted)
            batch = data[iteration * num_microbatches + outcome.microbatch]
            microbatches.append((batch, list(zip(outcome.stages, outcome.peers, strict=True))))
        looking.iteration(microbatches, scale=1.0 / num_microbatches)
    return looking


def test_an_overlapped_exchange_steps_the_true_state_on_the_sum_before_and_computes_on_a_look_ahead(
    swarm: Swarm,
) -> None:
    """With overlap_exchange, each iteration's step of a stage's true state is on the replicas' summed gradient of
    the iteration before (none at the first), and each node computes on its look-ahead: every node's true state and
    the parameters it computes on end where one process ends that does the same; stage 1's replicas hold the same
    true state, bit for bit, though they compute on different look-aheads (their fingerprints are of the true
    state: no drift repair); a replica that joins after iteration 2 computes on the true state it downloaded and
    steps on the others' sum of iteration 2 at its first iteration, so that all three hold the same bits after it.
    Stage 1's first replica has a measured link: the exchange in the background is paced, and sums the same."""
    nodes = swarm.roster()
    num_microbatches, iterations = 4, 4
    data = [tokens(seed) for seed in range(num_microbatches * iterations)]
    runners = [
        exact_runner(service, nodes, data, num_microbatches, overlap=True, link_bytes_per_s=500_000.0 * (index == 1))
        for index, service in enumerate(swarm.services)
    ]
    assert runners[1].service.background_bytes_per_s == 250_000.0 and runners[2].service.background_bytes_per_s is None
    joiner_dht = swarm.joiner_dht()
    joiner_service = StageService(joiner_dht, StagedModel(model(), NUM_STAGES), 1, LIMITS)
    try:
        joiner_service.start()
        reports = run_iterations(runners, range(iterations - 1))
        assert [report.replicas_summed for report in reports[0]] == [0] * len(runners), "no sum before iteration 0"
        assert reports[2][1].replicas_summed == reports[2][2].replicas_summed == 2
        with torch.no_grad():
            for parameter in joiner_service.staged.stage_parameters(1):
                parameter.add_(1.0)  # whatever it held, the download replaces
        everyone = [*nodes, schedules.node(joiner_service.peer_id, 1, memory=2)]
        joiner = exact_runner(joiner_service, everyone, data, num_microbatches, overlap=True)
        assert joiner.join(swarm.peer(1)) == iterations - 1
        for other in runners:
            other.set_nodes(everyone)
        reports.update(run_iterations([*runners, joiner], [iterations - 1]))
        assert reports[iterations - 1][-1].replicas_summed == 2, "the joiner's first step: the others' sum of 2"
        assert all(report.adopted_from is None for reports_of in reports.values() for report in reports_of)
        replicas = [r._state()[2] for r in (runners[1], runners[2], joiner)]
        assert torch.equal(replicas[0], replicas[1]) and torch.equal(replicas[0], replicas[2])
        assert not torch.equal(stage_vector(runners[1]), stage_vector(runners[2])), "each computes on its own"
    finally:
        for each in runners:
            each.close()
        joiner_service.close()
        joiner_dht.shutdown()
    reference = one_process_looking_ahead(reports, data, num_microbatches)
    for runner in [*runners, joiner]:
        stage, peer = runner.service.stage, runner.peer_id
        true = reference.staged.stage_parameters(stage)
        truth = torch.cat([p.detach().reshape(-1) for p in true])
        torch.testing.assert_close(runner._state()[2][: truth.numel()], truth, atol=1e-5, rtol=1e-4)
        computes_on = torch.cat([p.detach().reshape(-1) for p in reference.ahead.get((stage, peer), true)])
        torch.testing.assert_close(stage_vector(runner), computes_on, atol=1e-5, rtol=1e-4)


def test_a_stage_state_download_is_given_the_time_a_slow_home_uplink_takes() -> None:
    llama_20m_stage = 6_330_000 * STATE_PARTS  # float32 values: 76 MB, 30 s at 20 Mbit/s
    seconds_at_4_mbit = 4 * llama_20m_stage / (4e6 / 8)  # 152 s
    assert state_timeout_s(llama_20m_stage) > seconds_at_4_mbit
    assert state_timeout_s(1000) == pytest.approx(STATE_TIMEOUT_FLOOR_S, abs=0.01)


def test_a_fingerprint_tells_drifted_replicas_from_rounding() -> None:
    parameters = list(StagedModel(model(), NUM_STAGES).stage_parameters(1))
    positions = fingerprint_positions(parameters)
    assert sum(len(where) for where in positions) == 1024
    assert [len(where) for where in positions] == [len(where) for where in fingerprint_positions(parameters)]
    mine = fingerprint(parameters, positions)
    with torch.no_grad():
        rounded = [parameter * (1 + 1e-6) for parameter in parameters]  # another device's last bits
        stepped = [parameter - 1e-3 * torch.sign(torch.randn_like(parameter)) for parameter in parameters]
    assert not drifted(mine, mine.clone())
    assert not drifted(mine, fingerprint(rounded, positions))
    assert drifted(mine, fingerprint(stepped, positions)), "one AdamW step of lr 1e-3 apart"
    assert not drifted(mine, torch.zeros(3)), "a fingerprint of another size shows nothing"


def test_the_replicas_follow_the_majority_of_fingerprints_and_ties_go_to_the_lowest_peer_id() -> None:
    honest, other = torch.ones(8), torch.full((8,), 2.0)
    # two replicas: no majority, the lower peer ID
    assert reference_replica({"b": honest, "a": other}) == "a"
    # three: the one that differs is outvoted, be it the lowest (drifted, or lying to make the others take its state)
    assert reference_replica({"a": other, "b": honest, "c": honest * (1 + 1e-7)}) == "b"
    assert reference_replica({"a": honest, "b": honest, "c": other}) == "a"
    # a replica that sent no fingerprint (another version) counts for nothing
    assert reference_replica({"a": None, "b": other, "c": other}) == "b"
    assert reference_replica({"a": None}) is None
