"""How a DiLoCo peer keeps to the swarm's rounds: when it is behind, takes the swarm's state, waits for the donors'
next round, joins the swarm's round without a state, and resyncs when its θ₀ differs from its group's.

A mixin of DiLoCoMode (modes/diloco/mode.py): its methods read and write the mode's round, tracker and averager.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from crowdtrain.averaging.phases import Phase
from crowdtrain.collaboration.factory import LOAD_STATE_TIMEOUT_S
from crowdtrain.modes.diloco.pseudo_gradients import MAX_GATHERED

if TYPE_CHECKING:
    from crowdtrain.modes.diloco.internals import DiLoCoInternals

logger = logging.getLogger(__name__)

SYNC_RETRY_S = 10.0
"""After a state download, the next one waits this long: a swarm whose progress records claim a later round
than any donor serves (a peer lying about its progress) must not make every micro-batch a download."""
CATCH_UP_RETRY_S = 1.0
"""After a download that came back one or two rounds behind the swarm (its donor's last round still in flight, with
overlap), the next download waits only this long; until a donor serves the swarm's round (at most the averaging
timeout) the node starts no outer round of its own: ending one at once (the swarm's progress is ahead) would average
round r while the others average r + 1, and a group that mixes rounds is not applied."""
MAX_CATCH_UP_TRIES = 4
"""Quick downloads per wait at most: each is a whole state, and a dead peer's last progress record can claim a round
nobody serves."""
RESYNC_RETRY_S = 1.0
"""After a resync (`_check_lineage`) found no state, the next try waits only this long. The peer ranked above applies
the round's outer step at its next micro-batch and declares the round after it: the first try, at once, often comes
before that and finds no donor ranked above; waiting SYNC_RETRY_S would leave the two apart for rounds, each averaged
Δ landing on a θ₀ it was not computed from."""
MAX_RESYNC_TRIES = 5
"""Quick resync tries per averaged round that showed the difference; then, as before, the next averaged round decides
(a peer lying about its digest must not make an honest one download a state every second)."""

START_DIGEST_BYTES = 16


def _tiebreak(peer_id: str) -> float:
    """In [0, 0.5): ranks peers of one round alike on every peer (`_priority`)."""
    return int.from_bytes(hashlib.blake2b(peer_id.encode(), digest_size=4).digest(), "big") / 2**33


def _gathered_digest(value: Any) -> bytes | None:
    """The θ₀ digest a peer gathered (`_gather`); None without one (an older peer) or when malformed."""
    digest = value[2] if isinstance(value, list | tuple) and 3 <= len(value) <= MAX_GATHERED else None
    return digest if isinstance(digest, bytes) and len(digest) == START_DIGEST_BYTES else None


def group_start_digest(digests: dict[str, bytes | None]) -> bytes | None:
    """The θ₀ digest of a group's lineage, from each member's gathered one (None: it sent none): the one most members
    hold, between as many the one of the highest-ranked member (`_tiebreak`). One member, however it ranks, can't
    outvote the others; of two that differ, the lower-ranked one follows the other."""
    holders: dict[bytes, list[str]] = {}
    for peer, digest in digests.items():
        if digest is not None:
            holders.setdefault(digest, []).append(peer)
    if not holders:
        return None
    return max(holders, key=lambda digest: (len(holders[digest]), max(map(_tiebreak, holders[digest]))))


class RoundSync:
    """DiLoCoMode's joining and resyncing (see the module's doc)."""

    _catch_up_round: int | None
    _alone_round: int | None = None
    """The round whose θ₀ this peer stepped to alone while the swarm had others; None once it took a state."""

    def _stepped_alone(self: DiLoCoInternals) -> None:
        """This peer's outer step to the next round is its own (the round was not averaged, the swarm has others):
        it takes a state next, and serves no digest of this one (`_outer_state`'s "alone"; state/corroboration.py):
        others that stepped alone too hold states of their own at that round, and none is a witness of another's."""
        self.diverged = True
        self._alone_round = self.round + 1

    def _check_lineage(self: DiLoCoInternals) -> None:
        """After an averaged round: when this peer's θ₀ differed from the group's (`group_start_digest`), take a
        state next (`_resync`). Two peers that each stepped a round alone in the same round (neither saw the other
        yet) would average every round after and apply the same Δ to different θ₀: their states would never agree
        again, and a joiner could corroborate neither."""
        digests = {peer: _gathered_digest(value) for peer, value in self.round_gathered.items()}
        mine = digests.get(self.context.peer_id)
        if mine is None:
            return
        group = group_start_digest(digests)
        if group != mine:
            differ = sum(digest not in (None, mine) for digest in digests.values())
            logger.warning(f"this node's global parameters differ from those of {differ} of the {len(digests)} "
                           "peers of its last averaged round, the group's (each stepped a round apart): it takes a "
                           "state")  # fmt: skip
            self._resync, self._resync_tries = True, 0

    def _start_digest(self: DiLoCoInternals) -> bytes:
        """A digest of the round's θ₀, the global parameters: peers in step hold the same bits."""
        digest = hashlib.blake2b(digest_size=START_DIGEST_BYTES)
        with self._lock, torch.no_grad():
            for start in self.global_parameters:
                digest.update(start.detach().cpu().contiguous().numpy().tobytes())
        return digest.digest()

    def _passed_by_the_swarm(self: DiLoCoInternals, round_: int) -> bool:
        """Whether a peer of the swarm trains two rounds past `round_`: it has started averaging round_ + 1, and with
        at most one round in flight per peer, every group of round_ has closed (groups are keyed by round,
        RoundKeyManager). A liar's claim counts until a download finds no state that backs it
        (`_load_state_from_peers`)."""
        return self.tracker.global_epoch >= round_ + 2

    def _left_behind(self: DiLoCoInternals) -> bool:
        """Whether the swarm has passed the round this node trains in (`_passed_by_the_swarm`): then ending it would
        average with nobody, and counting rounds up alone would bring this node to the swarm's round with a θ₀ that
        is not the swarm's. It trains on in its round instead, and takes the swarm's state at its next download
        (or, if none comes, joins the swarm's round with its own: `_load_state_from_peers`)."""
        left_behind = self._passed_by_the_swarm(self.training_round)
        if left_behind and not self._said_left_behind:
            logger.warning(f"the swarm is at outer round {self.tracker.global_epoch}, this node at "
                           f"{self.training_round}: it trains on until it takes the swarm's state")  # fmt: skip
        self._said_left_behind = left_behind
        return left_behind

    def _catching_up(self: DiLoCoInternals) -> bool:
        """Whether this node waits to take the swarm's round (see CATCH_UP_RETRY_S) instead of ending one alone."""
        return time.monotonic() < self._catching_up_until and self.tracker.global_epoch > self.training_round

    def _behind_the_swarm(self: DiLoCoInternals) -> bool:
        if time.monotonic() < self._sync_not_before:
            return False
        if (self.diverged or self._resync) and self.tracker.global_progress.num_peers > 1:
            return True
        behind = self.tracker.global_epoch - self.training_round
        if behind == 1 and self.samples > 0 and not self._catching_up():
            # With overlap the others' epoch moves on as soon as they end a round, before its all-reduce: a node that
            # trained in that round and notices its end a micro-batch later (a slow step, a held-out score) ends it
            # too and joins the all-reduce; taking a state instead would cost it minutes on a home link.
            return False
        return behind > 0

    def _priority(self: DiLoCoInternals) -> float:
        """What this peer declares as a state donor: its round, then a tiebreak every peer computes alike, so peers
        whose round failed together all take the same one's state (each asks only donors ranked above itself).
        A peer others can't dial serves no state, and hivemind refuses any priority but 0 on its averager."""
        return 0.0 if self.context.client_mode else self._rank()

    def _rank(self: DiLoCoInternals) -> float:
        """This peer's place among donors, client or not: its round, then the tiebreak."""
        return self.round + _tiebreak(self.context.peer_id)

    def _load_state_from_peers(self: DiLoCoInternals) -> bool:
        """Take the swarm's global parameters, outer momentum and round; inner optimizer state stays this peer's.
        Only a state at least as new as this peer's round, from a donor ranked above it (resyncing: of its round), is
        taken. False when
        no donor had one."""
        self._sync_not_before = time.monotonic() + (CATCH_UP_RETRY_S if self._catching_up() else SYNC_RETRY_S)
        if self._in_flight is not None:  # applied first, so that a failed download leaves a consistent state
            self._finish_round_in_flight(wait=True)
        claimed_at_start = self.tracker.global_epoch
        resyncing = self._resync and not self.diverged
        self._resync = False  # asked again after the next averaged round, if its θ₀ still differs
        # Corroborated always: peers that stepped a round alone serve no digest of it (`_stepped_alone`), so they
        # don't refuse each other's states, while those that averaged it refute a state that is not theirs. A resync
        # follows its group's θ₀, which peers of its round ranked below it may hold too.
        above = float(self.round) if resyncing else self._rank()
        with self.context.phases.measure(Phase.STATE_DOWNLOAD):
            loaded = self.averager.load_state_from_peers(
                timeout=LOAD_STATE_TIMEOUT_S, above_priority=above if self.round > 0 else None, stop=self.context.stop
            )
        if loaded is None:
            self.diverged = False  # nobody to take a state from: go on with this one
            if resyncing and self._resync_tries < MAX_RESYNC_TRIES:
                # the peer ranked above may not have declared the round yet (RESYNC_RETRY_S)
                self._resync, self._resync_tries = True, self._resync_tries + 1
                self._sync_not_before = time.monotonic() + RESYNC_RETRY_S
            if self._passed_by_the_swarm(self.round):
                self._left_without_state()
            return False
        metadata, tensors = loaded
        count = len(self.global_parameters)
        with self._lock, torch.no_grad():
            for start, parameter, value in zip(self.global_parameters, self.parameters, tensors[:count], strict=True):
                start.copy_(value)
                parameter.copy_(value)
            for start, momentum in zip(self.global_parameters, tensors[count:], strict=True):
                self.outer_optimizer.state[start]["momentum_buffer"] = momentum.to(start.device, copy=True)
            self.round = int(metadata["epoch"])
            if self.feedback is not None:
                self.feedback.reset()  # kept back from the trajectory this peer leaves for the swarm's
        self._take_round_batches(metadata.get("inner_steps"))
        self._enter_round(self.round)
        self.diverged, self._alone_round = False, None
        logger.info(f"took the swarm's state of outer round {self.round}")
        # The swarm's newest state still short of the round some peer claims: the claim is not backed, and rounds
        # more than one past this node's are ignored for a while (averaging/progress_bounds.py); else a liar's round
        # would hold every node `_left_behind`. An honest donor's newest round may still be in flight (it serves
        # the one before), so the state counts as one round later than it is.
        self.tracker.distrust_unbacked_epochs(self.round + 1, self.round + 1, claimed_at_start=claimed_at_start)
        self._note_catch_up()
        return True

    def _left_without_state(self: DiLoCoInternals) -> None:
        """The swarm passed this node's round and no peer's state came."""
        if self.round == 0:
            # Still at round 0, this node holds the run's initial weights. Joining the swarm's round with them would
            # average a fresh model's pseudo-gradients into the swarm's, and every averaged Δ after would land on θ₀
            # that is not the swarm's. It keeps asking, every SYNC_RETRY_S, and ends no round meanwhile.
            if not self._said_waiting_for_state:
                logger.warning(f"no peer's state came; this node holds the run's initial weights and waits for the "
                               f"swarm's state of outer round {self.tracker.global_epoch}")  # fmt: skip
            self._said_waiting_for_state = True
            return
        # Left behind (on a home link a whole state can take longer than the download's timeout while the swarm
        # trains): join the swarm's round with this node's own θ₀, of the swarm's lineage, rather than wait for a
        # download that may never fit, as a node that counted its rounds up alone did before.
        logger.warning(f"no peer's state came; this node joins the swarm's outer round {self.tracker.global_epoch} "
                       "with its own")  # fmt: skip
        self._enter_round(self.tracker.global_epoch)

    def _enter_round(self: DiLoCoInternals, outer_round: int) -> None:
        """Make `outer_round` this node's round from its start: no samples of it yet, the progress tracker at it,
        and the state this node serves ranked by it."""
        with self.tracker.pause_updates():
            self.round, self.samples = outer_round, 0
            self.tracker.update_epoch(outer_round)
        self.averager.state_sharing_priority = self._priority()

    def _note_catch_up(self: DiLoCoInternals) -> None:
        """After a download: wait for the donors' next round when the swarm's all-reduce of this one already runs
        without this node (see CATCH_UP_RETRY_S); once a download shows they moved on, end the round at once, so
        that this node joins the matchmaking of their newest round, which has just begun."""
        now = time.monotonic()
        # one round behind (the donor's round in flight), or two (the donor served before it applied one)
        behind = self.round < self.tracker.global_epoch <= self.round + 2
        waiting = now < self._catching_up_until and self._catch_up_round is not None
        if behind and not waiting:  # the first such download: wait, at most the averaging timeout
            self._catch_up_round, self._catch_up_tries = self.round, 0
            self._catching_up_until = now + self.context.manifest.averaging.timeout_s
            self._sync_not_before = now + CATCH_UP_RETRY_S
        elif behind and self._catch_up_round is not None and self.round <= self._catch_up_round:
            self._catch_up_tries += 1  # the donors have not moved on yet (or a dead peer's record claims more)
            if self._catch_up_tries < MAX_CATCH_UP_TRIES:
                self._sync_not_before = now + CATCH_UP_RETRY_S
            else:  # a whole state per try: give up waiting, as before
                self._catch_up_round, self._catching_up_until = None, 0.0
        else:  # caught up, or the donors just moved on: their newest round's matchmaking is open
            self._catch_up_round, self._catching_up_until = None, 0.0
