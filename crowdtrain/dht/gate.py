"""Which peers may call this node's RPCs in an invite-only run: those whose published access token is valid, within
its join token's identity limit, and not revoked (dht/invites.py), decided from the run's admission records."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from hivemind.proto.auth_pb2 import AccessToken

from crowdtrain import proto
from crowdtrain.dht.admission import AccessChecker, AdmissionError, RevokedError
from crowdtrain.dht.invites import Admission, RevocationError, verified_since, verify_revocations, within_limits
from crowdtrain.dht.records import parse_capped

logger = logging.getLogger(__name__)

MAX_ADMISSION_RECORD_BYTES = 8 * 1024
"""As the DHT validator caps an admission record: a certificate, a public key, two signatures and slack."""
MAX_REVOCATION_LISTS = 64
"""Revocation lists read per fetch: one per member that republishes the founder's; the rest are ignored."""
MAX_NOTED_PEERS = 10_000


@dataclass(frozen=True, slots=True)
class AdmissionRecords:
    """What one fetch of the run's admission keys found; nothing in it is checked yet."""

    tokens: dict[str, bytes] = field(default_factory=dict)
    """{peer ID of the record's owner: serialized AdmissionRecord (or a bare AccessToken, from an older node)}."""
    revocations: list[bytes] = field(default_factory=list)
    """Serialized InviteRevocations, as published by the founder and republished by members."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a peer that published a valid-looking record is refused."""

    revoked: bool
    """True: its join token was revoked; False: its token's identity limit is taken by identities ranked before it."""
    reason: str
    """A clause naming the token and the cause, e.g. "the founder revoked its join token (label 'alice')"."""


class AdmissionGate:
    """Answers "may this peer call our RPCs?" from the admission records peers publish in the DHT.

    `lookup` fetches the run's admission records. A peer is admitted while its token is valid, not revoked, and within
    its join token's identity limit. A call from a peer not admitted yet waits for a fetch begun after it arrived
    (fetches are serialised, at most one every `refetch_interval_s`, and shared by every caller waiting for one, so a
    scan can neither flood the DHT nor queue a newcomer behind it) and is refused if that fetch does not admit it
    either. Admitted peers are checked again by a background fetch at least every `refresh_s` (their calls go on
    meanwhile), which is how revocations and identities ranked earlier take effect.
    """

    def __init__(
        self,
        checker: AccessChecker,
        lookup: Callable[[], Awaitable[AdmissionRecords]],
        local_peer_id: str,
        refetch_interval_s: float = 2.0,
        refresh_s: float = 60.0,
    ):
        self.checker = checker
        self._lookup = lookup
        self._local_peer_id = local_peer_id
        self._admissions: dict[str, Admission] = {}
        self._admitted_until: dict[str, float] = {}
        self.refusals: dict[str, Refusal] = {}
        """{peer ID: why it is refused} for the peers whose records the last fetch found but does not admit."""
        self.newest_revocations: tuple[float, bytes] | None = None
        """(issued_at, serialized list) of the newest verified revocation list: what members republish."""
        self._fetched_at = -math.inf
        self._refetch_interval_s = refetch_interval_s
        self._refresh_s = refresh_s
        self._lock_and_pid = (asyncio.Lock(), os.getpid())
        self._update_lock_and_pid = (threading.Lock(), os.getpid())
        self._refresh: tuple[asyncio.Task[None] | None, int] = (None, os.getpid())
        self._refused: set[str] = set()
        self._noted: set[tuple[str, bool]] = set()
        self._home_pid = os.getpid()
        """The daemon's process, which logs record refusals; the processes forked from it with this gate (averagers)
        reach the same verdicts from the same records and say nothing of them."""

    @property
    def _lock(self) -> asyncio.Lock:
        # Processes forked from the daemon (averagers, expert handlers) inherit this gate; a lock the parent's event
        # loop waited on is bound to that loop and would raise in the child's, so each process gets its own.
        lock, pid = self._lock_and_pid
        if pid != os.getpid():
            lock = asyncio.Lock()
            self._lock_and_pid = (lock, os.getpid())
        return lock

    def _admitted(self, peer_id: str) -> bool:
        return self._admitted_until.get(peer_id, 0.0) > time.time()

    def _stale(self) -> bool:
        return time.monotonic() - self._fetched_at > self._refresh_s

    async def admits(self, peer_id: str) -> bool:
        if peer_id == self._local_peer_id:
            return True
        if self._admitted(peer_id):
            if self._stale():  # checked again beside the call, which an admitted peer's RPC never waits for
                self._refresh_soon()
            return True
        asked_at = time.monotonic()
        async with self._lock:  # one fetch at a time, and at most one per interval: a scan cannot flood the DHT
            # A fetch begun after this call arrived answers it; otherwise wait for the next one rather than refuse
            # at once, since a newcomer calls right after storing its token and an older fetch may have missed it.
            if (self._fetched_at < asked_at and not self._admitted(peer_id)) or self._stale():
                await asyncio.sleep(max(0.0, self._fetched_at + self._refetch_interval_s - time.monotonic()))
                self._fetched_at = time.monotonic()
                self.update(await self._lookup())
        return self._admitted(peer_id)

    def _refresh_soon(self) -> None:
        """Start one background fetch of the records, unless one is under way in this process."""
        task, pid = self._refresh
        if task is not None and pid == os.getpid() and not task.done():
            return
        self._refresh = (asyncio.get_running_loop().create_task(self._refresh_now()), os.getpid())

    async def _refresh_now(self) -> None:
        async with self._lock:
            if not self._stale():
                return
            self._fetched_at = time.monotonic()
            try:
                records = await self._lookup()
            except Exception as e:  # the DHT read failed: the records stand, the next call tries again
                logger.debug(f"could not read the admission records: {e!r}")
                return
            self.update(records)

    def update(self, records: AdmissionRecords, now: float | None = None) -> None:
        """Take every valid revocation list and admission record; ignore the rest. Thread-safe: the heartbeat's
        standing check and the RPC handlers' fetches both update."""
        lock, pid = self._update_lock_and_pid
        if pid != os.getpid():  # a forked child: the parent's lock may have been held at the fork
            lock = threading.Lock()
            self._update_lock_and_pid = (lock, os.getpid())
        with lock:
            self._update(records, time.time() if now is None else now)

    def _update(self, records: AdmissionRecords, now: float) -> None:
        for data in records.revocations[:MAX_REVOCATION_LISTS]:
            self._take_revocations(data, now)
        refusals: dict[str, Refusal] = {}
        for claimed, data in records.tokens.items():
            try:
                admission = self._check_record(claimed, data, now)
            except RevokedError as e:
                refusals[claimed] = Refusal(revoked=True, reason=str(e))
                continue
            except (AdmissionError, DecodeError, ValueError) as e:
                logger.debug(f"ignored the admission record of {claimed}: {e}")
                continue
            previous = self._admissions.get(claimed)
            if previous is None or admission.expires_at >= previous.expires_at:
                self._admissions[claimed] = admission
        self._admissions = {
            peer_id: admission
            for peer_id, admission in self._admissions.items()
            if admission.expires_at > now and admission.invite_key not in self.checker.revoked
        }
        admitted = within_limits(self._admissions.values())
        self._admitted_until = {peer_id: self._admissions[peer_id].expires_at for peer_id in admitted}
        for peer_id, admission in self._admissions.items():
            if peer_id not in admitted:
                refusals[peer_id] = Refusal(revoked=False, reason=self._beyond_limit(admission, admitted))
        self.refusals = refusals
        for peer_id, refusal in refusals.items():
            self._note(peer_id, refusal)

    def _take_revocations(self, data: bytes, now: float) -> None:
        try:
            revocations = verify_revocations(data, self.checker.run_key, self.checker.run_id, now)
        except RevocationError as e:
            logger.debug(f"ignored a revocation list: {e}")
            return
        self.checker.revoke({entry.invite_public_key: entry.expires_at for entry in revocations.revoked}, now)
        if self.newest_revocations is None or revocations.issued_at > self.newest_revocations[0]:
            self.newest_revocations = (revocations.issued_at, data)

    def _check_record(self, claimed: str, data: bytes, now: float) -> Admission:
        record = parse_capped(proto.AdmissionRecord, data, MAX_ADMISSION_RECORD_BYTES, "the record", AdmissionError)
        token = AccessToken(
            username=record.username,
            public_key=record.public_key,
            expiration_time=record.expiration_time,
            signature=record.signature,
        )
        expiry, certificate = self.checker.check(token, now)
        if self.checker.peer_id(token) != claimed:
            raise AdmissionError("the token admits another peer")
        return Admission(
            peer_id=claimed,
            invite_key=certificate.invite_public_key,
            max_identities=certificate.max_identities if certificate.HasField("max_identities") else None,
            since=verified_since(record, certificate.invite_public_key, self.checker.run_id),
            expires_at=expiry,
            label=certificate.label,
        )

    def _beyond_limit(self, admission: Admission, admitted: set[str]) -> str:
        first = sorted(
            peer_id
            for peer_id, other in self._admissions.items()
            if other.invite_key == admission.invite_key and peer_id in admitted
        )
        label = f" (label {admission.label!r})" if admission.label else ""
        limit = admission.max_identities
        return (
            f"its join token{label} admits {limit} {'identity' if limit == 1 else 'identities'} and "
            f"{len(first)} used it first ({', '.join(first)})"
        )

    def _note(self, peer_id: str, refusal: Refusal) -> None:
        """Log once per peer and cause why its records are refused (records are read again every fetch), from the
        daemon's process only."""
        if os.getpid() != self._home_pid:
            return
        if (peer_id, refusal.revoked) in self._noted or len(self._noted) >= MAX_NOTED_PEERS:
            return
        self._noted.add((peer_id, refusal.revoked))
        if peer_id != self._local_peer_id:
            logger.warning(f"refusing peer {peer_id}: {refusal.reason}")

    def note_refusal(self, peer_id: str, rpc: str) -> None:
        """Log the first refusal of each peer (a scan would otherwise flood the log); one whose record was refused
        for a cause was logged with it already."""
        if peer_id in self.refusals:
            return
        if peer_id not in self._refused and len(self._refused) < MAX_NOTED_PEERS:
            self._refused.add(peer_id)
            logger.warning(f"refused {rpc} from {peer_id}: it holds no valid access token for this invite-only run")


_process_gate: AdmissionGate | None = None


def set_process_gate(gate: AdmissionGate | None) -> None:
    """Gate every RPC handler this process (and the averager processes it forks afterwards) registers.

    Process-wide because a daemon is one node: its averagers are built deep inside hivemind's optimizer, and they
    serve from processes forked after this call, which inherit it.
    """
    global _process_gate
    _process_gate = gate


class AdmissionGated:
    """Mixin for a hivemind servicer (averager, P2PService): with a process gate set, its `rpc_*` handlers serve
    only admitted callers. Put it first among the bases."""

    async def add_p2p_handlers(self, p2p: Any, wrapper: Any = None, *, namespace: Any = None, balanced: bool = False):
        if _process_gate is not None and wrapper is None:
            wrapper = _GatedHandlers(self, _process_gate)
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)  # type: ignore[misc]


class NotAdmittedError(PermissionError):
    """Raised to a caller that holds no valid access token for the run; hivemind sends the caller its text."""


class _GatedHandlers:
    """Stands in for a servicer when its handlers are registered: each `rpc_*` first asks the gate."""

    def __init__(self, servicer: Any, gate: AdmissionGate):
        self._servicer, self._gate = servicer, gate

    def __getattr__(self, name: str) -> Any:
        handler = getattr(self._servicer, name)
        if not name.startswith("rpc_"):
            return handler

        if inspect.isasyncgenfunction(handler):  # a streaming answer: refuse before its first message

            async def gated_stream(request: Any, context: Any) -> Any:
                await self._check(context, name)
                async for message in handler(request, context):
                    yield message

            return gated_stream

        async def gated(request: Any, context: Any) -> Any:
            await self._check(context, name)
            return await handler(request, context)

        return gated

    async def _check(self, context: Any, rpc: str) -> None:
        caller = context.remote_id.to_base58()
        if not await self._gate.admits(caller):
            self._gate.note_refusal(caller, rpc)
            raise NotAdmittedError(f"peer {caller} is not admitted to this invite-only run")
