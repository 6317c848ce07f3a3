"""An expert host checks every forward and backward request before it runs (moe/requests.py, moe/connection.py):
the checks alone, then a real host refusing oversized and malformed requests and serving honest ones after, and
an invite-only run's host serving nobody without an access token."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.moe.client.expert import RemoteExpert, get_server_stub
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.moe.expert_uid import ExpertInfo
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.streaming import split_for_streaming
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from crowdtrain.dht.admission import AccessChecker
from crowdtrain.dht.gate import AdmissionGate, AdmissionRecords, set_process_gate
from crowdtrain.dht.records import load_public_key, peer_id_of_public_key
from crowdtrain.manifest import expert_uids
from crowdtrain.moe.experts import MAX_BATCH_SEQUENCES, build_expert, make_backend
from crowdtrain.moe.hosting import ExpertHost, HostOptions
from crowdtrain.moe.requests import (
    MAX_FRAME_BYTES,
    RefusedRequestError,
    RequestShape,
    StreamedRequest,
    check_tensors,
    request_shapes,
)
from crowdtrain.optimizer import build_optimizer
from tests.messages import set_field
from tests.test_moe_replicas import LOOPBACK, tiny_moe

pytestmark = pytest.mark.timeout(120)

MANIFEST = tiny_moe()
UID = expert_uids(MANIFEST)[0]
SEQUENCE, HIDDEN = MANIFEST.data.sequence_length, int(MANIFEST.model.config["hidden_size"])


def shapes() -> tuple[RequestShape, RequestShape]:
    expert = build_expert(MANIFEST, UID)
    return request_shapes(
        make_backend(MANIFEST, UID, expert, build_optimizer(expert.parameters(), MANIFEST.optimizer)), 4
    )


def wire(*tensors: torch.Tensor) -> list[runtime_pb2.Tensor]:
    return [serialize_torch_tensor(tensor) for tensor in tensors]


def hidden(batch: int, sequence: int = SEQUENCE, width: int = HIDDEN, **kwargs: Any) -> torch.Tensor:
    return torch.randn(batch, sequence, width, **kwargs)


def test_a_request_that_fits_the_schema_is_taken_whole() -> None:
    forward, backward = shapes()
    assert len(forward.schemas) == 1 and len(backward.schemas) == 2  # backward: the inputs and the output gradients
    inputs = hidden(3)
    (taken,) = check_tensors(wire(inputs), forward)
    assert torch.equal(taken, inputs)
    assert len(check_tensors(wire(inputs, hidden(3)), backward)) == 2


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ([], "carries 0 tensors; this expert takes 1"),
        ([hidden(2), hidden(2)], "carries 2 tensors"),
        ([hidden(5)], "a batch of 5; this host takes 1 to 4"),
        ([hidden(2, sequence=SEQUENCE + 1)], "has shape"),
        ([hidden(2, width=HIDDEN * 2)], "has shape"),
        ([hidden(2)[0]], "has shape"),  # no batch dimension
        ([hidden(2)[None]], "has shape"),  # one too many
        ([hidden(2).double()], "is not uncompressed float32"),
        ([hidden(2).index_fill(1, torch.tensor([0]), math.nan)], "NaN or infinite"),
        ([hidden(2).index_fill(1, torch.tensor([0]), -math.inf)], "NaN or infinite"),
    ],
)
def test_a_forward_request_off_the_schema_is_refused(tensors: list[torch.Tensor], reason: str) -> None:
    with pytest.raises(RefusedRequestError, match=reason):
        check_tensors(wire(*tensors), shapes()[0])


def test_a_backward_request_whose_tensors_disagree_on_the_batch_is_refused() -> None:
    with pytest.raises(RefusedRequestError, match="different batch sizes"):
        check_tensors(wire(hidden(2), hidden(3)), shapes()[1])


def test_header_lies_are_refused_before_any_buffer_is_read() -> None:
    forward = shapes()[0]
    (tensor,) = wire(hidden(2))
    for lie in (
        {"size": [2, SEQUENCE, HIDDEN, 1]},
        {"size": [2**31, SEQUENCE, HIDDEN]},
        {"size": [0, SEQUENCE, HIDDEN]},
        {"buffer": tensor.buffer[:-4]},
        {"buffer": tensor.buffer + b"\0" * 4},
        {"compression": runtime_pb2.CompressionType.FLOAT16},
        {"dtype": "int64"},
        {"dtype": ""},
    ):
        forged = runtime_pb2.Tensor()
        forged.CopyFrom(tensor)
        for name, value in lie.items():
            set_field(forged, name, value)
        with pytest.raises(RefusedRequestError):
            check_tensors([forged], forward)


def test_an_integer_tensor_asking_for_gradients_is_refused_not_a_crash() -> None:
    # No expert declares an integer input today; a schema that does must still refuse, not raise hivemind's error.
    integer = RequestShape((BatchTensorDescriptor(SEQUENCE, HIDDEN, dtype=torch.int64),), max_batch_size=4)
    (tensor,) = wire(torch.zeros(2, SEQUENCE, HIDDEN, dtype=torch.int64))
    (taken,) = check_tensors([tensor], integer)
    assert taken.dtype == torch.int64
    tensor.requires_grad = True
    with pytest.raises(RefusedRequestError, match="asks for gradients"):
        check_tensors([tensor], integer)


def parts(*tensors: torch.Tensor, chunk_bytes: int) -> list[runtime_pb2.Tensor]:
    return [part for tensor in wire(*tensors) for part in split_for_streaming(tensor, chunk_bytes)]


def test_a_stream_is_reassembled_and_checked_and_bounded_as_it_arrives() -> None:
    forward = shapes()[0]
    inputs = hidden(3)
    streamed = StreamedRequest(forward)
    for part in parts(inputs, chunk_bytes=1000):
        streamed.add([part])
    (taken,) = streamed.tensors()
    assert torch.equal(taken, inputs)

    too_big = StreamedRequest(forward)
    with pytest.raises(RefusedRequestError, match="a batch of 5"):
        too_big.add(parts(hidden(5), chunk_bytes=1000)[:1])  # refused at its first part, before the others come
    too_long = StreamedRequest(forward)  # a header of 1 sequence, then the bytes of 2
    header, *chunks = parts(hidden(1), chunk_bytes=100)
    with pytest.raises(RefusedRequestError, match="carries more bytes than its shape"):
        for part in [header, *chunks, *chunks]:
            too_long.add([part])
    two_tensors = StreamedRequest(forward)
    with pytest.raises(RefusedRequestError, match="more than 1 tensors"):
        two_tensors.add(parts(hidden(1), hidden(1), chunk_bytes=10**6))
    headless = StreamedRequest(forward)
    with pytest.raises(RefusedRequestError, match="names no dtype"):
        headless.add([runtime_pb2.Tensor(buffer=b"\0" * 16)])
    empty_frames = StreamedRequest(forward)
    with pytest.raises(RefusedRequestError, match="frames a request needs"):
        for _ in range(1000):
            empty_frames.add([])


# --- a real host -------------------------------------------------------------------------------


@pytest.fixture
def host_and_client(tmp_path: Path) -> Iterator[tuple[ExpertHost, P2P, Path]]:
    """A host serving UID over its own DHT, a client's p2p, and the file the host's handler processes log to."""
    with serving_host(tmp_path) as served:
        yield served


@contextlib.contextmanager
def serving_host(tmp_path: Path) -> Iterator[tuple[ExpertHost, P2P, Path]]:
    log_path = tmp_path / "host.log"
    handler = logging.FileHandler(log_path)  # the handler processes are forked: they inherit it
    watched = [logging.getLogger(name) for name in ("crowdtrain.moe.connection", "crowdtrain.dht.frames")]
    watched.append(logging.getLogger("hivemind.p2p.p2p_daemon"))
    for logger in watched:
        logger.addHandler(handler)
    host_dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    client_dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=host_dht.get_visible_maddrs())
    host = ExpertHost(host_dht, MANIFEST, HostOptions(checkpoint_dir=tmp_path / "experts"))
    # hivemind's client runs its calls in RemoteExpertWorker's loop: the p2p replica lives and closes there
    client = RemoteExpertWorker.run_coroutine(client_dht.replicate_p2p())
    try:
        host.serve([UID])
        yield host, client, log_path
    finally:
        RemoteExpertWorker.run_coroutine(client.shutdown())
        host.shutdown()
        client_dht.shutdown()
        host_dht.shutdown()
        for logger in watched:
            logger.removeHandler(handler)
        handler.close()


def test_an_invite_only_hosts_experts_serve_only_admitted_callers(tmp_path: Path) -> None:
    # The daemon sets its process gate before it hosts experts; the handler processes fork with it. This gate's
    # admission records hold nobody, so the client (no access token) is refused before any expert code runs.
    async def nobody_admitted() -> AdmissionRecords:
        return AdmissionRecords()

    founder = peer_id_of_public_key(load_public_key(RSAPrivateKey().get_public_key().to_bytes())).to_base58()
    set_process_gate(AdmissionGate(AccessChecker(MANIFEST.run_id, founder), nobody_admitted, "QmHost", 0.1))
    try:
        with serving_host(tmp_path) as (host, client, _):
            for method, request in [
                ("rpc_info", runtime_pb2.ExpertUID(uid=UID)),
                ("rpc_forward", runtime_pb2.ExpertRequest(uid=UID, tensors=wire(hidden(2)))),
                ("rpc_forward_stream", frames(runtime_pb2.ExpertRequest(uid=UID, tensors=wire(hidden(2))))),
            ]:
                with pytest.raises(P2PHandlerError, match="not admitted to this invite-only run"):
                    call(client, host, method, request)
    finally:
        set_process_gate(None)


def call(client: P2P, host: ExpertHost, method: str, request: Any) -> Any:
    async def send() -> Any:
        stub: Any = get_server_stub(client, host.dht.peer_id)
        if method.endswith("_stream"):
            return [response async for response in await getattr(stub, method)(request)]
        return await getattr(stub, method)(request)

    return RemoteExpertWorker.run_coroutine(send())


async def frames(*requests: runtime_pb2.ExpertRequest) -> Any:
    for request in requests:
        yield request


def test_a_real_host_refuses_bad_requests_with_a_sentence_and_keeps_serving(
    host_and_client: tuple[ExpertHost, P2P, Path],
) -> None:
    host, client, log_path = host_and_client
    expert = RemoteExpert(ExpertInfo(UID, host.dht.peer_id), client)
    inputs = hidden(2, requires_grad=True)
    outputs = expert(inputs)
    outputs.sum().backward()  # an honest forward and backward, as hivemind's client sends them
    assert outputs.shape == inputs.shape and inputs.grad is not None

    def request(*tensors: torch.Tensor, uid: str = UID) -> runtime_pb2.ExpertRequest:
        return runtime_pb2.ExpertRequest(uid=uid, tensors=wire(*tensors))

    oversized = hidden(MAX_BATCH_SEQUENCES + 1)
    for method, bad, reason in [
        ("rpc_forward", request(oversized), f"a batch of {MAX_BATCH_SEQUENCES + 1}"),
        ("rpc_forward", request(hidden(2, sequence=SEQUENCE * 2)), "has shape"),
        ("rpc_forward", request(hidden(2).fill_(math.nan)), "NaN or infinite"),
        ("rpc_forward", request(hidden(2), uid="other-ffn0.0"), "is not served here"),
        ("rpc_backward", request(hidden(2), hidden(3)), "different batch sizes"),
        ("rpc_info", runtime_pb2.ExpertUID(uid="other-ffn0.0"), "is not served here"),
    ]:
        with pytest.raises(P2PHandlerError, match=reason):
            call(client, host, method, bad)

    # Streams of one frame each: a caller still sending when the host refuses sees the stream reset, not the sentence.
    # Even one frame races: the host refuses at the frame, before it has read the caller's end-of-stream marker, and
    # closing a stream with input unread can reset it, so the sentence may not arrive (1 run in about 20 here). Then
    # the stream must end with no answer, and the host's log (below) shows the refusal.
    (padded,) = wire(hidden(1))
    padded.buffer += b"\0" * 4096
    for method, frame, reason in [
        ("rpc_forward_stream", request(oversized), f"a batch of {MAX_BATCH_SEQUENCES + 1}"),
        ("rpc_backward_stream", request(hidden(2), hidden(2), hidden(2)), "more than 2 tensors"),
        ("rpc_forward_stream", runtime_pb2.ExpertRequest(uid=UID, tensors=[padded]), "carries more bytes than its"),
    ]:
        try:
            answers = call(client, host, method, frames(frame))
        except P2PHandlerError as e:
            assert reason in str(e)
        else:
            assert answers == [], "a refused stream answers nothing"
    one_huge_frame = runtime_pb2.ExpertRequest(uid=UID, tensors=[runtime_pb2.Tensor(buffer=b"\0" * MAX_FRAME_BYTES)])
    try:  # the host closes the stream at the frame's header: no sentence travels back, and no answer
        answers = call(client, host, "rpc_backward_stream", frames(one_huge_frame))
    except ConnectionError:  # the caller was still sending
        answers = []
    assert answers == []

    assert host.is_healthy(), "no refusal crashes the host"
    assert expert(hidden(1)).shape == (1, SEQUENCE, HIDDEN), "the host serves honest calls after the refusals"
    log = log_path.read_text()
    assert log.count("refused an expert") == 10 and f"frame of {MAX_FRAME_BYTES + 27} bytes, over the" in log
    for reason in (f"a batch of {MAX_BATCH_SEQUENCES + 1}", "more than 2 tensors", "carries more bytes than its"):
        assert reason in log, f"the host's log names the refusal: {reason}"
    assert "Traceback" not in log and "Handler failed" not in log
