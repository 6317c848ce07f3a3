"""A cap on every frame a peer's stream may make this process read (issue 14: "stream frames are unbounded").

Symptom worked around: hivemind reads each frame of a stream (a stream handler's requests, a stream call's
answers) whole, however long its 8-byte header says it is: one peer announcing a frame of 2**40 bytes makes this
process wait to allocate that much. p2pd bounds unary messages itself; streams pass through it raw. Here the
reader refuses a frame over its cap at the header, with one log line, before reading it.

The daemon's largest legitimate frame is a 1 MiB chunk (pipeline hops, expert copies) with its protobuf envelope;
averaging parts are 512 KiB, state chunks 64 KiB, probes 256 KiB. MAX_STREAM_FRAME_BYTES leaves 8x headroom.
An expert host's process installs a tighter cap of its own (moe/connection.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

MAX_STREAM_FRAME_BYTES = 8 << 20


def frame_closed(num_bytes: int) -> BaseException:
    """The refusal hivemind takes as the peer closing its stream: a handler returns quietly, a caller's stream of
    answers ends (and the caller's own counts then say what is missing)."""
    return asyncio.IncompleteReadError(b"", num_bytes)


def install_frame_cap(
    max_bytes: int = MAX_STREAM_FRAME_BYTES,
    refusal: Callable[[int], BaseException] = frame_closed,
    what: str = "a stream frame",
) -> None:
    """From now on, in this process and the processes it forks, a stream frame over `max_bytes` is refused at its
    header: one WARNING line naming `what`, then `refusal(num_bytes)` is raised to hivemind's reader."""

    async def receive_bounded_frame(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        num_bytes = int.from_bytes(header, P2P.BYTEORDER)
        if num_bytes > max_bytes:
            logger.warning(f"refused {what} of {num_bytes} bytes, over the {max_bytes} cap")
            raise refusal(num_bytes)
        return await reader.readexactly(num_bytes)

    P2P.receive_raw_data = staticmethod(receive_bounded_frame)  # type: ignore[method-assign]
