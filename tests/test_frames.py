"""A peer's stream frame is refused at its header when it is over the cap, on both ends of a stream (issue 14)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator

import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from crowdtrain.dht.frames import MAX_STREAM_FRAME_BYTES, install_frame_cap

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
CAP = 4096
ECHO = "crowdtrain_test.echo"


@pytest.fixture
def frame_cap() -> Iterator[None]:
    original = P2P.__dict__["receive_raw_data"]
    install_frame_cap(CAP)
    try:
        yield
    finally:
        P2P.receive_raw_data = original  # type: ignore[method-assign]


def test_the_daemon_cap_is_above_every_frame_we_send() -> None:
    from crowdtrain.links.protocol import CHUNK_BYTES as PROBE_CHUNK
    from crowdtrain.modes.skippipe.hops.hop_wire import CHUNK_BYTES as HOP_CHUNK
    from crowdtrain.modes.spes.expert_exchange import CHUNK_BYTES as EXPERT_CHUNK

    assert max(EXPERT_CHUNK, PROBE_CHUNK, HOP_CHUNK, 2**19) * 4 <= MAX_STREAM_FRAME_BYTES


def test_frames_over_the_cap_are_refused_at_the_header_by_handlers_and_callers(
    frame_cap: None, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []

    async def echo(
        requests: AsyncIterator[runtime_pb2.ExpertUID], _: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertUID]:
        async for request in requests:
            seen.append(request.uid[:16])
            yield runtime_pb2.ExpertUID(uid=request.uid * (1 if len(request.uid) < 100 else 8))

    async def scenario() -> tuple[list[str], list[str], bytes]:
        server = await P2P.create(host_maddrs=LOOPBACK)
        client = await P2P.create(host_maddrs=LOOPBACK, initial_peers=await server.get_visible_maddrs())
        try:
            await server.add_protobuf_handler(ECHO, echo, runtime_pb2.ExpertUID, stream_input=True)

            async def ask(*uids: str) -> list[str]:
                async def requests() -> AsyncIterator[runtime_pb2.ExpertUID]:
                    for uid in uids:
                        yield runtime_pb2.ExpertUID(uid=uid)

                answers = await client.iterate_protobuf_handler(server.peer_id, ECHO, requests(), runtime_pb2.ExpertUID)
                return [answer.uid[:16] async for answer in answers]

            small = await asyncio.wait_for(ask("hello", "again"), 30)
            # an answer of 8 x 1000 bytes is over the caller's cap: its stream of answers ends there
            cut = await asyncio.wait_for(ask("x" * 1000), 30)
            # a frame announcing 2**40 bytes, written by hand: the handler refuses it at the header and closes
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, ECHO)
            writer.write(P2P.MESSAGE_MARKER + (2**40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 64)
            await writer.drain()
            rest = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return small, cut, rest
        finally:
            await client.shutdown()
            await server.shutdown()

    with caplog.at_level(logging.WARNING, logger="crowdtrain.dht.frames"):
        small, cut, rest = asyncio.run(scenario())
    assert small == ["hello", "again"]
    assert cut == [], "the oversized answer was not delivered"
    assert rest == b"", "the handler answered nothing to the oversized frame and closed the stream"
    assert seen == ["hello", "again", "x" * 16], "the handler never saw the oversized frame's request"
    refusals = [record.getMessage() for record in caplog.records if "refused a stream frame" in record.getMessage()]
    assert f"refused a stream frame of {2**40} bytes, over the {CAP} cap" in refusals
    assert any(f"over the {CAP} cap" in message and str(2**40) not in message for message in refusals), refusals
    assert not [record for record in caplog.records if record.exc_info], "refusals log no traceback"
