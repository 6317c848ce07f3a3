"""Probe RPCs between peers: upload and download bandwidth, and dial-back reachability.

A node serves three RPCs (`proto/crowdtrain.proto`) on hivemind's P2P layer and measures itself with them:

- upload: the requester streams N bytes; the server times their arrival and replies;
- download: the server streams N bytes; the requester times their arrival;
- dial-back: the server opens a plain TCP connection to each announced address of the requester, but
  only to addresses whose IP is the one the requester connects from (as libp2p's AutoNAT), so the
  RPC cannot be used to scan third parties.

The server bounds every probe (bytes, time) and rate-limits them (`ProbeLimiter`), so nobody can use
a node to flood another; refused probes get a `ProbeRefusal` reply saying why and when to retry.

Whoever receives a stream times it, so each side learns something the other cannot fake: the rate of every
stream this node receives (a download it asked for, an upload it serves) is a lower bound of the sender's upload,
kept in `observations` and published for the plan (links/observations.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import hivemind
from hivemind.p2p import P2PContext, PeerID
from hivemind.utils.multiaddr import Multiaddr

from crowdtrain import proto
from crowdtrain.links.limiter import ProbeLimiter, ProbeLimits
from crowdtrain.links.observations import UploadObservations
from crowdtrain.links.protocol import (
    CALL_MARGIN_S,
    CHUNK_BYTES,
    CONNECT_TIMEOUT_S,
    DRAIN_GRACE_S,
    FILLER,
    INITIAL_PROBE_BYTES,
    JOINT_PROBE_S,
    MAX_DIALED_ADDRESSES,
    MAX_PROBED_PEERS,
    MAX_PROBES_PER_DIRECTION,
    MAX_REFUSALS_PER_PROBE,
    MAX_REPORTED_ADDRESSES,
    NAMESPACE,
    TARGET_PROBE_S,
    AddressVerdict,
    ArrivalTimer,
    BandwidthSample,
    ProbeReport,
    T,
    dial_back_verdicts,
    one_line,
    remaining_s,
    retry_after_s,
    short_peer,
    upload_sample,
    without_peer_suffix,
)
from crowdtrain.links.reachability import classify_address, direct_ip, reachability
from crowdtrain.rpc.service import P2PService

logger = logging.getLogger(__name__)

__all__ = ["BandwidthSample", "MAX_PROBED_PEERS", "ProbeLimiter", "ProbeLimits", "ProbeReport", "ProbeService"]


class ProbeService(P2PService):
    """Serves the probe RPCs on the DHT's p2p daemon and measures this node against its peers.

    `start()` runs an event loop in a daemon thread; `measure()` blocks the calling thread; `close()` stops.
    """

    def __init__(self, dht: hivemind.DHT, limits: ProbeLimits | None = None):
        super().__init__(dht, NAMESPACE, thread_name="probes")
        self.limits = limits or ProbeLimits()
        self.limiter = ProbeLimiter(self.limits)
        self.observations = UploadObservations()
        """The rates at which peers' streams reached this node, timed here: lower bounds of their uploads."""

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
        timed = BandwidthSample(measured_bytes=result.measured_bytes, duration_s=result.duration_s, truncated=False)
        self.observations.record(peer, timed)  # the requester's upload, as this node's clock saw it
        yield result
        await self._drain(requests)

    async def _receive(self, requests: AsyncIterator[proto.UploadChunk], total_bytes: int) -> proto.UploadResult:
        timer = ArrivalTimer()
        try:
            async with asyncio.timeout(self.limits.probe_time_limit_s):
                async for chunk in requests:
                    if timer.received >= total_bytes:
                        continue  # bytes beyond the announced size are not timed (the time limit bounds them)
                    timer.arrived(len(chunk.payload))
        except TimeoutError:
            pass
        return proto.UploadResult(
            received_bytes=timer.received,
            measured_bytes=timer.measured,
            duration_s=timer.duration_s,
            truncated=timer.received < total_bytes,
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
                yield proto.DownloadChunk(payload=FILLER[:size])
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
                    ip = direct_ip(address)
                    if ip is not None:
                        observed.add(ip)
        return observed

    async def _dial_all(self, addresses: list[str], observed: set[Any]) -> list[proto.DialAttempt]:
        """Dial the first MAX_DIALED_ADDRESSES eligible addresses concurrently; report on every address."""
        attempts: list[proto.DialAttempt | None] = []
        dials: dict[int, Awaitable[proto.DialAttempt]] = {}  # index in `attempts` -> its dial
        for address in addresses:
            attempt, endpoint = classify_address(address, observed)
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
        self, peers: Mapping[str, Sequence[str]], own_multiaddrs: Sequence[str], timeout_s: float
    ) -> ProbeReport:
        """Measure this node against up to 3 of `peers` (in their order) within about `timeout_s` seconds.

        `peers` maps each peer id to its addresses (from its status record; may be empty) so the p2p daemon can
        connect to peers it has not met; `own_multiaddrs` are the addresses peers are asked to dial back.
        Bandwidth is the best over each peer alone and all answering peers at once; reachability is true if any
        peer could dial us.
        Failed or refused probes land in `failures`, never in an exception; every call inside is bounded
        by the deadline, so only a stuck event loop makes this raise TimeoutError. Call from any thread
        but the service's own.
        """
        deadline = time.monotonic() + timeout_s
        coroutine = self._measure(list(peers), peers, list(own_multiaddrs), deadline)
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
        failures += [f"peer {short_peer(p)}: {e}" for p, e in zip(chosen, connected, strict=True) if e is not None]
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
            reachable=reachability(dial_results),
            verdicts=tuple(verdicts),
            observed_ips=tuple(sorted(observed)),
            answered_peers=tuple(peer for peer in peers if peer in answered),
            failures=tuple(failures),
        )

    async def _connect(self, peer: str, addresses: Sequence[str], deadline: float) -> str | None:
        """Have the p2p daemon connect to `peer` at its addresses; None on success, else why not."""
        try:
            peer_id = PeerID.from_base58(peer)
            maddrs = [Multiaddr(without_peer_suffix(address, peer)) for address in addresses]
        except Exception:
            return "its status holds a malformed peer id or address"
        timeout_s = min(CONNECT_TIMEOUT_S, remaining_s(deadline))
        try:
            # hivemind's P2P has no public connect(); its daemon client does (p2pd's CONNECT request).
            await asyncio.wait_for(self.require_p2p()._client.connect(peer_id, maddrs), timeout_s)
        except TimeoutError:
            return f"no connection within {timeout_s:.0f} s"
        except Exception as e:
            return f"cannot connect ({one_line(e)})"
        return None

    async def _ask_dial_back(
        self, peer: str, own: list[str], deadline: float, failures: list[str], observed: set[str]
    ) -> list[AddressVerdict]:
        timeout_s = min(self.limits.dial_timeout_s + CALL_MARGIN_S, remaining_s(deadline))
        try:
            result = await self._with_retries(
                lambda: self._dial_back(PeerID.from_base58(peer), own, timeout_s), deadline
            )
        except Exception as e:
            failures.append(f"peer {short_peer(peer)} did not answer the dial-back probe ({one_line(e)})")
            return []
        if isinstance(result, proto.ProbeRefusal):
            failures.append(f"peer {short_peer(peer)} refused the dial-back probe: {result.reason}")
            return []
        try:
            verdicts = dial_back_verdicts(peer, result, own)
        except ValueError as e:
            failures.append(f"peer {short_peer(peer)} sent a malformed dial-back answer: {e}")
            return []
        observed.update(ip.strip() for ip in result.observed_ip.split(",")[:MAX_DIALED_ADDRESSES] if ip.strip())
        return verdicts

    async def _dial_back(
        self, peer: PeerID, own: list[str], timeout_s: float
    ) -> proto.DialBackResult | proto.ProbeRefusal:
        stub: Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        result = await stub.rpc_dial_back(proto.DialBackRequest(multiaddrs=own), timeout=timeout_s)
        return result.refusal if result.HasField("refusal") else result

    async def _adaptive(self, peer: PeerID, direction: str, deadline: float, failures: list[str]) -> float | None:
        """Probe with growing sizes until a probe takes TARGET_PROBE_S or hits the cap; the last rate."""
        probe = self._upload if direction == "upload" else self._download
        size, rate, last = INITIAL_PROBE_BYTES, None, None
        for _ in range(MAX_PROBES_PER_DIRECTION):
            if remaining_s(deadline) <= 0:
                break
            try:
                outcome = await self._with_retries(lambda size=size: probe(peer, size, deadline), deadline)  # type: ignore[misc]
            except Exception as e:
                failures.append(f"{direction} probe with peer {short_peer(peer.to_base58())} failed ({one_line(e)})")
                break
            if isinstance(outcome, proto.ProbeRefusal):
                failures.append(f"peer {short_peer(peer.to_base58())} refused the {direction} probe: {outcome.reason}")
                break
            last = outcome
            rate = outcome.mbps if outcome.mbps is not None else rate
            if outcome.duration_s >= TARGET_PROBE_S or outcome.truncated or size >= self.limits.max_probe_bytes:
                break
            growth = 8.0 if outcome.duration_s <= 0 else min(8.0, max(2.0, 1.5 * TARGET_PROBE_S / outcome.duration_s))
            size = min(self.limits.max_probe_bytes, int(size * growth))
        if rate is None and last is not None:  # said, so that a link left unmeasured has a why in the log
            cut = ", cut short" if last.truncated else ""
            failures.append(
                f"the {direction} probe with peer {short_peer(peer.to_base58())} timed nothing "
                f"({last.measured_bytes} bytes timed in {last.duration_s:.6f} s{cut})"
            )
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
            if remaining_s(deadline) < wait_s + JOINT_PROBE_S + CALL_MARGIN_S:
                if attempt == 0:  # said in the daemon's log, so the researcher sees why a link reads slow
                    failures.append(f"no time left for the joint {direction} probe")
                break
            await asyncio.sleep(wait_s)
            rate, refusals, errors = await self._joint_flows(direction, sizes, deadline)
            failures += errors
            best = rate if best is None or (rate is not None and rate > best) else best
            wait_s = max((retry_after_s(refusal) for refusal in refusals.values()), default=0.0)
            if wait_s <= 0:
                break  # every flow ran, or failed or was refused for good
        if best is None:
            failures += [
                f"peer {short_peer(p)} refused the joint {direction} probe: {r.reason}" for p, r in refusals.items()
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
                errors.append(f"joint {direction} probe with peer {short_peer(peer)} failed ({one_line(outcome)})")
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
            wait_s = retry_after_s(outcome)
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
                yield proto.UploadChunk(payload=FILLER[: min(CHUNK_BYTES, num_bytes - offset)])

        stub: Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        async with asyncio.timeout(min(self._call_timeout_s(), remaining_s(deadline))):
            responses = await stub.rpc_upload_probe(chunks())
            try:
                result = await anext(responses)
            finally:
                await responses.aclose()  # the server may stop reading early; don't wait for our writer
        return result.refusal if result.HasField("refusal") else upload_sample(result, num_bytes)

    async def _download(self, peer: PeerID, num_bytes: int, deadline: float) -> BandwidthSample | proto.ProbeRefusal:
        stub: Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        timer = ArrivalTimer()
        truncated = False
        try:
            async with asyncio.timeout(min(self._call_timeout_s(), remaining_s(deadline))):
                responses = await stub.rpc_download_probe(proto.DownloadRequest(num_bytes=num_bytes))
                try:
                    async for chunk in responses:
                        if chunk.HasField("refusal"):
                            return chunk.refusal
                        timer.arrived(len(chunk.payload))
                finally:
                    await responses.aclose()
        except TimeoutError:
            truncated = True  # report what arrived by then
        truncated = truncated or timer.received < num_bytes
        sample = BandwidthSample(measured_bytes=timer.measured, duration_s=timer.duration_s, truncated=truncated)
        self.observations.record(peer.to_base58(), sample)  # the server's upload, timed by this node
        return sample
