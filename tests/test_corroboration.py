"""State verification is never switched off, and a state can't dodge it by naming another epoch (issue 47, findings 2,
3 and 11).

The joiner's side runs through VerifiedStateDownloadMixin's real search (`load_state_from_peers` down to `_accept`)
over scripted donors: each serves a state and answers digests of it with the asker's seed, as `rpc_state_digest`
would. A DiLoCo peer's side runs through RoundSync's real `_load_state_from_peers` and `_check_lineage`; the last test
runs real averagers on loopback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hivemind.p2p import PeerID

from crowdtrain import proto
from crowdtrain.modes.diloco.joining import START_DIGEST_BYTES, RoundSync, _tiebreak, group_start_digest
from crowdtrain.modes.diloco.mode import DiLoCoMode
from crowdtrain.modes.diloco.pseudo_gradients import PseudoGradientAverager
from crowdtrain.state.digest import MAX_EPOCH_LEAD, Corroboration, judge_epoch, read_digest, sketch_state
from crowdtrain.state.download import VerifiedStateDownloadMixin
from crowdtrain.state.template import StateTemplate, TensorSpec
from tests.test_state_download import DonorStateAverager, a_liar_two_donors_and_a_joiner

SHAPE = (3, 4)
TEMPLATE = StateTemplate((TensorSpec(SHAPE, torch.float32), TensorSpec(SHAPE, torch.float32)), epoch_ceiling=10**6)
"""A DiLoCo outer state: one global parameter, then its outer momentum; any epoch the run can have reached."""


def state(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator) * scale for _ in range(2)]


HONEST, POISONED = state(1), state(1, scale=0.5)


class ScriptedDonors(VerifiedStateDownloadMixin):
    """The joiner's averager over scripted donors: per donor its priority, its state's epoch and tensors, and
    whether it serves digests; the request the host sends over the pipe runs here at once."""

    next_chunk_timeout = 5.0
    request_timeout = 5.0

    def __init__(self, donors: dict[str, tuple[float, int, list[torch.Tensor]]], silent: tuple[str, ...] = ()):
        self.donors, self.silent, self.downloaded = donors, set(silent), []
        self.names = {PeerID(name.encode()): name for name in donors}
        self._outer_pipe = SimpleNamespace(send=self._run)

    def _run(self, message: tuple[str, list[Any], dict[str, Any]]) -> None:
        method, _, kwargs = message  # in a thread of its own, as the averager process has its own event loop
        thread = threading.Thread(target=asyncio.run, args=(getattr(self, method)(**kwargs),))
        thread.start()
        thread.join()

    def state_template(self) -> StateTemplate:
        return TEMPLATE

    async def _ranked_donors(self, bad_donors: set[PeerID]) -> list[tuple[PeerID, float]]:
        ranked = sorted(self.names, key=lambda peer: self.donors[self.names[peer]][0], reverse=True)
        return [(peer, self.donors[self.names[peer]][0]) for peer in ranked if peer not in bad_donors]

    async def _download(self, donor: PeerID, template: StateTemplate, chunk_timeout: float) -> Any:
        self.downloaded.append(self.names[donor])
        _, epoch, tensors = self.donors[self.names[donor]]
        return {"epoch": epoch}, [tensor.clone() for tensor in tensors]

    async def _ask_digest(self, peer: PeerID, seed: int, sizes: list[int]) -> Any:
        if self.names[peer] in self.silent:
            return None  # it stepped its state alone (or copied it): no digest
        _, epoch, tensors = self.donors[self.names[peer]]
        return epoch, sketch_state(tensors, seed)


@pytest.fixture(autouse=True)
def in_one_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted donors: the averager's answer as a thread's future, not hivemind's MPFuture (which sets itself through
    its creator's event loop); no pause before asking donors again. Real averagers keep both."""
    if request.node.get_closest_marker("swarm"):
        return
    monkeypatch.setattr("crowdtrain.state.download.MPFuture", concurrent.futures.Future)
    monkeypatch.setattr("crowdtrain.state.corroboration.CATCH_UP_S", 0.0)


def load(donors: ScriptedDonors, above_priority: float | None = None) -> list[torch.Tensor] | None:
    loaded = donors.load_state_from_peers(timeout=30, above_priority=above_priority)
    return None if loaded is None else loaded[1]


def same(tensors: list[torch.Tensor] | None, expected: list[torch.Tensor]) -> bool:
    return tensors is not None and all(map(torch.equal, tensors, expected))


@pytest.mark.parametrize("lead", [5, 50_000])
def test_a_state_labelled_past_the_swarms_epoch_is_refused_not_loaded_uncorroborated(lead: int) -> None:
    # The liar ranks first (priorities are unsigned) and names an epoch nobody else answers at, to dodge comparison.
    donors = ScriptedDonors(
        {"liar": (1e9, 4 + lead, POISONED), "honest": (2.0, 4, HONEST), "witness": (1.0, 4, HONEST)}
    )
    assert same(load(donors), HONEST), "the honest state, corroborated"
    assert PeerID(b"liar") in donors.__dict__["_bad_donors"], "two answers from far behind: not asked again"
    assert same(load(donors), HONEST) and donors.downloaded.count("liar") == 1


def test_one_answer_from_far_behind_refuses_a_state_for_now_and_the_next_donor_is_taken() -> None:
    donors = ScriptedDonors({"liar": (1e9, 50_004, POISONED), "honest": (1.0, 4, HONEST)})
    assert same(load(donors), HONEST), "the honest state: the liar's answer at 50,004 is ahead of it, not behind"
    assert PeerID(b"liar") not in donors.__dict__["_bad_donors"], "one answer is no majority against a donor"


def test_a_swarm_of_two_still_loads_its_only_donors_state_and_a_state_a_round_or_two_ahead_loads() -> None:
    assert same(load(ScriptedDonors({"only": (1.0, 50_004, HONEST)})), HONEST), "nobody to compare with"
    # A DiLoCo donor whose next round is in flight, answerers whose step to the state's epoch is still to come.
    ahead = ScriptedDonors(
        {"ahead": (9.0, 4 + MAX_EPOCH_LEAD, HONEST), "a": (2.0, 4, state(2)), "b": (1.0, 4, state(3))}
    )
    assert same(load(ahead), HONEST)


def test_the_epoch_rule() -> None:
    assert judge_epoch(10, []) is None
    assert judge_epoch(10, [10 - MAX_EPOCH_LEAD, 10 - MAX_EPOCH_LEAD]) is None
    assert judge_epoch(10, [7]) is Corroboration.DISPUTED
    assert judge_epoch(10, [7, 7]) is Corroboration.REFUTED
    assert judge_epoch(10, [7, 9]) is None, "half of the answers is no majority"
    assert judge_epoch(10, [7, 7, 9]) is Corroboration.DISPUTED, "2 of 4 epochs, the state's own included"


class Replica(RoundSync):
    """The parts of a DiLoCoMode that `_load_state_from_peers` and `_check_lineage` touch, over ScriptedDonors."""

    def __init__(self, averager: Any, peer_id: str, round_: int, swarm_round: int):
        self.averager, self.round, self.samples = averager, round_, 0
        self.context = SimpleNamespace(
            peer_id=peer_id,
            client_mode=False,
            phases=SimpleNamespace(measure=lambda phase: contextlib.nullcontext()),
            stop=threading.Event(),
        )
        self.tracker = SimpleNamespace(global_epoch=swarm_round, distrust_unbacked_epochs=lambda *args, **kwargs: None)
        self.diverged, self._resync, self._resync_tries, self._in_flight = False, False, 0, None
        self._sync_not_before, self._catching_up_until, self._said_waiting_for_state = 0.0, 0.0, False
        self.global_parameters = [torch.zeros(SHAPE)]
        self.parameters = [torch.nn.Parameter(torch.zeros(SHAPE))]
        self.outer_optimizer = torch.optim.SGD(self.global_parameters, lr=0.5, momentum=0.9)
        self.feedback, self._lock, self.round_gathered = None, threading.Lock(), {}

    def _take_round_batches(self, value: Any) -> None:
        pass

    def _enter_round(self, outer_round: int) -> None:
        self.round = outer_round

    def _note_catch_up(self) -> None:
        pass


def test_a_peer_whose_round_failed_still_has_its_next_state_corroborated() -> None:
    # A member aborted the round for everyone; each honest peer stepped alone and takes a state next. The liar ranks
    # first and serves a poisoned state at the swarm's round; two peers whose round was averaged refute it.
    donors = ScriptedDonors({"liar": (1e9, 5, POISONED), "a": (5.2, 5, HONEST), "b": (5.1, 5, HONEST)})
    replica = Replica(donors, "QmReplica", round_=4, swarm_round=5)
    replica._stepped_alone()
    assert replica.diverged and replica._load_state_from_peers()
    assert torch.equal(replica.global_parameters[0], HONEST[0]) and replica.round == 5
    assert not replica.diverged and replica._alone_round is None


def test_peers_that_stepped_alone_serve_no_digest_so_they_dont_refuse_each_others_states() -> None:
    # What asking them used to cost (why corroboration was switched off): every such peer refused every other's.
    replica: Any = Replica(None, "QmAlone", round_=4, swarm_round=5)
    replica._momentum, replica.round_batches = lambda start: torch.zeros(SHAPE), 8
    assert DiLoCoMode._outer_state(replica)[0]["alone"] is False
    replica._stepped_alone()
    replica.round = 5  # its outer step, alone
    assert DiLoCoMode._outer_state(replica)[0]["alone"] is True
    donor: Any = object.__new__(PseudoGradientAverager)
    donor._parent_pid = -1  # hivemind's __del__ shuts down only what this process started
    donor._allow_state_sharing = SimpleNamespace(value=True)
    metadata = {"epoch": 5, "alone": True}

    async def current_state() -> Any:
        return donor.serializer.dumps(metadata), HONEST, None

    donor._get_current_state_from_host_process = current_state
    context = SimpleNamespace(remote_id=PeerID(b"joiner"))
    assert not asyncio.run(donor.rpc_state_digest(proto.StateDigestRequest(seed=7), context)).served
    metadata["alone"] = False
    answer = asyncio.run(donor.rpc_state_digest(proto.StateDigestRequest(seed=7), context))
    assert read_digest(answer, [12, 12]) is not None
    # So a peer that stepped alone takes the state of the one ranked above it, all of them alone: not disputed.
    lone = ScriptedDonors({"top": (5.4, 5, HONEST), "other": (5.3, 5, state(2))}, silent=("top", "other"))
    assert same(load(lone, above_priority=5.2), HONEST)


def names_ranked(count: int) -> list[str]:
    """Peer ids in the order `_tiebreak` ranks them, lowest first."""
    return sorted((f"QmPeer{index}" for index in range(count)), key=_tiebreak)


def gathered(digests: dict[str, bytes]) -> dict[str, Any]:
    return {peer: [3, None, digest] for peer, digest in digests.items()}


def check_lineage(me: str, digests: dict[str, bytes]) -> bool:
    replica = Replica(None, me, round_=3, swarm_round=3)
    replica.round_gathered = gathered(digests)
    replica._check_lineage()
    return replica._resync


def test_one_member_ranked_above_with_another_digest_makes_nobody_resync() -> None:
    low, middle, top = names_ranked(3)
    ours, false = bytes(START_DIGEST_BYTES), b"\x01" * START_DIGEST_BYTES
    assert not check_lineage(low, {low: ours, middle: ours, top: false}), "a majority holds this θ₀"
    assert not check_lineage(middle, {low: ours, middle: ours, top: false})
    assert check_lineage(top, {low: ours, middle: ours, top: false}), "the odd one out resyncs, whatever its rank"
    # Two that differ: the lower-ranked follows the other, as before; three that all differ follow the top one.
    assert check_lineage(low, {low: ours, top: false}) and not check_lineage(top, {low: ours, top: false})
    third = b"\x02" * START_DIGEST_BYTES
    assert group_start_digest({low: ours, middle: third, top: false}) == false


def test_a_resync_takes_the_groups_state_from_a_peer_of_its_round_ranked_below_it() -> None:
    # The odd one out may rank first in its group: the group's θ₀ is then held only by peers ranked below it.
    me = max((f"QmTop{index}" for index in range(16)), key=_tiebreak)
    assert _tiebreak(me) > 0.1
    donors = ScriptedDonors({"a": (5.02, 5, HONEST), "b": (5.01, 5, HONEST)})
    replica = Replica(donors, me, round_=5, swarm_round=5)
    replica._resync = True
    assert replica._load_state_from_peers() and torch.equal(replica.global_parameters[0], HONEST[0])


class AheadStateAverager(DonorStateAverager):
    """A liar over the wire: its state well-formed but halved, labelled 5 epochs past the honest one."""

    def get_current_state(self) -> Any:
        metadata, tensors, infos = super().get_current_state()
        return {**metadata, "epoch": metadata["epoch"] + 5}, [tensor * 0.5 for tensor in tensors], infos


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_real_donors_refute_a_state_labelled_past_their_epoch() -> None:
    with a_liar_two_donors_and_a_joiner(AheadStateAverager) as (liar, _, joiner, loaded_honestly):
        joiner.load_state_from_peers(timeout=30)
        assert loaded_honestly(), "not the liar's epoch 9"
        assert liar.served == 1, "downloaded once, then marked bad: two donors answered from epoch 4"
