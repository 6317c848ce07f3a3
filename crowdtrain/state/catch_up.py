"""Hold the swarm's global step for a peer that is downloading the swarm's state, so it can catch up.

Symptom: on a GPU (llama-85m on one H100, 512-sample global batches) the founder stepped every 1.7 s and a state
download (1 GB: weights and Adam's moments) took 4-5 s. The joiner downloaded epoch 4 as the swarm reached 7,
epoch 8 as it reached 11, and so on: 13 downloads in 75 s, never a micro-batch trained, and the "swarm" was the
founder alone. hivemind lets a peer one epoch behind step with the swarm; further behind, it downloads again. A
swarm whose step is shorter than a state download can thus never be joined (hivemind issue #455 reports it; stock
hivemind hides it a little because its matchmaking wait makes every step longer).

Here a peer about to download announces it under the run's catch-up key (a signed record: its subkey is the
peer's progress-record key) with a deadline ANNOUNCE_FOR_S ahead, and renews it every ANNOUNCE_EVERY_S while the
download lasts. Every peer, at its next global step and before averaging, holds while an announcement is before
its deadline and the announcer's progress record shows an epoch below this peer's (or no record yet): the donor
is holding too, so the state it served is of this epoch, and when the joiner reports it, all average together and
step into the next epoch in one group. After the download the peer says which epoch it loaded, and is waited
for until its progress record shows that epoch: a first version released the swarm on a bare "done", before the
joiner's progress record reached the holders; hivemind then counted one peer, stepped alone, and the two were
apart again. Without the "loaded" a live announcement held the swarm again at the next step, while the joiner,
in step with it, was still finishing its share of the round. A joiner whose download left it behind downloads
again under a new announcement. The round after a hold looks for its group CATCH_UP_MATCHMAKING_S, so the
peers just caught up find it.

An announcement is a claim of an untrusted peer, so what it can cost is bounded by this node:
- one hold lasts at most HOLD_MAX_S by this node's clock, whatever the deadline says;
- the time held comes from a bucket that holds HOLD_MAX_S and refills at HOLD_SHARE of wall time: any number of
  announcers (liars, many identities) cost a node at most one HOLD_MAX_S hold at once and HOLD_SHARE of its time
  in the long run. An honest joiner whose download takes longer than HOLD_MAX_S still cannot catch up with a
  swarm that steps faster than its download (a larger target batch is the remedy);
- the announcements are read at every global step, one DHT read bounded by READ_TIMEOUT_S (a few milliseconds on
  loopback, a round trip on the internet); a DHT that does not answer in time holds nothing. They cannot wait for
  a sign that someone is behind: a joiner has no progress record before its first download.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HOLD_MAX_S = 120.0
"""The longest one hold lasts, and the most held at once."""
HOLD_SHARE = 0.05
"""The share of wall time a node spends holding, in the long run."""
CATCH_UP_MATCHMAKING_S = 10.0
"""How long the round after a hold looks for its group, so that the peers just caught up find it."""
HOLD_POLL_S = 0.25
"""How often a holding node reads the announcers' progress again."""
READ_TIMEOUT_S = 1.0
"""The longest a step waits for the announcements."""
ANNOUNCE_EVERY_S = 10.0
"""How often a peer renews its announcement while its download lasts."""
ANNOUNCE_FOR_S = 60.0
"""How far ahead each renewal sets the deadline: a peer that dies mid-download is waited for this long at most
after its last renewal. Not shorter: the holders' reads of a renewal can fail for the whole download, as they
query the downloader's DHT node over the link its download fills (a 20-s deadline lapsed mid-download on a
0.5 Mbit/s joiner, and the swarm stepped without it)."""


def catch_up_key(run_id: str) -> str:
    """The DHT key of a run's catch-up announcements: subkey = a peer's progress key, value = an announcement."""
    return f"{run_id}_catching_up"


@dataclass(frozen=True, slots=True)
class Announcement:
    """A peer downloads the swarm's state (`loaded` None), or has loaded the state of epoch `loaded`; either way
    wait for its progress record until `until` (a DHT time) at most."""

    until: float
    loaded: int | None = None

    def to_record(self) -> dict[str, Any]:
        """The DHT value."""
        return {"until": self.until} if self.loaded is None else {"until": self.until, "loaded": self.loaded}


def parse_announcements(entries: Any, now: float) -> dict[Any, Announcement]:
    """The well-formed announcements among a DHT dictionary's `entries` (subkey -> a value with `.value`);
    a deadline counts at most HOLD_MAX_S from `now`."""
    parsed = {}
    for subkey, entry in entries.items() if isinstance(entries, Mapping) else ():
        value = getattr(entry, "value", None)
        if not isinstance(value, Mapping):
            continue
        until, loaded = value.get("until"), value.get("loaded")
        if not isinstance(loaded, int) or isinstance(loaded, bool):
            loaded = None
        if isinstance(until, int | float) and not isinstance(until, bool) and math.isfinite(until):
            parsed[subkey] = Announcement(until=min(float(until), now + HOLD_MAX_S), loaded=loaded)
    return parsed


def progress_epochs(entries: Any) -> dict[Any, int]:
    """Each peer's epoch (subkey -> epoch) in the raw progress records hivemind's tracker read; garbage left out."""
    epochs = {}
    for subkey, entry in entries.items() if isinstance(entries, Mapping) else ():
        value = getattr(entry, "value", None)
        epoch = value.get("epoch") if isinstance(value, Mapping) else None
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            epochs[subkey] = epoch
    return epochs


def still_downloading(
    announcements: Mapping[Any, Announcement], epochs: Mapping[Any, int], epoch: int, now: float, own_key: Any
) -> list[Any]:
    """The announcers a node at `epoch` holds for: not itself, before their deadline, and with a progress record
    (or none yet) before `epoch` while downloading, before the epoch it loaded (at most `epoch`) after."""
    return [
        key
        for key, announcement in announcements.items()
        if key != own_key
        and announcement.until > now
        and epochs.get(key, -1) < (epoch if announcement.loaded is None else min(announcement.loaded, epoch))
    ]


@dataclass(slots=True)
class HoldBudget:
    """Seconds this node may still hold: up to HOLD_MAX_S, refilled at HOLD_SHARE of the time that passes."""

    level_s: float = HOLD_MAX_S
    updated_at: float | None = None

    def available(self, now: float) -> float:
        """Seconds available at `now` (a monotonic clock)."""
        if self.updated_at is not None:
            self.level_s = min(HOLD_MAX_S, self.level_s + HOLD_SHARE * max(now - self.updated_at, 0.0))
        self.updated_at = now
        return self.level_s

    def spend(self, seconds: float, now: float) -> None:
        """`seconds` were held, ending at `now`."""
        self.level_s = max(self.available(now) - max(seconds, 0.0), 0.0)
