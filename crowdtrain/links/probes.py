"""Probe RPCs between peers: upload and download bandwidth, and dial-back reachability.

A node serves three RPCs (`proto/probes.proto`) on hivemind's P2P layer and measures itself with them:

- upload: the requester streams N bytes; the server times their arrival and replies;
- download: the server streams N bytes; the requester times their arrival;
- dial-back: the server opens a plain TCP connection to each announced address of the requester, but
  only to addresses whose IP is the one the requester connects from (as libp2p's AutoNAT), so the
  RPC cannot be used to scan third parties.

The server bounds every probe (bytes, time) and rate-limits them (`ProbeLimiter`), so nobody can use
a node to flood another; refused probes get a `ProbeRefusal` reply saying why and when to retry.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import threading
import time
import typing
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from crowdtrain import proto
from crowdtrain.dht.service import P2PService

logger = logging.getLogger(__name__)

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

_FILLER = os.urandom(CHUNK_BYTES)  # random, so no compressing transport could inflate the numbers


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
            return 0, _refusal(f"asks for {num_bytes} bytes; probes must be 1 to {self.limits.max_probe_bytes}", 0.0)
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
            return _refusal(f"another {kind} probe is running", min(1.0, expires_at - now))
        ready_at = self._ready_at.get((kind, peer), 0.0)
        if now < ready_at:
            return _refusal(f"too soon after this peer's last {kind} probe", ready_at - now)
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
                return _refusal(f"{who} probe budget of {budget} bytes per minute is spent", retry_at - now)
        return None

    def _take_lease(self, kind: str, expires_at: float) -> int:
        lease, self._next_lease = self._next_lease, self._next_lease + 1
        self._leases[kind] = (lease, expires_at)
        return lease


def _refusal(reason: str, retry_after_s: float) -> proto.ProbeRefusal:
    return proto.ProbeRefusal(reason=reason, retry_after_s=max(retry_after_s, 0.0))


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
        """Megabits per second, or None when too little arrived to time anything."""
        if self.measured_bytes <= 0 or self.duration_s <= 0:
            return None
        return self.measured_bytes * 8 / self.duration_s / 1e6


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


class ProbeService(P2PService):
    """Serves the probe RPCs on the DHT's p2p daemon and measures this node against its peers.

    `start()` runs an event loop in a daemon thread; `measure()` blocks the calling thread; `close()` stops.
    """

    def __init__(self, dht: hivemind.DHT, limits: ProbeLimits | None = None):
        super().__init__(dht, NAMESPACE, thread_name="probes")
        self.limits = limits or ProbeLimits()
        self.limiter = ProbeLimiter(self.limits)

    # ---- the server side -------------------------------------------------------------------------
    # Streams are annotated with typing.AsyncIterator: hivemind's ServicerBase recognises a streaming
    # RPC by the `_name` of typing's alias, which collections.abc's generic alias lacks.

    async def rpc_upload_probe(
        self, requests: typing.AsyncIterator[proto.UploadChunk], context: P2PContext
    ) -> typing.AsyncIterator[proto.UploadResult]:
        """Time the arrival of a requester's stream of chunks (an upload for the requester)."""
        peer = context.remote_id.to_base58()
        try:
            header = await asyncio.wait_for(anext(requests), self.limits.probe_time_limit_s)
        except (StopAsyncIteration, TimeoutError):
            return
        lease, refusal = self.limiter.admit_bandwidth(peer, header.total_bytes)
        if refusal is not None:
            yield proto.UploadResult(refusal=refusal)
            await self._drain(requests)
            return
        try:
            result = await self._receive(requests, header.total_bytes)
        finally:
            self.limiter.release("bandwidth", peer, lease)
        yield result
        await self._drain(requests)

    async def _receive(self, requests: AsyncIterator[proto.UploadChunk], total_bytes: int) -> proto.UploadResult:
        received = measured = 0
        first_at = last_at = 0.0
        try:
            async with asyncio.timeout(self.limits.probe_time_limit_s):
                async for chunk in requests:
                    if received >= total_bytes:
                        continue  # bytes beyond the announced size are not timed (the time limit bounds them)
                    now = time.perf_counter()
                    if received == 0:
                        first_at = now
                    else:
                        measured += len(chunk.payload)
                    received += len(chunk.payload)
                    last_at = now
        except TimeoutError:
            pass
        return proto.UploadResult(
            received_bytes=received,
            measured_bytes=measured,
            duration_s=last_at - first_at,
            truncated=received < total_bytes,
        )

    async def _drain(self, requests: AsyncIterator[proto.UploadChunk]) -> None:
        """Read what the requester still sends, briefly: closing a stream with unread data resets it,
        and the reset can overtake our reply on the requester's side."""
        try:
            async with asyncio.timeout(DRAIN_GRACE_S):
                async for _ in requests:
                    pass
        except TimeoutError:
            pass

    async def rpc_download_probe(
        self, request: proto.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[proto.DownloadChunk]:
        """Stream the requested number of bytes to the requester, which times their arrival."""
        peer = context.remote_id.to_base58()
        lease, refusal = self.limiter.admit_bandwidth(peer, request.num_bytes)
        if refusal is not None:
            yield proto.DownloadChunk(refusal=refusal)
            return
        try:
            stop_at = time.monotonic() + self.limits.probe_time_limit_s
            sent = 0
            while sent < request.num_bytes and time.monotonic() < stop_at:
                size = min(CHUNK_BYTES, request.num_bytes - sent)
                yield proto.DownloadChunk(payload=_FILLER[:size])
                sent += size
        finally:
            self.limiter.release("bandwidth", peer, lease)

    async def rpc_dial_back(self, request: proto.DialBackRequest, context: P2PContext) -> proto.DialBackResult:
        """Try a TCP connection to each of the requester's addresses that has the IP it connects from."""
        peer = context.remote_id.to_base58()
        lease, refusal = self.limiter.admit_dial(peer)
        if refusal is not None:
            return proto.DialBackResult(refusal=refusal)
        try:
            observed = await self._observed_ips(context.remote_id)
            attempts = await self._dial_all(list(request.multiaddrs[:MAX_REPORTED_ADDRESSES]), observed)
            return proto.DialBackResult(attempts=attempts, observed_ip=", ".join(sorted(map(str, observed))))
        finally:
            self.limiter.release("dial", peer, lease)

    async def _observed_ips(self, peer: PeerID) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        """The IPs of our direct connections to `peer`, as the p2p daemon reports them (relayed ones excluded)."""
        peers = await asyncio.wait_for(self.require_p2p().list_peers(), CONNECT_TIMEOUT_S)
        observed = set()
        for info in peers:
            if info.peer_id == peer:
                for address in info.addrs:
                    ip = _direct_ip(address)
                    if ip is not None:
                        observed.add(ip)
        return observed

    async def _dial_all(self, addresses: list[str], observed: set[Any]) -> list[proto.DialAttempt]:
        """Dial the first MAX_DIALED_ADDRESSES eligible addresses concurrently; report on every address."""
        attempts: list[proto.DialAttempt | None] = []
        dials: dict[int, Awaitable[proto.DialAttempt]] = {}  # index in `attempts` -> its dial
        for address in addresses:
            attempt, endpoint = _classify(address, observed)
            if endpoint is not None and len(dials) < MAX_DIALED_ADDRESSES:
                dials[len(attempts)] = self._connect_tcp(address, *endpoint)
            elif endpoint is not None:
                attempt = proto.DialAttempt(multiaddr=address, verdict=proto.DialAttempt.NOT_TRIED)
            attempts.append(attempt)
        for index, dialed in zip(dials, await asyncio.gather(*dials.values()), strict=True):
            attempts[index] = dialed
        return [attempt for attempt in attempts if attempt is not None]

    async def _connect_tcp(self, address: str, host: str, port: int) -> proto.DialAttempt:
        verdicts = proto.DialAttempt
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.limits.dial_timeout_s)
        except TimeoutError:
            return verdicts(multiaddr=address, verdict=verdicts.TIMEOUT, detail=f"{self.limits.dial_timeout_s:g} s")
        except ConnectionRefusedError as e:
            return verdicts(multiaddr=address, verdict=verdicts.REFUSED, detail=e.strerror or "refused")
        except OSError as e:
            return verdicts(multiaddr=address, verdict=verdicts.UNREACHABLE, detail=e.strerror or str(e))
        writer.close()
        return verdicts(multiaddr=address, verdict=verdicts.DIALED, detail="")

    # ---- the requester side ----------------------------------------------------------------------

    def measure(
        self,
        peer_ids: Sequence[str],
        peer_multiaddrs: Mapping[str, Sequence[str]],
        own_multiaddrs: Sequence[str],
        timeout_s: float,
    ) -> ProbeReport:
        """Measure this node against up to 3 of `peer_ids` (in that order) within about `timeout_s` seconds.

        `peer_multiaddrs` gives each peer's addresses (from its status record) so the p2p daemon can
        connect to peers it has not met; `own_multiaddrs` are the addresses peers are asked to dial back.
        Bandwidth is the best over each peer alone and all answering peers at once; reachability is true if any
        peer could dial us.
        Failed or refused probes land in `failures`, never in an exception; every call inside is bounded
        by the deadline, so only a stuck event loop makes this raise TimeoutError. Call from any thread
        but the service's own.
        """
        deadline = time.monotonic() + timeout_s
        coroutine = self._measure(list(peer_ids), peer_multiaddrs, list(own_multiaddrs), deadline)
        return self.run(coroutine, timeout_s + CALL_MARGIN_S)

    def probe_upload(self, peer_id: str, num_bytes: int) -> BandwidthSample | proto.ProbeRefusal:
        """One upload probe of `num_bytes` to a connected peer: the sample, or the server's refusal."""
        deadline = time.monotonic() + self._call_timeout_s()
        return self.run(self._upload(PeerID.from_base58(peer_id), num_bytes, deadline), self._call_timeout_s() + 1)

    def probe_download(self, peer_id: str, num_bytes: int) -> BandwidthSample | proto.ProbeRefusal:
        """One download probe of `num_bytes` from a connected peer: the sample, or the server's refusal."""
        deadline = time.monotonic() + self._call_timeout_s()
        return self.run(self._download(PeerID.from_base58(peer_id), num_bytes, deadline), self._call_timeout_s() + 1)

    def probe_dial_back(self, peer_id: str, multiaddrs: Sequence[str]) -> proto.DialBackResult:
        """Ask a connected peer to dial `multiaddrs`; its reply (with a refusal if it refused)."""
        peer = PeerID.from_base58(peer_id)
        timeout_s = self.limits.dial_timeout_s + CALL_MARGIN_S
        return self.run(self._dial_back(peer, list(multiaddrs), timeout_s), timeout_s + 1)

    def _call_timeout_s(self) -> float:
        return self.limits.probe_time_limit_s + CALL_MARGIN_S

    async def _measure(
        self, peer_ids: list[str], addresses: Mapping[str, Sequence[str]], own: list[str], deadline: float
    ) -> ProbeReport:
        me = self.peer_id
        chosen = [peer for peer in dict.fromkeys(peer_ids) if peer != me][:MAX_PROBED_PEERS]
        failures: list[str] = []
        connected = await asyncio.gather(*(self._connect(peer, addresses.get(peer, ()), deadline) for peer in chosen))
        peers = [peer for peer, error in zip(chosen, connected, strict=True) if error is None]
        failures += [f"peer {_short(p)}: {e}" for p, e in zip(chosen, connected, strict=True) if e is not None]
        observed: set[str] = set()
        dial_results = await asyncio.gather(
            *(self._ask_dial_back(peer, own, deadline, failures, observed) for peer in peers)
        )
        verdicts = [verdict for result in dial_results for verdict in result]
        rates: dict[str, dict[str, float]] = {"upload": {}, "download": {}}  # direction -> peer -> Mbit/s
        answered = {verdict.peer_id for verdict in verdicts}
        for peer in peers:  # one peer at a time first: each probe has this node's link to itself
            for direction, per_peer in rates.items():
                rate = await self._adaptive(PeerID.from_base58(peer), direction, deadline, failures)
                if rate is not None:
                    per_peer[peer] = rate
                    answered.add(peer)
        best: dict[str, float | None] = {
            direction: max(per_peer.values(), default=None) for direction, per_peer in rates.items()
        }
        for direction, per_peer in rates.items():
            # A link faster than every peer's is seen only when they are probed at once (a volunteer's fast
            # machine among slow ones: the aggregator the plan must find).
            together = await self._together(direction, per_peer, deadline, failures) if len(per_peer) > 1 else None
            if together is not None and together > (best[direction] or 0.0):
                best[direction] = together
        return ProbeReport(
            upload_mbps=best["upload"],
            download_mbps=best["download"],
            reachable=_reachability(dial_results),
            verdicts=tuple(verdicts),
            observed_ips=tuple(sorted(observed)),
            answered_peers=tuple(peer for peer in peers if peer in answered),
            failures=tuple(failures),
        )

    async def _connect(self, peer: str, addresses: Sequence[str], deadline: float) -> str | None:
        """Have the p2p daemon connect to `peer` at its addresses; None on success, else why not."""
        try:
            peer_id = PeerID.from_base58(peer)
            maddrs = [Multiaddr(_without_peer_suffix(address, peer)) for address in addresses]
        except Exception:
            return "its status holds a malformed peer id or address"
        timeout_s = min(CONNECT_TIMEOUT_S, _remaining(deadline))
        try:
            # hivemind's P2P has no public connect(); its daemon client does (p2pd's CONNECT request).
            await asyncio.wait_for(self.require_p2p()._client.connect(peer_id, maddrs), timeout_s)
        except TimeoutError:
            return f"no connection within {timeout_s:.0f} s"
        except Exception as e:
            return f"cannot connect ({_one_line(e)})"
        return None

    async def _ask_dial_back(
        self, peer: str, own: list[str], deadline: float, failures: list[str], observed: set[str]
    ) -> list[AddressVerdict]:
        timeout_s = min(self.limits.dial_timeout_s + CALL_MARGIN_S, _remaining(deadline))
        try:
            result = await self._with_retries(
                lambda: self._dial_back(PeerID.from_base58(peer), own, timeout_s), deadline
            )
        except Exception as e:
            failures.append(f"peer {_short(peer)} did not answer the dial-back probe ({_one_line(e)})")
            return []
        if isinstance(result, proto.ProbeRefusal):
            failures.append(f"peer {_short(peer)} refused the dial-back probe: {result.reason}")
            return []
        observed.update(ip.strip() for ip in result.observed_ip.split(",")[:MAX_DIALED_ADDRESSES] if ip.strip())
        names = proto.DialAttempt.Verdict
        return [
            AddressVerdict(
                peer_id=peer, multiaddr=item.multiaddr, verdict=names.Name(item.verdict).lower(), detail=item.detail
            )
            for item in result.attempts
        ]

    async def _dial_back(
        self, peer: PeerID, own: list[str], timeout_s: float
    ) -> proto.DialBackResult | proto.ProbeRefusal:
        stub: Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        result = await stub.rpc_dial_back(proto.DialBackRequest(multiaddrs=own), timeout=timeout_s)
        return result.refusal if result.HasField("refusal") else result

    async def _adaptive(self, peer: PeerID, direction: str, deadline: float, failures: list[str]) -> float | None:
        """Probe with growing sizes until a probe takes TARGET_PROBE_S or hits the cap; the last rate."""
        probe = self._upload if direction == "upload" else self._download
        size, rate = INITIAL_PROBE_BYTES, None
        for _ in range(MAX_PROBES_PER_DIRECTION):
            if _remaining(deadline) <= 0:
                break
            try:
                outcome = await self._with_retries(lambda size=size: probe(peer, size, deadline), deadline)  # type: ignore[misc]
            except Exception as e:
                failures.append(f"{direction} probe with peer {_short(peer.to_base58())} failed ({_one_line(e)})")
                break
            if isinstance(outcome, proto.ProbeRefusal):
                failures.append(f"peer {_short(peer.to_base58())} refused the {direction} probe: {outcome.reason}")
                break
            rate = outcome.mbps if outcome.mbps is not None else rate
            if outcome.duration_s >= TARGET_PROBE_S or outcome.truncated or size >= self.limits.max_probe_bytes:
                break
            growth = 8.0 if outcome.duration_s <= 0 else min(8.0, max(2.0, 1.5 * TARGET_PROBE_S / outcome.duration_s))
            size = min(self.limits.max_probe_bytes, int(size * growth))
        return rate

    async def _together(
        self, direction: str, rates: Mapping[str, float], deadline: float, failures: list[str]
    ) -> float | None:
        """Probe every peer in `rates` at once for JOINT_PROBE_S: the Mbit/s of all flows together.

        Every flow is cut at the same moment (a download stops reading, an upload stops sending), so they
        overlap for the whole window: sized flows would end at different times, and the tail where one flow
        runs alone would count as the joint rate. A refused flow is not retried alone (it would not overlap
        the others): the whole joint probe is, after the longest wait the servers asked for, while some
        server refused and the deadline allows; the best joint rate counts.
        """
        cap = self.limits.max_probe_bytes // 2  # within a peer's byte budget after its own adaptive probes
        sizes = {
            peer: int(min(max(rate * 1e6 / 8 * 2 * JOINT_PROBE_S, INITIAL_PROBE_BYTES), cap))
            for peer, rate in rates.items()
        }
        best: float | None = None
        wait_s = self.limits.min_interval_s  # the servers' interval after this node's last probe
        refusals: dict[str, proto.ProbeRefusal] = {}
        for attempt in range(MAX_REFUSALS_PER_PROBE):
            if _remaining(deadline) < wait_s + JOINT_PROBE_S + CALL_MARGIN_S:
                if attempt == 0:  # said in the daemon's log, so the researcher sees why a link reads slow
                    failures.append(f"no time left for the joint {direction} probe")
                break
            await asyncio.sleep(wait_s)
            rate, refusals, errors = await self._joint_flows(direction, sizes, deadline)
            failures += errors
            best = rate if best is None or (rate is not None and rate > best) else best
            wait_s = max((refusal.retry_after_s for refusal in refusals.values()), default=0.0)
            if wait_s <= 0:
                break  # every flow ran, or failed or was refused for good
        if best is None:
            failures += [
                f"peer {_short(p)} refused the joint {direction} probe: {r.reason}" for p, r in refusals.items()
            ]
        return best

    async def _joint_flows(
        self, direction: str, sizes: Mapping[str, int], deadline: float
    ) -> tuple[float | None, dict[str, proto.ProbeRefusal], list[str]]:
        """One joint probe: its rate (None unless 2 flows ran), the refusals by peer, and other failures."""
        stop_at = time.monotonic() + JOINT_PROBE_S
        probes = (
            self._upload(PeerID.from_base58(peer), size, deadline, stop_sending_at=stop_at)
            if direction == "upload"
            else self._download(PeerID.from_base58(peer), size, min(deadline, stop_at))
            for peer, size in sizes.items()
        )
        outcomes = await asyncio.gather(*probes, return_exceptions=True)
        samples: list[BandwidthSample] = []
        refusals: dict[str, proto.ProbeRefusal] = {}
        errors: list[str] = []
        for peer, outcome in zip(sizes, outcomes, strict=True):
            if isinstance(outcome, BandwidthSample):
                samples.append(outcome)
            elif isinstance(outcome, proto.ProbeRefusal):
                refusals[peer] = outcome
            else:
                errors.append(f"joint {direction} probe with peer {_short(peer)} failed ({_one_line(outcome)})")
        duration_s = max((sample.duration_s for sample in samples), default=0.0)
        if len(samples) < 2 or duration_s <= 0:
            return None, refusals, errors
        return sum(sample.measured_bytes for sample in samples) * 8 / duration_s / 1e6, refusals, errors

    async def _with_retries(
        self, call: Callable[[], Awaitable[T | proto.ProbeRefusal]], deadline: float
    ) -> T | proto.ProbeRefusal:
        """Call; when refused with a retry time that fits before `deadline`, wait it out and call again."""
        for _ in range(MAX_REFUSALS_PER_PROBE):
            outcome = await call()
            if not isinstance(outcome, proto.ProbeRefusal):
                return outcome
            wait_s = outcome.retry_after_s
            if wait_s <= 0 or time.monotonic() + wait_s + 1.0 > deadline:
                return outcome
            await asyncio.sleep(wait_s)  # the server said when it will accept
        return outcome

    async def _upload(
        self, peer: PeerID, num_bytes: int, deadline: float, stop_sending_at: float = float("inf")
    ) -> BandwidthSample | proto.ProbeRefusal:
        async def chunks() -> AsyncIterator[proto.UploadChunk]:
            yield proto.UploadChunk(total_bytes=num_bytes)
            for offset in range(0, num_bytes, CHUNK_BYTES):
                if time.monotonic() >= stop_sending_at:
                    return  # the server times what arrived and replies once the stream ends
                yield proto.UploadChunk(payload=_FILLER[: min(CHUNK_BYTES, num_bytes - offset)])

        stub: Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        async with asyncio.timeout(min(self._call_timeout_s(), _remaining(deadline))):
            responses = await stub.rpc_upload_probe(chunks())
            try:
                result = await anext(responses)
            finally:
                await responses.aclose()  # the server may stop reading early; don't wait for our writer
        if result.HasField("refusal"):
            return result.refusal
        return BandwidthSample(
            measured_bytes=result.measured_bytes, duration_s=result.duration_s, truncated=result.truncated
        )

    async def _download(self, peer: PeerID, num_bytes: int, deadline: float) -> BandwidthSample | proto.ProbeRefusal:
        stub: Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        received = measured = 0
        first_at = last_at = 0.0
        truncated = False
        try:
            async with asyncio.timeout(min(self._call_timeout_s(), _remaining(deadline))):
                responses = await stub.rpc_download_probe(proto.DownloadRequest(num_bytes=num_bytes))
                try:
                    async for chunk in responses:
                        if chunk.HasField("refusal"):
                            return chunk.refusal
                        now = time.perf_counter()
                        if received == 0:
                            first_at = now
                        else:
                            measured += len(chunk.payload)
                        received += len(chunk.payload)
                        last_at = now
                finally:
                    await responses.aclose()
        except TimeoutError:
            truncated = True  # report what arrived by then
        truncated = truncated or received < num_bytes
        return BandwidthSample(measured_bytes=measured, duration_s=last_at - first_at, truncated=truncated)


def _classify(address: str, observed: set[Any]) -> tuple[proto.DialAttempt | None, tuple[str, int] | None]:
    """A verdict for an address the server won't dial, or the (host, port) to dial."""
    verdicts = proto.DialAttempt
    try:
        parsed = Multiaddr(address)
        ip = _direct_ip(parsed)
        port = int(parsed["tcp"]) if "tcp" in parsed else None
    except Exception:
        return verdicts(multiaddr=address, verdict=verdicts.UNSUPPORTED, detail="not a multiaddr"), None
    if ip is None or port is None:
        return verdicts(
            multiaddr=address, verdict=verdicts.UNSUPPORTED, detail="not a direct ip4/ip6 TCP address"
        ), None
    if ip not in observed:
        seen = ", ".join(sorted(map(str, observed))) or "no direct connection"
        return verdicts(multiaddr=address, verdict=verdicts.IP_MISMATCH, detail=f"connected from {seen}"), None
    return None, (str(ip), port)


def _direct_ip(address: Multiaddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a direct /ip4 or /ip6 address (IPv4-mapped IPv6 as IPv4); None for relayed or DNS ones."""
    if "p2p-circuit" in address:
        return None
    for protocol in ("ip4", "ip6"):
        if protocol in address:
            ip = ipaddress.ip_address(address[protocol])
            mapped = getattr(ip, "ipv4_mapped", None)
            return mapped or ip
    return None


def _reachability(dial_results: Sequence[list[AddressVerdict]]) -> bool | None:
    verdicts = [verdict for result in dial_results for verdict in result]
    if not any(dial_results):
        return None
    return any(verdict.verdict == "dialed" for verdict in verdicts)


def _without_peer_suffix(address: str, peer: str) -> str:
    suffix = f"/p2p/{peer}"
    return address[: -len(suffix)] if address.endswith(suffix) else address


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)


def _short(peer: str) -> str:
    return "…" + peer[-8:]


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
