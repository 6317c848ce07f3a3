"""Replicas of one expert on several hosts: copy a live replica's weights, and average with replicas.

Every expert host serves `rpc_expert_parameters` (`proto/crowdtrain.proto`): the current parameters of an
expert it serves, as float32 values in the module's parameter order. A host that starts serving an
expert another live host serves copies that host's weights instead of starting from its checkpoint
or the initial weights; a host serving a replicated expert periodically pulls one other replica's
weights and moves its own halfway to them (pairwise gossip averaging: replicas that keep doing this
converge to a common value, and the experts' optimizers keep their own state).

Reads and writes of an expert's parameters are not synchronised with hivemind's runtime, which
steps the expert's optimizer in its own thread: a copy may mix the weights before and after one
step, the same tolerance hivemind's averagers have for parameters updated while they average.

An answer is admitted like every bulk answer (crowdtrain/rpc/bulk.py: ANSWER_LIMITS) before a value is read, and
encodes the parameters one chunk at a time as it sends them, so it holds one chunk, never a whole copy; past the
limits the asker is answered busy at once, and an answer that runs past its time is cut short.
"""

from __future__ import annotations

import logging
import threading
import typing
from collections.abc import Callable, Iterator

import hivemind
import numpy as np
import torch
from hivemind.p2p import P2PContext, PeerID
from torch import nn

from crowdtrain import proto
from crowdtrain.errors import CrowdtrainError
from crowdtrain.rpc.bulk import BulkGate, BulkLimits
from crowdtrain.rpc.service import NodeStopping, P2PService

logger = logging.getLogger(__name__)

NAMESPACE = "crowdtrain.experts.v1"
"""Prefix of the expert RPCs' protocol names; a new, incompatible protocol gets a new one."""
CHUNK_VALUES = 256 * 1024
"""float32 values per streamed message (1 MiB)."""
ANSWER_LIMITS = BulkLimits(max_answers=4, max_answers_per_peer=1, max_bytes=4 * CHUNK_VALUES * 4, answer_time_s=120.0)
"""What answering parameter requests may take of this host at once: four answers, one to any one peer, each holding
one chunk."""
FETCH_TIMEOUT_S = 60.0
_WIRE_DTYPE = np.dtype("<f4")


class ReplicaError(CrowdtrainError):
    """A replica's parameters could not be had (not served there, wrong size, non-finite, no answer)."""


def flat_parameters(module: nn.Module) -> torch.Tensor:
    """The module's parameters as one float32 vector on the CPU, in `parameters()` order."""
    with torch.no_grad():
        return torch.cat([parameter.detach().reshape(-1).to("cpu", torch.float32) for parameter in module.parameters()])


def num_values(module: nn.Module) -> int:
    """How many numbers the module's parameters hold."""
    return sum(parameter.numel() for parameter in module.parameters())


def mix_into(module: nn.Module, values: torch.Tensor, weight: float) -> None:
    """Parameters ← (1 − weight)·parameters + weight·values: 1 copies `values`, 0.5 averages with them."""
    if values.numel() != num_values(module):
        raise ValueError(f"{values.numel()} values for a module with {num_values(module)} parameters")
    offset = 0
    with torch.no_grad():
        for parameter in module.parameters():
            part = values[offset : offset + parameter.numel()].view_as(parameter).to(parameter.device, parameter.dtype)
            parameter.lerp_(part, weight)
            offset += parameter.numel()


class ReplicaService(P2PService):
    """Serves the parameters of the experts `lookup` finds; fetches other hosts' ones."""

    def __init__(
        self, dht: hivemind.DHT, lookup: Callable[[str], nn.Module | None], stop: threading.Event | None = None
    ):
        super().__init__(dht, NAMESPACE, thread_name="expert-replicas", stop=stop)
        self.lookup = lookup
        self.answers = BulkGate(ANSWER_LIMITS)

    async def rpc_expert_parameters(
        self, request: proto.ExpertParametersRequest, context: P2PContext
    ) -> typing.AsyncIterator[proto.ExpertParametersChunk]:
        """Stream the current parameters of the requested expert, `found: false` if not served here, or `busy`."""
        module = self.lookup(request.uid)
        if module is None:
            yield proto.ExpertParametersChunk(found=False)
            return
        peer = context.remote_id.to_base58()
        grant = self.answers.admit(peer, CHUNK_VALUES * _WIRE_DTYPE.itemsize)
        if grant is None:
            yield proto.ExpertParametersChunk(found=True, busy=True)
            return
        with grant:
            yield proto.ExpertParametersChunk(found=True, num_values=num_values(module))
            for payload in _chunks(module):
                if grant.expired():
                    logger.warning(f"expert {request.uid}'s copy for peer {peer[-8:]} ran past its time: cut short")
                    return
                yield proto.ExpertParametersChunk(payload=payload)

    def fetch(self, peer_id: str, uid: str, expected_values: int, timeout_s: float = FETCH_TIMEOUT_S) -> torch.Tensor:
        """Expert `uid`'s parameters as served by `peer_id`; raises ReplicaError with a sentence why not, or
        NodeStopping once the node is stopping."""
        try:
            return self.run(self._fetch(PeerID.from_base58(peer_id), uid, expected_values), timeout_s)
        except (ReplicaError, NodeStopping):
            raise
        except TimeoutError as e:
            raise ReplicaError(f"peer {peer_id[-8:]} did not send expert {uid} within {timeout_s:.0f} s") from e
        except Exception as e:
            raise ReplicaError(f"peer {peer_id[-8:]} could not send expert {uid}: {e}") from e

    async def _fetch(self, peer: PeerID, uid: str, expected_values: int) -> torch.Tensor:
        stub: typing.Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        where = f"peer {peer.to_base58()[-8:]}"
        responses = await stub.rpc_expert_parameters(proto.ExpertParametersRequest(uid=uid))
        received = bytearray()
        try:
            header = await anext(responses)
            if not header.found:
                raise ReplicaError(f"{where} does not serve expert {uid}")
            if header.busy:
                raise ReplicaError(f"{where} is sending as many expert copies as it may: asked again later")
            if header.num_values != expected_values:
                raise ReplicaError(
                    f"{where} has {header.num_values} parameters for expert {uid}, not {expected_values}: "
                    "a different run or version"
                )
            expected_bytes = expected_values * _WIRE_DTYPE.itemsize
            async for chunk in responses:
                received += chunk.payload
                if len(received) > expected_bytes:
                    raise ReplicaError(f"{where} sent more than the {expected_values} parameters of expert {uid}")
        finally:
            await responses.aclose()
        if len(received) != expected_bytes:
            raise ReplicaError(f"{where} sent {len(received)} of the {expected_bytes} bytes of expert {uid}")
        values = torch.from_numpy(np.frombuffer(bytes(received), dtype=_WIRE_DTYPE).astype(np.float32))
        if not bool(torch.isfinite(values).all()):
            raise ReplicaError(f"{where} sent non-finite parameters for expert {uid}")
        return values


def _chunks(module: nn.Module) -> Iterator[bytes]:
    """The module's parameters as little-endian float32 bytes, CHUNK_VALUES values at most a chunk, each read as it
    is sent."""
    with torch.no_grad():
        for parameter in module.parameters():
            flat = parameter.detach().reshape(-1)
            for offset in range(0, flat.numel(), CHUNK_VALUES):
                part = flat[offset : offset + CHUNK_VALUES].to("cpu", torch.float32)
                yield part.numpy().astype(_WIRE_DTYPE, copy=False).tobytes()
