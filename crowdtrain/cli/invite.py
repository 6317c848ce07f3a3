"""`crowdtrain invite`: the founder of an invite-only run issues a join token, or revokes one, offline, with its
run key."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from crowdtrain.dht.admission import (
    MAX_VALIDITY_S,
    TOKEN_PREFIX,
    check_max_identities,
    issue_join_token,
    parse_join_token,
)
from crowdtrain.dht.invites import RevocationError, sign_revocations, verify_revocations
from crowdtrain.errors import BadInputError
from crowdtrain.node.admission_watch import revocations_path
from crowdtrain.node.identity import Identity, load_identity
from crowdtrain.node.membership import RUN_KEYS_FILE, read_pins

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{8,64}")
ISSUED_FILE = "invites.json"
"""In the founder's state dir: the public half of every join token issued (invite key, label, expiry), per run."""


def parse_duration(text: str) -> float:
    """Seconds in '90', '45m', '12h' or '7d'; one sentence for anything else."""
    match = _DURATION_RE.fullmatch(text.strip())
    if match is None:
        raise BadInputError(f"--expires takes a duration such as 12h or 7d, not {text!r}.")
    seconds = float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]
    if not 0 < seconds <= MAX_VALIDITY_S:
        raise BadInputError(f"--expires must be more than 0 and at most 366d, not {text!r}.")
    return seconds


def make_invite(
    state_path: Path, identity_path: Path, run_id: str, expires: str, label: str, max_identities: int = 1
) -> tuple[str, str]:
    """(join token, run id) for a run this node founded, signed with its identity (the run key); the token's public
    half is noted in the state dir, so `--revoke` can find it by label or fingerprint."""
    valid_for_s = parse_duration(expires)
    check_max_identities(max_identities)
    identity, run_id = _founded_run(state_path, identity_path, run_id)
    token = issue_join_token(run_id, identity.private_key, valid_for_s, label, max_identities)
    certificate = parse_join_token(token).certificate
    now = time.time()
    issued = {
        run: [entry for entry in entries if entry["expires_at"] > now]
        for run, entries in _read_issued(state_path / ISSUED_FILE).items()
    }
    issued.setdefault(run_id, []).append(
        {"invite_key": certificate.invite_public_key.hex(), "label": label, "expires_at": certificate.expires_at}
    )
    _write_json(state_path / ISSUED_FILE, issued)
    return token, run_id


def revoke_invites(state_path: Path, identity_path: Path, run_id: str, what: str) -> tuple[list[str], str, Path]:
    """Add the join tokens `what` names (a token, a label or a fingerprint) to the run's signed revocation list in
    the state dir, which the founder's daemon publishes. Returns their descriptions, the run id and the list's path."""
    identity, run_id = _founded_run(state_path, identity_path, run_id)
    targets = _revocation_targets(state_path, run_id, what.strip())
    path = revocations_path(state_path, run_id)
    revoked: dict[bytes, float] = {}
    if path.exists():
        try:
            listed = verify_revocations(path.read_bytes(), identity.peer_id.to_base58(), run_id)
        except (OSError, RevocationError) as e:
            raise BadInputError(f"Cannot use {path}: {e}; remove it and revoke again.") from None
        revoked = {entry.invite_public_key: entry.expires_at for entry in listed.revoked}
    revoked.update({key: expires_at for key, (expires_at, _) in targets.items()})
    try:
        data = sign_revocations(run_id, identity.private_key, revoked)
    except RevocationError as e:
        raise BadInputError(f"{e}; revoke fewer or wait for some to expire.") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return [description for _, description in targets.values()], run_id, path


def _revocation_targets(state_path: Path, run_id: str, what: str) -> dict[bytes, tuple[float, str]]:
    """{invite key: (expiry, description)} of the tokens `what` names."""
    if what.startswith(TOKEN_PREFIX):
        invite = parse_join_token(what)
        if invite.run_id != run_id:
            raise BadInputError(f"That join token is for run {invite.run_id!r}, not {run_id!r}.")
        key = invite.certificate.invite_public_key
        return {key: (invite.expires_at, _describe(key.hex(), invite.certificate.label))}
    now = time.time()
    issued = [entry for entry in _read_issued(state_path / ISSUED_FILE).get(run_id, []) if entry["expires_at"] > now]
    named = [entry for entry in issued if what and entry["label"] == what]
    if not named and _FINGERPRINT_RE.fullmatch(what.lower()):
        named = [entry for entry in issued if entry["invite_key"].startswith(what.lower())]
        if len(what) == 64 and not named:  # a token not issued here, named by its whole key: revoke it for a year
            return {bytes.fromhex(what): (now + MAX_VALIDITY_S, _describe(what.lower(), ""))}
        if len(named) > 1:
            raise BadInputError(f"Fingerprint {what!r} matches {len(named)} join tokens; give more of its digits.")
    if not named:
        raise BadInputError(
            f"--revoke takes a join token, or the label or fingerprint (8 to 64 hex digits) of one issued here for run "
            f"{run_id!r} and not expired; nothing matches {what!r}."
        )
    return {
        bytes.fromhex(entry["invite_key"]): (entry["expires_at"], _describe(entry["invite_key"], entry["label"]))
        for entry in named
    }


def _describe(invite_key_hex: str, label: str) -> str:
    return f"{invite_key_hex[:16]}" + (f" (label {label!r})" if label else "")


def _founded_run(state_path: Path, identity_path: Path, run_id: str) -> tuple[Identity, str]:
    """This node's identity and the run it founded that `run_id` names (or its only one)."""
    if not identity_path.exists():
        raise BadInputError(f"{identity_path} does not exist: run `crowdtrain invite` on the founder's machine.")
    identity = load_identity(identity_path)
    own = identity.peer_id.to_base58()
    founded = sorted(run for run, founder in read_pins(state_path / RUN_KEYS_FILE).items() if founder == own)
    if run_id:
        if run_id not in founded:
            raise BadInputError(
                f"This node ({own}) did not found a run named {run_id!r}; it founded: {', '.join(founded) or 'none'}."
            )
        return identity, run_id
    if len(founded) != 1:
        raise BadInputError(
            "This node founded no run yet; found one with `crowdtrain run --run-file ...` first."
            if not founded
            else f"This node founded {len(founded)} runs: {', '.join(founded)}; pass --run-id to choose one."
        )
    return identity, founded[0]


def _read_issued(path: Path) -> dict[str, list[dict[str, Any]]]:
    """{run id: [{invite_key (hex), label, expires_at}]} of the join tokens issued here; {} before the first."""
    try:
        issued = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise BadInputError(f"Cannot read {path}: {e}; fix or remove it (it lists the join tokens issued).") from None
    if not isinstance(issued, dict) or not all(
        isinstance(entries, list) and all(_is_issued_entry(entry) for entry in entries) for entries in issued.values()
    ):
        raise BadInputError(f"{path} is not a map of run ids to issued join tokens; fix or remove it.")
    return issued


def _is_issued_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("invite_key"), str)
        and isinstance(entry.get("label"), str)
        and isinstance(entry.get("expires_at"), float)
    )


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(temporary, path)
