"""SPES's expert exchange: after each outer round, every node takes each expert it does not own from its owner.

An owner publishes, at the end of each round, the weights its experts reached (`publish`), and serves them by
round (`rpc_spes_expert`, `proto/crowdtrain.proto`): a header with the number of values, then float16 payload
chunks. It keeps the last `KEPT_ROUNDS` rounds, so a node one round behind still finds what it asks for. A
fetcher asks for an exact round and checks everything before use: the header's size against the expert's
shape in the model every node builds, the bytes received against it, every value finite. An owner that has
not reached the round yet answers `found: false`; the fetcher asks again until its deadline.

Each value travels once per fetcher, in float16: an owner uploads its experts to each other node, where a
DiLoCo all-reduce would send every value twice (reduce-scatter, then all-gather).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import typing
from collections import OrderedDict

import hivemind
import numpy as np
import torch
from hivemind.p2p import P2PContext, PeerID

from crowdtrain import proto
from crowdtrain.dht.service import P2PService
from crowdtrain.errors import CrowdtrainError

logger = logging.getLogger(__name__)

NAMESPACE = "crowdtrain.spes.v1"
"""Prefix of the exchange's protocol names; a new, incompatible protocol gets a new one."""
CHUNK_VALUES = 512 * 1024
"""float16 values per streamed message (1 MiB)."""
KEPT_ROUNDS = 2
"""Rounds of published experts an owner keeps."""
MAX_CONCURRENT_READS = 4
"""Expert requests this node answers at once; others wait their turn."""
RETRY_S = 0.25
"""Between asks to an owner that has not published the round yet."""
_WIRE_DTYPE = np.dtype("<f2")


class ExpertFetchError(CrowdtrainError):
    """An expert could not be had from its owner (not there, wrong size, non-finite, no answer in time)."""


class ExpertExchange(P2PService):
    """Serves this node's published experts by round; fetches other owners' ones."""

    def __init__(self, dht: hivemind.DHT):
        super().__init__(dht, NAMESPACE, thread_name="spes-experts")
        self._published: OrderedDict[int, dict[int, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self._reads: asyncio.Semaphore | None = None
        self.bytes_served = 0
        """Payload bytes this node has sent to fetchers."""

    def publish(self, round_: int, experts: dict[int, torch.Tensor]) -> None:
        """Serve `experts` (unit → its flattened weights) as the weights at round `round_`'s end."""
        encoded = {
            unit: values.detach().reshape(-1).to("cpu", torch.float16).numpy() for unit, values in experts.items()
        }
        with self._lock:
            self._published[round_] = encoded
            while len(self._published) > KEPT_ROUNDS:
                self._published.popitem(last=False)

    def published(self, round_: int, unit: int) -> np.ndarray | None:
        with self._lock:
            return self._published.get(round_, {}).get(unit)

    async def rpc_spes_expert(
        self, request: proto.SpesExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[proto.SpesExpertChunk]:
        """Stream unit `request.unit`'s weights at round `request.round`'s end, or `found: false`."""
        values = self.published(request.round, request.unit)
        if values is None:
            yield proto.SpesExpertChunk(found=False)
            return
        if self._reads is None:
            self._reads = asyncio.Semaphore(MAX_CONCURRENT_READS)
        async with self._reads:
            yield proto.SpesExpertChunk(found=True, num_values=values.size)
            for offset in range(0, values.size, CHUNK_VALUES):
                payload = values[offset : offset + CHUNK_VALUES].astype(_WIRE_DTYPE, copy=False).tobytes()
                self.bytes_served += len(payload)
                yield proto.SpesExpertChunk(payload=payload)

    def fetch(self, peer_id: str, unit: int, round_: int, expected_values: int, timeout_s: float) -> torch.Tensor:
        """Unit `unit`'s weights at round `round_`'s end from `peer_id`, float32, flattened; waits up to
        `timeout_s` for the owner to publish them. Raises ExpertFetchError with a sentence why not."""
        deadline = time.monotonic() + timeout_s
        try:
            return self.run(
                self._fetch(PeerID.from_base58(peer_id), unit, round_, expected_values, deadline), timeout_s
            )
        except ExpertFetchError:
            raise
        except TimeoutError as e:
            raise ExpertFetchError(
                f"peer {peer_id[-8:]} did not send expert {unit} of round {round_} within {timeout_s:.0f} s"
            ) from e
        except Exception as e:
            raise ExpertFetchError(f"peer {peer_id[-8:]} could not send expert {unit}: {e!r}") from e

    async def _fetch(self, peer: PeerID, unit: int, round_: int, expected_values: int, deadline: float) -> torch.Tensor:
        stub: typing.Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        where = f"peer {peer.to_base58()[-8:]}"
        request = proto.SpesExpertRequest(unit=unit, round=round_)
        while True:
            responses = await stub.rpc_spes_expert(request)
            received = bytearray()
            try:
                header = await anext(responses)
                if header.found:
                    if header.num_values != expected_values:
                        raise ExpertFetchError(
                            f"{where} has {header.num_values} values for expert {unit}, not {expected_values}: "
                            "a different model"
                        )
                    expected_bytes = expected_values * _WIRE_DTYPE.itemsize
                    async for chunk in responses:
                        received += chunk.payload
                        if len(received) > expected_bytes:
                            raise ExpertFetchError(
                                f"{where} sent more than the {expected_values} values of expert {unit}"
                            )
                    if len(received) != expected_bytes:
                        raise ExpertFetchError(
                            f"{where} sent {len(received)} of the {expected_bytes} bytes of expert {unit}"
                        )
                    break
            finally:
                await responses.aclose()
            if time.monotonic() + RETRY_S > deadline:
                raise ExpertFetchError(f"{where} has no expert {unit} of round {round_} (not its owner, or behind)")
            await asyncio.sleep(RETRY_S)
        values = torch.from_numpy(np.frombuffer(bytes(received), dtype=_WIRE_DTYPE).astype(np.float32))
        if not bool(torch.isfinite(values).all()):
            raise ExpertFetchError(f"{where} sent non-finite weights for expert {unit}")
        return values
