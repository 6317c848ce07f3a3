"""hivemind's ConnectionHandler with every expert request checked before it runs (moe/requests.py).

A refused request is one log line here and its sentence at the caller; the handler process goes on serving.
"""

from __future__ import annotations

import contextlib
import logging
import typing
from collections.abc import Iterator
from typing import Any, NoReturn

from hivemind.moe.server.connection_handler import ConnectionHandler
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.p2p import P2PContext
from hivemind.p2p.p2p_daemon import DEFAULT_MAX_MSG_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from crowdtrain.dht.frames import install_frame_cap
from crowdtrain.dht.gate import AdmissionGated
from crowdtrain.moe.requests import (
    MAX_FRAME_BYTES,
    RefusedRequestError,
    StreamedRequest,
    check_tensors,
    request_shapes,
)
from crowdtrain.rpc.service import drain

logger = logging.getLogger(__name__)


class BoundedConnectionHandler(AdmissionGated, ConnectionHandler):
    """Serves the experts of `module_backends` to callers, refusing requests that don't fit their schemas and, in
    an invite-only run, callers without a valid access token (the daemon's process gate, which the handler
    processes inherit when they fork).

    The `rpc_*` annotations use `typing.AsyncIterator`: hivemind tells a stream from a unary call by that name.
    """

    def __init__(self, dht: Any, module_backends: dict[str, ModuleBackend], *, max_batch_size: int):
        super().__init__(dht, module_backends)
        self.shapes = {
            (uid, call): shape
            for uid, backend in module_backends.items()
            for call, shape in zip(("forward", "backward"), request_shapes(backend, max_batch_size), strict=True)
        }
        """What each expert's forward and backward requests must look like, by (uid, call)."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return ConnectionHandler._get_handle_name(namespace, method_name)  # callers dial hivemind's protocol names

    def run(self) -> None:
        _bound_frames_and_quiet_refusals()  # in this forked process only: it serves expert calls and nothing else
        super().run()

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        self._backend(request.uid, "info", context)
        return await super().rpc_info(request, context)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=await self._unary(request, "forward", context))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=await self._unary(request, "backward", context))

    def rpc_forward_stream(
        self, requests: typing.AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        return self._stream(requests, "forward", context)

    def rpc_backward_stream(
        self, requests: typing.AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        return self._stream(requests, "backward", context)

    async def _stream(
        self, requests: typing.AsyncIterator[runtime_pb2.ExpertRequest], call: str, context: P2PContext
    ) -> typing.AsyncIterator[runtime_pb2.ExpertResponse]:
        """A streamed forward or backward: the checked request gathered, run in the call's pool, its answer sent in
        parts of at most hivemind's message size."""
        uid, inputs = await self._gather(requests, call, context)
        answer = await self._process(uid, call, inputs)
        for part in (part for tensor in answer for part in split_for_streaming(tensor, DEFAULT_MAX_MSG_SIZE)):
            yield runtime_pb2.ExpertResponse(tensors=[part])

    async def _unary(
        self, request: runtime_pb2.ExpertRequest, call: str, context: P2PContext
    ) -> list[runtime_pb2.Tensor]:
        """A unary forward or backward: the request checked against the call's schema, then run in its pool."""
        self._backend(request.uid, call, context)
        with self._refusals(call, context):
            inputs = check_tensors(request.tensors, self.shapes[request.uid, call])
        return await self._process(request.uid, call, inputs)

    async def _process(self, uid: str, call: str, inputs: list[Any]) -> list[runtime_pb2.Tensor]:
        """Checked inputs run in the call's pool of expert `uid`, the answer serialized as the call's schema says."""
        backend = self.module_backends[uid]
        if call == "forward":
            return await self._process_inputs(inputs, backend.forward_pool, backend.outputs_schema)
        return await self._process_inputs(inputs, backend.backward_pool, backend.grad_inputs_schema)

    async def _gather(
        self, requests: typing.AsyncIterator[runtime_pb2.ExpertRequest], call: str, context: P2PContext
    ) -> tuple[str, list[Any]]:
        uid, streamed = "", None
        try:
            async for request in requests:
                if streamed is None:
                    uid = request.uid
                    self._backend(uid, call, context)
                    streamed = StreamedRequest(self.shapes[uid, call])
                elif request.uid != uid:
                    self._refuse(f"the stream names expert {request.uid[:80]!r} after {uid!r}", call, context)
                with self._refusals(call, context):
                    streamed.add(request.tensors)
        except RefusedRequestError:
            await drain(requests)  # so that the refusal reaches the caller
            raise
        if streamed is None:
            self._refuse("the stream is empty", call, context)
        with self._refusals(call, context):
            return uid, streamed.tensors()

    def _backend(self, uid: str, call: str, context: P2PContext) -> ModuleBackend:
        backend = self.module_backends.get(uid)
        if backend is None:
            self._refuse(f"expert {uid[:80]!r} is not served here", call, context)
        return backend

    @contextlib.contextmanager
    def _refusals(self, call: str, context: P2PContext) -> Iterator[None]:
        try:
            yield
        except RefusedRequestError as e:
            self._refuse(str(e), call, context)

    def _refuse(self, reason: str, call: str, context: P2PContext) -> NoReturn:
        logger.warning(f"refused an expert {call} request from peer {context.remote_id.to_base58()[-8:]}: {reason}")
        raise RefusedRequestError(f"expert {call} refused: {reason}") from None


class _FrameTooLargeError(RefusedRequestError):
    """A frame of an expert stream over MAX_FRAME_BYTES."""

    def __init__(self, num_bytes: int):
        super().__init__(f"a frame of {num_bytes} bytes is over the {MAX_FRAME_BYTES} cap")


class _QuietRefusals(logging.Filter):
    """Drops hivemind's traceback for a request this module refused: its one line is already logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RefusedRequestError))


def _bound_frames_and_quiet_refusals() -> None:
    """Symptom worked around: hivemind's stream handlers read each frame whole, however long its header says it
    is (an 8-byte length), and log a traceback for any exception a handler raises. In the handler process, a
    frame is read only up to MAX_FRAME_BYTES, and a refusal is the one line `_refuse` logged."""
    install_frame_cap(MAX_FRAME_BYTES, _FrameTooLargeError, what="an expert stream frame")
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_QuietRefusals())
