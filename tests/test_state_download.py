"""A joiner's state download is checked before it is loaded, and corroborated by other donors' digests; a donor
that serves a bad state is skipped (issue 14, "verified state")."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads typing's AsyncIterator as a stream)

import hivemind
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import split_for_streaming
from lab.diloco import identity_key, loopback_dhts

from crowdtrain import proto
from crowdtrain.averaging.traffic import AveragingTraffic
from crowdtrain.collaboration.hivemind_optimizer import PlannedStateAverager
from crowdtrain.dht.gate import NotAdmittedError, _GatedHandlers
from crowdtrain.dht.records import EPOCH_SLACK, MAX_GLOBAL_STEPS_PER_S, epoch_ceiling
from crowdtrain.modes.diloco.pseudo_gradients import PseudoGradientAverager
from crowdtrain.state import download as state_download
from crowdtrain.state.digest import (
    DIGESTS_PER_MINUTE,
    DIGESTS_PER_PEER_PER_MINUTE,
    SKETCH_SAMPLES,
    Corroboration,
    DigestLimiter,
    MalformedDigestError,
    judge,
    read_digest,
    sample_positions,
    sketch_state,
    sketches_agree,
    to_digest,
)
from crowdtrain.state.download import (
    CUT_SHORT_PAUSE_S,
    MAX_CUT_SHORT_PAUSE_S,
    CutShortError,
    CutShortPauses,
    VerifiedStateDownloadMixin,
    _whole_state,
)
from crowdtrain.state.template import (
    EpochTooHighError,
    StateTemplate,
    TensorSpec,
    UnacceptableStateError,
    check_state,
    optimizer_tensor_specs,
)
from tests.harness import shut_down

TEMPLATE = StateTemplate(
    (TensorSpec((3, 4), torch.float32), TensorSpec((), torch.float32, non_negative=True)), epoch_ceiling=10
)


def honest_tensors() -> list[torch.Tensor]:
    return [torch.randn(3, 4), torch.tensor(5.0)]


def test_an_honest_state_passes_and_its_epoch_is_returned() -> None:
    assert check_state({"epoch": 7}, honest_tensors(), TEMPLATE) == 7


@pytest.mark.parametrize(
    ("metadata", "tensors", "reason"),
    [
        ({"epoch": -1}, honest_tensors(), "epoch"),
        ({"epoch": 3.0}, honest_tensors(), "epoch"),
        ({"epoch": True}, honest_tensors(), "epoch"),
        ("not a dict", honest_tensors(), "epoch"),
        ({"epoch": 1}, [torch.full((3, 4), float("nan")), torch.tensor(5.0)], "NaN"),
        ({"epoch": 1}, [torch.full((3, 4), float("inf")), torch.tensor(5.0)], "NaN"),
        ({"epoch": 1}, [torch.ones(1), torch.tensor(5.0)], "expected"),  # copy_ would broadcast it
        ({"epoch": 1}, [torch.ones(3, 4, dtype=torch.float64), torch.tensor(5.0)], "expected"),
        ({"epoch": 1}, [torch.randn(3, 4), torch.tensor(-1.0)], "negative"),
        ({"epoch": 1}, honest_tensors()[:1], "tensors"),
        ({"epoch": 1}, [*honest_tensors(), torch.zeros(1)], "tensors"),
        ({"epoch": 1}, [torch.randn(3, 4), "a string"], "expected"),
    ],
)
def test_a_hostile_state_is_refused(metadata: Any, tensors: list[Any], reason: str) -> None:
    with pytest.raises(UnacceptableStateError, match=reason):
        check_state(metadata, tensors, TEMPLATE)


def test_an_epoch_beyond_what_the_run_can_have_reached_is_refused_but_not_held_against_the_donor() -> None:
    # an epoch of 2**62 made hivemind's scheduler step forever; a run a day old can't be past 20 steps/s
    assert epoch_ceiling(created_at=1000.0, now=1000.0 + 86400) == int(86400 * MAX_GLOBAL_STEPS_PER_S) + EPOCH_SLACK
    assert epoch_ceiling(created_at=2000.0, now=1000.0) == EPOCH_SLACK  # a clock behind the founder's
    with pytest.raises(EpochTooHighError):
        check_state({"epoch": 2**62}, honest_tensors(), TEMPLATE)


def test_adam_second_moments_and_steps_must_not_be_negative() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    specs = optimizer_tensor_specs(optimizer)
    assert len(specs) == 6  # per parameter: exp_avg, exp_avg_sq, step
    assert sum(spec.non_negative for spec in specs) == 4
    assert {spec.shape for spec in specs if not spec.non_negative} == {(3, 4), (3,)}


class DonorStateAverager(PlannedStateAverager):
    """A donor a test can change: it serves under PlannedStateAverager's RPC names (hivemind names them after the
    class), as a modified client would, and counts the times it was asked for its state (a download or a digest)."""

    served = 0

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return PlannedStateAverager._get_handle_name(namespace, method_name)

    def get_current_state(self) -> Any:
        self.served += 1  # runs in this (the host) process, in hivemind's background thread
        return super().get_current_state()


class HeldDonorStateAverager(DonorStateAverager):
    """A donor whose answers wait for the test's word before the state is read: an admitted answer can't end (and
    free its slot) before the requests that should be refused beside it have arrived."""

    release = threading.Event()

    def get_current_state(self) -> Any:
        if not self.release.wait(timeout=60):
            raise AssertionError("the test never released the held donor")
        return super().get_current_state()


class PoisonedStateAverager(DonorStateAverager):
    """A donor that serves NaN parameters at a huge epoch, and declares the highest priority to be asked first."""

    def get_current_state(self) -> Any:
        metadata, tensors, infos = super().get_current_state()
        return {**metadata, "epoch": 2**62}, [torch.full_like(tensor, float("nan")) for tensor in tensors], infos


def make_averager(cls: type, dht: hivemind.DHT, seed: int, *, priority: float = 0.0) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    averager = cls(
        dht=dht,
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        params=model.parameters(),
        prefix="verified_state_test",
        author=identity_key(dht),
        start=True,
        traffic=AveragingTraffic.new(),
    )
    averager.state_sharing_priority = priority
    return averager, model


def wait_for_donors(dht: hivemind.DHT, priorities: set[float], timeout_s: float = 60.0) -> None:
    """Until the DHT lists donors with these priorities (the averagers declare them in their background)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = dht.get("verified_state_test.all_averagers", latest=True)
        declared = {entry.value for entry in found.value.values()} if found is not None else set()
        if priorities <= declared:
            return
        time.sleep(0.2)
    raise AssertionError(f"the donors' priorities {priorities} never reached the DHT")


def same_parameters(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    pairs = zip(model.parameters(), other.parameters(), strict=True)
    return all(torch.equal(mine, theirs) for mine, theirs in pairs)


@contextlib.contextmanager
def a_donor_and_a_joiner(donor_class: type) -> Iterator[tuple[hivemind.DHT, Any, Any, Callable[[], bool]]]:
    """A donor of `donor_class` at epoch 4 and a joiner with another model, each on a DHT of its own: (the donor's
    DHT, donor, joiner, holds_donors_parameters) once the joiner sees the donor; `holds_donors_parameters()` says
    whether the joiner's parameters are the donor's."""
    first, second = loopback_dhts(2)
    averagers: list[Any] = []
    try:
        donor, donor_model = make_averager(donor_class, first, seed=1, priority=1.0)
        joiner, joiner_model = make_averager(PlannedStateAverager, second, seed=3)
        averagers += [donor, joiner]
        donor.local_epoch = 4
        wait_for_donors(second, {1.0})
        yield first, donor, joiner, lambda: same_parameters(joiner_model, donor_model)
    finally:
        shut_down(averagers, dhts=[first, second])


@pytest.mark.swarm
def test_a_joiner_skips_a_poisoned_donor_and_loads_the_honest_state() -> None:
    dhts = loopback_dhts(3)
    averagers: list[Any] = []
    try:
        honest, honest_model = make_averager(PlannedStateAverager, dhts[0], seed=1, priority=1.0)
        poisoned, _ = make_averager(PoisonedStateAverager, dhts[1], seed=2, priority=1e9)
        joiner, joiner_model = make_averager(PlannedStateAverager, dhts[2], seed=3)
        averagers += [honest, poisoned, joiner]
        honest.local_epoch = 4
        wait_for_donors(dhts[2], {1.0, 1e9})
        joiner.load_state_from_peers(timeout=30)
        assert joiner.local_epoch == 4
        assert same_parameters(joiner_model, honest_model)
        assert all(torch.isfinite(parameter).all() for parameter in joiner_model.parameters())
        assert joiner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    finally:
        shut_down(averagers, dhts)


class CutShortStateAverager(DonorStateAverager):
    """A donor whose first state stream stops after a few messages, as a connection that closes mid-download does:
    hivemind's caller sees that as a stream that ended."""

    cuts_left = 1  # in the averager process, which serves the stream

    async def rpc_download_state(  # annotated: hivemind reads the message types from them
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        sent = 0
        async for message in super().rpc_download_state(request, context):
            if self.cuts_left and sent == 5:
                self.cuts_left -= 1
                return
            sent += 1
            yield message


@pytest.mark.swarm
def test_a_donor_serves_one_state_per_peer_and_few_in_all_and_the_rest_get_an_empty_answer() -> None:
    # Each answer makes a whole copy of the state before its first byte: a peer's third request at once is answered
    # empty without a copy (the donor's host process made one copy, not three), another peer is still served.
    with a_donor_and_a_joiner(HeldDonorStateAverager) as (donor_dht, donor, joiner, holds_donors_parameters):
        peers = donor_dht.get_visible_maddrs()

        async def ask_at_once(count: int) -> None:
            p2p = await P2P.create(initial_peers=peers)
            try:
                stub: Any = DonorStateAverager.get_stub(p2p, donor_dht.peer_id, namespace="verified_state_test")
                streams = [await stub.rpc_download_state(averaging_pb2.DownloadRequest()) for _ in range(count)]
                firsts = [asyncio.ensure_future(anext(stream, None)) for stream in streams]
                async with asyncio.timeout(30):  # the refused answers end while the admitted one waits
                    while sum(first.done() for first in firsts) < count - 1:
                        await asyncio.wait([first for first in firsts if not first.done()],
                                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                assert all(first.result() is None for first in firsts if first.done()), "refused: an empty answer"
                HeldDonorStateAverager.release.set()
                answers = await asyncio.wait_for(asyncio.gather(*firsts), timeout=30)
                assert sum(message is not None for message in answers) == 1, "one answer per peer at once"
                assert donor.served == 1, "no copy of the state was made for the refused ones"
                # the donor's second slot is another peer's: the joiner loads the whole state meanwhile
                loaded = await asyncio.to_thread(joiner.load_state_from_peers, timeout=30)
                assert loaded is None and joiner.local_epoch == 4
                for stream in streams:
                    await stream.aclose()
            finally:
                await p2p.shutdown()

        asyncio.run(ask_at_once(3))
        assert holds_donors_parameters()


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_a_stream_cut_short_is_asked_again_after_a_pause_not_held_against_the_donor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fresh-clone CI run failed this way: the only donor's stream ended early once, the joiner called that a
    # malformed state, never asked that donor again, and so never joined the swarm.
    monkeypatch.setattr(state_download, "CUT_SHORT_PAUSE_S", 2.0)  # before the averager processes fork
    with a_donor_and_a_joiner(CutShortStateAverager) as (_, donor, joiner, holds_donors_parameters):
        assert joiner.load_state_from_peers(timeout=30) is None, "the cut stream is not loaded"
        assert (joiner.local_epoch, donor.served) == (0, 1)
        assert joiner.load_state_from_peers(timeout=30) is None, "the donor is not asked again at once"
        assert donor.served == 1
        deadline = time.monotonic() + 10  # the pause is 2 s
        while joiner.local_epoch != 4 and time.monotonic() < deadline:
            joiner.load_state_from_peers(timeout=30)
            time.sleep(0.2)
        assert joiner.local_epoch == 4, "after its pause the donor is asked again, and its whole state is loaded"
        assert holds_donors_parameters()


def test_cut_short_pauses_double_with_each_stream_in_a_row_up_to_the_maximum_and_a_whole_state_ends_them() -> None:
    pauses, donor, other = CutShortPauses(), PeerID(b"donor"), PeerID(b"other")
    assert [pauses.cut_short(donor, now=0.0) for _ in range(3)] == [CUT_SHORT_PAUSE_S * k for k in (1, 2, 4)]
    assert pauses.paused(donor, now=4 * CUT_SHORT_PAUSE_S - 0.1) and not pauses.paused(donor, 4 * CUT_SHORT_PAUSE_S)
    assert not pauses.paused(other, now=0.0)
    for _ in range(20):
        longest = pauses.cut_short(donor, now=0.0)
    assert longest == MAX_CUT_SHORT_PAUSE_S
    pauses.completed(donor)
    assert not pauses.paused(donor, now=0.0) and pauses.cut_short(donor, now=0.0) == CUT_SHORT_PAUSE_S


def test_a_stream_that_ends_inside_or_before_the_last_tensor_is_cut_short_one_without_metadata_is_malformed() -> None:
    tensors = honest_tensors()
    parts = list(split_for_streaming(serialize_torch_tensor(tensors[1]), chunk_size_bytes=2))
    assert len(parts) == 2
    assert _whole_state({"epoch": 1}, tensors[:1], parts, TEMPLATE)[1][1].item() == 5.0
    with pytest.raises(CutShortError, match="ended inside tensor 1 of 2"):
        _whole_state({"epoch": 1}, tensors[:1], parts[:1], TEMPLATE)
    with pytest.raises(CutShortError, match="ended after 1 of its 2 tensors"):
        _whole_state({"epoch": 1}, tensors[:1], [], TEMPLATE)
    with pytest.raises(UnacceptableStateError, match="sent no metadata"):
        _whole_state(None, tensors[:1], parts, TEMPLATE)
    assert not issubclass(CutShortError, UnacceptableStateError), "a cut stream is not held against its donor"


def test_a_high_epoch_moves_the_learning_rate_schedule_in_one_step() -> None:
    # hivemind stepped the scheduler once per epoch: an epoch of 2**62 never returned.
    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / 100) * 0.5 ** (step // 1000)

    reference = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), schedule)
    for _ in range(2500):
        reference.optimizer.step()
        reference.step()
    averager: Any = object.__new__(PlannedStateAverager)
    averager._parent_pid = -1  # hivemind's __del__ shuts down only what this process started
    averager.scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), schedule)
    averager.local_epoch = 2500
    averager._update_scheduler()
    assert averager.scheduler.get_last_lr() == reference.get_last_lr()
    assert averager.scheduler.last_epoch == reference.last_epoch == 2500
    averager.local_epoch = 2**62
    averager._update_scheduler()  # returns at once
    assert averager.scheduler.last_epoch == 2**62


def model_state(seed: int = 0) -> list[torch.Tensor]:
    """Tensors like a small model's state: matrices, vectors, a scalar step counter, an empty tensor."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (32,), (1000,), (3, 3, 3)]
    return [torch.randn(shape, generator=generator) for shape in shapes] + [torch.tensor(7.0), torch.zeros(0)]


SIZES = [tensor.numel() for tensor in model_state()]


def test_identical_states_and_float_noise_agree_scaled_or_replaced_ones_do_not() -> None:
    state = model_state()
    sketch = sketch_state(state, seed=42)
    assert sketches_agree(sketch, sketch_state([tensor.clone() for tensor in state], seed=42))
    noisy = [tensor * (1 + 1e-6 * torch.randn(tensor.shape)) for tensor in state]  # another machine's last bits
    assert sketches_agree(sketch, sketch_state(noisy, seed=42))
    assert not sketches_agree(sketch, sketch_state([tensor * 0.5 for tensor in state], seed=42))
    replaced = [*state[:2], torch.randn(1000), *state[3:]]  # one tensor swapped for another of its distribution
    assert not sketches_agree(sketch, sketch_state(replaced, seed=42))
    shifted = [state[0] + 0.01 * state[0].abs().mean(), *state[1:]]  # every value moved by 1% of its scale
    assert not sketches_agree(sketch, sketch_state(shifted, seed=42))
    assert not sketches_agree(sketch, sketch[:-1])


def test_the_seed_picks_the_positions_the_same_way_everywhere() -> None:
    assert sample_positions(7, 3, 10**6) == sample_positions(7, 3, 10**6)
    assert sample_positions(7, 3, 10**6) != sample_positions(8, 3, 10**6) != sample_positions(7, 4, 10**6)
    assert len(sample_positions(7, 0, 10**6)) == SKETCH_SAMPLES
    assert len(sample_positions(7, 0, 3)) == 3 and all(0 <= i < 3 for i in sample_positions(7, 0, 3))
    assert sample_positions(7, 0, 0) == []


def test_a_digest_round_trips_and_a_malformed_one_is_refused() -> None:
    sketch = sketch_state(model_state(), seed=1)
    digest = to_digest(12, sketch)
    assert read_digest(proto.StateDigest.FromString(digest.SerializeToString()), SIZES) == (12, sketch)
    assert read_digest(proto.StateDigest(served=False), SIZES) is None

    def broken(change: Any) -> proto.StateDigest:
        copy = proto.StateDigest()
        copy.CopyFrom(digest)
        change(copy)
        return copy

    hostile = [
        broken(lambda d: d.tensors.pop()),  # one tensor short
        broken(lambda d: d.tensors.add()),  # one too many
        broken(lambda d: setattr(d.tensors[0], "sum", float("nan"))),
        broken(lambda d: d.tensors[1].samples.__setitem__(0, float("inf"))),
        broken(lambda d: setattr(d.tensors[0], "norm", -1.0)),
        broken(lambda d: d.tensors[0].samples.append(0.0)),  # more samples than the seed draws
        broken(lambda d: d.tensors[0].samples.extend([0.0] * 100_000)),  # oversize
    ]
    for digest in hostile:
        with pytest.raises(MalformedDigestError):
            read_digest(digest, SIZES)


def test_the_majority_of_sketches_at_the_epoch_decides() -> None:
    honest = sketch_state(model_state(0), seed=5)
    liar = sketch_state([tensor * 0.5 for tensor in model_state(0)], seed=5)
    other = sketch_state(model_state(1), seed=5)
    assert judge(honest, []).verdict is Corroboration.UNCORROBORATED
    assert judge(honest, [honest]).verdict is Corroboration.CORROBORATED
    assert judge(honest, [honest, liar]).verdict is Corroboration.CORROBORATED  # 2 of 3
    assert judge(honest, [liar]).verdict is Corroboration.DISPUTED  # 1 of 2: nothing says which is right
    assert judge(liar, [honest, honest]).verdict is Corroboration.REFUTED
    assert judge(liar, [honest, other]).verdict is Corroboration.DISPUTED  # the others agree with nobody either
    refuted = judge(liar, [honest, honest, liar])  # 2 of 4: no majority for it, nor against it
    assert (refuted.verdict, refuted.num_agreeing, refuted.num_sketches) == (Corroboration.DISPUTED, 2, 4)


def test_digests_are_rate_bounded_per_asker_and_in_all() -> None:
    now = [0.0]
    limiter = DigestLimiter(clock=lambda: now[0])
    assert all(limiter.admit("QmA") for _ in range(DIGESTS_PER_PEER_PER_MINUTE))
    assert not limiter.admit("QmA")
    others = [f"Qm{i}" for i in range(DIGESTS_PER_MINUTE - DIGESTS_PER_PEER_PER_MINUTE)]
    assert all(limiter.admit(peer) for peer in others)
    assert not limiter.admit("QmNewcomer")
    now[0] = DigestLimiter.WINDOW_S + 0.1
    assert limiter.admit("QmA") and limiter.admit("QmNewcomer")


class ScriptedDonors(VerifiedStateDownloadMixin):
    """The asking side alone: each peer's digest answer is scripted, and the peers asked are recorded."""

    def __init__(self, answers: dict[str, Any]):
        self.answers, self.asked = answers, []

    async def _ask_digest(self, peer: Any, seed: int, sizes: list[int]) -> Any:
        self.asked.append(peer)
        answer = self.answers[peer]
        if isinstance(answer, list):  # one answer per ask, the last one repeated
            return answer.pop(0) if len(answer) > 1 else answer[0]
        return answer


def corroborate(answers: dict[str, Any], first: list[str], further: list[str]) -> tuple[Any, list[str]]:
    donors = ScriptedDonors(answers)
    mine = sketch_state(model_state(0), seed=9)

    async def run() -> Any:
        tasks = [(peer, asyncio.create_task(donors._ask_digest(peer, 9, SIZES))) for peer in first]
        judgement, _ = await donors._corroborate(4, mine, tasks, further, 9, SIZES)
        return judgement

    return asyncio.run(run()), donors.asked[len(first) :]


def test_only_answers_at_the_states_epoch_count_and_a_disagreement_asks_one_more() -> None:
    honest = (4, sketch_state(model_state(0), seed=9))
    halved = (4, sketch_state([tensor * 0.5 for tensor in model_state(0)], seed=9))
    later = (5, sketch_state(model_state(1), seed=9))  # training moved on: no opinion
    answers = {"agrees": honest, "agrees too": honest, "disagrees": halved, "later": later, "silent": None}
    judgement, further = corroborate(answers, ["agrees", "later"], ["agrees too"])
    assert (judgement.verdict, judgement.num_sketches, further) == (Corroboration.CORROBORATED, 2, [])
    judgement, further = corroborate(answers, ["later", "silent"], ["agrees"])
    assert (judgement.verdict, further) == (Corroboration.UNCORROBORATED, [])
    judgement, further = corroborate(answers, ["agrees", "disagrees"], ["later", "silent", "agrees too"])
    assert (judgement.verdict, judgement.num_agreeing, judgement.num_sketches) == (Corroboration.CORROBORATED, 3, 4)
    assert further == ["later", "silent", "agrees too"]  # until one more answer at the epoch came
    judgement, further = corroborate(answers, ["agrees", "disagrees"], [])
    assert judgement.verdict is Corroboration.CORROBORATED  # 2 of 3, nobody further to ask
    judgement, _ = corroborate({**answers, "agrees": halved}, ["agrees", "disagrees"], ["silent"])
    assert judgement.verdict is Corroboration.REFUTED


def test_donors_a_step_behind_are_asked_again_as_they_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # Gradient mode: the joiner downloads epoch 4 while the others were still finishing their step to it.
    monkeypatch.setattr("crowdtrain.state.corroboration.CATCH_UP_S", 0.0)
    honest, earlier = (4, sketch_state(model_state(0), seed=9)), (3, sketch_state(model_state(1), seed=9))
    halved = (4, sketch_state([tensor * 0.5 for tensor in model_state(0)], seed=9))
    later = (5, sketch_state(model_state(1), seed=9))
    judgement, asked = corroborate({"behind": [earlier, earlier, honest], "ahead": later}, ["behind", "ahead"], [])
    assert (judgement.verdict, judgement.num_sketches) == (Corroboration.CORROBORATED, 2)
    assert asked == ["behind", "behind"], "only the peer behind is asked again, until it answers at the epoch"
    judgement, _ = corroborate({"behind": [earlier, halved]}, ["behind"], [])
    assert judgement.verdict is Corroboration.DISPUTED, "a caught-up answer counts as any other"
    judgement, asked = corroborate({"behind": [earlier], "ahead": later}, ["behind", "ahead"], [])
    assert (judgement.verdict, asked) == (Corroboration.UNCORROBORATED, ["behind", "behind"]), "two tries at most"


@pytest.mark.parametrize("cls", [PlannedStateAverager, PseudoGradientAverager])
def test_every_averager_that_serves_its_state_serves_digests_to_admitted_callers_only(cls: type) -> None:
    cls._collect_rpc_handlers()
    handlers = {handler.method_name: handler for handler in cls._rpc_handlers}
    assert {"rpc_download_state", "rpc_state_digest"} <= handlers.keys()
    assert handlers["rpc_state_digest"].request_type is proto.StateDigestRequest
    assert handlers["rpc_state_digest"].response_type is proto.StateDigest

    class Refusing:
        def __init__(self) -> None:
            self.refused: list[str] = []

        async def admits(self, peer_id: str) -> bool:
            return False

        def note_refusal(self, peer_id: str, rpc: str) -> None:
            self.refused.append(rpc)

    servicer: Any = object.__new__(cls)
    servicer._parent_pid = -1  # hivemind's __del__ shuts down only what this process started
    gate = Refusing()
    context = SimpleNamespace(remote_id=PeerID(b"stranger"))
    gated = _GatedHandlers(servicer, gate)  # type: ignore[arg-type]
    with pytest.raises(NotAdmittedError):
        asyncio.run(gated.rpc_state_digest(proto.StateDigestRequest(seed=1), context))
    assert gate.refused == ["rpc_state_digest"]


def test_a_node_serves_no_digest_of_the_state_it_downloaded_until_it_steps() -> None:
    # Two joiners of one donor would otherwise corroborate each other's copy of the donor's state.
    donor: Any = object.__new__(PlannedStateAverager)
    donor._parent_pid = -1  # hivemind's __del__ shuts down only what this process started
    donor._allow_state_sharing = SimpleNamespace(value=True)
    state = {"epoch": 4}

    async def current_state() -> Any:
        return donor.serializer.dumps(dict(state)), model_state(0), None

    donor._get_current_state_from_host_process = current_state
    context = SimpleNamespace(remote_id=PeerID(b"joiner"))

    def digest() -> Any:
        return asyncio.run(donor.rpc_state_digest(proto.StateDigestRequest(seed=7), context))

    assert digest().served and read_digest(digest(), SIZES) is not None
    donor.__dict__["_downloaded_epoch"] = 4  # as _load_verified_state records a loaded state's epoch
    assert donor.echoes(4) and not digest().served
    state["epoch"] = 5  # its first step of its own
    assert digest().served and read_digest(digest(), SIZES)[0] == 5


class ScaledStateAverager(DonorStateAverager):
    """A liar: its state well-formed and at the honest epoch, but every tensor halved."""

    def get_current_state(self) -> Any:
        metadata, tensors, infos = super().get_current_state()
        return metadata, [tensor * 0.5 for tensor in tensors], infos


@contextlib.contextmanager
def a_liar_two_donors_and_a_joiner(liar_class: type) -> Iterator[tuple[Any, Any, Any, Any]]:
    """A donor of `liar_class` ranked first, an honest donor and a witness below it, all three at epoch 4 with the
    same model, and a joiner with another: (liar, witness, joiner, loaded_honestly) once the joiner sees all three;
    `loaded_honestly()` says whether the joiner holds the honest donors' epoch and parameters."""
    dhts = loopback_dhts(4)
    averagers: list[Any] = []
    try:
        liar, _ = make_averager(liar_class, dhts[0], seed=1, priority=1e9)
        honest, honest_model = make_averager(DonorStateAverager, dhts[1], seed=1, priority=2.0)
        witness, _ = make_averager(DonorStateAverager, dhts[2], seed=1, priority=1.0)
        joiner, joiner_model = make_averager(PlannedStateAverager, dhts[3], seed=3)
        averagers += [liar, honest, witness, joiner]
        for donor in (liar, honest, witness):
            donor.local_epoch = 4
        wait_for_donors(dhts[3], {1e9, 2.0, 1.0})

        def loaded_honestly() -> bool:
            return joiner.local_epoch == 4 and same_parameters(joiner_model, honest_model)

        yield liar, witness, joiner, loaded_honestly
    finally:
        shut_down(averagers, dhts)


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_a_joiner_refuses_a_well_formed_lie_that_two_honest_donors_refute() -> None:
    with a_liar_two_donors_and_a_joiner(ScaledStateAverager) as (liar, witness, joiner, loaded_honestly):
        joiner.load_state_from_peers(timeout=30)
        assert loaded_honestly()
        assert liar.served == 1, "downloaded once, then never asked for a digest: it was marked bad"
        assert witness.served >= 1, "never downloaded from (it ranks below `honest`), so asked for digests"
        joiner.load_state_from_peers(timeout=30)  # the liar still ranks first, and is not asked again
        assert liar.served == 1 and loaded_honestly()


def test_an_answer_that_comes_too_late_is_no_state_said_plainly_not_a_timeout_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The averager process gives up a little before its caller; on a saturated home link (the WAN lab) its answer
    still came late, and the caller's TimeoutError reached hivemind's retry loop (a traceback in the log) or would
    stop a DiLoCo node's training. A late answer is now no state: the caller goes on with its own."""
    sent: list[Any] = []
    averager = SimpleNamespace(
        state_template=lambda: TEMPLATE,
        states_agree_at_epoch=True,
        _outer_pipe=SimpleNamespace(send=sent.append),  # a request nobody answers
        last_loaded_epoch=3,
    )
    started = time.monotonic()
    assert VerifiedStateDownloadMixin.load_state_from_peers(averager, timeout=0.2) is None  # type: ignore[arg-type]
    assert time.monotonic() - started < 5 and len(sent) == 1
    assert "no verified state came within 0.2 s" in caplog.text
    # nothing loaded, so none: the last download's epoch would tell the tracker this one loaded it (and make it
    # distrust the swarm's epochs when that was far behind them)
    assert averager.last_loaded_epoch is None
