"""Calling other nodes' stages: the client side of SkipPipe's hops (`hop_wire`), which `StageService` inherits.

A stage-0 node sends a microbatch's hidden states to the next node of its path, and their gradient back along it
(`call`); it tells every node when it is done with an iteration (`say_done`); a node asks another which iteration it
serves (`ping`); a stage's replicas fetch each other's gradient of an iteration (`fetch_gradient`) and a joiner a
replica's state (`fetch_state`). Every call is bounded by its timeout, and every answer is checked as a request is
(`hop_wire.receive_frames`: the shape, exactly its bytes, finite values); a call that gets no answer raises
`HopFailedError` with a sentence, and every call raises `NodeStopping` once the node is stopping.
"""

from __future__ import annotations

import asyncio
import logging
import time
import typing
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import P2PHandlerError, PeerID

from crowdtrain import proto
from crowdtrain.modes.skippipe.hops.hop_wire import (
    BUSY,
    GRADIENT_DTYPES,
    MAX_FINGERPRINT,
    NAMESPACE,
    WIRE_DTYPES,
    HopFailedError,
    HopLimits,
    HopRefusedError,
    encode_frames,
    prepend,
    receive_frames,
    stream_values,
)
from crowdtrain.rpc.service import NodeStopping, P2PService

logger = logging.getLogger(__name__)

GRADIENT_RETRY_S = 0.02
"""Between asks for a replica's gradient that is not published yet."""


class StageCalls(P2PService):
    """The calls a node makes on other nodes' stages; `StageService`, which serves them, sets what they read."""

    stage: int
    """The stage this node serves: the one whose gradient and state it asks its replicas for."""
    limits: HopLimits
    """The largest hidden states an answer may carry."""
    bytes_sent: int
    bytes_received: int

    def call(
        self, peer_id: str, call: str, header: proto.StageHop, tensor: torch.Tensor, timeout_s: float
    ) -> torch.Tensor:
        """Send `tensor` to `peer_id`'s `rpc_stage_<call>` ("forward" or "backward") under `header` (iteration,
        microbatch, stage, wire dtype) and return its answer, float32; HopFailedError with a sentence if none."""
        where = f"peer {peer_id[-8:]}"
        try:
            return self.run(self._call(PeerID.from_base58(peer_id), call, header, tensor, where), timeout_s)
        except (HopFailedError, NodeStopping):
            raise
        except TimeoutError:
            raise HopFailedError(f"{where} did not answer a stage {call} within {timeout_s:.1f} s") from None
        except Exception as e:
            refused = isinstance(e, P2PHandlerError)
            raise HopFailedError(f"{where} failed a stage {call}: {e}", busy=BUSY in str(e), refused=refused) from None

    async def _call(
        self, peer: PeerID, call: str, header: proto.StageHop, tensor: torch.Tensor, where: str
    ) -> torch.Tensor:
        async def frames() -> AsyncIterator[proto.StageHop]:
            for frame in encode_frames(tensor, header, header.dtype):
                self.bytes_sent += len(frame.payload)
                yield frame

        answers = await getattr(self._stub(peer), f"rpc_stage_{call}")(frames())
        try:

            def failed(reason: str) -> HopFailedError:
                return HopFailedError(f"{where}: {reason}")

            reply, shape, payload = await receive_frames(answers, self.limits.check_shape, failed, to_end=False)
            answer = stream_values(reply, shape, payload, failed)
        finally:
            await answers.aclose()
        self.bytes_received += answer.numel() * WIRE_DTYPES[reply.dtype].itemsize
        if (reply.iteration, reply.microbatch, reply.stage) != (header.iteration, header.microbatch, header.stage):
            raise HopFailedError(f"{where} answered for another microbatch or stage")
        if answer.shape != tensor.shape:
            raise HopFailedError(f"{where} answered shape {list(answer.shape)} for {list(tensor.shape)}")
        return answer

    def _stub(self, peer: PeerID | str) -> typing.Any:
        """The stub that calls `peer`'s stage RPCs."""
        peer_id = PeerID.from_base58(peer) if isinstance(peer, str) else peer
        return self.get_stub(self.require_p2p(), peer_id, namespace=NAMESPACE)

    def say_done(
        self, peers: typing.Collection[str], iteration: int, timeout_s: float, loss: float = 0.0, microbatches: int = 0
    ) -> list[str]:
        """Tell each of `peers`, all at once, that this source will send no more of `iteration` (and the mean `loss`
        of its `microbatches`); the peers that could not be told (each logged)."""
        request = proto.StageHop(iteration=iteration, loss=loss, microbatches=microbatches)

        async def tell(peer_id: str) -> str | None:
            try:
                await self._stub(peer_id).rpc_stage_done(request, timeout=timeout_s)  # the stub bounds it
            except Exception as e:
                logger.info(f"peer {peer_id[-8:]} was not told iteration {iteration} is done: {e!r}")
                return peer_id
            return None

        async def tell_all() -> list[str | None]:
            return await asyncio.gather(*(tell(peer) for peer in peers))

        return [peer for peer in self.run(tell_all(), timeout_s + 1.0) if peer is not None]

    def ping(self, peer_id: str, timeout_s: float) -> int | None:
        """The iteration `peer_id` serves (0 before any), or None if it does not answer within `timeout_s`."""
        try:
            answer = self.run(self._stub(peer_id).rpc_stage_ping(proto.StageHop(), timeout=timeout_s), timeout_s + 1.0)
        except NodeStopping:
            raise
        except Exception as e:
            logger.debug(f"peer {peer_id[-8:]} did not answer a ping: {e!r}")
            return None
        return int(answer.iteration)

    def fetch_gradient(
        self, peer_id: str, iteration: int, num_values: int, timeout_s: float, max_bytes_per_s: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`peer_id`'s gradient of `iteration` for this node's stage, `num_values` values (float32, whatever wire
        dtype they came in), and the fingerprint of its parameters before the step (None unless it sent one of
        MAX_FINGERPRINT finite values or fewer); waits up to `timeout_s` for it to be published; HopFailedError if
        it is not had. `max_bytes_per_s` > 0: a background exchange, to be sent paced at most this fast (infinity:
        at the answering node's own share of its upload)."""
        request = proto.StageHop(iteration=iteration, stage=self.stage, max_bytes_per_s=max_bytes_per_s)
        what = f"gradient of iteration {iteration}"
        header, gradient = self._fetch_flat(peer_id, "gradient", request, num_values, timeout_s, what)
        fingerprint = torch.tensor(list(header.fingerprint[:MAX_FINGERPRINT]), dtype=torch.float32)
        if len(header.fingerprint) > MAX_FINGERPRINT or not bool(fingerprint.isfinite().all()):
            return gradient, None
        return gradient, fingerprint

    def fetch_state(
        self, peer_id: str, num_values: int, timeout_s: float, stage: int | None = None, since: int = 0
    ) -> tuple[proto.StageHop, torch.Tensor]:
        """`peer_id`'s state of `stage` (default: this node's; `set_state_source`'s layout, `num_values` float32
        values) and its header (the iteration it is from, `since` or later, and the optimizer's steps), waiting
        up to `timeout_s` for one; HopFailedError if not had."""
        request = proto.StageHop(stage=self.stage if stage is None else stage, iteration=since)
        return self._fetch_flat(peer_id, "state", request, num_values, timeout_s, "state")

    def _fetch_flat(
        self, peer_id: str, call: str, request: proto.StageHop, num_values: int, timeout_s: float, what: str
    ) -> tuple[proto.StageHop, torch.Tensor]:
        where = f"peer {peer_id[-8:]}"
        deadline = time.monotonic() + timeout_s
        try:
            fetching = self._fetch(PeerID.from_base58(peer_id), call, request, num_values, deadline, where, what)
            reply, payload = self.run(fetching, timeout_s + 1.0)
        except (HopFailedError, NodeStopping):
            raise
        except Exception as e:
            raise HopFailedError(f"{where} did not send its {what}: {e!r}") from None
        # in the calling thread: a stage's gradient (millions of values) decoded on the loop held up every hop
        return reply, stream_values(reply, [num_values], payload, lambda reason: HopFailedError(f"{where}: {reason}"))

    async def _fetch(
        self,
        peer: PeerID,
        call: str,
        request: proto.StageHop,
        num_values: int,
        deadline: float,
        where: str,
        what: str,
    ) -> tuple[proto.StageHop, bytearray]:
        """The header and the bytes of one vector of `num_values` from `rpc_stage_<call>` (in the header's dtype,
        not decoded), asking again while the peer has none yet."""

        def flat(shape: typing.Sequence[int]) -> tuple[int, ...]:
            if list(shape) != [num_values]:
                raise HopRefusedError(f"a {what} of shape {list(shape)[:4]}, not [{num_values}]")
            return (num_values,)

        stub = self._stub(peer)
        while True:
            answers = await getattr(stub, f"rpc_stage_{call}")(request)
            try:
                header = await anext(answers, None)
                if header is not None and header.shape:
                    if header.stage != request.stage:
                        raise HopFailedError(f"{where} sent stage {header.stage}'s {what}, not stage {request.stage}'s")
                    reply, _, payload = await receive_frames(
                        prepend(header, answers),
                        flat,
                        lambda reason: HopFailedError(f"{where}: {reason}"),
                        to_end=False,
                        dtypes=GRADIENT_DTYPES if call == "gradient" else ("float32",),
                    )
                    self.bytes_received += len(payload)
                    return reply, payload
            finally:
                await answers.aclose()
            if time.monotonic() + GRADIENT_RETRY_S > deadline:
                raise HopFailedError(f"{where} had no {what} for stage {request.stage} in time")
            await asyncio.sleep(GRADIENT_RETRY_S)
