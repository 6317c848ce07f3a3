"""The probe protocol's numbers and results: chunk sizes, limits, timeouts, and what a probe measured."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from crowdtrain import proto

T = TypeVar("T")

NAMESPACE = "crowdtrain.probes.v1"
"""Prefix of the probe handlers' protocol names; a new, incompatible protocol gets a new one."""
CHUNK_BYTES = 256 * 1024
"""Payload bytes per streamed message."""
MAX_DIALED_ADDRESSES = 4
"""The server dials at most this many of a requester's addresses."""
MAX_REPORTED_ADDRESSES = 16
"""Addresses of a dial-back request beyond this many are ignored, not even listed in the reply."""
MAX_PROBED_PEERS = 3
"""`measure` asks at most this many peers."""
INITIAL_PROBE_BYTES = 2 * CHUNK_BYTES
"""First bandwidth probe size: two chunks, so the arrival of the second one is timed."""
TARGET_PROBE_S = 1.0
"""Probes grow until one takes at least this long (or reaches the size cap)."""
MAX_PROBES_PER_DIRECTION = 8
MAX_REFUSALS_PER_PROBE = 10
"""A refused probe is retried after the server's retry_after_s at most this many times (within the round's
deadline): joiners starting together queue for a server's one probe slot, joint probes included."""
CONNECT_TIMEOUT_S = 5.0
CALL_MARGIN_S = 5.0
"""A probe call may take this much longer than the server's time limit (setup, the reply's way back)."""
JOINT_PROBE_S = 1.5
"""Length of the probe to all peers at once."""
DRAIN_GRACE_S = 2.0
"""After replying to an upload probe, the server reads what is still in flight for at most this long."""

MAX_PLAUSIBLE_MBPS = 400_000.0
"""No link a volunteer has is faster (400 Gbit/s): a measured rate above it is not a measurement."""
FILLER = os.urandom(CHUNK_BYTES)  # random, so no compressing transport could inflate the numbers


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthSample:
    """One timed bandwidth probe."""

    measured_bytes: int
    """Payload bytes timed (those after the first chunk)."""
    duration_s: float
    """Seconds from the first chunk's arrival to the last one's."""
    truncated: bool
    """True when the time limit cut the probe short."""

    @property
    def mbps(self) -> float | None:
        """Megabits per second, or None when too little arrived to time anything or the figures are not physical
        (an upload's figures come from the peer that received it: a NaN or zero duration crashed the prober, and a
        tiny one made any node the plan's aggregator)."""
        if self.measured_bytes <= 0 or not (math.isfinite(self.duration_s) and self.duration_s > 0):
            return None
        rate = self.measured_bytes * 8 / self.duration_s / 1e6
        return rate if rate <= MAX_PLAUSIBLE_MBPS else None


class ArrivalTimer:
    """Times a probe's chunks as they arrive: the clock starts at the first chunk, whose bytes are not timed."""

    def __init__(self) -> None:
        self.received = self.measured = 0
        self.first_at = self.last_at = 0.0

    def arrived(self, num_bytes: int) -> None:
        """One chunk of `num_bytes` arrived now."""
        now = time.perf_counter()
        if self.received == 0:
            self.first_at = now
        else:
            self.measured += num_bytes
        self.received += num_bytes
        self.last_at = now

    @property
    def duration_s(self) -> float:
        """Seconds from the first chunk's arrival to the last one's."""
        return self.last_at - self.first_at


@dataclass(frozen=True, kw_only=True, slots=True)
class AddressVerdict:
    """What one peer found when asked to dial one of this node's addresses."""

    peer_id: str
    """The peer that tried."""
    multiaddr: str
    """The address it was asked to dial."""
    verdict: str
    """dialed, refused, timeout, ip_mismatch, unsupported, unreachable or not_tried."""
    detail: str
    """The error, or the IP the peer saw this node connect from (for ip_mismatch)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeReport:
    """What `ProbeService.measure` found out about this node's links."""

    upload_mbps: float | None
    """Best upload bandwidth, Mbit/s, to any one peer or to all answering peers at once; None if none measured."""
    download_mbps: float | None
    """Best download bandwidth, Mbit/s, from any one peer or from all answering peers at once; None if none measured."""
    reachable: bool | None
    """True if a peer could dial one of our addresses, False if peers tried and none could, None if none tried."""
    verdicts: tuple[AddressVerdict, ...]
    """Every dial-back attempt, per peer and address."""
    observed_ips: tuple[str, ...]
    """The IPs peers saw this node connect from (its public IP, behind a NAT)."""
    answered_peers: tuple[str, ...]
    """Peers that answered at least one probe."""
    failures: tuple[str, ...]
    """One sentence per peer or probe that failed or was refused."""


def without_peer_suffix(address: str, peer: str) -> str:
    """`address` without a trailing `/p2p/<peer>`."""
    suffix = f"/p2p/{peer}"
    return address[: -len(suffix)] if address.endswith(suffix) else address


def remaining_s(deadline: float) -> float:
    """Seconds left until the monotonic `deadline`, never negative."""
    return max(deadline - time.monotonic(), 0.0)


def short_peer(peer: str) -> str:
    """A peer id shortened for log lines."""
    return "…" + peer[-8:]


def one_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def upload_sample(result: proto.UploadResult, sent_bytes: int) -> BandwidthSample:
    """What a peer's answer to an upload probe of `sent_bytes` says: never more bytes than were sent
    (`BandwidthSample.mbps` refuses durations and rates that are not physical)."""
    return BandwidthSample(
        measured_bytes=min(result.measured_bytes, sent_bytes), duration_s=result.duration_s, truncated=result.truncated
    )


def retry_after_s(refusal: proto.ProbeRefusal) -> float:
    """Seconds a refusing server asked this node to wait before asking again; 0 (not again) unless the wait is
    finite and positive: a NaN wait slept forever, and `measure` ran into its own timeout."""
    wait_s = refusal.retry_after_s
    return wait_s if math.isfinite(wait_s) and wait_s > 0 else 0.0


def dial_back_verdicts(peer: str, result: proto.DialBackResult, asked: Sequence[str]) -> list[AddressVerdict]:
    """The verdicts of `peer`'s answer to a dial-back request for the addresses `asked`; ValueError for more
    attempts than the server answers or a verdict this node does not know (that crashed `measure`)."""
    if len(result.attempts) > min(len(asked), MAX_REPORTED_ADDRESSES):
        raise ValueError(f"{len(result.attempts)} dial-back attempts answered for {len(asked)} addresses asked")
    names = proto.DialAttempt.Verdict
    unknown = [item.verdict for item in result.attempts if item.verdict not in names.values()]
    if unknown:
        raise ValueError(f"a dial-back attempt with the unknown verdict {unknown[0]}")
    return [
        AddressVerdict(
            peer_id=peer, multiaddr=item.multiaddr, verdict=names.Name(item.verdict).lower(), detail=item.detail
        )
        for item in result.attempts
    ]
