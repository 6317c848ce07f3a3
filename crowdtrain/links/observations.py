"""What this node saw of other peers' links: the rates at which their probe streams reached it.

A probe stream is timed by its receiver alone (links/probes.py): this node times the chunks a peer streams to it,
when it asks that peer for a download probe and when it serves that peer's upload probe. Either way the bytes left
the peer through its upload, so the rate is a lower bound of the peer's upload that the peer cannot inflate (it
can only send slower). Nobody can time another peer's download: that peer's own figure is all there is. The node
publishes the fastest rate per peer (`PeerStatus.observed_uploads`); the plan caps each peer's self-reported
upload by what others saw (planning/planner.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from crowdtrain.dht.records import MAX_OBSERVED_UPLOADS
from crowdtrain.links.protocol import CHUNK_BYTES, BandwidthSample

MIN_OBSERVED_BYTES = 4 * CHUNK_BYTES
MIN_OBSERVED_S = 0.5
"""A timed stream counts as an observation only if it timed at least MIN_OBSERVED_BYTES or lasted at least
MIN_OBSERVED_S: chunks that wait while this node's event loop is busy are read back to back, and in a short
stream that burst would read as a link far faster than the sender's (a slow link still makes long streams,
a fast one big ones)."""
OBSERVATION_MAX_AGE_S = 1800.0
"""Rates timed longer ago than this are forgotten (three default probe rounds): a link changes, with a
volunteer's other traffic or a move, and a peer's own figure is re-measured every round."""
MAX_SAMPLES_PER_PEER = 64
"""Rates kept per peer (a probe round times up to 8 growing probes and a few joint ones per peer)."""
MAX_TRACKED_PEERS = 256
"""Peers whose rates are kept; the one observed least recently is forgotten first."""


class UploadObservations:
    """The rates at which peers' probe streams reached this node, by peer; thread-safe.

    The probe service records from its event loop's thread; the heartbeat reads from its own.
    """

    def __init__(self, *, max_age_s: float = OBSERVATION_MAX_AGE_S, clock: Callable[[], float] = time.monotonic):
        """`max_age_s`: how long a rate counts, in seconds; `clock`: monotonic seconds (a parameter for tests)."""
        self.max_age_s, self.clock = max_age_s, clock
        self._samples: dict[str, deque[tuple[float, float]]] = {}  # peer -> (when, Mbit/s), least recent peer first
        self._lock = threading.Lock()

    def record(self, peer_id: str, sample: BandwidthSample) -> None:
        """A stream from `peer_id` reached this node as `sample` says; too short or not physical: no observation."""
        mbps = sample.mbps  # None when nothing could be timed or the rate is not physical
        if mbps is None or (sample.measured_bytes < MIN_OBSERVED_BYTES and sample.duration_s < MIN_OBSERVED_S):
            return
        with self._lock:
            samples = self._samples.pop(peer_id, None) or deque(maxlen=MAX_SAMPLES_PER_PEER)
            samples.append((self.clock(), mbps))
            self._samples[peer_id] = samples  # re-inserted last: the most recently observed
            while len(self._samples) > MAX_TRACKED_PEERS:
                del self._samples[next(iter(self._samples))]

    def fastest(self) -> dict[str, float]:
        """The fastest rate within `max_age_s` of each of the MAX_OBSERVED_UPLOADS peers observed most recently,
        in Mbit/s, in peer-ID order."""
        now = self.clock()
        fastest: dict[str, float] = {}
        with self._lock:
            peers = list(self._samples)
            for index in range(len(peers) - 1, -1, -1):
                rates = [mbps for at, mbps in self._samples[peers[index]] if now - at <= self.max_age_s]
                if not rates:  # every peer observed before this one is as stale: forget them all
                    for stale in peers[: index + 1]:
                        del self._samples[stale]
                    break
                fastest[peers[index]] = max(rates)
                if len(fastest) == MAX_OBSERVED_UPLOADS:
                    break
        return dict(sorted(fastest.items()))
