"""A SkipPipe node's place in the roster: its first iteration, the leader's rosters, moves, stage 0 founded again.

Which nodes an iteration counts comes from the roster the stage-0 leader announces two iterations ahead
(`membership`). A node not in it yet (a joiner) keeps serving and declaring, and takes its stage's state from a
replica just before its first iteration (`_take_place`, `_join`); the run's first node founds the roster. The
leader announces the membership of a later iteration when the nodes declared differ from the roster's (`_lead`).

A stage 1..S-1 that has had no node for REBALANCE_AFTER_S (its last node left; every path skips its layers
meanwhile) takes one from the stage with the most nodes (`spare_for_empty_stage`): the spare declares the empty
stage, the leader announces the move two iterations ahead like any change, and the spare serves the new stage from
that iteration on, from its own copy of the stage's layers (no node serves a trained one): `_offer_to_move`,
`_move`. A joiner's download is checked by the drift repair in its first iteration (a state that differs from the
majority of its stage's replicas is replaced; with one other replica nothing checks it).

A swarm whose stage 0 lost every node has no source and no leader: its nodes hold (`_hold_without_sources`: no
iteration, no step) and, once the stage-0 nodes' declarations have been gone for REBALANCE_AFTER_S, a joiner that
declared stage 0 (the lowest peer ID of them) or else the node `spare_for_empty_stage` names takes stage 0 and
founds the roster again (`_refound_stage_zero`), from LOOKAHEAD iterations past the swarm's; the others follow it
(`StageDirectory.roster` trusts its publisher once the old stage 0 is gone) and jump to its first iteration.
"""

from __future__ import annotations

import logging
import time
import typing

import torch

from crowdtrain.modes.skippipe.hops.hop_wire import HopFailedError
from crowdtrain.modes.skippipe.hops.stage_ledger import MAX_ITERATIONS_AHEAD
from crowdtrain.modes.skippipe.iteration import SkipPipeNode
from crowdtrain.modes.skippipe.roster.declaration import StageDeclaration
from crowdtrain.modes.skippipe.roster.membership import (
    DECLARATION_TTL_S,
    LOOKAHEAD,
    ROSTER_RENEW_S,
    PipelineMembers,
    cost_changes,
    leader_of,
    membership_at,
    missed_reads,
    next_members,
    spare_for_empty_stage,
    stage_zero_gone,
)
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo

logger = logging.getLogger(__name__)

WAIT_FOR_ROSTER_S = 1.0
"""A node not in the roster yet reads it again after this long (it serves its stage meanwhile)."""
JOIN_TIMEOUT_S = 120.0
"""How long a joiner looks for a replica serving the iteration before its first (then gets the time one download of
its stage's state may take, `SkipPipeNode.state_timeout_s`, to take that state)."""
MISSING_READS = 3
"""A member whose declaration is missing from this many of the leader's reads in a row is gone (or expired)."""
CHECK_MEMBERS_S = 15.0
"""How often a follower reads the declarations to check the members of the membership in force (`_check_members`);
under SUSPICION_S, so a member that never declared stays suspected."""
PING_AT_MOST = 8
"""Nodes a joiner asks for the iteration they serve."""
REBALANCE_AFTER_S = 300.0
"""A stage without a node for this long takes a node from the stage with the most (`spare_for_empty_stage`); a
node that restarts within it finds its stage free and keeps its trained layers (the mover's would replace them)."""


class Rostering(StageDeclaration):
    """A `SkipPipeMode`'s place in the roster (see the module's doc); the mode sets what it reads."""

    runner: SkipPipeNode
    history: list[PipelineMembers]
    iteration: int | None
    _published_at: float
    _missing: dict[str, int]
    _unseen: dict[str, int]
    _members_read_at: float
    _members_read: tuple[int, frozenset[str]] | None
    _members_checked: int
    _empty_since: dict[int, float]
    _stage_zero_gone_since: float | None
    _holding: bool
    _given_up: dict[str, float]

    if typing.TYPE_CHECKING:  # the mode's own

        @property
        def optimizer(self) -> torch.optim.Optimizer: ...

        def _stage_runner(self) -> SkipPipeNode: ...

    def _take_place(self) -> bool:
        """Find this node's first iteration in the roster (found the roster if none exists and this node serves
        stage 0); take its stage's state from a replica if the stage has one. Whether it has a place now."""
        serving = self.directory.declarations(serving_only=True) if not self.history and self.stage == 0 else {}
        if not self.history and self.stage == 0 and set(serving) <= {self.me.peer_id}:
            # no roster and no other node serving: the run's first node (else the roster is on its way: wait)
            founding = PipelineMembers(0, (self.me,))
            if self.directory.publish_roster([founding]):
                self.history = [founding]
                self._published_at = time.monotonic()
                logger.info("founded the SkipPipe roster")
        orphan = self.history and self.me.peer_id not in self.history[-1].peers() and self.stage == 0
        if orphan and self._refound_stage_zero(0):  # a joiner on stage 0 of a swarm that lost its stage 0
            self.iteration = self.history[-1].from_iteration  # no replica of its stage is left to take a state from
            logger.info(f"taking part in SkipPipe iterations from iteration {self.iteration} on")
            return True
        if not self.history or self.me.peer_id not in self.history[-1].peers():
            return False
        index = len(self.history) - 1
        while index > 0 and self.me.peer_id in self.history[index - 1].peers():
            index -= 1  # the first membership of the newest run of memberships that list this node
        first = self.history[index].from_iteration
        swarm = self._swarm_iteration()
        if swarm > first + MAX_ITERATIONS_AHEAD:  # restarted while its place lasted: too far behind to catch up
            first = swarm
        before = membership_at(self.history, first - 1)
        replicas = sorted(
            node.peer_id
            for node in (before.members if before else ())
            if node.stage == self.stage and node.peer_id != self.me.peer_id
        )
        self.iteration = self._join(replicas, first) if replicas else first
        logger.info(f"taking part in SkipPipe iterations from iteration {self.iteration} on")
        return True

    def _swarm_iteration(self) -> int:
        """The iteration the newest membership's other nodes serve (the highest that answered; 0 if none did)."""
        others = [node.peer_id for node in self.history[-1].members if node.peer_id != self.me.peer_id]
        answers = [self.service.ping(peer, timeout_s=2.0) for peer in others[:PING_AT_MOST]]
        return max((answer for answer in answers if answer is not None), default=0)

    def _join(self, replicas: list[str], first: int) -> int:
        """Take the stage's state of iteration `first - 1` from one of `replicas`; the iteration to run next."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S + self.runner.state_timeout_s()
        while time.monotonic() < deadline:
            for peer in replicas:
                serving = self.service.ping(peer, timeout_s=2.0)
                if serving is None or serving < first:
                    continue  # gone, or still stepping an earlier iteration: a state is a whole stage, ask once
                try:
                    self.runner.join(peer)
                except HopFailedError as e:
                    logger.warning(f"could not take stage {self.stage}'s state: {e}")
                    continue
                if self.runner.last_iteration >= first - 1:
                    if self.runner.last_iteration >= first:  # gradients served meanwhile are in the state taken
                        self.optimizer.zero_grad(set_to_none=False)
                    return self.runner.last_iteration + 1
            time.sleep(0.2)
        logger.warning(f"no replica of stage {self.stage} served its state of iteration {first - 1}; starting as is")
        return first

    def _lead(self, iteration: int, membership: PipelineMembers) -> None:
        """As the leader, announce the membership of iteration + LOOKAHEAD when the declared nodes differ."""
        now = time.monotonic()
        self._given_up.update({peer: now + DECLARATION_TTL_S for peer in self.runner.suspected})
        self._given_up = {peer: until for peer, until in self._given_up.items() if until > now}
        if leader_of(membership, self._given_up) != self.me.peer_id:
            return
        newest = self.history[-1] if self.history else membership
        if time.monotonic() - self._published_at >= ROSTER_RENEW_S and self.directory.publish_roster(self.history):
            self._published_at = time.monotonic()  # renewed: a roster left alone would expire
        if newest.from_iteration > iteration:
            return  # a change is announced already
        members = next_members(newest, self._live_declarations(newest), self._given_up)
        if set(members) == set(newest.members) or not any(node.stage == 0 for node in members):
            return
        announced = PipelineMembers(iteration + LOOKAHEAD, members)
        if self.directory.publish_roster([*self.history, announced]):
            self.history, self._published_at = [*self.history, announced], time.monotonic()
            costs = cost_changes(newest, members)
            logger.info(
                f"announced {len(members)} SkipPipe nodes from iteration {announced.from_iteration}"
                + (f" (seconds per microbatch: {', '.join(costs)})" if costs else "")
            )

    def _read_in_background(self) -> None:
        """As a follower, every CHECK_MEMBERS_S, in the declaration's thread: read which nodes declare serving a
        stage, for the next iteration's `_check_members` (numbered, so each read counts once)."""
        now = time.monotonic()
        newest = self.history[-1] if self.history else None
        if now - self._members_read_at < CHECK_MEMBERS_S or newest is None or leader_of(newest, ()) == self.me.peer_id:
            return
        self._members_read_at = now
        count = 0 if self._members_read is None else self._members_read[0]
        self._members_read = (count + 1, frozenset(self.directory.declarations(serving_only=True)))

    def _check_members(self, membership: PipelineMembers) -> None:
        """As a follower, at each new read of the declarations (`_read_in_background`): suspect each member of the
        membership in force whose serving declaration MISSING_READS reads in a row did not find (a leader may list
        nodes that never declared; a read that misses this node's own declaration doesn't count), which leaves it
        out of this node's schedules and gradient sums (`SkipPipeNode.suspect`) for as long as it stays undeclared.
        The leader's own reads drop such members from its next roster (`_lead`)."""
        read = self._members_read
        if read is None or read[0] == self._members_checked or leader_of(membership, ()) == self.me.peer_id:
            return
        self._members_checked, declared = read
        if self.me.peer_id not in declared:
            return  # a read that misses this node's own declaration (renewed every DECLARATION_RENEW_S) missed records
        others = [node for node in membership.members if node.peer_id != self.me.peer_id]
        self._unseen = missed_reads(others, declared, self._unseen)
        for peer, reads in self._unseen.items():
            if reads < MISSING_READS:
                continue
            if peer not in self.runner.suspected:
                logger.warning(
                    f"node {peer[-8:]} of the SkipPipe roster has no stage declaration: left out of this node's "
                    "iterations while it has none"
                )
            self.runner.suspect(peer)

    def _offer_to_move(self) -> None:
        """When a stage has had no node for REBALANCE_AFTER_S and this node is the one to spare
        (`spare_for_empty_stage`) and no joiner declared that stage meanwhile, declare it: the leader announces the
        move two iterations ahead, and every node makes it at the same iteration (`_move`)."""
        newest, now = self.history[-1], time.monotonic()
        empty = set(range(1, self.spec.stages)) - {node.stage for node in newest.members}
        self._empty_since = {stage: self._empty_since.get(stage, now) for stage in empty}
        spare = spare_for_empty_stage(newest, self.spec.stages)
        if self.me.stage != self.stage or spare is None or spare[0] != self.me.peer_id:
            return  # already moving, or not this node's to do
        stage = spare[1]
        if now - self._empty_since[stage] < REBALANCE_AFTER_S:
            return
        known = set().union(*(membership.peers() for membership in self.history))
        if any(node.stage == stage and node.peer_id not in known for node in self.directory.declarations().values()):
            return  # a joiner took it: it enters with the next membership (a gone member's declaration lingers)
        self.me = self._node(stage)
        self._declared_at = -float("inf")
        self._renew_declaration()
        logger.warning(
            f"stage {stage} has had no node for {now - self._empty_since[stage]:.0f} s: this node moves there from "
            f"stage {self.stage} (declared; the leader announces the move)"
        )

    def _hold_without_sources(self, iteration: int) -> None:
        """No stage-0 node is left to drive microbatches: run no iteration (nothing would be trained), give the
        suspected ones another chance after their suspicion ends, and found the roster again where it is this
        node's to do (`_refound_stage_zero`)."""
        if not self._holding:
            logger.warning(f"iteration {iteration}: no stage-0 node is left to drive microbatches; waiting for one "
                           f"(after {REBALANCE_AFTER_S:.0f} s a node of another stage takes stage 0)")  # fmt: skip
        self._holding = True
        self.service.hold(self.runner.last_iteration)
        self.runner.forgive()
        self._refound_stage_zero(iteration)
        self.context.stop.wait(WAIT_FOR_ROSTER_S)

    def _refound_stage_zero(self, iteration: int) -> bool:
        """When every stage-0 node of the newest membership has been gone (no live declaration) for
        REBALANCE_AFTER_S, and this node is the one to take stage 0 (a joiner that declared stage 0, the lowest
        peer ID of them; else the node `spare_for_empty_stage` spares, while no joiner declares stage 0), take
        stage 0 and found the roster again: a membership of the live nodes, from LOOKAHEAD iterations past the
        swarm's, that every node follows (`StageDirectory.roster`: its publisher's stage-0 predecessors are gone).
        Stage 0's layers start from this node's copy of them. Whether it did."""
        newest, now = self.history[-1], time.monotonic()
        declared = self.directory.declarations(serving_only=True)
        absent = {node.peer_id for node in newest.members if node.peer_id not in declared}
        if not stage_zero_gone(newest, declared.keys()):
            self._stage_zero_gone_since = None
            return False
        since = self._stage_zero_gone_since = self._stage_zero_gone_since or now
        joiners = sorted(peer for peer, node in declared.items() if node.stage == 0 and peer not in newest.peers())
        if self.stage == 0:
            ours = bool(joiners) and joiners[0] == self.me.peer_id
        else:
            ours = not joiners and spare_for_empty_stage(newest, self.spec.stages, absent) == (self.me.peer_id, 0)
        if not ours or now - since < REBALANCE_AFTER_S:
            return False
        if self.me.stage != 0:
            self.me = self._node(0)
            self._declared_at = -float("inf")
            self._renew_declaration()
        members = next_members(newest, {**declared, self.me.peer_id: self.me}, absent)
        start = max(iteration, newest.from_iteration, self._swarm_iteration()) + LOOKAHEAD  # no node is past it
        announced = PipelineMembers(start, members)
        if not self.directory.publish_roster([*self.history, announced]):
            return False
        self.history, self._published_at = [*self.history, announced], now
        logger.warning(
            f"every stage-0 node has been gone for {now - since:.0f} s: this node takes stage 0 and founds the roster "
            f"again, {len(members)} nodes from iteration {announced.from_iteration}; stage 0's layers start from "
            "this node's copy of them"
        )
        return True

    def _move(self, stage: int, iteration: int) -> None:
        """Serve `stage` from `iteration` on, as the roster says: a fresh optimizer over its layers, which start
        from this node's own copy of them (no node serves a trained one: that is why it moves)."""
        old, last = self.stage, self.runner.last_iteration
        self.service.set_stage(stage, self.me.memory_microbatches)
        self.runner.close()
        self.runner = self._stage_runner()
        self.runner.last_iteration = last
        logger.warning(
            f"iteration {iteration}: moved from stage {old} to stage {stage}, which had no node; its layers start "
            "from this node's copy of them"
        )

    def _live_declarations(self, newest: PipelineMembers) -> dict[str, NodeInfo]:
        """The serving nodes' declarations, and the members' whose declaration was missing from fewer than
        MISSING_READS reads in a row: one read that misses records (a DHT node slow to answer) drops no one."""
        declared = self.directory.declarations(serving_only=True)
        self._missing.update(missed_reads(newest.members, declared, self._missing))
        kept = {node.peer_id: node for node in newest.members if 0 < self._missing[node.peer_id] < MISSING_READS}
        return {**kept, **declared}
