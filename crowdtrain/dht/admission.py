"""Admission to an invite-only run: join tokens the founder signs with the run key, checked by every node.

A run whose manifest says `admission = "invite"` admits only holders of a join token. `crowdtrain invite` (on the
founder's machine) makes one: a fresh Ed25519 *invite key* and an InviteCertificate, signed by the run key, saying
that whoever holds the invite key may join the run until an expiry. The token carries both halves, so joining needs
no server and no founder online: the joiner signs short-lived hivemind AccessTokens with the invite key, binding
them to its own RSA identity (its peer ID), and every node checks them offline against the run key.

Checked where peers reach a node:
- the DHT: hivemind signs each request and response with the AccessToken (`InviteAuthorizer`); a node without a
  valid one is answered nothing, and its records are never stored;
- our RPCs and the averagers' (`AdmissionGate`, dht/gate.py): each admitted node publishes its access token
  under its owner marker in the run's admission key, and a handler serves a caller only if the caller's peer ID has
  a valid one within its join token's identity limit (dht/invites.py).
Neither admits an identity whose join token the founder revoked.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from crowdtrain import proto
from crowdtrain.dht.invites import MAX_IDENTITIES, sign_since
from crowdtrain.dht.records import RecordError, load_public_key, parse_capped, peer_id_of_public_key
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
"""A join token lasts at most a year (a leaked one is revoked with `crowdtrain invite --revoke`)."""
ACCESS_TOKEN_LIFETIME_S = 3600.0
"""How long one AccessToken (what a node shows its peers) is valid; renewed 5 minutes before it ends."""
ACCESS_TOKEN_REFRESH_S = 300.0
FOUNDER_CERTIFICATE_LIFETIME_S = 86_400.0
"""The founder certifies its own invite key for a day at a time, and renews it."""
MAX_PUBLIC_KEY_BYTES = 1024
MAX_CACHED_CERTIFICATES = 1024
MAX_KNOWN_REVOCATIONS = 4096
"""Revoked invite keys a node remembers (the union of every list it verified); the soonest to expire go first."""


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


def issue_join_token(
    run_id: str, founder_key: RSAPrivateKey, valid_for_s: float, label: str = "", max_identities: int | None = 1
) -> str:
    """A join token for `run_id`, signed by the founder's key, valid for `valid_for_s` seconds from now, for at most
    `max_identities` node identities at once (None: any number, as tokens made before the limit existed)."""
    if max_identities is not None:
        check_max_identities(max_identities)
    if not 0 < valid_for_s <= MAX_VALIDITY_S:
        raise BadInputError(
            f"A join token must be valid for more than 0 s and at most 366 days, not {valid_for_s:g} s."
        )
    if len(label) > MAX_LABEL_CHARS or not label.isprintable():
        raise BadInputError(f"The label must be at most {MAX_LABEL_CHARS} printable characters.")
    invite_key = Ed25519PrivateKey.generate()
    certificate = _certify(run_id, founder_key, invite_key, time.time() + valid_for_s, label, max_identities)
    token = proto.JoinToken(certificate=certificate, invite_private_key=invite_key.private_bytes_raw())
    return TOKEN_PREFIX + base64.urlsafe_b64encode(token.SerializeToString()).decode().rstrip("=")


def check_max_identities(max_identities: int) -> None:
    """Raise BadInputError unless a join token may admit `max_identities` identities."""
    if not 1 <= max_identities <= MAX_IDENTITIES:
        raise BadInputError(f"--max-identities must be between 1 and {MAX_IDENTITIES}, not {max_identities}.")


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


class RevokedError(AdmissionError):
    """A token whose certificate's invite key the founder revoked."""


def _labelled(certificate: proto.InviteCertificate) -> str:
    return f" (label {certificate.label!r})" if certificate.label else ""


class ClockSkewError(AdmissionError):
    """A refusal that a clock a little behind the founder's may have caused: checked again later, never cached."""


def verify_certificate(
    data: bytes, run_key: str | None, now: float | None = None
) -> tuple[proto.InviteCertificate, str]:
    """Check a serialized InviteCertificate: bounded, signed by its founder key, unexpired, and (with `run_key`)
    by that run key. Returns it and its founder's peer ID; raises AdmissionError."""
    certificate = parse_capped(proto.InviteCertificate, data, MAX_CERTIFICATE_BYTES, "the certificate", AdmissionError)
    if not RUN_ID_PATTERN.fullmatch(certificate.run_id):
        raise AdmissionError("the certificate names no valid run")
    if len(certificate.invite_public_key) != 32 or len(certificate.label) > MAX_LABEL_CHARS:
        raise AdmissionError("the certificate's invite key or label is malformed")
    if certificate.HasField("max_identities") and not 1 <= certificate.max_identities <= MAX_IDENTITIES:
        raise AdmissionError(f"the certificate's identity limit is not between 1 and {MAX_IDENTITIES}")
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
    run_id: str,
    founder_key: RSAPrivateKey,
    invite_key: Ed25519PrivateKey,
    expires_at: float,
    label: str,
    max_identities: int | None = None,
) -> proto.InviteCertificate:
    certificate = proto.InviteCertificate(
        run_id=run_id,
        founder_public_key=founder_key.get_public_key().to_bytes(),
        invite_public_key=invite_key.public_key().public_bytes_raw(),
        expires_at=expires_at,
        label=label,
        max_identities=max_identities,
    )
    certificate.signature = founder_key.sign(certificate.SerializeToString(deterministic=True))
    return certificate


def _access_payload(run_id: str, public_key: bytes, expiration_time: str) -> bytes:
    return b"crowdtrain-access\0" + run_id.encode() + b"\0" + public_key + b"\0" + expiration_time.encode()


class AccessChecker:
    """Checks AccessTokens against one run key and its revocations, caching certificate signatures (RSA checks cost
    ~50 µs each)."""

    def __init__(self, run_id: str, run_key: str):
        self.run_id, self.run_key = run_id, run_key
        self._certificates: OrderedDict[bytes, proto.InviteCertificate | None] = OrderedDict()
        self.revoked: dict[bytes, float] = {}
        """{revoked invite key: its certificate's expiry}: the union of the verified revocation lists seen."""

    def revoke(self, revoked: dict[bytes, float], now: float | None = None) -> None:
        """Refuse from now on every certificate of these invite keys ({key: expiry}); expired entries are dropped."""
        now = time.time() if now is None else now
        merged = {key: expires_at for key, expires_at in {**self.revoked, **revoked}.items() if expires_at > now}
        while len(merged) > MAX_KNOWN_REVOCATIONS:
            del merged[min(merged, key=merged.__getitem__)]
        self.revoked = merged

    def expiry(self, token: AccessToken, now: float | None = None) -> float:
        """When `token` stops admitting its holder; raises AdmissionError if it admits nobody now."""
        return self.check(token, now)[0]

    def check(self, token: AccessToken, now: float | None = None) -> tuple[float, proto.InviteCertificate]:
        """`token`'s expiry and its verified certificate; raises AdmissionError if it admits nobody now."""
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
        if certificate.invite_public_key in self.revoked:
            raise RevokedError(f"the founder revoked its join token{_labelled(certificate)}")
        invite_key = Ed25519PublicKey.from_public_bytes(certificate.invite_public_key)
        try:
            invite_key.verify(token.signature, _access_payload(self.run_id, token.public_key, token.expiration_time))
        except InvalidSignature:
            raise AdmissionError("the access token's signature is invalid") from None
        return expiration, certificate

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
        since: float | None = None,
    ):
        super().__init__(node_key)
        self.checker = AccessChecker(run_id, run_key)
        self._credential = credential
        self.expires_at = expires_at
        """When this node's admission ends: its join token's expiry; never for the founder."""
        self.since = time.time() if since is None else since
        """When this identity first used its join token, unix seconds: it ranks it under the token's limit."""

    @classmethod
    def for_joiner(cls, invite: Invite, node_key: RSAPrivateKey, since: float | None = None) -> InviteAuthorizer:
        return cls(
            invite.run_id,
            invite.run_key,
            node_key,
            lambda: (invite.certificate_bytes, invite.invite_key),
            expires_at=invite.expires_at,
            since=since,
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

    def own_revocation(self) -> str | None:
        """Why this node's own join token no longer admits it, by the revocations its checker holds; None while it
        does (the founder's invite key is fresh at each call, and never revoked)."""
        certificate = proto.InviteCertificate.FromString(self._credential()[0])
        if certificate.invite_public_key not in self.checker.revoked:
            return None
        return f"the founder revoked its join token{_labelled(certificate)}"

    def access_token(self) -> AccessToken:
        """A fresh AccessToken for this node: valid for an hour, or until the certificate expires."""
        return self._signed(*self._credential())

    def admission_record(self) -> proto.AdmissionRecord:
        """What this node publishes in the run's admission key: a fresh access token, and since when it holds one."""
        certificate_bytes, invite_key = self._credential()  # once: the founder's credential is fresh at each call
        token = self._signed(certificate_bytes, invite_key)
        since_signature = sign_since(invite_key, self.checker.run_id, token.public_key, self.since)
        fields = {field.name: value for field, value in token.ListFields()}
        return proto.AdmissionRecord(**fields, since=self.since, since_signature=since_signature)

    def _signed(self, certificate_bytes: bytes, invite_key: Ed25519PrivateKey) -> AccessToken:
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
