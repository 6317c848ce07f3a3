"""SPES's expert exchange: after each outer round, every node takes each expert it does not own from its owner.

Every node holds a copy of every expert, tagged with the round it is from; copies of one round are the same bits
on every node. At a round's end an owner makes the expert's new copy from its trained weights θ as
P_r = P_b + int8(θ − P_b), with P_b its copy from round b (usually r − 1): the change is quantized (hivemind's
uniform 8-bit codebook, crowdtrain/codecs/compression.py), and P_r is what every node reconstructs from it,
bit for bit. The owner keeps training θ; what the quantization left out of P_r stays in θ − P_r and travels
with the next round's change (error feedback, without a residual to keep). `publish` serves P_r by round
(`rpc_spes_expert`, `proto/crowdtrain.proto`): as the int8 change to a fetcher whose copy is P_b, in float32
to any other (a joiner, or a node that missed a round). An owner keeps the last `KEPT_ROUNDS` rounds.

A fetcher asks for an exact round and checks everything before use: the header's encoding, base round and size
against the expert's shape in the model every node builds, the bytes received against it, every value finite.
An owner that has not reached the round yet answers `found: false`; the fetcher asks again until its deadline.
A round's experts are fetched MAX_CONCURRENT_FETCHES copies at a time (`fetch_all`), each expert written into the
model once its copies are in, so the round's exchange waits for the slowest owner, not for the sum of them. An
expert with several owners (`spes.replicas`) comes from each of them: every node makes its copy of the round the
mean of the owners' copies (modes/spes/mode.py).

Each value travels once per fetcher, in one byte: a DiLoCo all-reduce sends each value of the model twice
(reduce-scatter, then all-gather), in two bytes under its default fp16.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
import typing
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import hivemind
import numpy as np
import torch
from hivemind.p2p import P2PContext, PeerID

from crowdtrain import proto
from crowdtrain.codecs.compression import decode_int8_blocks, encode_int8_blocks, int8_blocks_size
from crowdtrain.errors import CrowdtrainError
from crowdtrain.rpc.bulk import BulkGate, BulkLimits, within_time
from crowdtrain.rpc.service import NodeStopping, P2PService, linger

logger = logging.getLogger(__name__)

NAMESPACE = "crowdtrain.spes.v2"
"""Prefix of the exchange's protocol names; a new, incompatible protocol gets a new one."""
CHUNK_BYTES = 1 << 20
"""Payload bytes per streamed message."""
KEPT_ROUNDS = 2
"""Rounds of published experts an owner keeps."""
ANSWER_LIMITS = BulkLimits(max_answers=4, max_answers_per_peer=2, max_bytes=4 << 20, answer_time_s=120.0)
"""What answering expert requests may take of this node at once: four answers, two to any one peer, each holding
one chunk (a copy's values are encoded chunk by chunk as they are sent). A request past them is answered busy at
once and asked again by its fetcher, RETRY_S later."""
RETRY_S = 0.25
"""Between asks to an owner that has not published the round yet."""
MAX_CONCURRENT_FETCHES = 4
"""Experts a node fetches at once after a round (`fetch_all`): one after another, a round's exchange would take the
sum of every owner's latency and publishing delay; as many at once as an owner answers (ANSWER_LIMITS)."""
FETCH_ALL_SLACK_S = 5.0
"""`fetch_all`'s fetches end at its deadline; the call itself gives up this much later (never reached)."""
MAX_CUT_SHORT = 2
"""Asks again after a stream that ended before its announced bytes, at most this many times."""
DIGEST_BYTES = 16
BLOCK = 256
"""Values per int8 block of a change (each block has its own scale)."""
_FULL_DTYPE = np.dtype("<f4")


class ExpertFetchError(CrowdtrainError):
    """An expert could not be had from its owner (not there, wrong size, non-finite, no answer in time)."""


def _explained(error: Exception, peer_id: str, unit: int, round_: int, timeout_s: float) -> ExpertFetchError:
    """A failed fetch as an ExpertFetchError with a sentence."""
    if isinstance(error, ExpertFetchError):
        return error
    if isinstance(error, TimeoutError):
        return ExpertFetchError(
            f"peer {peer_id[-8:]} did not send expert {unit} of round {round_} within {timeout_s:.0f} s"
        )
    return ExpertFetchError(f"peer {peer_id[-8:]} could not send expert {unit}: {error!r}")


class _CutShort(ExpertFetchError):
    """The owner's answer ended before its header, or before the bytes its header announced."""


@dataclass(frozen=True, slots=True)
class Published:
    """An expert's copy at a round's end, as its owner serves it."""

    values: torch.Tensor
    """P', float32, flattened."""
    base_digest: bytes
    """`copy_digest` of the copy P the change is from; empty: none (only the full values are served)."""
    change: bytes
    """The int8 change P' − P (`encode_change`); empty without a base."""
    digest: bytes = b""
    """`copy_digest(values)`, computed when published."""


def encode_change(base: torch.Tensor, target: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """The int8 change from `base` toward `target` (float32, flattened) in blocks of BLOCK values
    (`encode_int8_blocks`), and the copy it makes: base + change."""
    buffer = encode_int8_blocks((target.float() - base).reshape(-1), block=BLOCK)
    return buffer, apply_change(base, buffer)


def apply_change(base: torch.Tensor, buffer: bytes) -> torch.Tensor:
    """base + the int8 change in `buffer`; ValueError for a buffer that is not one for base's size."""
    return base + decode_int8_blocks(buffer, base.numel(), block=BLOCK)


def copy_digest(values: torch.Tensor) -> bytes:
    """A 16-byte digest of a copy's float32 bits: what a change applies to, and what a fetched copy must be."""
    return hashlib.blake2b(values.detach().float().contiguous().numpy().tobytes(), digest_size=DIGEST_BYTES).digest()


def change_bytes(num_values: int) -> int:
    """The size of an int8 change of `num_values` values: a float32 scale per block, a byte per value."""
    return int8_blocks_size(num_values, block=BLOCK)


class ExpertExchange(P2PService):
    """Serves this node's published experts by round; fetches other owners' ones."""

    def __init__(self, dht: hivemind.DHT, stop: threading.Event | None = None):
        super().__init__(dht, NAMESPACE, thread_name="spes-experts", stop=stop)
        self._published: OrderedDict[int, dict[int, Published]] = OrderedDict()
        self._lock = threading.Lock()
        self.gate = BulkGate(ANSWER_LIMITS)
        """Admission of the answers this node serves (`rpc_spes_expert`)."""
        self.bytes_served = 0
        """Payload bytes this node has sent to fetchers (a stream cut short counts what was sent of it)."""
        self.asks_repeated = 0
        """Asks this node repeated after an owner's answer was cut short (each may have cost the owner a copy)."""
        self.unreachable: set[str] = set()
        """The owners the last `fetch_all` asked that never answered: every fetch from them failed in transport or
        timed out (none sent a copy or a refusal)."""

    def publish(self, round_: int, experts: dict[int, Published]) -> None:
        """Serve `experts` (unit → its copy) as the copies at round `round_`'s end."""
        digested = {unit: dataclasses.replace(copy, digest=copy_digest(copy.values)) for unit, copy in experts.items()}
        with self._lock:
            self._published[round_] = digested
            while len(self._published) > KEPT_ROUNDS:
                self._published.popitem(last=False)

    def published(self, round_: int, unit: int) -> Published | None:
        with self._lock:
            return self._published.get(round_, {}).get(unit)

    async def rpc_spes_expert(
        self, request: proto.SpesExpertRequest, context: P2PContext
    ) -> typing.AsyncIterator[proto.SpesExpertChunk]:
        """Stream unit `request.unit`'s copy of round `request.round`: the change from the fetcher's copy when its
        digest is `request.base_digest`, else the full values; or `found: false`, with `busy` when this node
        answers as many requests as it may (ANSWER_LIMITS)."""
        with self._lock:
            round_published = self._published.get(request.round)
        copy = None if round_published is None else round_published.get(request.unit)
        if copy is None:
            yield proto.SpesExpertChunk(found=False, not_owner=round_published is not None)
        else:
            as_change = bool(copy.base_digest) and request.base_digest == copy.base_digest
            size = len(copy.change) if as_change else copy.values.numel() * _FULL_DTYPE.itemsize
            grant = self.gate.admit(context.remote_id.to_base58(), min(size, CHUNK_BYTES))
            if grant is None:
                yield proto.SpesExpertChunk(found=False, busy=True)
            else:
                with grant:
                    async for chunk in within_time(grant, self._answer(copy, as_change), "an answer of expert values"):
                        yield chunk
        await linger()  # the fetcher closes the stream once it has the answer (protocol v2)

    async def _answer(self, copy: Published, as_change: bool) -> typing.AsyncIterator[proto.SpesExpertChunk]:
        """The found copy's header, payload chunk by chunk and end marker."""
        yield proto.SpesExpertChunk(found=True, num_values=copy.values.numel(), change=as_change, digest=copy.digest)
        for chunk in _payload_chunks(copy, as_change):
            self.bytes_served += len(chunk)
            yield proto.SpesExpertChunk(payload=chunk)
        yield proto.SpesExpertChunk()  # the end of the answer: read by a fetcher only when it came short

    def fetch(self, peer_id: str, unit: int, round_: int, held: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Unit `unit`'s copy of round `round_` from `peer_id`, float32, flattened. `held`: this node's copy, which
        a change applies to. Waits up to `timeout_s` for the owner to publish the round. Raises ExpertFetchError
        with a sentence why not."""
        try:
            fetching = self._fetch(PeerID.from_base58(peer_id), unit, round_, held, time.monotonic() + timeout_s)
            return self.run(fetching, timeout_s)
        except NodeStopping:
            raise
        except Exception as e:
            raise _explained(e, peer_id, unit, round_, timeout_s) from e

    def fetch_all(
        self,
        owners: Mapping[int, Sequence[str]],
        round_: int,
        timeout_s: float,
        held: Callable[[int], torch.Tensor],
        take: Callable[[int, dict[str, torch.Tensor]], None],
    ) -> dict[int, dict[str, str]]:
        """Every unit of `owners` (unit → the peer IDs of the owners to fetch it from), round `round_`, fetched
        MAX_CONCURRENT_FETCHES copies at a time within `timeout_s` in all: `held(unit)` gives this node's copy as a
        unit's fetches start, `take(unit, copies)` gets the copies that came (owner → values) once each of the
        unit's owners has answered or failed, and at least one came (both in the exchange's thread, while the
        caller waits here, so few copies are in memory at once). Returns why each copy that did not come failed
        (unit → owner → a sentence)."""
        deadline = time.monotonic() + timeout_s
        failures: dict[int, dict[str, str]] = {}
        answered: set[str] = set()

        async def fetch_one(slots: asyncio.Semaphore, unit: int, peer_id: str, base: torch.Tensor) -> torch.Tensor:
            async with slots:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                return await asyncio.wait_for(
                    self._fetch(PeerID.from_base58(peer_id), unit, round_, base, deadline), left
                )

        async def fetch_unit(slots: asyncio.Semaphore, unit: int, peer_ids: Sequence[str]) -> None:
            base = held(unit)
            answers = await asyncio.gather(
                *(fetch_one(slots, unit, peer_id, base) for peer_id in peer_ids), return_exceptions=True
            )
            copies: dict[str, torch.Tensor] = {}
            for peer_id, answer in zip(peer_ids, answers, strict=True):
                if isinstance(answer, torch.Tensor | ExpertFetchError):
                    answered.add(peer_id)  # a copy, or the owner's answer refused
                if isinstance(answer, torch.Tensor):
                    copies[peer_id] = answer
                elif isinstance(answer, Exception):
                    reason = str(_explained(answer, peer_id, unit, round_, timeout_s))
                    failures.setdefault(unit, {})[peer_id] = reason
                else:
                    raise answer  # cancelled: the call as a whole gives up
            if copies:
                take(unit, copies)

        async def fetch_every_one() -> None:
            slots = asyncio.Semaphore(MAX_CONCURRENT_FETCHES)
            await asyncio.gather(*(fetch_unit(slots, unit, peer_ids) for unit, peer_ids in owners.items()))

        self.run(fetch_every_one(), timeout_s + FETCH_ALL_SLACK_S)
        self.unreachable = {peer for why in failures.values() for peer in why} - answered
        return failures

    async def _fetch(self, peer: PeerID, unit: int, round_: int, held: torch.Tensor, deadline: float) -> torch.Tensor:
        where = f"peer {peer.to_base58()[-8:]}"
        request = proto.SpesExpertRequest(unit=unit, round=round_, base_digest=copy_digest(held))
        header, payload = await self._ask_until_found(peer, request, held, where, deadline)
        if header.change:
            try:
                values = apply_change(held, payload)
            except ValueError as e:
                raise ExpertFetchError(f"{where} sent an unreadable change of expert {unit}: {e}") from None
        else:
            values = torch.from_numpy(np.frombuffer(payload, dtype=_FULL_DTYPE).astype(np.float32))
        if not bool(torch.isfinite(values).all()):
            raise ExpertFetchError(f"{where} sent non-finite weights for expert {unit}")
        if copy_digest(values) != header.digest:
            raise ExpertFetchError(f"{where} sent expert {unit}, but not the copy its digest names")
        return values

    async def _ask_until_found(
        self, peer: PeerID, request: proto.SpesExpertRequest, held: torch.Tensor, where: str, deadline: float
    ) -> tuple[proto.SpesExpertChunk, bytes]:
        """The owner's answer (header, payload), asked again RETRY_S apart while it has no copy of the round yet or
        is busy, until `deadline`."""
        cut_short = 0
        while True:
            try:
                received = await self._receive(peer, request, held, where)
            except _CutShort as e:
                # the stream ended before its announced bytes (about 1 fetch in 10,000 while owners closed first; not
                # seen since the fetcher closes, see `linger`): ask again, a few times
                cut_short += 1
                self.asks_repeated += 1
                if cut_short > MAX_CUT_SHORT or time.monotonic() + RETRY_S > deadline:
                    raise ExpertFetchError(str(e)) from None
                received = None
            header, payload = received if received is not None else (None, None)
            if header is not None and payload is not None:
                return header, payload
            if time.monotonic() + RETRY_S > deadline:
                unit, round_ = request.unit, request.round
                if header is not None and header.busy:
                    raise ExpertFetchError(f"{where} was busy answering others until the deadline for expert {unit}")
                raise ExpertFetchError(f"{where} has no expert {unit} of round {round_} (not its owner, or behind)")
            await asyncio.sleep(RETRY_S)

    async def _receive(
        self, peer: PeerID, request: proto.SpesExpertRequest, held: torch.Tensor, where: str
    ) -> tuple[proto.SpesExpertChunk, bytes | None]:
        """One ask: the header and the payload; no payload when the owner has no such copy (yet) or is busy (the
        header says which)."""
        stub: typing.Any = self.get_stub(self.require_p2p(), peer, namespace=NAMESPACE)
        responses = await stub.rpc_spes_expert(request)
        try:
            header = await anext(responses, None)
            if header is None:
                raise _CutShort(f"{where}'s answer for expert {request.unit} ended before its header")
            if not header.found and header.not_owner:
                raise ExpertFetchError(f"{where} did not own expert {request.unit} in round {request.round}")
            if not header.found:
                return header, None
            size = self._expected_size(header, held, where, request.unit)
            received = bytearray()
            while len(received) < size:  # read to the announced size, then close the stream (the owner waits)
                chunk = await anext(responses, None)
                if chunk is None:
                    break
                if not chunk.payload:
                    raise ExpertFetchError(f"{where} sent {len(received)} of {size} bytes of expert {request.unit}")
                received += chunk.payload
                if len(received) > size:
                    raise ExpertFetchError(f"{where} sent over {size} bytes for expert {request.unit}")
            if len(received) != size:
                raise _CutShort(f"{where} sent {len(received)} of {size} bytes of expert {request.unit}")
            return header, bytes(received)
        finally:
            await responses.aclose()

    @staticmethod
    def _expected_size(header: proto.SpesExpertChunk, held: torch.Tensor, where: str, unit: int) -> int:
        """The payload bytes the header announces, once it is checked against what this node expects."""
        num_values = held.numel()
        if header.num_values != num_values:
            raise ExpertFetchError(f"{where} has {header.num_values} values for expert {unit}, not {num_values}")
        if len(header.digest) != DIGEST_BYTES:
            raise ExpertFetchError(f"{where} sent expert {unit} without its copy's digest")
        if header.change:
            return change_bytes(num_values)
        return num_values * _FULL_DTYPE.itemsize


def _payload_chunks(copy: Published, as_change: bool) -> typing.Iterator[bytes]:
    """The answer's payload, CHUNK_BYTES at a time: slices of the change, or the values encoded one chunk at a time
    (never a whole copy of them)."""
    if as_change:
        for offset in range(0, len(copy.change), CHUNK_BYTES):
            yield copy.change[offset : offset + CHUNK_BYTES]
        return
    step = CHUNK_BYTES // _FULL_DTYPE.itemsize
    values = copy.values.detach().reshape(-1)
    for start in range(0, values.numel(), step):
        yield values[start : start + step].numpy().astype(_FULL_DTYPE).tobytes()
