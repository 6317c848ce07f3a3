"""DHT key names. Every key is versioned so a future schema can live beside this one."""

SCHEMA_PREFIX = "crowdtrain/v1"

RUNS_KEY = f"{SCHEMA_PREFIX}/runs"
"""Dictionary key: subkey = a member's owner marker, value = a SignedManifest of its run."""


def peers_key(run_id: str) -> str:
    """Dictionary key of a run's peer statuses: subkey = owner marker, value = PeerStatus."""
    return f"{SCHEMA_PREFIX}/run/{run_id}/peers"


def admitted_key(run_id: str) -> str:
    """Dictionary key of an invite-only run's admissions: subkey = owner marker, value = the node's AccessToken."""
    return f"{SCHEMA_PREFIX}/run/{run_id}/admitted"


def revoked_key(run_id: str) -> str:
    """Dictionary key of an invite-only run's revocations: subkey = a republisher's owner marker, value = the
    founder's signed InviteRevocations."""
    return f"{SCHEMA_PREFIX}/run/{run_id}/revoked"


def skippipe_stages_key(run_id: str) -> str:
    """Dictionary key of a SkipPipe run's stage declarations: subkey = owner marker, value = SkipPipeMember."""
    return f"{SCHEMA_PREFIX}/run/{run_id}/skippipe_stages"


def skippipe_roster_key(run_id: str) -> str:
    """Dictionary key of a SkipPipe run's rosters: subkey = a stage-0 node's owner marker, value = SkipPipeRoster."""
    return f"{SCHEMA_PREFIX}/run/{run_id}/skippipe_roster"
