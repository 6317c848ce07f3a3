"""A peer caught sending bad all-reduce parts is kept out of the catcher's groups for a while, and status shows it
(issue 14, "a peer caught sending bad parts is excluded from the run's groups for a while and shown in status")."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.utils import MPFuture
from hivemind.utils.crypto import RSAPrivateKey
from lab.diloco import loopback_dhts
from lab.processes import await_condition
from rich.console import Console

from crowdtrain import proto
from crowdtrain.averaging.quarantine import MAX_QUARANTINE_S, MAX_QUARANTINED, QUARANTINE_S, Quarantine
from crowdtrain.averaging.traffic import AggregationSettings, TrafficCountingAverager
from crowdtrain.cli.status import render, summarize
from crowdtrain.dht.records import RecordError, decode_peer_status, owner_marker, peer_id_of_owner
from crowdtrain.modes.progress import Progress
from tests.harness import averager_group, shut_down, step_together


def test_a_first_offence_keeps_a_peer_out_for_a_while_and_repeats_double_up_to_a_cap() -> None:
    quarantine = Quarantine()
    first = quarantine.add("QmBad", "a part with NaN or infinite values", now=0.0)
    assert first.until == QUARANTINE_S and quarantine.holds("QmBad", now=QUARANTINE_S - 1)
    assert not quarantine.holds("QmBad", now=QUARANTINE_S + 1) and not quarantine.holds("QmHonest", now=0.0)
    assert quarantine.current(now=QUARANTINE_S + 1) == {}
    second = quarantine.add("QmBad", "a part 1e+06x the median norm", now=QUARANTINE_S + 1)
    assert second.offences == 2 and second.until == QUARANTINE_S + 1 + 2 * QUARANTINE_S
    for _ in range(20):
        last = quarantine.add("QmBad", "again", now=0.0)
    assert last.until == MAX_QUARANTINE_S


def test_a_crowd_of_offenders_is_bounded_and_the_nearest_release_goes_first() -> None:
    quarantine = Quarantine()
    for index in range(MAX_QUARANTINED + 10):
        quarantine.add(f"QmSybil{index}", "x" * 10_000, now=float(index))
    current = quarantine.current(now=0.0)
    assert len(current) == MAX_QUARANTINED and "QmSybil0" not in current and f"QmSybil{MAX_QUARANTINED + 9}" in current
    assert all(len(verdict.reason) <= 200 for verdict in current.values())


OWNER_KEY = RSAPrivateKey()
OWNER = owner_marker(OWNER_KEY)


def _status_with(excluded: dict[str, tuple[str, float]], peer_id: str | None = None) -> proto.PeerStatus:
    peer_id = peer_id_of_owner(OWNER).to_base58() if peer_id is None else peer_id
    status = proto.PeerStatus(peer_id=peer_id, run_id="demo", last_seen=1.0)
    for excluded_id, (reason, remaining_s) in excluded.items():
        status.excluded_peers.add(peer_id=excluded_id, reason=reason, remaining_s=remaining_s)
    return status


@pytest.mark.parametrize(
    "excluded",
    [
        {"QmBad": ("nan", math.nan)},
        {"QmBad": ("forever", 1e12)},
        {"QmBad": ("x" * 201, 1.0)},
        {"Qm" + "x" * 100: ("long id", 1.0)},
        {f"QmSybil{index}": ("crowd", 1.0) for index in range(MAX_QUARANTINED + 1)},
    ],
)
def test_a_status_record_with_an_unbounded_exclusion_is_refused(excluded: dict[str, tuple[str, float]]) -> None:
    with pytest.raises(RecordError):
        decode_peer_status(_status_with(excluded).SerializeToString(), OWNER)
    bounded = _status_with({"QmBad": ("a part with NaN or infinite values", MAX_QUARANTINE_S)})
    assert len(decode_peer_status(bounded.SerializeToString(), OWNER).excluded_peers) == 1


def test_status_counts_each_reporters_exclusions_and_shows_them_escaped() -> None:
    progress = Progress()
    progress.excluded_peers = {"QmBadPeer12345678": Quarantine().add("QmBadPeer12345678", "[/bold] a part with NaN")}
    entries = progress.excluded_peer_statuses()
    assert [entry.peer_id for entry in entries] == ["QmBadPeer12345678"]
    assert 0 < entries[0].remaining_s <= QUARANTINE_S
    reporters = [
        _status_with({"QmBadPeer12345678": ("[/bold] a part with NaN", 500.0)}, "QmHonestA"),
        _status_with({"QmBadPeer12345678": ("a part 1e+06x the median norm", 400.0)}, "QmHonestB"),
        _status_with({"QmHonestA": ("a lone accusation", 100.0)}, "QmBadPeer12345678"),
    ]
    report = summarize("demo", None, reporters)
    assert report.run.excluded_peers == {"QmBadPeer12345678": 2, "QmHonestA": 1}
    peer_json = report.to_json()["peers"][0]["excluded_peers"]
    assert peer_json == [{"peer_id": "QmBadPeer12345678", "reason": "[/bold] a part with NaN", "remaining_s": 500.0}]
    console = Console(width=200, record=True)
    console.print(render(report, now=2.0))  # the reason is a peer's text: printed as it is, never parsed as markup
    assert "kept out of averaging groups by 2 of 3 peers" in console.export_text()


class QuarantiningAverager(TrafficCountingAverager):
    """The daemon's runner (robust reducers, quarantine), its minimum group size settable between rounds."""

    def set_min_group_size(self, size: int) -> None:
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_set_min_group_size", [], {"size": size, "future": future}))
        future.result(timeout=10)

    async def _set_min_group_size(self, size: int, future: MPFuture) -> None:
        self._matchmaking.min_group_size = size
        future.set_result(None)


SIZE = 3000
"""With parts of PART_BYTES, each member of a group of 3 reduces a part of the vector, and so sees every sender's."""
PART_BYTES = 4 * 500


@pytest.mark.swarm
def test_a_peer_that_sent_nan_parts_is_left_out_of_the_next_round() -> None:
    dhts = loopback_dhts(3)
    values = [torch.full((SIZE,), 1.0), torch.full((SIZE,), 3.0), torch.full((SIZE,), math.nan)]
    averagers = averager_group(
        QuarantiningAverager,
        values,
        dhts,
        "quarantine-test",
        aggregation=AggregationSettings(rule="mean", max_weight=1.0),
        part_size_bytes=PART_BYTES,
    )
    honest, attacker = averagers[:2], averagers[2]
    attacker_id = str(dhts[2].peer_id)
    try:
        # round 1: all three; each honest reducer drops the NaN part
        assert all(group is not None for group in step_together(averagers))
        for averager in honest:
            # The verdict travels from the averager's process to this one through a queue: awaited, not assumed.
            excluded = await_condition(averager.excluded_peers, 10, "the attacker's quarantine")
            assert set(excluded) == {attacker_id}
            with averager.get_tensors() as tensors:
                assert torch.equal(tensors[0], torch.full((SIZE,), 2.0))
            averager.set_min_group_size(2)
        attacker.set_min_group_size(2)
        # Round 2: the attacker looks for a group too, but the honest peers neither accept it nor ask it to lead.
        attacker_round = attacker.step(timeout=20, wait=False)
        for group in step_together(honest):
            assert group is not None and attacker_id not in {str(peer) for peer in group}, group
        assert attacker_round.exception(timeout=40) is not None  # it found nobody to average with
        assert not attacker.excluded_peers()  # its own reducer saw only honest parts
    finally:
        shut_down(averagers, dhts)
