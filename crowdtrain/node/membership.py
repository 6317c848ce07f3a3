"""Which run this node belongs to: found a new one, or learn the swarm's from the DHT."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import hivemind
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.dht.admission import InviteAuthorizer, parse_join_token
from crowdtrain.dht.records import sign_manifest
from crowdtrain.dht.registry import RunListing, await_runs
from crowdtrain.errors import BadInputError, CrowdtrainError
from crowdtrain.manifest import RunManifest, load_run_file
from crowdtrain.models import check_model_spec, load_tokenizer, model_kind
from crowdtrain.models.device import available_memory_bytes
from crowdtrain.node.config import NodeConfig, SwarmSettings
from crowdtrain.node.identity import Identity
from crowdtrain.node.limits import check_remote_manifest

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=SwarmSettings)

RUN_KEYS_FILE = "runs.json"
"""In the state dir: the founder (run key) of every run this node founded or joined."""
JOINED_FILE = "joined.json"
"""In the state dir: since when this node has used each join token (its rank under the token's identity limit)."""


@dataclass(frozen=True, slots=True)
class Membership:
    """The run this node trains in, with the founder-signed manifest it republishes."""

    manifest: RunManifest
    signed_bytes: bytes
    founded: bool
    """True when this node founded the run (it then always republishes the manifest)."""
    founder_peer_id: str
    """The run key: the peer whose key signed the manifest; this node accepts no other founder's."""


def with_join_token(config: C) -> C:
    """`config` with the run id and run key its join token names; a token naming another run or key than the
    flags is refused. Unchanged without a token."""
    if not config.join_token:
        return config
    invite = parse_join_token(config.join_token)
    if config.run_id and config.run_id != invite.run_id:
        raise BadInputError(f"The join token is for run {invite.run_id!r}, not {config.run_id!r} (--run-id).")
    if config.run_key and config.run_key != invite.run_key:
        raise BadInputError(f"The join token was issued by run key {invite.run_key}, not {config.run_key} (--run-key).")
    return dataclasses.replace(config, run_id=invite.run_id, run_key=invite.run_key)


def node_authorizer(config: NodeConfig, identity: Identity) -> InviteAuthorizer | None:
    """How this node proves its admission to the swarm's DHT: with its join token; as the founder of an
    invite-only run it founds (its run file says so), with the run key; None in an open run."""
    if config.join_token:
        invite = parse_join_token(config.join_token)
        since = joined_since(config.state_path / JOINED_FILE, invite.certificate.invite_public_key)
        return InviteAuthorizer.for_joiner(invite, identity.private_key, since)
    if config.initial_peers and not config.run_file:
        return None  # joining whatever run the swarm holds: an invite-only one would need a token
    manifest = load_run_file(config.run_file or "demo", run_id=config.run_id or None)
    if manifest.admission != "invite":
        return None
    return InviteAuthorizer.for_founder(manifest.run_id, identity.private_key, identity.private_key)


def joined_since(path: Path, invite_public_key: bytes) -> float:
    """When this node first used the join token of `invite_public_key`, unix seconds: remembered in `path`, so a
    restart keeps its rank among the identities sharing the token; now on first use."""
    try:
        joined = json.loads(path.read_text())
    except FileNotFoundError:
        joined = {}
    except (OSError, ValueError) as e:
        raise BadInputError(
            f"Cannot read {path}: {e}; fix or remove it (it lists when join tokens were first used)."
        ) from None
    if not isinstance(joined, dict):
        raise BadInputError(f"{path} is not a map of invite keys to times; fix or remove it.")
    since = joined.get(invite_public_key.hex())
    if isinstance(since, float) and math.isfinite(since):
        return since
    joined[invite_public_key.hex()] = since = time.time()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(joined, indent=1, sort_keys=True))
    os.replace(temporary, path)
    return since


def reader_authorizer(config: SwarmSettings, key: RSAPrivateKey) -> InviteAuthorizer | None:
    """`status` and `check` read an invite-only run's DHT with a join token of their own."""
    if not config.join_token:
        return None
    return InviteAuthorizer.for_joiner(parse_join_token(config.join_token), key)


def resolve_membership(dht: hivemind.DHT, config: NodeConfig, identity: Identity) -> Membership:
    """Found a run (no initial peers, or a run file naming a run the swarm lacks) or join one; the run's founder
    is pinned in the state dir, and a later different founder for the same run is refused."""
    membership = _resolve(dht, config, identity)
    pin_founder(config.state_path / RUN_KEYS_FILE, membership.manifest.run_id, membership.founder_peer_id)
    return membership


def pin_founder(path: Path, run_id: str, founder_peer_id: str) -> None:
    """Remember the run's founder on first sight; refuse, with one sentence, a different one later."""
    pins = read_pins(path)
    pinned = pins.get(run_id)
    if pinned == founder_peer_id:
        return
    if pinned is not None:
        raise BadInputError(
            f"Run {run_id!r} is now published by founder {founder_peer_id}, but this node joined it under founder "
            f"{pinned}; refusing a manifest from another key (pass --run-key {founder_peer_id} to accept the new "
            f"founder, or remove {path})."
        )
    pins[run_id] = founder_peer_id
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(pins, indent=1, sort_keys=True))
    os.replace(temporary, path)


def read_pins(path: Path) -> dict[str, str]:
    """{run id: founder peer ID} of the runs this node founded or joined; {} before the first."""
    try:
        pins = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise BadInputError(
            f"Cannot read {path}: {e}; fix or remove it (it lists the founders of runs joined)."
        ) from None
    if not isinstance(pins, dict) or not all(isinstance(v, str) for v in pins.values()):
        raise BadInputError(f"{path} is not a map of run ids to founders; fix or remove it.")
    return pins


def _resolve(dht: hivemind.DHT, config: NodeConfig, identity: Identity) -> Membership:
    if not config.initial_peers:
        return _found(load_run_file(config.run_file or "demo", run_id=config.run_id or None), identity)
    wanted = load_run_file(config.run_file, run_id=config.run_id or None) if config.run_file else None
    founder = config.run_key or None
    runs = await_runs(dht, wanted.run_id if wanted else config.run_id, config.bootstrap_timeout_s, founder)
    if wanted is not None:
        return _found_or_join_same(wanted, runs.get(wanted.run_id), identity)
    if config.run_id:
        if config.run_id not in runs:
            raise BadInputError(f"The swarm holds no run named {config.run_id!r}; runs here: {_describe(runs)}.")
        return _join(runs[config.run_id], config)
    if not runs and founder is not None:
        raise BadInputError(f"The swarm holds no run founded by {founder} (--run-key); check the key you were given.")
    if not runs:
        raise CrowdtrainError(
            "The swarm answered but holds no run yet; found one by running `crowdtrain run` "
            "without --initial-peers (or with --run-file)."
        )
    if len(runs) > 1:
        raise BadInputError(f"The swarm holds {len(runs)} runs: {_describe(runs)}; pass --run-id to choose one.")
    return _join(next(iter(runs.values())), config)


def _found(manifest: RunManifest, identity: Identity) -> Membership:
    # A run nobody can build must fail here, before its manifest reaches the swarm.
    check_model_spec(manifest.model, load_tokenizer(manifest.model).vocab_size)
    model_kind(manifest.model)
    manifest = dataclasses.replace(manifest, created_at=time.time())
    logger.info(f"founding run {manifest.run_id!r} ({manifest.model.architecture})")
    signed = sign_manifest(manifest, identity.private_key)
    return Membership(
        manifest=manifest, signed_bytes=signed, founded=True, founder_peer_id=identity.peer_id.to_base58()
    )


def _join(listing: RunListing, config: NodeConfig | None = None) -> Membership:
    """Join the swarm's run; `config` given: the run came from the DHT and must fit this node's limits."""
    manifest = listing.published.manifest
    if config is not None:
        check_remote_manifest(
            manifest,
            data_paths=config.data_paths,
            max_parameters=config.max_parameters,
            available_bytes=available_memory_bytes(),
        )
    logger.info(f"joining run {manifest.run_id!r} founded by {listing.published.founder_peer_id}")
    return Membership(
        manifest=manifest,
        signed_bytes=listing.signed_bytes,
        founded=False,
        founder_peer_id=listing.published.founder_peer_id,
    )


def _found_or_join_same(wanted: RunManifest, existing: RunListing | None, identity: Identity) -> Membership:
    if existing is None:
        return _found(wanted, identity)
    if dataclasses.replace(existing.published.manifest, created_at=0.0) == wanted:
        return _join(existing)
    raise BadInputError(
        f"The swarm already holds a run named {wanted.run_id!r} with a different manifest; "
        "pass --run-id to found yours under another name, or drop --run-file to join it."
    )


def _describe(runs: dict[str, RunListing]) -> str:
    if not runs:
        return "none"
    return ", ".join(
        f"{run_id} ({listing.published.manifest.model.architecture})" for run_id, listing in sorted(runs.items())
    )
