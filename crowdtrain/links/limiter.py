"""The probe server's rate limiter: one probe per direction at a time, per-peer byte budgets, refusals."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from crowdtrain import proto


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeLimits:
    """What this node lets its peers probe, and the bounds it keeps to when probing them."""

    max_probe_bytes: int = 16 * 2**20
    """Largest bandwidth probe, in bytes, in either direction."""
    probe_time_limit_s: float = 10.0
    """A bandwidth probe stops after this many seconds and reports what arrived by then."""
    min_interval_s: float = 0.2
    """Seconds a peer must wait after one of its bandwidth probes ends before the next one starts."""
    peer_bytes_per_minute: int = 64 * 2**20
    """Bandwidth-probe bytes one peer may use in any 60 s."""
    total_bytes_per_minute: int = 256 * 2**20
    """Bandwidth-probe bytes all peers together may use in any 60 s."""
    dial_timeout_s: float = 3.0
    """Seconds the server waits for one dial-back TCP connection."""
    dial_interval_s: float = 10.0
    """Seconds a peer must wait between two dial-back probes."""

    def __post_init__(self) -> None:
        for name in ("max_probe_bytes", "probe_time_limit_s", "peer_bytes_per_minute", "total_bytes_per_minute"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.dial_timeout_s > 0 or self.min_interval_s < 0 or self.dial_interval_s < 0:
            raise ValueError("dial_timeout_s must be positive, min_interval_s and dial_interval_s not negative")


class ProbeLimiter:
    """The server's admission rules: one probe at a time, a minimum interval per peer, byte budgets per minute.

    Each admitted probe holds a lease that ends on `release` or, should its handler hang on a peer that
    stopped reading, by itself after the probe's time limit and a grace period.
    """

    WINDOW_S = 60.0
    LEASE_GRACE_S = 5.0

    def __init__(self, limits: ProbeLimits, clock: Callable[[], float] = time.monotonic):
        self.limits, self.clock = limits, clock
        self._lock = threading.Lock()
        self._leases = {"bandwidth": (0, 0.0), "dial": (0, 0.0)}  # kind -> (lease number, expiry)
        self._next_lease = 1
        self._ready_at: dict[tuple[str, str], float] = {}  # (kind, peer) -> earliest next start
        self._spent: deque[tuple[float, str, int]] = deque()  # (time, peer, bytes) of the last WINDOW_S

    def admit_bandwidth(self, peer: str, num_bytes: int) -> tuple[int, proto.ProbeRefusal | None]:
        """A lease number for a bandwidth probe of `num_bytes`, or a refusal saying why and when to retry."""
        if num_bytes <= 0 or num_bytes > self.limits.max_probe_bytes:
            limit = self.limits.max_probe_bytes
            return 0, make_refusal(f"asks for {num_bytes} bytes; probes must be 1 to {limit}", 0.0)
        with self._lock:
            now = self.clock()
            refusal = self._check_turn("bandwidth", peer, now) or self._check_budget(peer, num_bytes, now)
            if refusal is not None:
                return 0, refusal
            self._spent.append((now, peer, num_bytes))
            return self._take_lease("bandwidth", now + self.limits.probe_time_limit_s + self.LEASE_GRACE_S), None

    def admit_dial(self, peer: str) -> tuple[int, proto.ProbeRefusal | None]:
        """A lease number for a dial-back probe, or a refusal."""
        with self._lock:
            now = self.clock()
            refusal = self._check_turn("dial", peer, now)
            if refusal is not None:
                return 0, refusal
            return self._take_lease("dial", now + self.limits.dial_timeout_s + self.LEASE_GRACE_S), None

    def release(self, kind: str, peer: str, lease: int) -> None:
        """End a probe: free its slot and start the peer's interval."""
        interval_s = self.limits.min_interval_s if kind == "bandwidth" else self.limits.dial_interval_s
        with self._lock:
            now = self.clock()
            if self._leases[kind][0] == lease:
                self._leases[kind] = (0, 0.0)
            self._ready_at[(kind, peer)] = now + interval_s

    def _check_turn(self, kind: str, peer: str, now: float) -> proto.ProbeRefusal | None:
        lease, expires_at = self._leases[kind]
        if lease and now < expires_at:
            return make_refusal(f"another {kind} probe is running", min(1.0, expires_at - now))
        ready_at = self._ready_at.get((kind, peer), 0.0)
        if now < ready_at:
            return make_refusal(f"too soon after this peer's last {kind} probe", ready_at - now)
        return None

    def _check_budget(self, peer: str, num_bytes: int, now: float) -> proto.ProbeRefusal | None:
        while self._spent and self._spent[0][0] <= now - self.WINDOW_S:
            self._spent.popleft()
        for budget, mine in ((self.limits.peer_bytes_per_minute, True), (self.limits.total_bytes_per_minute, False)):
            entries = [(at, size) for at, who, size in self._spent if who == peer or not mine]
            excess = sum(size for _, size in entries) + num_bytes - budget
            if excess > 0:
                freed, retry_at = 0, now + self.WINDOW_S  # when enough of the window's bytes expire
                for at, size in entries:
                    freed += size
                    if freed >= excess:
                        retry_at = at + self.WINDOW_S
                        break
                who = "this peer's" if mine else "the node's"
                return make_refusal(f"{who} probe budget of {budget} bytes per minute is spent", retry_at - now)
        return None

    def _take_lease(self, kind: str, expires_at: float) -> int:
        lease, self._next_lease = self._next_lease, self._next_lease + 1
        self._leases[kind] = (lease, expires_at)
        return lease


def make_refusal(reason: str, retry_after_s: float) -> proto.ProbeRefusal:
    """The reply to a refused probe: why, and after how many seconds to retry."""
    return proto.ProbeRefusal(reason=reason, retry_after_s=max(retry_after_s, 0.0))
