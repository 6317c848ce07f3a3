"""SkipPipe's stage choice, rosters and manifest section (pure logic; the daemons' use is in test_skippipe_swarm)."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.utils.crypto import RSAPrivateKey
from rich.console import Console

from crowdtrain import proto
from crowdtrain.cli.status import render, summarize
from crowdtrain.dht.records import PublishedManifest, RecordError, owner_marker, peer_id_of_owner
from crowdtrain.dht.registry import RunListing
from crowdtrain.manifest import SkipPipeSpec, demo, skippipe_demo
from crowdtrain.modes.skippipe.roster.membership import (
    PipelineMembers,
    choose_stage,
    cost_changes,
    encode_roster,
    leader_of,
    membership_at,
    next_members,
    parse_declaration,
    parse_roster,
    pick_roster,
    restage,
    spare_for_empty_stage,
    stage_zero_gone,
)
from crowdtrain.modes.skippipe.roster.rostering import MISSING_READS, Rostering
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo


def node(peer: str, stage: int, seconds: float = 1.0) -> NodeInfo:
    return NodeInfo(peer_id=peer.ljust(46, "x"), stage=stage, seconds_per_microbatch=seconds, memory_microbatches=2)


def test_a_node_takes_the_stage_with_fewest_replicas_then_least_compute_then_the_lowest() -> None:
    assert choose_stage([], 4, "me") == 0
    assert choose_stage([node("a", 0)], 4, "me") == 1
    assert choose_stage([node("a", 0), node("b", 1), node("c", 2), node("d", 3)], 4, "me") == 0
    # one replica each: the stage whose replica is slowest has the least compute
    assert choose_stage([node("a", 0), node("b", 1, 0.5), node("c", 2, 4.0), node("d", 3)], 4, "me") == 2
    # its own declaration does not count
    assert choose_stage([node("me", 0)], 2, "me".ljust(46, "x")) == 0


def test_two_joiners_that_chose_one_stage_at_once_split_the_lower_peer_id_keeps_it() -> None:
    founder, low, high = node("a", 0), node("b", 1), node("c", 1)
    declared = [founder, low, high]
    assert restage(declared, 1, 3, high.peer_id) == 2  # stage 2 has no node: the higher peer ID moves there
    assert restage(declared, 1, 3, low.peer_id) is None  # the lower keeps its stage
    assert restage(declared, 1, 2, high.peer_id) is None  # every stage has a node: two replicas of stage 1 is fine
    assert restage([founder, high], 1, 3, high.peer_id) is None  # no clash


def test_the_roster_followed_starts_latest_is_from_a_stage_zero_member_and_ties_go_to_the_lowest() -> None:
    a, b, c = node("a", 0), node("b", 0), node("c", 1)
    old = [PipelineMembers(0, (a, c))]
    newer = [PipelineMembers(0, (a, c)), PipelineMembers(5, (a, b, c))]
    assert pick_roster({a.peer_id: old, b.peer_id: newer}) == newer
    assert pick_roster({b.peer_id: newer, a.peer_id: newer[:1] + [PipelineMembers(5, (a, c))]})[-1].members == (a, c)
    # a stage-1 node's roster is not followed, however new
    assert pick_roster({a.peer_id: old, c.peer_id: [PipelineMembers(9, (c,))]}) == old
    # once a node follows a roster, only its stage-0 members may publish the next, and not far ahead
    stranger = node("s", 0)
    hijack = [PipelineMembers(0, (a, c)), PipelineMembers(6, (stranger, c))]
    assert pick_roster({a.peer_id: newer, stranger.peer_id: hijack}) == hijack  # a joiner knows no better
    assert pick_roster({a.peer_id: newer, stranger.peer_id: hijack}, current=newer, iteration=5) == newer
    far = [*newer, PipelineMembers(5 + 2 + 64 + 1, (a, b))]
    assert pick_roster({b.peer_id: far, a.peer_id: newer}, current=newer, iteration=5) == newer
    near = [*newer, PipelineMembers(7, (a, b))]
    assert pick_roster({b.peer_id: near, a.peer_id: newer}, current=newer, iteration=5) == near  # a successor
    assert membership_at(newer, 4) == newer[0] and membership_at(newer, 5) == newer[1]
    assert membership_at(newer[1:], 4) is None
    assert leader_of(newer[1], given_up=()) == a.peer_id
    assert leader_of(newer[1], given_up={a.peer_id}) == b.peer_id


def test_the_next_membership_keeps_live_members_adds_declared_ones_and_drops_the_given_up() -> None:
    a, b, c, d = node("a", 0), node("b", 1), node("c", 1), node("d", 0)
    current = PipelineMembers(0, (a, b, c))
    declared = {n.peer_id: n for n in (a, c, d)}  # b's declaration expired
    assert next_members(current, declared, given_up=()) == (a, c, d)
    assert next_members(current, declared, given_up={c.peer_id}) == (a, d)
    # a member keeps the cost it is scheduled at through small swings of its declaration, and takes the declared
    # one past COST_DRIFT (its device found slower or faster): the roster carries it to every node alike
    swing = {**declared, a.peer_id: dataclasses.replace(a, seconds_per_microbatch=1.15)}
    assert next_members(current, swing, given_up=())[0].seconds_per_microbatch == 1.0
    slower = {**declared, a.peer_id: dataclasses.replace(a, seconds_per_microbatch=1.4, memory_microbatches=9)}
    followed = next_members(current, slower, given_up=())[0]
    assert followed.seconds_per_microbatch == 1.4 and followed.memory_microbatches == a.memory_microbatches
    assert cost_changes(current, next_members(current, slower, ())) == [f"{a.peer_id[-8:]} 1000 -> 1400 ms"]
    faster = {**declared, a.peer_id: dataclasses.replace(a, seconds_per_microbatch=0.7)}
    assert next_members(current, faster, given_up=())[0].seconds_per_microbatch == 0.7


def test_a_swarm_whose_stage_zero_is_gone_follows_the_roster_a_node_founds_again() -> None:
    a, b, c, d = node("a", 0), node("b", 0), node("c", 1), node("d", 1)
    current = [PipelineMembers(0, (a, b, c, d))]
    assert stage_zero_gone(current[-1], {b.peer_id, c.peer_id}) == []  # one stage-0 node is enough
    assert stage_zero_gone(current[-1], {c.peer_id, d.peer_id}) == [a.peer_id, b.peer_id]
    moved = dataclasses.replace(d, stage=0)
    refounded = [*current, PipelineMembers(9, (c, moved))]
    rosters = {a.peer_id: current, d.peer_id: refounded}
    assert pick_roster(rosters, current, iteration=7) == current, "d was no stage-0 member: not followed"
    assert pick_roster(rosters, current, iteration=7, orphaned=True) == refounded
    far = [*current, PipelineMembers(7 + 2 + 64 + 1, (c, moved))]
    assert pick_roster({d.peer_id: far}, current, iteration=7, orphaned=True) == [], "nor far ahead"


def test_a_stage_left_without_nodes_takes_the_highest_peer_id_of_the_most_replicated_stage() -> None:
    a, b, c, d, e = node("a", 0), node("b", 0), node("c", 1), node("d", 1), node("e", 2)
    assert spare_for_empty_stage(PipelineMembers(0, (a, b, c, e)), 4) == (b.peer_id, 3)  # stage 0's non-leader
    assert spare_for_empty_stage(PipelineMembers(0, (a, b, c, d)), 4) == (d.peer_id, 2)  # ties: the higher stage spares
    assert spare_for_empty_stage(PipelineMembers(0, (a, c, e)), 4) is None  # no stage has a node to spare
    assert spare_for_empty_stage(PipelineMembers(0, (a, b, c, e)), 3) is None  # no stage is empty
    # stage 0 (it drives every microbatch) takes one from any stage, even its only node; stage 0 first
    assert spare_for_empty_stage(PipelineMembers(0, (c, d)), 2) == (d.peer_id, 0)
    assert spare_for_empty_stage(PipelineMembers(0, (a, c, e)), 4, gone={a.peer_id}) == (e.peer_id, 0)
    assert spare_for_empty_stage(PipelineMembers(0, (a, b, c, e)), 4, gone={a.peer_id}) is None  # b: stage 0's last
    # a mover declares its new stage; the leader's next membership has it there, and it spares no more
    moved = dataclasses.replace(b, stage=3)
    declared = {n.peer_id: n for n in (a, moved, c, e)}
    assert next_members(PipelineMembers(0, (a, b, c, e)), declared, ()) == (a, moved, c, e)
    assert spare_for_empty_stage(PipelineMembers(2, (a, moved, c, e)), 4) is None


def test_records_are_checked_before_use() -> None:
    key = RSAPrivateKey()
    marker = owner_marker(key)
    me = peer_id_of_owner(marker).to_base58()
    member = proto.SkipPipeMember(peer_id=me, stage=1, seconds_per_microbatch=0.5, memory_microbatches=2)
    assert parse_declaration(marker, member.SerializeToString(), num_stages=2).stage == 1
    with pytest.raises(RecordError, match="stage 1 of a run of 1"):
        parse_declaration(marker, member.SerializeToString(), num_stages=1)
    other = proto.SkipPipeMember(peer_id="Qm" + "z" * 44, stage=0, seconds_per_microbatch=0.5, memory_microbatches=2)
    with pytest.raises(RecordError, match="another peer than its signer"):
        parse_declaration(marker, other.SerializeToString(), num_stages=2)
    bad_seconds = proto.SkipPipeMember(peer_id=me, stage=0, seconds_per_microbatch=float("nan"), memory_microbatches=2)
    with pytest.raises(RecordError, match="seconds_per_microbatch"):
        parse_declaration(marker, bad_seconds.SerializeToString(), num_stages=2)
    for hop_s, reason in ((float("nan"), "a hop"), (1e9, "a hop"), (-1.0, "seconds_per_hop")):
        bad_link = proto.SkipPipeMember(
            peer_id=me, stage=0, seconds_per_microbatch=0.5, memory_microbatches=2, seconds_per_hop=hop_s
        )
        with pytest.raises(RecordError, match=reason):
            parse_declaration(marker, bad_link.SerializeToString(), num_stages=2)

    a, b = node("a", 0), dataclasses.replace(node("b", 1), seconds_per_hop=0.25)
    good = [PipelineMembers(0, (a,)), PipelineMembers(3, (a, b))]
    assert parse_roster(marker, encode_roster(good), num_stages=2) == good
    for history, reason in (
        ([PipelineMembers(3, (a,)), PipelineMembers(3, (a, b))], "rising iterations"),
        ([PipelineMembers(0, (a, a))], "twice"),
        ([PipelineMembers(0, (a, b))], None),
    ):
        value = encode_roster(history)
        if reason is None:
            with pytest.raises(RecordError, match="stage 1 of a run of 1"):
                parse_roster(marker, value, num_stages=1)
        else:
            with pytest.raises(RecordError, match=reason):
                parse_roster(marker, value, num_stages=2)
    with pytest.raises(RecordError, match="not a valid SkipPipeRoster"):
        parse_roster(marker, b"\xff\xff", num_stages=2)


def test_the_manifest_section_is_checked_and_the_preset_is_a_skippipe_run() -> None:
    preset = skippipe_demo()
    assert (preset.training.mode, preset.skippipe) == ("skippipe", SkipPipeSpec(stages=4, skip_ratio=0.25))
    assert type(preset).from_bytes(preset.to_bytes()) == preset
    exact = dataclasses.replace(preset, skippipe=SkipPipeSpec(gradient_dtype="float32", overlap_exchange=True))
    spec = type(exact).from_bytes(exact.to_bytes()).skippipe
    assert spec == SkipPipeSpec(gradient_dtype="float32", overlap_exchange=True)
    older = proto.RunManifest.FromString(exact.to_bytes())
    older.skippipe.ClearField("gradient_dtype")  # a manifest from before the settings
    older.skippipe.ClearField("overlap_exchange")
    assert type(exact).from_bytes(older.SerializeToString()).skippipe == SkipPipeSpec()
    for bad, reason in (
        (dict(stages=1), "stages must be between 2"),
        (dict(skip_ratio=1.0), "skip_ratio"),
        (dict(microbatches=0), "microbatches"),
        (dict(wire_dtype="int8"), "wire_dtype"),
        (dict(gradient_dtype="float16"), "gradient_dtype must be one of bfloat16, float32, int8"),
    ):
        with pytest.raises(ValueError, match=reason):
            SkipPipeSpec(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs training.mode = 'skippipe'"):
        dataclasses.replace(demo(), skippipe=SkipPipeSpec())
    with pytest.raises(ValueError, match="num_hidden_layers >= 5"):
        dataclasses.replace(preset, skippipe=SkipPipeSpec(stages=5))


def test_status_shows_the_stages_replicas_and_gradient_exchange_in_force() -> None:
    spec = dataclasses.replace(skippipe_demo().skippipe or SkipPipeSpec(), gradient_dtype="int8")
    manifest = dataclasses.replace(skippipe_demo(), skippipe=spec, created_at=1.0)
    listing = RunListing(PublishedManifest(manifest, "QmFounder"), signed_bytes=b"", publishers=frozenset())
    stages = {"QmA": 0, "QmB": 0, "QmC": 1, "QmD": 3}  # no node serves stage 2
    peers = [
        proto.PeerStatus(
            peer_id=peer,
            run_id=manifest.run_id,
            last_seen=1.0,
            training=proto.TrainingStatus(mode="skippipe", skippipe_stage=stage),
        )
        for peer, stage in stages.items()
    ]
    report = summarize(manifest.run_id, listing, peers)
    assert report.to_json()["run"]["skippipe"] == {
        "stages": 4,
        "skip_ratio": 0.25,
        "reorder": True,
        "replicas": [2, 1, 0, 1],
        "gradient_dtype": "int8",
        "overlap_exchange": False,
    }
    console = Console(width=240, record=True)
    console.print(render(report, now=2.0))
    assert "4 stages (replicas 2/1/0/1), skipping 25%, reordered, gradients in int8" in console.export_text()


class Declarations:
    """What a follower's reads of the declarations find, one dict per read."""

    def __init__(self, *reads: dict[str, NodeInfo]):
        self.reads = list(reads)

    def declarations(self, serving_only: bool = False) -> dict[str, NodeInfo]:
        assert serving_only, "only a serving node may be scheduled"
        return self.reads.pop(0)


class Suspicions:
    """The two members of SkipPipeNode the check uses: whom this node leaves out of its iterations."""

    def __init__(self) -> None:
        self.suspected: set[str] = set()
        self.times: dict[str, int] = {}

    def suspect(self, peer_id: str) -> None:
        self.suspected.add(peer_id)
        self.times[peer_id] = self.times.get(peer_id, 0) + 1


def test_a_follower_leaves_out_a_roster_member_that_never_declared_but_not_on_a_read_that_missed_records() -> None:
    # A stage-0 leader may list a phantom (no declaration; SkipPipe finding 9): a follower's reads that keep missing
    # its declaration leave it out of the follower's schedules and sums, refreshed so it is never forgiven.
    leader, me, honest, phantom = node("a", 0), node("b", 0), node("c", 1), node("d", 1)
    membership = PipelineMembers(0, (leader, me, honest, phantom))
    declared = {peer.peer_id: peer for peer in (leader, me, honest)}
    follower = Rostering.__new__(Rostering)  # the check reads only what is set here
    follower.me, follower.runner, follower.history = me, Suspicions(), [membership]  # type: ignore[assignment]
    follower._unseen, follower._members_read, follower._members_checked = {}, None, 0
    lost = {honest.peer_id: honest}  # a read that found only another node's record: it missed records
    follower.directory = Declarations(declared, lost, declared, declared, declared)  # type: ignore[assignment]
    follower._check_members(membership)  # no read yet: nothing to check
    assert follower.runner.suspected == set() and follower._unseen == {}
    for read in range(5):
        follower._members_read_at = -float("inf")  # due: the reads are made every CHECK_MEMBERS_S
        follower._read_in_background()  # in the declaration's thread, off the training path
        follower._check_members(membership)
        follower._check_members(membership)  # the next iteration, before the next read: it counts once
        if read < 3:
            assert follower.runner.suspected == set(), "a member is suspected after MISSING_READS reads that count"
    assert follower.runner.suspected == {phantom.peer_id}
    assert follower.runner.times[phantom.peer_id] == 2, "suspected again at each check while it has no declaration"
    assert follower._unseen[phantom.peer_id] == MISSING_READS + 1 and follower._unseen[honest.peer_id] == 0
    # the leader itself doesn't check: its own reads drop such members from its next roster
    follower.me = leader
    follower.directory = Declarations()  # type: ignore[assignment]  # (a read would fail: none is made)
    follower._members_read_at = -float("inf")
    follower._read_in_background()
    follower._members_read = (99, frozenset())  # a read from before it led, finding no one
    follower._check_members(membership)
    assert follower.runner.times[phantom.peer_id] == 2 and follower._members_checked == 5, "the leader checks nothing"
