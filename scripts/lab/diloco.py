"""Real DiLoCo and SPES modes in one process, for the outer-step tests, the SPES tests and the wire benchmarks.

Each DiLoCo peer (`diloco_peers`) is a real DiLoCoMode (its averager process, its progress tracker, a DHT on
loopback) over its own replica of the given tensors; nothing computes (compute=None): callers write what inner
steps would have done straight into the replicas. Each SPES peer (`spes_peers`) is a real SPESMode over its own
replica of the run's model, built from the same seed, with real forward and backward passes. A gradients or
parameters run's peer is its collaborative optimizer (`collaborative_optimizer`) on such a DHT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.averaging.exact import new_partial_counter
from crowdtrain.averaging.phases import PhaseAccumulator
from crowdtrain.collaboration.factory import make_optimizer
from crowdtrain.manifest import RunManifest
from crowdtrain.models import MicroStep, build_model, model_kind, precision_for_device
from crowdtrain.modes.base import ModeContext, SwarmView
from crowdtrain.modes.compute import LocalCompute
from crowdtrain.modes.diloco.mode import DiLoCoMode
from crowdtrain.modes.spes.mode import SPESMode
from crowdtrain.node.identity import load_or_create_identity

M = TypeVar("M", bound=DiLoCoMode)


_IDENTITY_KEYS: dict[str, RSAPrivateKey] = {}
"""The identity key of each DHT `loopback_dhts` started, by its peer ID (base58)."""


def loopback_dhts(count: int) -> list[hivemind.DHT]:
    """`count` DHTs on loopback, every one after the first bootstrapped from it, each with an identity key of its own
    (`identity_key`), as a node's daemon has."""
    first = loopback_dht([])
    return [first, *(loopback_dht(first.get_visible_maddrs()) for _ in range(count - 1))]


def identity_key(dht: hivemind.DHT) -> RSAPrivateKey:
    """The key `dht`'s peer ID derives from (what a node signs its averaging entries and records with); only a
    DHT started here (`loopback_dht`) has one known."""
    try:
        return _IDENTITY_KEYS[dht.peer_id.to_base58()]
    except KeyError:
        raise ValueError("a DHT not started by lab.diloco.loopback_dht has no known identity key") from None


def loopback_dht(initial_peers: Sequence[Any]) -> hivemind.DHT:
    """A DHT on loopback bootstrapped from `initial_peers`, with an identity key of its own (`identity_key`)."""
    with tempfile.TemporaryDirectory() as directory:  # p2pd reads the key as it starts
        identity = load_or_create_identity(Path(directory) / "identity.key")
        dht = hivemind.DHT(
            start=True,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=list(initial_peers),
            use_ipfs=False,
            identity_path=str(identity.path),
            check_if_identity_free=False,
        )
    _IDENTITY_KEYS[dht.peer_id.to_base58()] = identity.private_key
    return dht


def collaborative_optimizer(
    dht: hivemind.DHT,
    run: RunManifest,
    parameters: Iterable[torch.nn.Parameter],
    micro_batch_size: int,
    **options: Any,
) -> hivemind.Optimizer:
    """`run`'s hivemind.Optimizer over `parameters` as a dialable node makes it on `dht` (started by `loopback_dht`):
    no group bits, signing with the DHT's identity key; `options` go to make_optimizer as they are."""
    return make_optimizer(
        dht=dht,
        manifest=run,
        parameters=parameters,
        micro_batch_size=micro_batch_size,
        client_mode=False,
        group_bits="",
        private_key=identity_key(dht),
        partial_counter=new_partial_counter(),
        **options,
    )


@contextlib.contextmanager
def diloco_peers(run: RunManifest, num_peers: int, start: Sequence[torch.Tensor]) -> Iterator[list[DiLoCoMode]]:
    """`num_peers` real DiLoCoModes on loopback DHTs, each over a replica of the tensors `start`; all closed after."""
    dhts = loopback_dhts(num_peers)
    statuses = [proto.PeerStatus(peer_id=dht.peer_id.to_base58()) for dht in dhts]
    modes: list[DiLoCoMode] = []
    try:
        for dht, status in zip(dhts, statuses, strict=True):
            parameters = [torch.nn.Parameter(value.clone()) for value in start]
            modes.append(DiLoCoMode(_context(run, dht, status, statuses, parameters, None)))
        yield modes
    finally:
        close_peers(modes, dhts)


@contextlib.contextmanager
def spes_peers(run: RunManifest, num_peers: int, micro_batch_size: int = 4) -> Iterator[list[SPESMode]]:
    """`num_peers` real SPESModes on loopback DHTs, each over its own replica of `run`'s model (the same initial
    weights), computing on the CPU; all closed after. The peers' statuses carry no measured compute: equal shares."""
    with computing_peers(run, num_peers, SPESMode, micro_batch_size) as modes:
        yield modes


@contextlib.contextmanager
def computing_peers(
    run: RunManifest, num_peers: int, mode_class: type[M], micro_batch_size: int = 4
) -> Iterator[list[M]]:
    """`num_peers` real modes of `mode_class` (DiLoCoMode or SPESMode) over replicas of `run`'s model, computing
    on the CPU, on loopback DHTs; all closed after."""
    dhts = loopback_dhts(num_peers)
    statuses = [proto.PeerStatus(peer_id=dht.peer_id.to_base58()) for dht in dhts]
    modes: list[M] = []
    try:
        for dht in dhts:
            modes.append(computing_peer(run, dht, statuses, mode_class, micro_batch_size))
        yield modes
    finally:
        close_peers(modes, dhts)


def spes_peer(
    run: RunManifest, dht: hivemind.DHT, statuses: Sequence[proto.PeerStatus], micro_batch_size: int = 4
) -> SPESMode:
    """One real SPESMode over a new replica of `run`'s model on `dht`, seeing the swarm `statuses`."""
    return computing_peer(run, dht, statuses, SPESMode, micro_batch_size)


def computing_peer(
    run: RunManifest,
    dht: hivemind.DHT,
    statuses: Sequence[proto.PeerStatus],
    mode_class: type[M],
    micro_batch_size: int = 4,
    *,
    client_mode: bool = False,
) -> M:
    """One real mode of `mode_class` over a new replica of `run`'s model on `dht`, seeing the swarm `statuses`;
    `client_mode`: as a node peers can't dial (behind a NAT)."""
    model = build_model(run.model, 260, seed=0)
    status = proto.PeerStatus(peer_id=dht.peer_id.to_base58())
    compute = cpu_compute(run, model)
    context = _context(run, dht, status, statuses, list(model.parameters()), compute, micro_batch_size)
    return mode_class(dataclasses.replace(context, client_mode=client_mode))


def cpu_compute(run: RunManifest, model: torch.nn.Module) -> LocalCompute:
    """`model`'s forward and backward on the CPU in `run`'s precision, as a node's training loop computes them."""
    return LocalCompute(
        model=model,
        kind=model_kind(run.model),
        micro_step=MicroStep(precision_for_device(run.model.precision, "cpu"), "cpu"),
        device="cpu",
        generator=torch.Generator().manual_seed(0),
        phases=PhaseAccumulator(),
    )


def _context(
    run: RunManifest,
    dht: hivemind.DHT,
    status: proto.PeerStatus,
    statuses: Sequence[proto.PeerStatus],
    parameters: Sequence[torch.nn.Parameter],
    compute: LocalCompute | None,
    micro_batch_size: int = 8,
) -> ModeContext:
    return ModeContext(
        dht=dht,
        manifest=run,
        peer_id=status.peer_id,
        private_key=identity_key(dht),
        parameters=parameters,
        compute=compute,
        micro_batch_size=micro_batch_size,
        client_mode=False,
        auxiliary=False,
        swarm=SwarmView(plan_share=None, statuses=statuses),
        partial_counter=new_partial_counter(),
    )


def close_peers(modes: Sequence[DiLoCoMode], dhts: Sequence[hivemind.DHT]) -> None:
    """Close every mode, then every DHT."""
    for mode in modes:
        mode.close()
    for dht in dhts:
        dht.shutdown()
