"""Real DiLoCoModes in one process, for the outer-step tests and the wire benchmark.

Each peer is a real DiLoCoMode (its averager process, its progress tracker, a DHT on loopback) over its own
replica of the given tensors; nothing computes (compute=None): callers write what inner steps would have done
straight into the replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain import proto
from crowdtrain.averaging.exact import new_partial_counter
from crowdtrain.manifest import RunManifest
from crowdtrain.training.modes.base import ModeContext, SwarmView
from crowdtrain.training.modes.diloco import DiLoCoMode


def loopback_dhts(count: int) -> list[hivemind.DHT]:
    """`count` DHTs on loopback, every one after the first bootstrapped from it."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False)
    others = [
        hivemind.DHT(
            start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), use_ipfs=False
        )
        for _ in range(count - 1)
    ]
    return [first, *others]


@contextlib.contextmanager
def diloco_peers(run: RunManifest, num_peers: int, start: Sequence[torch.Tensor]) -> Iterator[list[DiLoCoMode]]:
    """`num_peers` real DiLoCoModes on loopback DHTs, each over a replica of the tensors `start`; all closed after."""
    dhts = loopback_dhts(num_peers)
    statuses = [proto.PeerStatus(peer_id=dht.peer_id.to_base58()) for dht in dhts]
    modes: list[DiLoCoMode] = []
    try:
        for dht, status in zip(dhts, statuses, strict=True):
            context = ModeContext(
                dht=dht,
                manifest=run,
                peer_id=status.peer_id,
                private_key=RSAPrivateKey(),
                parameters=[torch.nn.Parameter(value.clone()) for value in start],
                compute=None,
                micro_batch_size=8,
                client_mode=False,
                auxiliary=False,
                swarm=SwarmView(plan_share=None, statuses=statuses),
                partial_counter=new_partial_counter(),
            )
            modes.append(DiLoCoMode(context))
        yield modes
    finally:
        for mode in modes:
            mode.close()
        for dht in dhts:
            dht.shutdown()
