"""Peers caught sending bad parts are kept out of this node's averaging groups for a while (issue 14).

The robust reducer (averaging/robust.py) drops a malformed, non-finite or outsized part from the round it came
in; the sender is then *quarantined* by this node: as a group leader it refuses the peer's join requests,
and as a follower it does not ask the peer to lead it. A peer kept out of a group reduces no part of an honest
peer's vector either, so a poisoner that has shown itself once loses its chance to return bad averages too.

The verdict is local: each node quarantines only the peers whose parts it saw itself, never on another peer's
word (an accusation in the DHT would let one liar exclude honest peers). It is published in the node's status
record so that `crowdtrain status` shows the researcher who is kept out, by how many peers, and why.

A quarantine lasts QUARANTINE_S, doubling for a repeat offender up to MAX_QUARANTINE_S: an honest peer whose
part was dropped by accident (a bit flip, a bug fixed by a restart) comes back, a persistent poisoner spends
most of the run outside. At most MAX_QUARANTINED peers are held; past that the verdict closest to its end is
forgotten first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from crowdtrain.dht.records import MAX_EXCLUDED_PEERS, MAX_EXCLUSION_REASON_CHARS, MAX_EXCLUSION_S

QUARANTINE_S = 600.0
"""A first offence keeps the peer out of this node's groups for 10 minutes."""
MAX_QUARANTINE_S = MAX_EXCLUSION_S
"""Repeat offences double the time, up to 6 hours (the most a status record may show)."""
MAX_QUARANTINED = MAX_EXCLUDED_PEERS
"""Peers held at once (a Sybil crowd can't grow this node's memory), as many as a status record may show."""
MAX_REASON_CHARS = MAX_EXCLUSION_REASON_CHARS
"""A verdict's reason as kept and published."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why and until when (time.time()) a peer is kept out."""

    reason: str
    until: float
    offences: int


class Quarantine:
    """The peers this node keeps out of its averaging groups, by peer ID (base58)."""

    def __init__(self, duration_s: float = QUARANTINE_S, max_duration_s: float = MAX_QUARANTINE_S):
        self.duration_s, self.max_duration_s = duration_s, max_duration_s
        self._verdicts: dict[str, Verdict] = {}

    def add(self, peer_id: str, reason: str, now: float | None = None) -> Verdict:
        """Keep `peer_id` out from now on: QUARANTINE_S for a first offence, doubled for each one after (the
        reducer reports a sender once per round)."""
        now = time.time() if now is None else now
        previous = self._verdicts.get(peer_id)
        offences = 1 if previous is None else previous.offences + 1
        duration = min(self.duration_s * 2 ** (offences - 1), self.max_duration_s)
        verdict = Verdict(reason[:MAX_REASON_CHARS], now + duration, offences)
        self._verdicts[peer_id] = verdict
        if len(self._verdicts) > MAX_QUARANTINED:
            del self._verdicts[min(self._verdicts, key=lambda peer: self._verdicts[peer].until)]
        return verdict

    def holds(self, peer_id: str, now: float | None = None) -> bool:
        """Whether `peer_id` is kept out now."""
        verdict = self._verdicts.get(peer_id)
        return verdict is not None and verdict.until > (time.time() if now is None else now)

    def current(self, now: float | None = None) -> dict[str, Verdict]:
        """The verdicts in force, by peer ID (expired ones are kept only to count repeat offences)."""
        now = time.time() if now is None else now
        return {peer: verdict for peer, verdict in self._verdicts.items() if verdict.until > now}
