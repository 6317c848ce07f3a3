"""Read and write the run's records: published manifests, peer statuses, admission records and revocations."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from crowdtrain import proto
from crowdtrain.dht import keys
from crowdtrain.dht.calls import DHTCallFailed, dht_answer
from crowdtrain.dht.gate import AdmissionRecords
from crowdtrain.dht.records import (
    PublishedManifest,
    RecordError,
    decode_peer_status,
    encode_peer_status,
    open_manifest,
    peer_id_of_owner,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunListing:
    """One run found in the DHT: its verified manifest, its signed bytes, and who republishes it."""

    published: PublishedManifest
    signed_bytes: bytes
    publishers: frozenset[bytes]


def list_runs(dht: hivemind.DHT, timeout_s: float, founder: str | None = None) -> dict[str, RunListing]:
    """Every run whose manifest is in the DHT, by run_id; for a contested run_id the oldest wins.

    `founder` (a run key: the founder's peer ID) keeps only manifests that founder signed: anyone can publish a
    manifest for any run_id (with an older `created_at`, it would win), so a pinned node looks at no other.
    """
    entries = read_dictionary(dht, keys.RUNS_KEY, timeout_s)
    by_run: dict[str, list[tuple[PublishedManifest, bytes, bytes]]] = defaultdict(list)
    for publisher, value in entries.items():
        try:
            published = open_manifest(value)
        except RecordError as e:
            logger.debug(f"skipped a manifest record: {e}")
            continue
        if founder is not None and published.founder_peer_id != founder:
            logger.warning(
                f"ignored a manifest for run {published.manifest.run_id!r} signed by {published.founder_peer_id}, "
                f"not by the run key {founder}"
            )
            continue
        by_run[published.manifest.run_id].append((published, value, publisher))
    return {run_id: _pick_canonical(candidates) for run_id, candidates in by_run.items()}


def await_runs(dht: hivemind.DHT, run_id: str, timeout_s: float, founder: str | None = None) -> dict[str, RunListing]:
    """`list_runs`, polled with backoff until a run (or the one named `run_id`) shows up or `timeout_s` passes: a
    node that just joined, or a busy swarm, may answer a first lookup with nothing (hivemind's own request timeout)."""
    deadline = time.monotonic() + timeout_s
    delay_s = 0.25
    while True:
        runs = list_runs(dht, max(deadline - time.monotonic(), 1.0), founder)
        if (run_id in runs) if run_id else runs:
            return runs
        if time.monotonic() + delay_s > deadline:
            return runs
        time.sleep(delay_s)
        delay_s = min(delay_s * 2, 2.0)


def _pick_canonical(candidates: list[tuple[PublishedManifest, bytes, bytes]]) -> RunListing:
    def age_key(item: tuple[PublishedManifest, bytes, bytes]) -> tuple[float, str]:
        return item[0].manifest.created_at, item[0].founder_peer_id

    oldest = min(candidates, key=age_key)
    same = frozenset(publisher for published, value, publisher in candidates if value == oldest[1])
    if len(same) != len(candidates):
        logger.warning(f"run {oldest[0].manifest.run_id!r} has manifests from several founders; using the oldest")
    return RunListing(published=oldest[0], signed_bytes=oldest[1], publishers=same)


def publish_manifest(dht: hivemind.DHT, signed_bytes: bytes, owner: bytes, ttl_s: float, timeout_s: float) -> bool:
    """Store (or refresh) a signed manifest under this node's own subkey."""
    return store_signed(dht, keys.RUNS_KEY, signed_bytes, owner, ttl_s, timeout_s)


def publish_peer_status(
    dht: hivemind.DHT, status: proto.PeerStatus, owner: bytes, ttl_s: float, timeout_s: float
) -> bool:
    """Store this node's heartbeat under its run; it expires `ttl_s` after the last refresh."""
    return store_signed(dht, keys.peers_key(status.run_id), encode_peer_status(status), owner, ttl_s, timeout_s)


def publish_access_token(
    dht: hivemind.DHT, run_id: str, token: bytes, owner: bytes, expires_at: float, timeout_s: float
) -> bool:
    """Store this node's admission record in an invite-only run, so its peers' RPC handlers admit its calls."""
    return store_signed(dht, keys.admitted_key(run_id), token, owner, max(expires_at - get_dht_time(), 1.0), timeout_s)


def publish_revocations(
    dht: hivemind.DHT, run_id: str, data: bytes, owner: bytes, ttl_s: float, timeout_s: float
) -> bool:
    """Store (or republish) the founder's signed revocation list under this node's own subkey."""
    return store_signed(dht, keys.revoked_key(run_id), data, owner, ttl_s, timeout_s)


async def fetch_admission(dht: hivemind.DHT, run_id: str) -> AdmissionRecords:
    """The run's admission records and revocation lists, unchecked."""
    found = await asyncio.gather(
        dht.get(keys.admitted_key(run_id), latest=True, return_future=True),
        dht.get(keys.revoked_key(run_id), latest=True, return_future=True),
    )
    tokens, revocations = (
        {} if entry is None or not isinstance(entry.value, dict) else {k: v.value for k, v in entry.value.items()}
        for entry in found
    )
    return _admission_records(tokens, revocations)


def read_admission(dht: hivemind.DHT, run_id: str, timeout_s: float) -> AdmissionRecords:
    """`fetch_admission` for a thread that may block: {} for a key not read within `timeout_s`."""
    tokens = read_dictionary(dht, keys.admitted_key(run_id), timeout_s)
    return _admission_records(tokens, read_dictionary(dht, keys.revoked_key(run_id), timeout_s))


def _admission_records(tokens: dict[Any, Any], revocations: dict[Any, Any]) -> AdmissionRecords:
    records = AdmissionRecords(revocations=[value for value in revocations.values() if isinstance(value, bytes)])
    for owner, value in tokens.items():
        if not isinstance(owner, bytes) or not isinstance(value, bytes):
            continue
        try:
            records.tokens[peer_id_of_owner(owner).to_base58()] = value
        except RecordError:
            continue
    return records


def store_signed(dht: hivemind.DHT, key: str, value: bytes, owner: bytes, ttl_s: float, timeout_s: float) -> bool:
    """Store `value` under `key`, subkey `owner` (this node's owner marker: signed), for `ttl_s`; whether it was."""
    future = dht.store(key, value, get_dht_time() + ttl_s, subkey=owner, return_future=True)
    try:
        return bool(dht_answer(future, timeout_s, f"DHT store of {key}"))
    except DHTCallFailed as e:
        logger.warning(f"{e}")
        return False


def list_peer_statuses(dht: hivemind.DHT, run_id: str, timeout_s: float) -> list[proto.PeerStatus]:
    """The run's online peers, one verified status each, ordered by peer ID."""
    statuses = []
    for owner, value in read_dictionary(dht, keys.peers_key(run_id), timeout_s).items():
        try:
            status = decode_peer_status(value, owner)
        except RecordError as e:
            logger.debug(f"skipped a peer status: {e}")
            continue
        if status.state == proto.PeerStatus.ONLINE and status.run_id == run_id:
            statuses.append(status)
    return sorted(statuses, key=lambda status: status.peer_id)


def read_dictionary(dht: hivemind.DHT, key: str, timeout_s: float) -> dict[bytes, bytes]:
    """The unexpired byte values of the dictionary under `key`, by subkey; {} if none or on timeout."""
    future = dht.get(key, latest=True, return_future=True)
    try:
        found = dht_answer(future, timeout_s, f"DHT lookup of {key}")
    except DHTCallFailed as e:
        logger.warning(f"{e}")
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    return {
        subkey: item.value
        for subkey, item in found.value.items()
        if isinstance(subkey, bytes) and isinstance(item.value, bytes) and item.expiration_time > now
    }
