"""Admission to an invite-only run: join tokens the founder signs with the run key, checked by every node.

A run whose manifest says `admission = "invite"` admits only holders of a join token. `crowdtrain invite` (on the
founder's machine) makes one: a fresh Ed25519 *invite key* and an InviteCertificate, signed by the run key, saying
that whoever holds the invite key may join the run until an expiry. The token carries both halves, so joining needs
no server and no founder online: the joiner signs short-lived hivemind AccessTokens with the invite key, binding
them to its own RSA identity (its peer ID), and every node checks them offline against the run key.

Checked where peers reach a node:
- the DHT: hivemind signs each request and response with the AccessToken (`InviteAuthorizer`); a node without a
  valid one is answered nothing, and its records are never stored;
- our RPCs and the averagers' (`AdmissionGate`): each admitted node publishes its AccessToken under its owner
  marker in the run's admission key, and a handler serves a caller only if the caller's peer ID has a valid one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from crowdtrain import proto
from crowdtrain.dht.records import RecordError, load_public_key, peer_id_of_public_key
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import RUN_ID_PATTERN

logger = logging.getLogger(__name__)

TOKEN_PREFIX = "ctjoin1."
"""Every join token starts with this (the 1 is the token format's version)."""
MAX_TOKEN_CHARS = 4096
MAX_CERTIFICATE_BYTES = 2048
"""An RSA-2048 founder key and signature, an Ed25519 key and a label fit in about 800 bytes."""
MAX_LABEL_CHARS = 64
MAX_VALIDITY_S = 366 * 86_400.0
"""A join token lasts at most a year: a leaked one cannot be revoked, only outlived."""
ACCESS_TOKEN_LIFETIME_S = 3600.0
"""How long one AccessToken (what a node shows its peers) is valid; renewed 5 minutes before it ends."""
ACCESS_TOKEN_REFRESH_S = 300.0
FOUNDER_CERTIFICATE_LIFETIME_S = 86_400.0
"""The founder certifies its own invite key for a day at a time, and renews it."""
MAX_PUBLIC_KEY_BYTES = 1024
MAX_CACHED_CERTIFICATES = 1024


class AdmissionError(ValueError):
    """A join token, certificate or access token that does not admit its holder."""


@dataclass(frozen=True, slots=True)
class Invite:
    """A parsed, verified join token."""

    certificate: proto.InviteCertificate
    certificate_bytes: bytes
    invite_key: Ed25519PrivateKey
    run_key: str
    """The founder's peer ID: the token pins the run to it."""

    @property
    def run_id(self) -> str:
        return self.certificate.run_id

    @property
    def expires_at(self) -> float:
        return self.certificate.expires_at


def issue_join_token(run_id: str, founder_key: RSAPrivateKey, valid_for_s: float, label: str = "") -> str:
    """A join token for `run_id`, signed by the founder's key, valid for `valid_for_s` seconds from now."""
    if not 0 < valid_for_s <= MAX_VALIDITY_S:
        raise BadInputError(
            f"A join token must be valid for more than 0 s and at most 366 days, not {valid_for_s:g} s."
        )
    if len(label) > MAX_LABEL_CHARS or not label.isprintable():
        raise BadInputError(f"The label must be at most {MAX_LABEL_CHARS} printable characters.")
    invite_key = Ed25519PrivateKey.generate()
    certificate = _certify(run_id, founder_key, invite_key, time.time() + valid_for_s, label)
    token = proto.JoinToken(certificate=certificate, invite_private_key=invite_key.private_bytes_raw())
    return TOKEN_PREFIX + base64.urlsafe_b64encode(token.SerializeToString()).decode().rstrip("=")


def parse_join_token(text: str, now: float | None = None) -> Invite:
    """Parse and verify a join token as a user pasted it; raises BadInputError with one sentence."""
    text = text.strip()
    if not text.startswith(TOKEN_PREFIX) or len(text) > MAX_TOKEN_CHARS:
        raise BadInputError(
            f"The join token is not one `crowdtrain invite` made (it starts with {TOKEN_PREFIX!r}); "
            "copy it whole from the founder."
        )
    body = text[len(TOKEN_PREFIX) :]
    try:
        token = proto.JoinToken.FromString(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        if len(token.invite_private_key) != 32:
            raise AdmissionError("the invite key is not an Ed25519 key")
        invite_key = Ed25519PrivateKey.from_private_bytes(token.invite_private_key)
        certificate_bytes = token.certificate.SerializeToString(deterministic=True)
        certificate, run_key = verify_certificate(certificate_bytes, None, now)
        if invite_key.public_key().public_bytes_raw() != certificate.invite_public_key:
            raise AdmissionError("its invite key does not match its certificate")
    except AdmissionError as e:
        raise BadInputError(f"The join token is not valid: {e}; ask the founder for a new one.") from None
    except (binascii.Error, ValueError, DecodeError):
        raise BadInputError(
            "The join token is damaged (not base64 of a token); copy it whole from the founder."
        ) from None
    return Invite(certificate=certificate, certificate_bytes=certificate_bytes, invite_key=invite_key, run_key=run_key)


def _check_expiry(expires_at: float, now: float) -> None:
    """Raise AdmissionError unless a certificate expiring at `expires_at` is valid at `now`."""
    if not math.isfinite(expires_at):
        raise AdmissionError("the certificate's expiry is not a plausible time")
    if expires_at > now + MAX_VALIDITY_S:  # this node's clock may be behind the founder's
        raise ClockSkewError("the certificate's expiry is further away than a join token may last")
    if expires_at <= now:
        raise AdmissionError(f"it expired at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(expires_at))}")


class ClockSkewError(AdmissionError):
    """A refusal that a clock a little behind the founder's may have caused: checked again later, never cached."""


def verify_certificate(
    data: bytes, run_key: str | None, now: float | None = None
) -> tuple[proto.InviteCertificate, str]:
    """Check a serialized InviteCertificate: bounded, signed by its founder key, unexpired, and (with `run_key`)
    by that run key. Returns it and its founder's peer ID; raises AdmissionError."""
    if len(data) > MAX_CERTIFICATE_BYTES:
        raise AdmissionError(f"the certificate is {len(data)} bytes, over {MAX_CERTIFICATE_BYTES}")
    try:
        certificate = proto.InviteCertificate.FromString(data)
    except DecodeError:
        raise AdmissionError("the certificate is not an InviteCertificate") from None
    if not RUN_ID_PATTERN.fullmatch(certificate.run_id):
        raise AdmissionError("the certificate names no valid run")
    if len(certificate.invite_public_key) != 32 or len(certificate.label) > MAX_LABEL_CHARS:
        raise AdmissionError("the certificate's invite key or label is malformed")
    _check_expiry(certificate.expires_at, time.time() if now is None else now)
    try:
        founder_key = load_public_key(certificate.founder_public_key)
    except RecordError as e:
        raise AdmissionError(str(e)) from None
    founder = peer_id_of_public_key(founder_key).to_base58()
    if run_key is not None and founder != run_key:
        raise AdmissionError(f"it was issued by {founder}, not by the run key {run_key}")
    unsigned = proto.InviteCertificate()
    unsigned.CopyFrom(certificate)
    unsigned.signature = b""
    if not RSAPublicKey(founder_key).verify(unsigned.SerializeToString(deterministic=True), certificate.signature):
        raise AdmissionError("its founder signature is invalid")
    return certificate, founder


def _certify(
    run_id: str, founder_key: RSAPrivateKey, invite_key: Ed25519PrivateKey, expires_at: float, label: str
) -> proto.InviteCertificate:
    certificate = proto.InviteCertificate(
        run_id=run_id,
        founder_public_key=founder_key.get_public_key().to_bytes(),
        invite_public_key=invite_key.public_key().public_bytes_raw(),
        expires_at=expires_at,
        label=label,
    )
    certificate.signature = founder_key.sign(certificate.SerializeToString(deterministic=True))
    return certificate


def _access_payload(run_id: str, public_key: bytes, expiration_time: str) -> bytes:
    return b"crowdtrain-access\0" + run_id.encode() + b"\0" + public_key + b"\0" + expiration_time.encode()


class AccessChecker:
    """Checks AccessTokens against one run key, caching certificate signatures (RSA checks cost ~50 µs each)."""

    def __init__(self, run_id: str, run_key: str):
        self.run_id, self.run_key = run_id, run_key
        self._certificates: OrderedDict[bytes, proto.InviteCertificate | None] = OrderedDict()

    def expiry(self, token: AccessToken, now: float | None = None) -> float:
        """When `token` stops admitting its holder; raises AdmissionError if it admits nobody now."""
        now = time.time() if now is None else now
        if len(token.public_key) > MAX_PUBLIC_KEY_BYTES or len(token.expiration_time) > 32:
            raise AdmissionError("the access token is oversized")
        try:
            expiration = float(token.expiration_time)
        except ValueError:
            raise AdmissionError("the access token's expiry is not a number") from None
        if not now < expiration <= now + 2 * ACCESS_TOKEN_LIFETIME_S:
            raise AdmissionError("the access token is expired or lasts implausibly long")
        certificate = self._certificate(token.username, now)
        if expiration > certificate.expires_at:
            raise AdmissionError("the access token outlives its certificate")
        invite_key = Ed25519PublicKey.from_public_bytes(certificate.invite_public_key)
        try:
            invite_key.verify(token.signature, _access_payload(self.run_id, token.public_key, token.expiration_time))
        except InvalidSignature:
            raise AdmissionError("the access token's signature is invalid") from None
        return expiration

    def peer_id(self, token: AccessToken) -> str:
        """The peer ID of the RSA key the token admits."""
        try:
            return peer_id_of_public_key(load_public_key(token.public_key)).to_base58()
        except RecordError as e:
            raise AdmissionError(str(e)) from None

    def _certificate(self, encoded: str, now: float) -> proto.InviteCertificate:
        if len(encoded) > 2 * MAX_CERTIFICATE_BYTES:
            raise AdmissionError("the certificate is oversized")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise AdmissionError("the certificate is not base64") from None
        if data in self._certificates:
            self._certificates.move_to_end(data)
            cached = self._certificates[data]
            if cached is None:
                raise AdmissionError("the certificate was refused before")
            if cached.expires_at <= now:
                raise AdmissionError("the certificate expired")
            return cached
        try:
            certificate, _ = verify_certificate(data, self.run_key, now)
            if certificate.run_id != self.run_id:
                raise AdmissionError(f"the certificate is for run {certificate.run_id!r}, not {self.run_id!r}")
        except ClockSkewError:
            raise  # not remembered: the same certificate is checked again at the next token, by a later clock
        except AdmissionError:
            self._remember(data, None)
            raise
        self._remember(data, certificate)
        return certificate

    def _remember(self, data: bytes, certificate: proto.InviteCertificate | None) -> None:
        self._certificates[data] = certificate
        while len(self._certificates) > MAX_CACHED_CERTIFICATES:
            self._certificates.popitem(last=False)


class InviteAuthorizer(TokenAuthorizerBase):
    """hivemind's DHT authorizer for an invite-only run: signs our requests and checks everyone else's.

    A joiner shows an AccessToken signed with its join token's invite key; the founder certifies a fresh invite
    key of its own each day with the run key.
    """

    def __init__(
        self,
        run_id: str,
        run_key: str,
        node_key: RSAPrivateKey,
        credential: Callable[[], tuple[bytes, Ed25519PrivateKey]],
        expires_at: float = math.inf,
    ):
        super().__init__(node_key)
        self.checker = AccessChecker(run_id, run_key)
        self._credential = credential
        self.expires_at = expires_at
        """When this node's admission ends: its join token's expiry; never for the founder."""

    @classmethod
    def for_joiner(cls, invite: Invite, node_key: RSAPrivateKey) -> InviteAuthorizer:
        return cls(
            invite.run_id,
            invite.run_key,
            node_key,
            lambda: (invite.certificate_bytes, invite.invite_key),
            expires_at=invite.expires_at,
        )

    @classmethod
    def for_founder(cls, run_id: str, founder_key: RSAPrivateKey, node_key: RSAPrivateKey) -> InviteAuthorizer:
        def credential() -> tuple[bytes, Ed25519PrivateKey]:
            invite_key = Ed25519PrivateKey.generate()
            expires_at = time.time() + FOUNDER_CERTIFICATE_LIFETIME_S
            certificate = _certify(run_id, founder_key, invite_key, expires_at, "founder")
            return certificate.SerializeToString(deterministic=True), invite_key

        run_key = peer_id_of_public_key(load_public_key(founder_key.get_public_key().to_bytes())).to_base58()
        return cls(run_id, run_key, node_key, credential)

    def access_token(self) -> AccessToken:
        """A fresh AccessToken for this node: valid for an hour, or until the certificate expires."""
        certificate_bytes, invite_key = self._credential()
        certificate = proto.InviteCertificate.FromString(certificate_bytes)
        expiration = min(time.time() + ACCESS_TOKEN_LIFETIME_S, certificate.expires_at)
        public_key = self.local_public_key.to_bytes()
        expiration_time = repr(expiration)
        return AccessToken(
            username=base64.b64encode(certificate_bytes).decode(),
            public_key=public_key,
            expiration_time=expiration_time,
            signature=invite_key.sign(_access_payload(self.checker.run_id, public_key, expiration_time)),
        )

    async def get_token(self) -> AccessToken:
        return self.access_token()

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            self.checker.expiry(access_token)
        except AdmissionError as e:
            logger.debug(f"refused an access token: {e}")
            return False
        return True

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        try:
            return float(access_token.expiration_time) - time.time() < ACCESS_TOKEN_REFRESH_S
        except ValueError:
            return True


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


class AdmissionGate:
    """Answers "may this peer call our RPCs?" from the access tokens admitted peers publish in the DHT.

    `lookup` fetches the run's admission records: {peer ID: serialized AccessToken}. A peer is admitted while its
    token is valid. A call from a peer not admitted yet waits for a fetch begun after it arrived (fetches are
    serialised, at most one every `refetch_interval_s`, and shared by every caller waiting for one, so a scan can
    neither flood the DHT nor queue a newcomer behind it) and is refused if that fetch does not admit it either.
    """

    def __init__(
        self, checker: AccessChecker, lookup: Callable[[], Any], local_peer_id: str, refetch_interval_s: float = 2.0
    ):
        self.checker = checker
        self._lookup = lookup
        self._local_peer_id = local_peer_id
        self._admitted_until: dict[str, float] = {}
        self._fetched_at = -math.inf
        self._refetch_interval_s = refetch_interval_s
        self._lock_and_pid = (asyncio.Lock(), os.getpid())
        self._refused: set[str] = set()

    @property
    def _lock(self) -> asyncio.Lock:
        # Processes forked from the daemon (averagers, expert handlers) inherit this gate; a lock the parent's event
        # loop waited on is bound to that loop and would raise in the child's, so each process gets its own.
        lock, pid = self._lock_and_pid
        if pid != os.getpid():
            lock = asyncio.Lock()
            self._lock_and_pid = (lock, os.getpid())
        return lock

    async def admits(self, peer_id: str) -> bool:
        if peer_id == self._local_peer_id or self._admitted_until.get(peer_id, 0.0) > time.time():
            return True
        asked_at = time.monotonic()
        async with self._lock:  # one fetch at a time, and at most one per interval: a scan cannot flood the DHT
            # A fetch begun after this call arrived answers it; otherwise wait for the next one rather than refuse
            # at once, since a newcomer calls right after storing its token and an older fetch may have missed it.
            if self._fetched_at < asked_at and self._admitted_until.get(peer_id, 0.0) <= time.time():
                await asyncio.sleep(max(0.0, self._fetched_at + self._refetch_interval_s - time.monotonic()))
                self._fetched_at = time.monotonic()
                self.update(await self._lookup())
        return self._admitted_until.get(peer_id, 0.0) > time.time()

    def update(self, records: dict[str, bytes]) -> None:
        """Take every valid token in {claimed peer ID: serialized AccessToken}; ignore the rest."""
        now = time.time()
        for claimed, data in records.items():
            try:
                token = AccessToken.FromString(data)
                expiry = self.checker.expiry(token, now)
                if self.checker.peer_id(token) != claimed:
                    raise AdmissionError("the token admits another peer")
            except (AdmissionError, DecodeError, ValueError) as e:
                logger.debug(f"ignored the admission record of {claimed}: {e}")
                continue
            self._admitted_until[claimed] = max(self._admitted_until.get(claimed, 0.0), expiry)
        for peer_id in [peer for peer, until in self._admitted_until.items() if until <= now]:
            del self._admitted_until[peer_id]

    def note_refusal(self, peer_id: str, rpc: str) -> None:
        """Log the first refusal of each peer (a scan would otherwise flood the log)."""
        if peer_id not in self._refused and len(self._refused) < 10_000:
            self._refused.add(peer_id)
            logger.warning(f"refused {rpc} from {peer_id}: it holds no valid access token for this invite-only run")
