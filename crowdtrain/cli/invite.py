"""`crowdtrain invite`: the founder of an invite-only run issues a join token, offline, with its run key."""

from __future__ import annotations

import re
from pathlib import Path

from crowdtrain.dht.admission import MAX_VALIDITY_S, issue_join_token
from crowdtrain.errors import BadInputError
from crowdtrain.node.identity import load_identity
from crowdtrain.node.membership import RUN_KEYS_FILE, read_pins

DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")


def parse_duration(text: str) -> float:
    """Seconds in '90', '45m', '12h' or '7d'; one sentence for anything else."""
    match = _DURATION_RE.fullmatch(text.strip())
    if match is None:
        raise BadInputError(f"--expires takes a duration such as 12h or 7d, not {text!r}.")
    seconds = float(match.group(1)) * DURATION_UNITS[match.group(2) or "s"]
    if not 0 < seconds <= MAX_VALIDITY_S:
        raise BadInputError(f"--expires must be more than 0 and at most 366d, not {text!r}.")
    return seconds


def make_invite(state_path: Path, identity_path: Path, run_id: str, expires: str, label: str) -> tuple[str, str]:
    """(join token, run id) for a run this node founded, signed with its identity (the run key)."""
    valid_for_s = parse_duration(expires)
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
    elif len(founded) != 1:
        raise BadInputError(
            "This node founded no run yet; found one with `crowdtrain run --run-file ...` first."
            if not founded
            else f"This node founded {len(founded)} runs: {', '.join(founded)}; pass --run-id to choose one."
        )
    else:
        run_id = founded[0]
    return issue_join_token(run_id, identity.private_key, valid_for_s, label), run_id
