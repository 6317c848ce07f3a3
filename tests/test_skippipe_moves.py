"""SkipPipe nodes in one process (real SkipPipeModes, each with its own DHT, p2p daemon and stage service, training
in its own thread as the training loop would): when a stage loses its last node, the stage with the most nodes
spares one, which moves there at one iteration on every node, and the swarm trains on with every stage served."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from lab.diloco import cpu_compute
from lab.fixtures import tiny_run_file
from lab.processes import await_condition

from crowdtrain import proto
from crowdtrain.averaging.exact import new_partial_counter
from crowdtrain.data import WindowSampler, load_token_stream
from crowdtrain.dht.swarm import SupervisedDHT, SwarmOptions, join_swarm
from crowdtrain.dht.validator import make_validators
from crowdtrain.manifest import RunManifest, load_run_file
from crowdtrain.models import build_model, load_tokenizer
from crowdtrain.modes.base import ModeContext, SwarmView
from crowdtrain.modes.skippipe import iteration as pipeline_iteration
from crowdtrain.modes.skippipe.hops.driver import MicrobatchOutcome
from crowdtrain.modes.skippipe.iteration import SkipPipeNode
from crowdtrain.modes.skippipe.mode import SkipPipeMode
from crowdtrain.modes.skippipe.roster import declaration, membership, rostering
from crowdtrain.modes.skippipe.roster.membership import membership_at
from crowdtrain.modes.skippipe.roster.schedule import Schedule
from crowdtrain.modes.skippipe.stages import Activations, StagedModel
from crowdtrain.node.identity import load_or_create_identity
from crowdtrain.optimizer import learning_rate_factor
from crowdtrain.rpc.service import NodeStopping

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

MICRO_BATCH = 4
SLOWER_BY_S = 0.05


@dataclass
class Node:
    """A SkipPipeMode on its own DHT, trained in its own thread until `stop`."""

    mode: SkipPipeMode
    dht: SupervisedDHT
    stop: threading.Event = field(default_factory=threading.Event)
    losses: list[float] = field(default_factory=list)
    thread: threading.Thread | None = None
    error: BaseException | None = None

    @property
    def peer_id(self) -> str:
        return self.mode.me.peer_id

    def start(self) -> None:
        self.thread = threading.Thread(target=self._train, daemon=True)
        self.thread.start()

    def _train(self) -> None:
        sampler = self.mode.sampler
        try:
            step = 0
            while not self.stop.is_set():
                step += 1
                loss = self.mode.train_micro_batch(sampler.batch(self.mode.epoch, MICRO_BATCH, step))
                if loss is not None:
                    self.losses.append(loss)
        except NodeStopping:
            pass  # stopped mid-iteration, as the training loop ends on it
        except BaseException as e:
            self.error = e

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)
        self.mode.close()
        self.dht.shutdown()


def start_node(run: RunManifest, tmp_path: Path, name: str, initial_peers: list[str]) -> Node:
    identity = load_or_create_identity(tmp_path / f"{name}.key")
    dht = join_swarm(
        SwarmOptions(initial_peers=tuple(initial_peers), identity_path=str(identity.path)),
        make_validators(identity.private_key, [run.run_id]),
    )
    tokenizer = load_tokenizer(run.model)
    model = build_model(run.model, tokenizer.vocab_size, seed=0)
    tokens = load_token_stream(run.data, tokenizer, tmp_path / "data-cache")
    peer_id = dht.peer_id.to_base58()
    stop = threading.Event()
    context = ModeContext(
        dht=dht,
        manifest=run,
        peer_id=peer_id,
        private_key=identity.private_key,
        parameters=list(model.parameters()),
        compute=cpu_compute(run, model),
        micro_batch_size=MICRO_BATCH,
        client_mode=False,
        auxiliary=False,
        swarm=SwarmView(plan_share=None, statuses=[proto.PeerStatus(peer_id=peer_id)]),
        partial_counter=new_partial_counter(),
        sampler=WindowSampler(tokens, run.data.sequence_length, peer_seed=len(initial_peers)),
        stop=stop,
    )
    try:
        node = Node(SkipPipeMode(context), dht, stop)
    except BaseException:
        dht.shutdown()
        raise
    node.start()
    return node


def start_pair(run: RunManifest, tmp_path: Path, nodes: list[Node]) -> tuple[Node, Node]:
    """A founder (stage 0) and a second node (stage 1), added to `nodes` (which the caller closes), once both run in
    the membership in force."""
    nodes.append(start_node(run, tmp_path, "founder", []))
    nodes.append(start_node(run, tmp_path, "second", [str(nodes[0].dht.get_visible_maddrs()[0])]))
    await_condition(lambda: all(len(stages_in_force(node)) == 2 for node in nodes), 90, "two nodes in force")
    return nodes[0], nodes[1]


@contextlib.contextmanager
def closing_all(nodes: list[Node]) -> Iterator[list[Node]]:
    try:
        yield nodes
    finally:
        for node in nodes:
            node.close()


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One thread for this process's torch while its nodes train, then as many as before, so that later tests in the
    process don't run on one. (The failures once blamed on it, test_diloco_outer's after these, were torch's thread
    pool in forked averagers, which any set_num_threads exposed: crowdtrain/forking.py.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def two_stage_run(tmp_path: Path, name: str, overlap: bool = False) -> RunManifest:
    """The tiny LM in two SkipPipe stages, every microbatch through both."""
    run_file = tmp_path / "run.toml"
    sections = '[skippipe]\nstages = 2\nskip_ratio = 0.0\nmicrobatches = 4\nwire_dtype = "float32"\n'
    run_file.write_text(
        tiny_run_file(
            name,
            64,
            mode="skippipe",
            sections=sections + ("overlap_exchange = true\n" if overlap else ""),
        )
    )
    return load_run_file(str(run_file))


def records_that_expire_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real node waits 300 s for a lost stage-0 node to come back, and a gone node's declaration lasts 60 s."""
    monkeypatch.setattr(rostering, "REBALANCE_AFTER_S", 3.0)
    monkeypatch.setattr(membership, "DECLARATION_TTL_S", 6.0)
    monkeypatch.setattr(declaration, "DECLARATION_RENEW_S", 1.0)


def three_more_iterations(nodes: list[Node], what: str) -> None:
    """Wait until every node stepped three iterations past the newest any of them runs now; none failed."""
    begun = max(node.mode.iteration or 0 for node in nodes)
    await_condition(
        lambda: all(node.mode.runner.last_iteration >= begun + 3 for node in nodes), 60, f"three iterations {what}"
    )
    for node in nodes:
        assert node.error is None, repr(node.error)


def stages_in_force(node: Node) -> dict[str, int]:
    """The stage of each node in the membership `node` runs its current iteration with."""
    mode = node.mode
    membership = membership_at(mode.history, mode.iteration) if mode.iteration is not None else None
    return {member.peer_id: member.stage for member in membership.members} if membership else {}


def costs_in_force(node: Node) -> dict[str, float]:
    """The seconds per microbatch each node is scheduled at in the membership `node` runs its current iteration with."""
    mode = node.mode
    membership = membership_at(mode.history, mode.iteration) if mode.iteration is not None else None
    return {member.peer_id: member.seconds_per_microbatch for member in membership.members} if membership else {}


def test_a_stage_that_loses_its_last_node_takes_a_spare_one_at_one_iteration_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = two_stage_run(tmp_path, "skippipe-moves")
    monkeypatch.setattr(rostering, "REBALANCE_AFTER_S", 3.0)  # a real node waits 300 s for its stage's node to return
    with closing_all([]) as nodes:
        nodes.append(start_node(run, tmp_path, "founder", []))
        address = [str(nodes[0].dht.get_visible_maddrs()[0])]
        nodes.append(start_node(run, tmp_path, "second", address))
        assert [node.mode.stage for node in nodes] == [0, 1], "the second node takes the stage with no node"
        # The third would take the stage whose one node has the least compute; this test needs a second node on
        # stage 0, so that stage 1 has none once its node is gone.
        with monkeypatch.context() as choosing:
            choosing.setattr(declaration, "choose_stage", lambda declared, num_stages, me: 0)
            nodes.append(start_node(run, tmp_path, "third", address))
        founder, second, third = nodes
        assert third.mode.stage == 0
        await_condition(lambda: all(len(stages_in_force(node)) == 3 for node in nodes), 90, "three nodes in force")

        # stage 1's only node goes without a word: the leader drops it, then one of stage 0's nodes moves to it
        nodes.remove(second)
        second.close()
        spare = max(founder.peer_id, third.peer_id)  # the leader, the lower, stays on stage 0
        expected = {min(founder.peer_id, third.peer_id): 0, spare: 1}
        mover = next(node for node in nodes if node.peer_id == spare)
        await_condition(
            lambda: all(stages_in_force(node) == expected for node in nodes) and mover.mode.stage == 1,
            120,
            "the spare node in force on stage 1",
        )
        assert mover.mode.me.stage == 1
        three_more_iterations(nodes, "with every stage served again")
        for node in nodes:
            assert node.losses and all(math.isfinite(loss) for loss in node.losses)
        assert mover.mode.runner.driver is None, "a stage-1 node drives no microbatches"
        for node in nodes:  # a source runs as many microbatches at once as the schedule counts on its memory
            assert node.mode.runner.in_flight == node.mode.me.memory_microbatches > 2


def test_a_swarm_whose_stage_zero_is_gone_holds_then_a_spare_founds_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = two_stage_run(tmp_path, "skippipe-refound")
    records_that_expire_fast(monkeypatch)
    monkeypatch.setattr(pipeline_iteration, "SUSPICION_S", 600.0)  # a suspicion outlasts the test
    held: dict[str, list[torch.Tensor]] = {}
    suspects: dict[str, str] = {}
    hold = SkipPipeMode._hold_without_sources

    def holding(mode: SkipPipeMode, iteration: int) -> None:
        # the stage's parameters each time the node holds: no step may move them while no source is left
        held.setdefault(mode.me.peer_id, []).append(torch.cat([p.detach().reshape(-1) for p in mode.runner.parameters]))
        if mode.me.peer_id in suspects:
            # as a replica does whose gradient did not come while the other held (seen in a CI run): that must not
            # keep it from following the roster the other founds again from stage 0
            mode.runner.suspect(suspects[mode.me.peer_id])
        hold(mode, iteration)

    monkeypatch.setattr(SkipPipeMode, "_hold_without_sources", holding)
    with closing_all([]) as nodes:
        nodes.append(start_node(run, tmp_path, "founder", []))
        address = [str(nodes[0].dht.get_visible_maddrs()[0])]
        with monkeypatch.context() as choosing:  # both others on stage 1, so that stage 0 has one node to lose
            choosing.setattr(declaration, "choose_stage", lambda declared, num_stages, me: 1)
            nodes += [start_node(run, tmp_path, name, address) for name in ("second", "third")]
        founder, second, third = nodes
        assert [node.mode.stage for node in nodes] == [0, 1, 1]
        await_condition(lambda: all(len(stages_in_force(node)) == 3 for node in nodes), 90, "three nodes in force")

        # stage 0's only node goes without a word: no microbatch can be driven; the others hold, then the spare
        # (stage 1's highest peer ID) takes stage 0 and founds the roster again
        nodes.remove(founder)
        founder.close()
        spare, other = sorted(nodes, key=lambda node: node.peer_id, reverse=True)
        suspects[other.peer_id] = spare.peer_id
        await_condition(
            lambda: (
                all(stages_in_force(node) == {spare.peer_id: 0, other.peer_id: 1} for node in nodes)
                and spare.mode.stage == 0
            ),
            120,
            "the spare in force on stage 0",
        )
        three_more_iterations(nodes, "driven by the new stage 0")
        assert spare.mode.runner.driver is not None, "the new stage-0 node drives microbatches"
        assert len(held.get(other.peer_id, [])) >= 2, "the stage-1 node held while no source was left"
        assert spare.peer_id not in other.mode.runner.suspected, "suspicions start afresh with the new roster"
        first = held[other.peer_id][0]
        assert all(torch.equal(first, later) for later in held[other.peer_id]), "no step while holding"
        assert other.losses and all(math.isfinite(loss) for loss in other.losses[-3:])


def test_a_joiner_that_takes_the_lost_stage_zero_founds_the_roster_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = two_stage_run(tmp_path, "skippipe-rejoin")
    records_that_expire_fast(monkeypatch)
    monkeypatch.setattr(rostering, "spare_for_empty_stage", lambda *args: None)  # only the joiner may take stage 0
    with closing_all([]) as nodes:
        founder, second = start_pair(run, tmp_path, nodes)
        nodes.remove(founder)
        founder.close()
        await_condition(lambda: second.mode._holding, 60, "the stage-1 node to hold")
        gone = founder.peer_id
        await_condition(lambda: gone not in second.mode.directory.declarations(), 30, "the founder's record to expire")
        address = [str(second.dht.get_visible_maddrs()[0])]
        joiner = start_node(run, tmp_path, "joiner", address)  # stage 0 has no declared node: it takes it
        nodes.append(joiner)
        assert joiner.mode.stage == 0
        await_condition(
            lambda: all(stages_in_force(node) == {joiner.peer_id: 0, second.peer_id: 1} for node in nodes),
            120,
            "the joiner in force on stage 0",
        )
        three_more_iterations(nodes, "driven by the joiner")


def test_a_node_stays_declared_while_an_iteration_blocks_longer_than_a_declaration_lasts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = two_stage_run(tmp_path, "skippipe-declared")
    records_that_expire_fast(monkeypatch)
    armed, blocking, released = threading.Event(), threading.Event(), threading.Event()
    drive = SkipPipeNode._drive

    def slow_drive(runner: SkipPipeNode, iteration: int, schedule: Schedule) -> tuple[list[MicrobatchOutcome], int]:
        # the source's microbatches of one iteration take longer than a declaration lasts; the stage-1 node waits
        # for them all along (as for a slow volunteer's), in its iteration
        if armed.is_set() and not blocking.is_set():
            blocking.set()
            released.wait(120)
        return drive(runner, iteration, schedule)

    monkeypatch.setattr(SkipPipeNode, "_drive", slow_drive)
    with closing_all([]) as nodes:
        founder, second = start_pair(run, tmp_path, nodes)
        in_force = stages_in_force(founder)
        armed.set()
        await_condition(blocking.is_set, 30, "the source's slow iteration")
        try:
            # past a declaration's life: one renewed only between iterations has expired by now
            time.sleep(membership.DECLARATION_TTL_S + 2.0)
            both = {founder.peer_id, second.peer_id}
            await_condition(
                lambda: both <= set(founder.mode.directory.declarations(serving_only=True)),
                membership.DECLARATION_TTL_S,
                "both nodes' declarations, read while their iteration blocks",
            )
        finally:
            released.set()
        three_more_iterations(nodes, "after the slow one")
        assert all(stages_in_force(node) == in_force for node in nodes), "no node left the roster"


def test_a_node_whose_device_turns_slow_is_scheduled_at_its_new_cost_on_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = two_stage_run(tmp_path, "skippipe-follow")
    monkeypatch.setattr(declaration, "FOLLOW_EVERY_S", 1.0)  # a daemon declares again at most once a minute
    slow, run_stage = threading.Event(), StagedModel.run_stage

    def slow_stage_one(staged: StagedModel, stage: int, activations: Activations) -> Activations:
        if stage == 1 and slow.is_set():
            time.sleep(SLOWER_BY_S)  # under the model lock: the device busy, as a throttled laptop's would be
        return run_stage(staged, stage, activations)

    monkeypatch.setattr(StagedModel, "run_stage", slow_stage_one)
    with closing_all([]) as nodes:
        founder, second = start_pair(run, tmp_path, nodes)
        slow.set()

        # the second node declares its device's new cost, the leader's roster carries it, and both nodes schedule
        # it from one iteration on
        await_condition(
            lambda: all(costs_in_force(node).get(second.peer_id, 0.0) >= SLOWER_BY_S for node in nodes),
            90,
            "the slow node's cost in force",
        )
        assert second.mode.me.seconds_per_microbatch >= SLOWER_BY_S
        assert all(stages_in_force(node) == {founder.peer_id: 0, second.peer_id: 1} for node in nodes)
        three_more_iterations(nodes, "at the new cost")


def test_an_overlapped_node_checkpoints_its_stage_s_true_state_not_the_look_ahead_it_computes_on(
    tmp_path: Path,
) -> None:
    """With overlap_exchange a node computes on a look-ahead of its stage's true state; what its checkpoint keeps of
    the model is the true parameters (those its AdamW moments go with and its replicas hold), the rest as it is."""
    run = two_stage_run(tmp_path, "skippipe-overlap-checkpoint", overlap=True)
    with closing_all([]) as nodes:
        start_pair(run, tmp_path, nodes)
        three_more_iterations(nodes, "with the exchange overlapped")
        for node in nodes:  # one by one: the first to stop leaves its partner mid-iteration, waiting on it
            assert node.thread is not None
            node.stop.set()
            node.thread.join(timeout=10)
            assert not node.thread.is_alive(), "a stopping node waited out its hops' deadlines"
        for node in nodes:
            mode = node.mode
            live = mode.staged.model.state_dict()
            kept = mode.checkpoint_model_state(live)
            true = {
                parameter.data_ptr(): value
                for parameter, value in zip(mode.runner.parameters, mode.runner.true_parameters(), strict=True)
            }
            stage_keys = [key for key, tensor in live.items() if tensor.data_ptr() in true]  # tied ones too
            assert set(kept) == set(live) and stage_keys
            for key in stage_keys:
                assert torch.equal(kept[key], true[live[key].data_ptr()])
            assert any(not torch.equal(kept[key], live[key]) for key in stage_keys), "no look-ahead to leave out"
            assert all(kept[key] is live[key] for key in set(live) - set(stage_keys))


def test_a_stage_steps_with_the_runs_clipping_and_learning_rate_schedule(tmp_path: Path) -> None:
    base = two_stage_run(tmp_path, "skippipe-optimizer")
    spec = dataclasses.replace(base.optimizer, max_grad_norm=1e-3, warmup_steps=1_000, total_steps=2_000)
    run = dataclasses.replace(base, optimizer=spec)
    steps: dict[str, list[tuple[int, float, float]]] = {}

    def recorder(node: Node) -> Callable[..., None]:
        """A step pre-hook registered after the factory's clipping: it sees the gradient the step takes."""

        def record(optimizer: torch.optim.Optimizer, *_: object) -> None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            iteration = node.mode.iteration
            assert iteration is not None
            steps.setdefault(node.peer_id, []).append((iteration, norm, optimizer.param_groups[0]["lr"]))

        return record

    with closing_all([]) as nodes:
        for node in start_pair(run, tmp_path, nodes):
            node.mode.optimizer.register_step_pre_hook(recorder(node))
        await_condition(lambda: len(steps) == 2 and all(len(s) >= 2 for s in steps.values()), 90, "two steps each")
    for taken in steps.values():
        for iteration, norm, learning_rate in taken:
            assert 0 < norm <= spec.max_grad_norm * 1.0001, "each stage's step takes a gradient clipped to the run's"
            assert learning_rate == pytest.approx(spec.learning_rate * learning_rate_factor(iteration, spec))
        assert taken[-1][2] > taken[0][2], "the warm-up raises the learning rate from one iteration to the next"
