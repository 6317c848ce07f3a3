"""Who serves which stage of a SkipPipe run, and which nodes each iteration counts: signed records in the DHT.

Declarations. A node serves one stage; it says so in a signed `SkipPipeMember` record (its stage, its measured seconds
per microbatch on that stage (declared again when its device drifts from it, `pipeline.device_clock`), how many
microbatches it holds at once, its link's seconds per hop from the bandwidth its probes measured before training, up to
MAX_SECONDS_PER_HOP) under the run's stages key, subkey its owner marker, renewed while it runs and expiring
`DECLARATION_TTL_S` after its last renewal. A joiner takes a stage by the rule the DMoE hosts use, fewest replicas
first, here weighted by compute: the stage with the fewest declared replicas, ties to the one with the least compute
(the sum of its replicas' microbatches per second), then the lowest stage (`choose_stage`).

Rosters. Every node of an iteration computes its schedule from the same list of nodes (`planning.skippipe`: a
pure function), so the list must be the same on every node, and a node that joins or leaves must be added or
removed at the same iteration everywhere. The *leader*, the stage-0 member of the current membership with the
lowest peer ID that its peers have not given up on, announces each change `LOOKAHEAD` iterations ahead: a
`SkipPipeRoster` record of its last `HISTORY` memberships, each "these nodes from iteration i on". Every node reads
the rosters at each iteration and takes the one whose newest membership starts latest (ties: the lowest
publisher), from a publisher that is a stage-0 member of that membership; so when a leader dies, the next stage-0
node's roster, which starts later, takes over.

What a roster cannot guarantee: a node that missed the newest roster when its iteration began runs it with the
membership before (the change is announced two iterations ahead to make that rare); its schedule then differs
from the others' and only the balance of that iteration suffers (sources tell every node they are done, and each
stage sums its replicas' gradients by peer ID). A stage-0 node is trusted to publish the rosters, and checked where
a follower can: a member whose serving declaration a follower's reads keep missing is left out of its schedules
and gradient sums (`rostering._check_members`), as is one that fails a hop; a leader may still leave honest nodes
out (SECURITY.md).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import hivemind

from crowdtrain import proto
from crowdtrain.dht import keys
from crowdtrain.dht.records import RecordError, check_roster, check_stage_declaration, peer_id_of_owner
from crowdtrain.dht.registry import read_dictionary, store_signed
from crowdtrain.modes.skippipe.hops.device_clock import drifted
from crowdtrain.modes.skippipe.roster.costs import MAX_SECONDS_PER_HOP, MAX_SECONDS_PER_MICROBATCH, counted_compute
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo

logger = logging.getLogger(__name__)

DECLARATION_TTL_S = 60.0
"""A declaration not renewed for this long expires: its node is gone."""
DECLARATION_RENEW_S = 15.0
"""How often a running node renews its declaration."""
ROSTER_TTL_S = 600.0
"""A roster expires this long after the leader last wrote it (at each change, and every ROSTER_RENEW_S)."""
ROSTER_RENEW_S = 60.0
LOOKAHEAD = 2
"""A membership announced at iteration i applies from iteration i + LOOKAHEAD."""
HISTORY = 4
"""Memberships a roster keeps, the newest last."""
MAX_JUMP = 64
"""A roster a running node follows announces no membership more than this many iterations (+ LOOKAHEAD) past its
own iteration."""
MAX_MEMBERS = 256
"""The most nodes one membership lists (MAX_ROSTER_BYTES allows HISTORY of them)."""
DHT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class PipelineMembers:
    """The nodes of a SkipPipe run from iteration `from_iteration` on, in peer-ID order."""

    from_iteration: int
    members: tuple[NodeInfo, ...]

    def to_proto(self) -> proto.SkipPipeMembership:
        return proto.SkipPipeMembership(
            from_iteration=self.from_iteration, members=[member_proto(node) for node in self.members]
        )

    def peers(self) -> set[str]:
        return {node.peer_id for node in self.members}

    def stage_of(self, peer_id: str) -> int | None:
        return next((node.stage for node in self.members if node.peer_id == peer_id), None)


def member_proto(node: NodeInfo, serving: bool = False) -> proto.SkipPipeMember:
    """`node` as a declaration (`serving`: it serves its stage already) or a roster's member."""
    return proto.SkipPipeMember(
        peer_id=node.peer_id,
        stage=node.stage,
        seconds_per_microbatch=node.seconds_per_microbatch,
        memory_microbatches=node.memory_microbatches,
        serving=serving,
        seconds_per_hop=node.seconds_per_hop if node.seconds_per_hop > 0 else None,
    )


def node_info(member: proto.SkipPipeMember, num_stages: int) -> NodeInfo:
    """The member as the scheduler takes it; RecordError when it is not a valid node of a run of `num_stages`."""
    if not 40 <= len(member.peer_id) <= 60:
        raise RecordError("a SkipPipe member's peer ID is not a base58 peer ID")
    if member.stage >= num_stages:
        raise RecordError(f"a SkipPipe member serves stage {member.stage} of a run of {num_stages}")
    if not member.memory_microbatches <= 4096:
        raise RecordError(f"a SkipPipe member holds {member.memory_microbatches} microbatches, over 4096")
    if not member.seconds_per_microbatch <= MAX_SECONDS_PER_MICROBATCH:  # NaN fails here too
        raise RecordError(
            f"a SkipPipe member's seconds_per_microbatch is {member.seconds_per_microbatch}, "
            f"not a number of seconds up to {MAX_SECONDS_PER_MICROBATCH}"
        )
    if not member.seconds_per_hop <= MAX_SECONDS_PER_HOP:  # NaN fails here too
        raise RecordError(
            f"a SkipPipe member's link takes {member.seconds_per_hop} s a hop, over {MAX_SECONDS_PER_HOP}"
        )
    try:
        return NodeInfo(
            peer_id=member.peer_id,
            stage=member.stage,
            seconds_per_microbatch=member.seconds_per_microbatch,
            memory_microbatches=member.memory_microbatches,
            seconds_per_hop=member.seconds_per_hop,
        )
    except ValueError as e:
        raise RecordError(str(e)) from None


def parse_declaration(subkey: bytes, value: bytes, num_stages: int) -> NodeInfo:
    """A declaration's node; RecordError unless it is well formed and its peer ID is its signer's."""
    return node_info(check_stage_declaration(subkey, value), num_stages)


def parse_roster(subkey: bytes, value: bytes, num_stages: int) -> list[PipelineMembers]:
    """A roster's memberships, oldest first; RecordError unless it is signed and each membership is well formed, in
    rising iterations, with distinct members and at most MAX_MEMBERS of them."""
    roster = check_roster(subkey, value)
    if not 1 <= len(roster.history) <= HISTORY:
        raise RecordError(f"a roster of {len(roster.history)} memberships; 1 to {HISTORY} expected")
    history: list[PipelineMembers] = []
    for entry in roster.history:
        if history and entry.from_iteration <= history[-1].from_iteration:
            raise RecordError("a roster's memberships are not in rising iterations")
        if len(entry.members) > MAX_MEMBERS:
            raise RecordError(f"a membership of {len(entry.members)} nodes, over {MAX_MEMBERS}")
        members = tuple(sorted((node_info(member, num_stages) for member in entry.members), key=_peer))
        if len({node.peer_id for node in members}) != len(members):
            raise RecordError("a membership lists a node twice")
        history.append(PipelineMembers(entry.from_iteration, members))
    return history


def encode_roster(history: Sequence[PipelineMembers]) -> bytes:
    """The roster record of `history`'s last HISTORY memberships."""
    return proto.SkipPipeRoster(history=[membership.to_proto() for membership in history[-HISTORY:]]).SerializeToString(
        deterministic=True
    )


def choose_stage(declared: Iterable[NodeInfo], num_stages: int, me: str) -> int:
    """The stage a node takes: the fewest replicas among the other nodes' declarations, then the least compute
    (microbatches per second summed over its replicas, each counted as `costs` bounds it), then the lowest stage."""
    replicas, compute = [0] * num_stages, [0.0] * num_stages
    for node in counted_compute([node for node in declared if node.peer_id != me]):
        if node.stage < num_stages:
            replicas[node.stage] += 1
            compute[node.stage] += 1.0 / node.seconds_per_microbatch
    return min(range(num_stages), key=lambda stage: (replicas[stage], compute[stage], stage))


def restage(declared: Iterable[NodeInfo], stage: int, num_stages: int, me: str) -> int | None:
    """After a joiner declared `stage`: the stage to take instead when a node with a lower peer ID declared the same
    one while another stage has no node (two joiners chose at once; the lower keeps it), else None."""
    others = [node for node in declared if node.peer_id != me]
    clash = any(node.stage == stage and node.peer_id < me for node in others)
    if not clash or {node.stage for node in others} >= set(range(num_stages)):
        return None
    return choose_stage(others, num_stages, me)


def spare_for_empty_stage(
    membership: PipelineMembers, num_stages: int, gone: Collection[str] = ()
) -> tuple[str, int] | None:
    """When a stage has no member but those `gone` (its last node left): (the member that moves there, the lowest
    such stage), the member being the highest peer ID of the stage with the most members (ties to the higher stage;
    stage 0's highest is never its leader, the lowest). A stage 1..S-1 is given a node only by a stage of at least
    two; stage 0, which drives every microbatch, by any (the stage it leaves is skipped by every path until it
    gets one). None when no stage is empty or none can spare a node. Every node computes the same from the same
    membership and the same gone nodes."""
    members: list[list[str]] = [[] for _ in range(num_stages)]
    for node in membership.members:
        if node.peer_id not in gone:
            members[node.stage].append(node.peer_id)
    empty = [stage for stage in range(num_stages) if not members[stage]]
    crowded = max(range(num_stages), key=lambda stage: (len(members[stage]), stage))
    if not empty or len(members[crowded]) < (1 if empty[0] == 0 else 2):
        return None
    return max(members[crowded]), empty[0]


def stage_zero_gone(membership: PipelineMembers, declared: Collection[str]) -> list[str]:
    """The stage-0 members of `membership` when none of them has a live declaration (`declared`: the peer IDs that
    have one): no node is left to drive microbatches or announce rosters. [] while one is there."""
    stage_zero = [node.peer_id for node in membership.members if node.stage == 0]
    return [] if any(peer in declared for peer in stage_zero) else stage_zero


def pick_roster(
    rosters: Mapping[str, Sequence[PipelineMembers]],
    current: Sequence[PipelineMembers] = (),
    iteration: int | None = None,
    orphaned: bool = False,
) -> list[PipelineMembers]:
    """The roster every node follows among those found (publisher → history): the newest membership starting
    latest, ties to the lowest publisher; [] if none. Only from a stage-0 member of its own newest membership and,
    once this node follows a roster (`current`), of that roster's newest membership (a node that is not a stage-0
    member can't take the swarm over) unless every one of those is gone (`orphaned`: a node that took stage 0 since
    founds the roster again), and for a node that runs `iteration`, announcing no further than MAX_JUMP iterations
    past it (nor can a stage-0 member move the swarm to an iteration far ahead)."""
    trusted = None if not current or orphaned else {node.peer_id for node in current[-1].members if node.stage == 0}
    limit = None if iteration is None else iteration + LOOKAHEAD + MAX_JUMP
    valid = [
        (history[-1].from_iteration, publisher)
        for publisher, history in rosters.items()
        if history
        and history[-1].stage_of(publisher) == 0
        and (trusted is None or publisher in trusted)
        and (limit is None or history[-1].from_iteration <= limit)
    ]
    if not valid:
        return []
    _, publisher = min(valid, key=lambda item: (-item[0], item[1]))
    return list(rosters[publisher])


def membership_at(history: Sequence[PipelineMembers], iteration: int) -> PipelineMembers | None:
    """The membership in force at `iteration`: the newest one starting at or before it; None before the first."""
    current = None
    for membership in history:
        if membership.from_iteration <= iteration:
            current = membership
    return current


def leader_of(membership: PipelineMembers, given_up: Collection[str]) -> str | None:
    """The node that announces changes: the stage-0 member with the lowest peer ID not in `given_up`."""
    candidates = sorted(node.peer_id for node in membership.members if node.stage == 0 and node.peer_id not in given_up)
    return candidates[0] if candidates else None


def next_members(
    current: PipelineMembers | None, declared: Mapping[str, NodeInfo], given_up: Collection[str]
) -> tuple[NodeInfo, ...]:
    """The nodes of the next membership: the current members whose declaration is still live and who were not
    given up on, then every other declared node; at most MAX_MEMBERS, members first. A member keeps the cost it is
    scheduled at until its declaration's differs by more than COST_DRIFT (`follow_cost`)."""
    kept = [node for node in (current.members if current else ()) if node.peer_id in declared]
    kept = [
        follow_cost(node, declared[node.peer_id])
        for node in kept
        if node.peer_id not in given_up and declared[node.peer_id].stage == node.stage
    ]
    present = {node.peer_id for node in kept}
    joining = [node for peer, node in sorted(declared.items()) if peer not in present and peer not in given_up]
    return tuple(sorted([*kept, *joining][:MAX_MEMBERS], key=_peer))


def missed_reads(members: Iterable[NodeInfo], declared: Collection[str], before: Mapping[str, int]) -> dict[str, int]:
    """For each of `members`, the reads in a row, this one included, that did not find its declaration (0 where
    `declared` holds it), counting on from `before`."""
    return {node.peer_id: 0 if node.peer_id in declared else before.get(node.peer_id, 0) + 1 for node in members}


def follow_cost(member: NodeInfo, declaration: NodeInfo) -> NodeInfo:
    """`member` as the next membership schedules it: at its declaration's seconds per microbatch where they differ
    from the scheduled ones by more than COST_DRIFT (the node found its device slower or faster than it said,
    `pipeline.device_clock`), else unchanged (a roster is announced only when the members change; every small
    swing would announce one)."""
    if not drifted(member.seconds_per_microbatch, declaration.seconds_per_microbatch):
        return member
    return dataclasses.replace(member, seconds_per_microbatch=declaration.seconds_per_microbatch)


def cost_changes(before: PipelineMembers, after: Iterable[NodeInfo]) -> list[str]:
    """For a log line: the members of `after` whose seconds per microbatch differ from `before`'s."""
    old = {node.peer_id: node.seconds_per_microbatch for node in before.members}
    return [
        f"{node.peer_id[-8:]} {old[node.peer_id] * 1000:.0f} -> {node.seconds_per_microbatch * 1000:.0f} ms"
        for node in after
        if node.peer_id in old and old[node.peer_id] != node.seconds_per_microbatch
    ]


def _peer(node: NodeInfo) -> str:
    return node.peer_id


@dataclass
class StageDirectory:
    """A SkipPipe run's declarations and rosters in the DHT, read and written by one node."""

    dht: hivemind.DHT
    run_id: str
    owner: bytes
    """This node's owner marker: its records are signed."""
    num_stages: int

    def declare(self, node: NodeInfo, serving: bool) -> bool:
        """Sign and store this node's declaration (`serving`: a leader may add it to the roster)."""
        value = member_proto(node, serving).SerializeToString(deterministic=True)
        key = keys.skippipe_stages_key(self.run_id)
        return store_signed(self.dht, key, value, self.owner, DECLARATION_TTL_S, DHT_TIMEOUT_S)

    def declarations(self, serving_only: bool = False) -> dict[str, NodeInfo]:
        """The live, valid declarations (with `serving_only`, of nodes that serve their stage already), by peer ID."""
        found = {}
        for subkey, value in read_dictionary(self.dht, keys.skippipe_stages_key(self.run_id), DHT_TIMEOUT_S).items():
            try:
                member = check_stage_declaration(subkey, value)
                node = node_info(member, self.num_stages)
            except RecordError as e:
                logger.debug(f"skipped a stage declaration: {e}")
                continue
            if member.serving or not serving_only:
                found[node.peer_id] = node
        return found

    def publish_roster(self, history: Sequence[PipelineMembers]) -> bool:
        key = keys.skippipe_roster_key(self.run_id)
        return store_signed(self.dht, key, encode_roster(history), self.owner, ROSTER_TTL_S, DHT_TIMEOUT_S)

    def roster(self, current: Sequence[PipelineMembers] = (), iteration: int | None = None) -> list[PipelineMembers]:
        """The roster to follow (`pick_roster`, after `current`, by a node running `iteration`) among the valid ones
        found; [] if none. A roster from a node outside the current stage 0 is followed only when the declarations
        say that every node of the current stage 0 is gone (read only then)."""
        rosters = {}
        for subkey, value in read_dictionary(self.dht, keys.skippipe_roster_key(self.run_id), DHT_TIMEOUT_S).items():
            try:
                rosters[peer_id_of_owner(subkey).to_base58()] = parse_roster(subkey, value, self.num_stages)
            except RecordError as e:
                logger.debug(f"skipped a roster: {e}")
        picked = pick_roster(rosters, current, iteration)
        refounded = pick_roster(rosters, current, iteration, orphaned=True) if current else picked
        if refounded != picked and stage_zero_gone(current[-1], self.declarations().keys()):
            return refounded
        return picked
