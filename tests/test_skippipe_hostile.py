"""Hostile peers against a SkipPipe stage node, through its real handlers on loopback p2p daemons (issue 47, findings
1, 8, 10 and 16): a peer outside the roster writes no gradient into a stage, a roster member's hop in another wire
dtype is refused, a gradient that overflows never becomes a NaN weight, a gradient that can't be published does not
stop the iterations, done messages from outsiders, for far iterations or with absurd losses are not kept, and a peer
that stops reading a stage's state holds no other asker's slot."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import hivemind
import pytest
import torch

from crowdtrain import proto
from crowdtrain.manifest import OptimizerSpec
from crowdtrain.modes.skippipe.hops import HopFailedError, HopLimits, StageService
from crowdtrain.modes.skippipe.hops.hop_callers import IterationCallers
from crowdtrain.modes.skippipe.hops.stage_ledger import MAX_ITERATIONS_AHEAD
from crowdtrain.modes.skippipe.iteration import SkipPipeNode
from crowdtrain.modes.skippipe.stages import StagedModel
from crowdtrain.optimizer import build_optimizer
from tests import schedules
from tests.messages import read_first_then_stall
from tests.stage_swarm import stage_services, tiny_llama

pytestmark = pytest.mark.timeout(180)

NUM_STAGES = 2
HIDDEN = 16
LIMITS = HopLimits(max_batch=4, max_sequence=8, hidden_size=HIDDEN)
ITERATION = 5
SOURCE, OUTSIDER, REPLICA, TWIN = range(4)
"""The roster's stage-0 node, a peer outside the roster, and stage 1's two replicas."""
STAGE_OF = (0, 0, 1, 1)


def model() -> torch.nn.Module:
    return tiny_llama(LIMITS, num_layers=NUM_STAGES)


class PublishFails(StageService):
    """A replica whose next publish of a gradient fails (`fail_next`), as one past its wire dtype's range does."""

    fail_next = False

    def publish_gradient(
        self, iteration: int, gradient: torch.Tensor, fingerprint: torch.Tensor, dtype: str = "float32"
    ) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise ValueError("the values hold NaN or infinite ones")
        return super().publish_gradient(iteration, gradient, fingerprint, dtype)


@dataclass
class Swarm:
    services: list[StageService]

    def peer(self, node: int) -> str:
        return self.services[node].peer_id

    def callers(self, wire_dtype: str = "float32") -> IterationCallers:
        return IterationCallers.of(ITERATION, [self.peer(SOURCE)], 4, wire_dtype)


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    def build(node: int, dht: hivemind.DHT) -> StageService:
        kind = PublishFails if node == REPLICA else StageService
        return kind(dht, StagedModel(model(), NUM_STAGES), STAGE_OF[node], LIMITS, slot_wait_s=0.5)

    with stage_services(len(STAGE_OF), build) as (_, services):
        yield Swarm(services)


def hop(swarm: Swarm, caller: int, call: str, values: torch.Tensor, dtype: str = "float32", microbatch: int = 0):
    header = proto.StageHop(iteration=ITERATION, microbatch=microbatch, stage=1, dtype=dtype)
    return swarm.services[caller].call(swarm.peer(REPLICA), call, header, values, 20.0)


def stage_weights(service: StageService) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in service.staged.stage_parameters(service.stage)])


def stage_gradient_norm(service: StageService) -> float:
    grads = [p.grad for p in service.staged.stage_parameters(service.stage) if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def hidden(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_an_outsiders_forward_and_backward_are_refused_and_write_nothing(
    swarm: Swarm, caplog: pytest.LogCaptureFixture
) -> None:
    victim = swarm.services[REPLICA]
    victim.open_iteration(ITERATION, swarm.callers())
    before = stage_weights(victim)
    with caplog.at_level(logging.WARNING, logger="crowdtrain.modes.skippipe.hops.stage_service"):
        for call in ("forward", "backward", "forward"):
            with pytest.raises(HopFailedError, match="is no source of iteration 5 in this node's roster"):
                hop(swarm, OUTSIDER, call, hidden())
    said = [r for r in caplog.records if swarm.peer(OUTSIDER)[-8:] in r.getMessage()]
    assert len(said) == 1, "an outsider's refusals are logged once"
    assert victim.held_microbatches == 0 and stage_gradient_norm(victim) == 0.0
    build_optimizer(victim.staged.stage_parameters(1), OptimizerSpec(learning_rate=0.1)).step()
    assert torch.equal(stage_weights(victim), before), "no outsider's gradient moved the stage"
    # the roster's source is served, once per microbatch, and only for the iteration's microbatches
    assert hop(swarm, SOURCE, "forward", hidden()).shape == hidden().shape
    assert hop(swarm, SOURCE, "backward", hidden(2)).shape == hidden().shape
    assert stage_gradient_norm(victim) > 0.0
    with pytest.raises(HopFailedError, match="ran here already"):
        hop(swarm, SOURCE, "forward", hidden())
    with pytest.raises(HopFailedError, match="not one of the iteration's 0..3"):
        hop(swarm, SOURCE, "forward", hidden(), microbatch=4)


def test_a_roster_members_hop_in_another_wire_dtype_is_refused(swarm: Swarm) -> None:
    victim = swarm.services[REPLICA]
    victim.open_iteration(ITERATION, swarm.callers("float32"))
    for dtype in ("float16", "bfloat16"):
        with pytest.raises(HopFailedError, match=f"wire dtype '{dtype}' is not one of \\['float32'\\]"):
            hop(swarm, SOURCE, "forward", hidden(), dtype=dtype)
    assert victim.held_microbatches == 0
    victim.open_iteration(ITERATION, swarm.callers("bfloat16"))
    assert hop(swarm, SOURCE, "forward", hidden(), dtype="bfloat16").shape == hidden().shape


def test_a_huge_float32_gradient_never_makes_a_weight_nan(swarm: Swarm) -> None:
    """A source's backward of 3e38 in a float32 run: the stage's gradient overflows, its step is skipped, and the
    weights stay as they were (before, clipping made the infinities NaN and AdamW wrote them into the weights)."""
    victim = swarm.services[REPLICA]
    victim.open_iteration(ITERATION, swarm.callers())
    before = stage_weights(victim)
    hop(swarm, SOURCE, "forward", hidden())
    try:  # its answer may overflow too, and is then refused; what it left in the stage's gradient stays
        hop(swarm, SOURCE, "backward", torch.full_like(hidden(), 3e38))
    except HopFailedError as e:
        assert "overflowed" in str(e)
    assert not math.isfinite(stage_gradient_norm(victim)), "the attack reached the stage's gradient"
    optimizer = build_optimizer(victim.staged.stage_parameters(1), OptimizerSpec(learning_rate=0.1, max_grad_norm=1.0))
    optimizer.step()
    after = stage_weights(victim)
    assert bool(torch.isfinite(after).all()) and torch.equal(after, before)
    assert stage_gradient_norm(victim) == 0.0, "the skipped step's gradient is zeroed"
    assert not optimizer.state, "AdamW's moments were not touched"


def test_a_gradient_that_cant_be_published_does_not_stop_the_iterations(swarm: Swarm) -> None:
    """Stage 1's replicas: one holds a non-finite gradient (iteration 0), then fails to publish (iteration 1); each
    iteration ends on every node, the replicas step on the other's gradient, and hold the same finite weights."""
    members = [SOURCE, REPLICA, TWIN]
    nodes = [schedules.node(swarm.peer(node), STAGE_OF[node], memory=2) for node in members]
    runners = [
        SkipPipeNode(
            service=swarm.services[node],
            nodes=nodes,
            num_microbatches=2,
            skip_ratio=0.0,
            reorder=False,
            optimizer=build_optimizer(
                swarm.services[node].staged.stage_parameters(STAGE_OF[node]), OptimizerSpec(learning_rate=1e-2)
            ),
            batch=lambda iteration, microbatch: torch.randint(0, 32, (2, 6)),
            wire_dtype="float32",
            gradient_dtype="bfloat16",
            done_timeout_s=30.0,
            exchange_timeout_s=20.0,
        )
        for node in members
    ]
    replica = swarm.services[REPLICA]
    assert isinstance(replica, PublishFails)
    before = stage_weights(replica)
    for iteration in range(2):
        if iteration == 0:
            first = replica.staged.stage_parameters(1)[0]
            first.grad = torch.zeros_like(first)
            first.grad.view(-1)[0] = float("inf")  # as a hop that overflowed in this stage's layers left it
        else:
            replica.fail_next = True
        with ThreadPoolExecutor(max_workers=len(runners)) as pool:
            reports = [f.result(timeout=120) for f in [pool.submit(r.run_iteration, iteration) for r in runners]]
        assert [report.iteration for report in reports] == [iteration] * 3
        assert reports[1].replicas_summed == reports[2].replicas_summed == 2
        weights = stage_weights(replica)
        assert bool(torch.isfinite(weights).all())
        assert torch.equal(weights, stage_weights(swarm.services[TWIN])), "the replicas summed the same gradient"
    assert not replica.fail_next and not torch.equal(stage_weights(replica), before), "the stage trained"


def test_done_messages_from_outsiders_far_iterations_or_absurd_losses_are_not_kept(swarm: Swarm) -> None:
    victim, source, outsider = swarm.services[REPLICA], swarm.services[SOURCE], swarm.services[OUTSIDER]
    victim.open_iteration(ITERATION, swarm.callers())
    assert outsider.say_done([victim.peer_id], ITERATION, 10.0, 2.0, 2) == []
    assert victim.wait_sources(ITERATION, [outsider.peer_id], 0.0) == set()
    far = ITERATION + MAX_ITERATIONS_AHEAD + 1
    assert source.say_done([victim.peer_id], far, 10.0) == []
    assert victim.wait_sources(far, [source.peer_id], 0.0) == set(), "an iteration past the bound is dropped"
    assert source.say_done([victim.peer_id], ITERATION, 10.0, 1e308, 2) == []
    assert victim.wait_sources(ITERATION, [source.peer_id], 0.0) == {source.peer_id}, "the done itself counts"
    assert victim.sources_losses(ITERATION) == [], "a loss of 1e308 is left out"
    assert source.say_done([victim.peer_id], ITERATION, 10.0, 2.5, 9) == []
    assert victim.sources_losses(ITERATION) == [], "more microbatches than the iteration has"
    assert source.say_done([victim.peer_id], ITERATION, 10.0, 2.5, 2) == []
    assert victim.sources_losses(ITERATION) == [(2.5, 2)]

    # A held node (joining) keeps the roster's done messages for its next iterations; 64 far ones push none out.
    joiner = swarm.services[TWIN]
    joiner.hold(-1)
    joiner.set_members({source.peer_id}, 40)
    assert outsider.say_done([joiner.peer_id], 41, 10.0) == []
    assert source.say_done([joiner.peer_id], 41, 10.0) == []
    for iteration in range(10**6, 10**6 + MAX_ITERATIONS_AHEAD):
        source.say_done([joiner.peer_id], iteration, 10.0)
    assert joiner.wait_sources(41, [source.peer_id, outsider.peer_id], 0.0) == {source.peer_id}
    assert joiner.wait_sources(10**6, [source.peer_id], 0.0) == set()


def test_a_peer_that_stops_reading_a_stage_state_holds_no_other_askers_slot(swarm: Swarm) -> None:
    """Finding 10: one caller that never read held `rpc_stage_state`'s only slot, so every joiner's and drift
    repair's fetch from that node timed out. Now each asker has its own slot, for the time the state may take."""
    victim, attacker, joiner = swarm.services[REPLICA], swarm.services[OUTSIDER], swarm.services[SOURCE]
    values = torch.randn(8 * 2**20, generator=torch.Generator().manual_seed(3))  # 32 MiB, past the streams' buffers
    victim.set_state_source(lambda: (3, 7, values), answer_s=60.0)
    reading = threading.Event()

    async def read_one_frame_then_stop() -> None:
        answers = await attacker._stub(victim.peer_id).rpc_stage_state(proto.StageHop(stage=1))
        await read_first_then_stall(answers, reading, 150)

    held = asyncio.run_coroutine_threadsafe(read_one_frame_then_stop(), attacker._loop)
    try:
        assert reading.wait(30)
        with pytest.raises(HopFailedError, match="had no state"):
            attacker.fetch_state(victim.peer_id, values.numel(), 1.0, stage=1)  # its one slot is held: still busy
        header, got = joiner.fetch_state(victim.peer_id, values.numel(), 30.0, stage=1)
        assert (header.iteration, header.optimizer_steps) == (3, 7) and torch.equal(got, values)
    finally:
        held.cancel()
