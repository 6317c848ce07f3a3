"""An invite-only run's admission, kept up by the heartbeat: this node's admission record published and renewed; its
own standing checked (a join token expired, revoked, or whose identity limit others took first stops the node with
one sentence); the revocations the founder signed published by the founder and republished by every member."""

from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path
from typing import Any

import hivemind

from crowdtrain.dht.admission import InviteAuthorizer
from crowdtrain.dht.calls import DHTCallFailed, dht_answer
from crowdtrain.dht.gate import AdmissionGate, Refusal
from crowdtrain.dht.registry import publish_access_token, publish_revocations, read_admission
from crowdtrain.errors import BadInputError, CrowdtrainError

logger = logging.getLogger(__name__)

ACCESS_REPUBLISH_S = 60.0
"""This node stores its admission record again this often (records on departed DHT nodes are lost)..."""
ACCESS_RENEW_S = 600.0
"""...and renews it this long before it ends (tokens last an hour: crowdtrain/dht/admission.py)."""
STANDING_CHECK_S = 30.0
"""How often this node reads the admission records: its own standing, and revocations for its DHT process."""
REVOCATIONS_TTL_S = 3600.0
"""A published revocation list outlives its publisher's last refresh by this long."""
REVOCATIONS_REPUBLISH_S = 600.0
REVOCATIONS_DIR = "revocations"
"""In the founder's state dir: `<run id>.bin`, the signed revocation list `crowdtrain invite --revoke` writes."""


def revocations_path(state_path: Path, run_id: str) -> Path:
    """Where the founder's `crowdtrain invite --revoke` keeps the run's signed revocation list."""
    return state_path / REVOCATIONS_DIR / f"{run_id}.bin"


class JoinTokenExpired(CrowdtrainError):
    """This node's admission to an invite-only run ended."""


class AdmissionRefused(BadInputError):
    """This node's join token no longer admits it: the founder revoked it, or other identities took its limit."""


class AdmissionWatch:
    """Called by each heartbeat; raises JoinTokenExpired or AdmissionRefused when this node must stop."""

    def __init__(
        self,
        dht: hivemind.DHT,
        authorizer: InviteAuthorizer,
        gate: AdmissionGate,
        peer_id: str,
        owner: bytes,
        revocations_file: Path | None,
        timeout_s: float,
    ):
        self.dht, self.authorizer, self.gate, self.peer_id, self.owner = dht, authorizer, gate, peer_id, owner
        self.run_id = authorizer.checker.run_id
        self.revocations_file = revocations_file
        """The founder's signed revocation list (it publishes it); None on every other node."""
        self.timeout_s = timeout_s
        self.published_at = -math.inf
        self.expires_at = 0.0
        self.next_check_at = -math.inf
        self.revocations_published_at = -math.inf
        self.revocations_published: bytes | None = None
        self.revoked_in_dht_process: dict[bytes, float] = {}
        self.revocations_looked = False
        self.revocations_seen: tuple[int, int] | None = None
        """The founder's list file's (mtime, size) at the last beat; None while there is none."""

    def beat(self) -> None:
        now = time.time()
        if now >= self.authorizer.expires_at:
            expired = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.authorizer.expires_at))
            raise JoinTokenExpired(f"this node's join token expired at {expired}; ask the founder for a new one")
        self._publish_record(now)
        if time.monotonic() >= self.next_check_at or self._own_revocations_changed():
            self.next_check_at = time.monotonic() + STANDING_CHECK_S
            self._check_standing()

    def _publish_record(self, now: float) -> None:
        """Keep this node's admission record in the DHT (peers' RPC handlers admit only holders), renewed before it
        ends."""
        if now - self.published_at < ACCESS_REPUBLISH_S and self.expires_at - now > ACCESS_RENEW_S:
            return
        record = self.authorizer.admission_record()
        expires_at = float(record.expiration_time)
        data = record.SerializeToString()
        if publish_access_token(self.dht, self.run_id, data, self.owner, expires_at, self.timeout_s):
            self.published_at, self.expires_at = now, expires_at

    def _check_standing(self) -> None:
        own_list = self._read_own_revocations()
        records = read_admission(self.dht, self.run_id, self.timeout_s)
        if own_list is not None:
            records.revocations.insert(0, own_list)
        self.gate.update(records)
        refusal = self.gate.refusals.get(self.peer_id)
        revoked = self.authorizer.own_revocation()  # decided by the list alone: its own record may not have been read
        if refusal is None and revoked is not None:
            refusal = Refusal(revoked=True, reason=revoked)
        if refusal is not None and refusal.revoked:
            raise AdmissionRefused(f"This node is no longer admitted: {refusal.reason}; ask the founder for a new one.")
        # Published before this node's DHT refuses the revoked: a store reaching them tells them to stop.
        self._republish_revocations(own_list)
        self._revoke_in_dht_process()
        if refusal is None:
            return
        raise AdmissionRefused(
            f"This node is refused: {refusal.reason}; run no more nodes on one join token than it admits, "
            "or ask the founder for one made with --max-identities."
        )

    def _own_revocations_changed(self) -> bool:
        """Whether `crowdtrain invite --revoke` rewrote the founder's list since the last look (a stat per beat): the
        founder then publishes it at once instead of at its next standing check."""
        if self.revocations_file is None:
            return False
        try:
            stat = self.revocations_file.stat()
            current: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            current = None  # no list yet
        changed = self.revocations_looked and current != self.revocations_seen
        self.revocations_looked, self.revocations_seen = True, current
        return changed

    def _read_own_revocations(self) -> bytes | None:
        if self.revocations_file is None:
            return None
        try:
            return self.revocations_file.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning(f"cannot read the revocation list {self.revocations_file}: {e}")
            return None

    def _republish_revocations(self, own_list: bytes | None) -> None:
        """The founder publishes its list; members republish the newest they verified, so it outlives the founder's
        absence."""
        newest = own_list if own_list is not None else (self.gate.newest_revocations or (0.0, None))[1]
        if newest is None:
            return
        due = time.monotonic() - self.revocations_published_at >= REVOCATIONS_REPUBLISH_S
        if not due and newest == self.revocations_published:
            return
        if publish_revocations(self.dht, self.run_id, newest, self.owner, REVOCATIONS_TTL_S, self.timeout_s):
            self.revocations_published_at, self.revocations_published = time.monotonic(), newest

    def _revoke_in_dht_process(self) -> None:
        """hivemind's DHT runs in a process of its own, with its own copy of the authorizer: tell it."""
        revoked = self.gate.checker.revoked
        if revoked == self.revoked_in_dht_process:
            return
        future = self.dht.run_coroutine(functools.partial(_revoke, dict(revoked)), return_future=True)
        try:
            dht_answer(future, self.timeout_s, "revocations for the DHT process")
        except DHTCallFailed as e:
            logger.warning(f"the DHT process took no revocations this time ({e}); trying again at the next check")
            return
        self.revoked_in_dht_process = dict(revoked)


async def _revoke(revoked: dict[bytes, float], _dht: hivemind.DHT, node: Any) -> None:
    authorizer = node.protocol.authorizer
    if isinstance(authorizer, InviteAuthorizer):
        authorizer.checker.revoke(revoked)
