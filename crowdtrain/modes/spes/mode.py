"""`spes`: each node trains the dense parameters and only the routed experts it owns; no server.

SPES (Pretraining A Large Language Model using Distributed GPUs: A Memory-Efficient Decentralized Paradigm),
peer to peer. Every node holds the whole mixture-of-experts model (transformers' fused experts: OLMoE and
its kin) but keeps gradients and optimizer state only for the dense parameters and the experts it owns
(modes/spes/owned_experts.py); the others are frozen locally. Rounds are DiLoCo's (modes/diloco/mode.py, the
[diloco] settings): when the swarm has processed H global batches, the *dense* pseudo-gradients are averaged in
Moshpit groups and every node applies the same outer step. Then each owner publishes the weights its experts
reached, and every node fetches each expert it does not own from that expert's owner, versioned by round,
float16 on the wire, checked (modes/spes/expert_exchange.py). A node so sends the dense all-reduce and its own
experts, never the others'.

Ownership is a pure function of a list of peers and their measured compute (modes/spes/ownership.py): balanced,
stable when peers come and go, recomputed at each round's end. A peer whose status says it completed no round,
in a swarm past its first, is in no list (`_training_peers`): a joiner still waiting for the swarm's state can train
no expert. The list is the round's averaging group when the swarm fits in one group (`_next_owners`): every member
saw the same group, so they agree, and a vanished peer's experts go to the others at the end of the round it missed
(its status record may outlive it by status_ttl_s: a peer that missed the round and answered none of its fetches
counts as gone); they go on from the copies fetched the round before. A fetch that fails (an owner gone mid-round,
or behind) leaves that expert as this node last had it, and says so in the log: a partial exchange is never silent.
Changes are keyed by the digest of the copy they apply to, so nodes that briefly disagreed about owners converge to
the owner's copy at the next exchange.

With `spes.merge_every` set, each owner runs the expert-merging warm-up on its experts every M inner steps
(modes/spes/expert_merging.py), from the copies of the others it holds.

Ownership is weighted by memory too: each node gathers, with its round, how many experts' gradients and AdamW
moments fit MEMORY_SHARE of its device's free memory (`_unit_capacity`), and no member of an averaged round is
given more than that while the others have room (modes/spes/ownership.py). What a member gathers is signed by it
in the core (averaging/authored.py), so the round's leader that relays it can't rewrite it; a malformed entry claims
nothing (median compute, no cap, dialable; modes/spes/gathered.py). Peers known from their status records
(a swarm larger than a group) are capped by what their records say (`experts_capacity`, as of their last round).

Only peers others can dial own experts (modes/spes/ownership.py, `owner_candidates`): a member of an averaged round
says with its round whether it can be dialed, a peer known from its status record by its `reachable`. A node that
can't be dialed (a client: behind a NAT) trains the dense parameters and uses the experts it fetches.

Replicas (`spes.replicas = R`): each expert has R owners (modes/spes/ownership.py, `assign_owners`), each training it
on its own samples from the round's common copy; at the round's end every node, the owners too, fetches each
owner's copy and makes the expert the mean of the copies that came, summed in the order of the owners' peer IDs
so that every node holding the same copies holds the same bits. An owner that vanishes mid-round then costs its
experts its share of the round, not the round: the others' copies still come. A node that missed a copy another
got holds another mean for a round; the changes being keyed by copy digests, it gets whole copies next round.

Not built yet: overlap of the exchange with the next round's inner steps (SPES rounds run without DiLoCo's
`overlap`), and replicas chosen by an owner's weakness or flakiness (R is the run's, for every expert).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from crowdtrain import proto
from crowdtrain.manifest import SPESSpec
from crowdtrain.models.device import available_memory_bytes
from crowdtrain.modes.base import ModeContext, SwarmView
from crowdtrain.modes.diloco.mode import DiLoCoMode
from crowdtrain.modes.progress import Progress
from crowdtrain.modes.spes.expert_exchange import (
    ExpertExchange,
    Published,
    copy_digest,
    encode_change,
)
from crowdtrain.modes.spes.expert_merging import merge_alpha, merged_experts
from crowdtrain.modes.spes.gathered import MemberClaims, owners_by_claims, read_round, spes_gathered
from crowdtrain.modes.spes.owned_experts import (
    expert_parameter_ids,
    find_fused_experts,
    own,
    unit_experts,
    units_of,
)
from crowdtrain.modes.spes.ownership import assign_owners, owner_candidates
from crowdtrain.optimizer import build_optimizer
from crowdtrain.roles import Role

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.5
"""The share of its device's free memory a node offers for the gradients and AdamW moments of experts it owns."""
TRAINABLE_BYTES_PER_VALUE = 12
"""A trained float32 value's gradient and its two AdamW moments."""


class SPESMode(DiLoCoMode):
    """SPES behind the training-mode seam (see the module's doc)."""

    name = "spes"

    def __init__(self, context: ModeContext):
        compute = context.compute
        if compute is None:
            raise ValueError("a SPES peer always computes")
        self.layers = find_fused_experts(compute.model)
        self.num_units = units_of(self.layers)
        own(self.layers, [])  # freeze every expert before the dense parameters are chosen
        self.spes = context.manifest.spes if context.manifest.spes is not None else SPESSpec()
        self._view = context.swarm
        self.owners: list[tuple[str, ...]] = []
        """The owners of each unit in the current round (peer IDs in order; more than one with `spes.replicas`)."""
        self.owned: list[int] = []
        self.bases: dict[int, torch.Tensor] = {}
        """Owned expert → the copy every other node holds of it (float32, flattened); its trained weights are
        the model's."""
        self.round_claims: dict[str, MemberClaims] = {}
        """Each member's claims in the last averaged round (`_note_round`), by peer ID; what ownership reads."""
        self._capacity: int | None = None
        """The experts this node said it can train, at its last round's end (`_unit_capacity`)."""
        self.fetch_failures = 0
        """Copies of experts this node could not fetch from their owners."""
        self.stale_experts = 0
        """Experts a round left as this node had them before it (no owner's copy came): that round's training of
        them is lost to this node."""
        self.exchange = ExpertExchange(context.dht, context.stop)
        self.exchange.start()
        try:
            super().__init__(context)
        except BaseException:
            self.exchange.close()
            raise
        if context.client_mode:
            logger.info(
                "peers can't dial this node, so it owns no experts while a peer they can dial takes part: it trains "
                "the dense parameters as a client and uses the experts it fetches from their owners"
            )
        self._take_ownership()

    @property
    def overlapped(self) -> bool:
        return False  # the exchange follows the outer step; overlapping both is not built

    def _synchronised_parameters(self) -> list[torch.nn.Parameter]:
        experts = expert_parameter_ids(self.layers)
        return [p for p in self.context.parameters if p.requires_grad and id(p) not in experts]

    def train_micro_batch(self, batch: torch.Tensor) -> float | None:
        loss = super().train_micro_batch(batch)
        if loss is not None and self.spes.merge_every and self.inner_steps % self.spes.merge_every == 0:
            self._merge_warm_up()
        return loss

    def apply_swarm_view(self, view: SwarmView) -> None:
        super().apply_swarm_view(view)
        self._view = view  # ownership follows it from the next round's start
        if self.owners and self.round == 0 and self.inner_steps == 0:  # (not from DiLoCoMode's __init__)
            self._take_ownership()  # before the first step: the peers the node waited for (start_with_peers) count

    def report(self, progress: Progress) -> None:
        super().report(progress)
        progress.averaging_bytes_sent += self.exchange.bytes_served
        progress.experts_owned, progress.experts_total = len(self.owned), self.num_units
        progress.experts_capacity = self._capacity

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.exchange.close()

    # ownership

    def _take_ownership(self, peers: list[str] | None = None) -> None:
        """Train exactly this node's experts of the next round (`_next_owners`, or among `peers` only)."""
        me = self.context.peer_id
        if peers is not None:
            owners = self._assign_from_statuses(peers)
        else:
            owners = self._next_owners()
        owned = [unit for unit, unit_owners in enumerate(owners) if me in unit_owners]
        if owned != self.owned:
            logger.info(f"owns {len(owned)} of {self.num_units} experts (was {len(self.owned)})")
        for unit in set(self.bases) - set(owned):
            self._write(unit, self.bases.pop(unit))  # given up: hold the copy the other nodes hold
        for unit in set(owned) - set(self.bases):
            self.bases[unit] = self._flat(unit).clone()  # taken over: train on from this node's copy
        self.owners, self.owned = owners, owned
        self._set_inner_optimizer(own(self.layers, owned))

    def _next_owners(self) -> list[tuple[str, ...]]:
        """Who owns which expert in the next round. Nodes must agree, and the freshest agreed fact is the round
        just averaged: when its group held every peer this node knows, the experts go to its members. A group that
        holds part of the swarm (a larger swarm's Moshpit group, or a round whose peers came to it too far apart to
        meet) would share every expert among its members only: two groups, two owners of each expert, each
        fetching the other's copies from the wrong peers (seen in the WAN lab). A node alone takes every expert.
        A node whose round was not averaged while others train leaves the experts to them for a round: it can't
        know whom they counted, and two owners of one expert would waste a round of its training. Otherwise (a
        fresh run, a partial group) the last re-planning read decides, from the peers' measured compute; it lags
        a round or two behind joins and leaves."""
        me = self.context.peer_id
        group, started = self.round_group, self.round > 0
        known = self._training_peers() | {me}
        if group is not None:
            # A peer that missed the round and answered none of this round's fetches of its experts is gone (killed,
            # or cut off): its status record may last status_ttl_s more, its experts go to the group now.
            known -= self.exchange.unreachable - set(group)
        if group is not None and known <= set(group):
            # every member computes from the same signed gathered claims (status records differ between readers)
            return owners_by_claims(group, self.round_claims, self.num_units, self.spes.replicas)
        if started and self.tracker.global_progress.num_peers <= 1:
            peers = [me]
        elif started and group is None:
            # left to the others that can be dialed: one that can't serves no copy (then this node keeps them)
            others = sorted(known - {me})
            peers = [peer for peer in others if peer not in self._undialable(others)] or [me]
        else:
            peers = sorted(known)
        return self._assign_from_statuses(peers)

    def _training_peers(self) -> set[str]:
        """The peers the status records show, less those that completed no round yet in a swarm past its first: a
        joiner whose state download was refused or still streams trains no expert and serves no copy, and while it
        owned some every node waited out the exchange's timeout for them, each round (a CI log: rounds of 17 s for
        four minutes, their experts untrained)."""
        started = self.round > 0
        return {status.peer_id for status in self._view.statuses if status.epoch > 0 or not started}

    def _assign_from_statuses(self, peers: list[str]) -> list[tuple[str, ...]]:
        """Ownership among `peers` by the compute, memory and reachability their status records (last re-planning
        read) say; this node's own reachability is its averager's."""
        peers = owner_candidates(peers, self._undialable(peers))
        caps = {peer: self._capacity_of(peer) for peer in peers}
        rates = [(peer, self._compute_of(peer)) for peer in peers]
        return assign_owners(rates, self.num_units, self.spes.replicas, caps)

    def _undialable(self, peers: list[str]) -> set[str]:
        """The `peers` that can't be dialed: this node if its averager is a client, another whose status record says
        it measured so or is a declared client (a peer with no record counts as dialable, as before)."""
        me = self.context.peer_id
        said = {status.peer_id for status in self._view.statuses if status.peer_id != me and _undialable(status)}
        return {peer for peer in peers if peer in said or (peer == me and self.context.client_mode)}

    def _gather(self) -> Any:
        """DiLoCo's round, proposed H and θ₀ digest (the dense parameters': the lineage check), then this node's
        samples/s in the round, how many experts it can train and whether peers can dial it, for every member to
        see alike (modes/spes/gathered.py)."""
        elapsed = time.monotonic() - self._round_started_at
        self._capacity = capacity = self._unit_capacity()
        rate = float(self.samples) / elapsed if elapsed > 0 else 0.0
        return spes_gathered(super()._gather(), rate, capacity, not self.context.client_mode)

    def _note_round(self, gathered: dict[Any, Any], allreduce_s: float) -> None:
        """DiLoCo's, then every member's claims for ownership (`round_claims`), each its own (signed in the core,
        averaging/authored.py); the members whose entry was malformed are named in one line."""
        super()._note_round(gathered, allreduce_s)
        self.round_claims = read_round(self.round_gathered, self.round, self.num_units)
        malformed = sorted(peer for peer, claims in self.round_claims.items() if not claims.well_formed)
        if malformed:
            named = ", ".join(f"peer {peer[-8:]}" for peer in malformed[:4]) + (", ..." if len(malformed) > 4 else "")
            logger.warning(f"outer round {self.round}: the gathered entries of {len(malformed)} of "
                           f"{len(self.round_claims)} members ({named}) are not well-formed SPES entries of the "
                           "round (another version?): each counts as a median peer without a memory cap, "
                           "dialable")  # fmt: skip

    def _unit_capacity(self) -> int | None:
        """The experts this node can train: those it owns (their state is allocated) and as many more as fit
        MEMORY_SHARE of the free memory; None where the free memory can't be read."""
        free = available_memory_bytes(str(self.layers[0].module.gate_up_proj.device))
        if free is None:
            return None
        per_unit = sum(tensor.numel() for tensor in unit_experts(self.layers, 0)) * TRAINABLE_BYTES_PER_VALUE
        return min(self.num_units, len(self.owned) + int(free * MEMORY_SHARE // per_unit))

    def _capacity_of(self, peer: str) -> int | None:
        """The experts `peer`'s status record says fit its memory (checked against the total when read); None if
        it says none."""
        status = next((s for s in self._view.statuses if s.peer_id == peer), None)
        if status is None or not status.HasField("training") or not status.training.HasField("experts_capacity"):
            return None
        return int(status.training.experts_capacity)

    def _compute_of(self, peer: str) -> float:
        """The peer's measured samples/s from the last re-planning read; 0 (counted as the median) if unknown."""
        return next((s.measured_samples_per_second for s in self._view.statuses if s.peer_id == peer), 0.0)

    def _set_inner_optimizer(self, owned_parameters: list[torch.nn.Parameter]) -> None:
        """The inner optimizer over the dense parameters and `owned_parameters`; state carries over for parameters it
        had before (the dense ones, experts still owned); a newly owned expert starts with none."""
        previous = self.inner_optimizer
        optimizer = build_optimizer(
            [{"params": self.parameters}, {"params": owned_parameters}],
            self.context.manifest.optimizer,
            learning_rate=previous.param_groups[0]["lr"],
        )
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter in previous.state:
                    optimizer.state[parameter] = previous.state[parameter]
        self.inner_optimizer = optimizer

    # the exchange, after each outer step

    def _outer_step(self, ends: list[torch.Tensor] | None = None) -> None:
        super()._outer_step(ends)
        self._exchange_experts(self.owners)
        self._take_ownership()

    def _exchange_experts(self, owners: list[tuple[str, ...]]) -> None:
        """Publish this node's copies of its experts for the round just made; fetch every other owner's copy, and
        make each expert the mean of its owners' copies (`_take_copies`)."""
        me, round_ = self.context.peer_id, self.round
        previous = dict(self.bases)  # the copies every node held at the round's start: the changes apply to them
        published = {unit: self._publish(unit) for unit in self.bases}
        self.exchange.publish(round_, published)
        others = {unit: [peer for peer in unit_owners if peer != me] for unit, unit_owners in enumerate(owners)}
        wanted = {unit: peers for unit, peers in others.items() if peers}
        failures = self.exchange.fetch_all(
            wanted,
            round_,
            self.context.manifest.averaging.timeout_s,
            lambda unit: previous[unit] if unit in previous else self._flat(unit),
            lambda unit, copies: self._take_copies(unit, copies, published.get(unit)),
        )
        # stale: no owner's copy came, and this node's own was not one of them
        stale = {unit for unit, why in failures.items() if len(why) == len(wanted[unit]) and unit not in published}
        self._say_failures(failures, sum(map(len, wanted.values())), stale)

    def _say_failures(self, failures: dict[int, dict[str, str]], wanted: int, stale: set[int]) -> None:
        """Count the round's missing copies and say, in one line, what they cost and why (by owner)."""
        missed = sum(map(len, failures.values()))
        self.fetch_failures += missed
        self.stale_experts += len(stale)
        if not missed:
            return
        by_owner: dict[str, list[str]] = {}
        for _, why in sorted(failures.items()):
            for owner, reason in why.items():
                by_owner.setdefault(owner, []).append(reason)
        reasons = "; ".join(f"{len(why)} from peer {owner[-8:]} ({why[0].splitlines()[0]})"
                            for owner, why in sorted(by_owner.items())[:3])  # fmt: skip
        logger.warning(f"round {self.round}: {missed} of {wanted} expert copies did not come: {reasons}; "
                       f"{len(stale)} experts stay as they were (their round's training is lost here), "
                       f"{len(failures) - len(stale)} are made from the copies that came")  # fmt: skip

    def _take_copies(self, unit: int, copies: dict[str, torch.Tensor], mine: Published | None) -> None:
        """Make `unit` the mean of its owners' copies (`copies`, and this node's own one, `mine`, if it owns it),
        summed in the order of the owners' peer IDs: the same bits on every node that got the same copies. An
        owner keeps what the int8 change left out of its copy (θ − P) on top of the mean, as it would alone."""
        if mine is not None:
            copies = {**copies, self.context.peer_id: mine.values}
        ordered = [copies[peer] for peer in sorted(copies)]
        mean = ordered[0].clone()
        for copy in ordered[1:]:
            mean += copy
        mean /= len(ordered)
        if mine is None:
            self._write(unit, mean)
            return
        left_out = self._flat(unit) - mine.values
        self.bases[unit] = mean
        self._write(unit, mean + left_out)

    def _publish(self, unit: int) -> Published:
        """The new copy of owned `unit`: its last copy plus the int8 change toward its trained weights. Fetchers
        holding that last copy get the change; others, the whole copy."""
        base = self.bases[unit]
        change, copy = encode_change(base, self._flat(unit))
        self.bases[unit] = copy
        return Published(values=copy, base_digest=copy_digest(base), change=change)

    def _flat(self, unit: int) -> torch.Tensor:
        gate_up, down = unit_experts(self.layers, unit)
        return torch.cat([gate_up.detach().reshape(-1), down.detach().reshape(-1)]).float()

    def _write(self, unit: int, values: torch.Tensor) -> None:
        gate_up, down = unit_experts(self.layers, unit)
        with torch.no_grad():
            gate_up.copy_(values[: gate_up.numel()].view_as(gate_up))
            down.copy_(values[gate_up.numel() :].view_as(down))

    # joining

    def _load_state_from_peers(self) -> bool:
        held = self.round
        if not super()._load_state_from_peers():
            return False
        if self.round == held > 0:
            return True  # the dense state of its own round (a resync): its experts are that round's, as exchanged
        # The experts come from the owners of the swarm without this node: they trained the round it took.
        others = sorted(self._training_peers() - {self.context.peer_id})
        if others:
            self._take_ownership(peers=others)
            self._exchange_experts(self.owners)
        self._take_ownership()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "owned": list(self.owned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # the saved inner optimizer's groups are the dense parameters and the experts owned then
        saved = state.get("owned")
        if isinstance(saved, list) and all(isinstance(u, int) and 0 <= u < self.num_units for u in saved):
            self.owned = sorted(set(saved))
            self._set_inner_optimizer(own(self.layers, self.owned))
        super().load_state_dict(state)
        self.bases = {unit: self._flat(unit).clone() for unit in self.owned}
        self._take_ownership()

    # the expert-merging warm-up

    def _merge_warm_up(self) -> None:
        step = self._swarm_inner_step()
        alpha = merge_alpha(step, self.spes.merge_alpha, self.spes.merge_warmup_steps)
        if alpha <= 0 or not self.owned:
            return
        per_layer = self.layers[0].num_experts
        with torch.no_grad():
            for layer in self.layers:
                targets = [unit % per_layer for unit in self.owned if unit // per_layer == layer.layer]
                if not targets:
                    continue
                rows = torch.stack([self._flat(layer.layer * per_layer + index) for index in range(per_layer)])
                merged = merged_experts(rows, targets, self.spes.merge_neighbours, alpha)
                for index, values in zip(targets, merged, strict=True):
                    self._write(layer.layer * per_layer + index, values)


def _undialable(status: proto.PeerStatus) -> bool:
    """Whether a status record says peers can't dial its node: measured so, or a declared client (a record that sets
    neither, proto3's default `reachable`, says nothing)."""
    return not status.reachable and (status.reachability_measured or status.role_override == Role.CLIENT)
