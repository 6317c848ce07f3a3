"""RPC services of our own on the DHT's p2p daemon: an event loop in a thread, a replica of the daemon's client.

A subclass defines hivemind `rpc_*` handlers (protobuf in, protobuf out) and client methods that call
peers' handlers through `self.get_stub(self.require_p2p(), peer, namespace=self.namespace)` inside
coroutines run with `self.run(...)`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import hivemind
from hivemind.p2p import P2P, ServicerBase
from hivemind.utils.multiaddr import Multiaddr

from crowdtrain.dht.gate import AdmissionGated

logger = logging.getLogger(__name__)

T = TypeVar("T")

START_TIMEOUT_S = 30.0
DRAIN_FRAMES = 64
DRAIN_S = 2.0
LINGER_S = 10.0
"""After its last message a streamed answer waits up to this long for its caller, who knows the answer's size, to
close the stream (`linger`)."""
STOP_CHECK_S = 0.1
"""How often a call waiting on a peer looks whether the node is stopping (`P2PService.run`)."""


class NodeStopping(Exception):
    """The node is stopping: a call to a peer was cut short, and no more are made (`P2PService.run`)."""


def result_unless_stopping(
    future: concurrent.futures.Future[T], timeout_s: float | None, stop: threading.Event | None, what: str
) -> T:
    """`future`'s result, waited for at most `timeout_s` (None: no limit; TimeoutError after); once `stop` (the
    node's stop event) is set, NodeStopping instead, within STOP_CHECK_S. The future is left as it is."""
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    while stop is not None and not stop.is_set() and deadline - time.monotonic() > STOP_CHECK_S:
        with contextlib.suppress(TimeoutError):
            return future.result(timeout=STOP_CHECK_S)
    if stop is not None and stop.is_set():
        raise NodeStopping(f"the node is stopping: {what} was cut short")
    return future.result(timeout=None if timeout_s is None else max(0.0, deadline - time.monotonic()))


class P2PService(AdmissionGated, ServicerBase):
    """Serves this class's `rpc_*` handlers under `namespace` and calls other peers' ones.

    `start()` runs an event loop in a daemon thread; `run()` blocks the calling thread on a coroutine
    in that loop; `close()` stops serving and the loop. Once `stop` is set (the node is stopping), `run()` cuts
    short the calls waiting on peers and refuses new ones, raising NodeStopping, so a Ctrl-C never waits out a
    deadline on a peer that has gone.
    """

    def __init__(self, dht: hivemind.DHT, namespace: str, thread_name: str, stop: threading.Event | None = None):
        self.dht, self.namespace = dht, namespace
        self.stop = stop if stop is not None else threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name, daemon=True)
        self._p2p: P2P | None = None
        self._serving = False

    def start(self, serve: bool = True) -> None:
        """Connect to the DHT's p2p daemon and, with `serve`, answer peers' calls; raises if that fails."""
        self._thread.start()
        self._run(self._start(serve), START_TIMEOUT_S)

    async def _start(self, serve: bool) -> None:
        # Not dht.replicate_p2p(): it caches one replica per process, and a replica only works in the
        # event loop that created it, so a cached one would break any other caller in this process.
        future = self.dht.run_coroutine(_daemon_listen_maddr, return_future=True)
        self._p2p = await P2P.replicate(await asyncio.wait_for(asyncio.wrap_future(future), START_TIMEOUT_S))
        if serve:
            await self.add_p2p_handlers(self._p2p, namespace=self.namespace)
            self._serving = True

    @property
    def peer_id(self) -> str:
        """This node's peer ID (base58)."""
        return self.require_p2p().peer_id.to_base58()

    def close(self) -> None:
        """Stop serving and stop the event loop; safe to call twice or before `start`."""
        if self._thread.is_alive():
            try:
                self._run(self._close(), 10.0)
            except Exception as e:
                logger.debug(f"{self.namespace} service did not close cleanly: {e}")
            try:
                self._run(_cancel_other_tasks(), 5.0)
            except Exception as e:
                logger.debug(f"{self.namespace} service tasks did not stop cleanly: {e}")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    async def _close(self) -> None:
        if self._p2p is not None:
            if self._serving:
                await self.remove_p2p_handlers(self._p2p, namespace=self.namespace)
            await self._p2p.shutdown()  # a replica: closes our client only, the daemon lives on
            self._p2p = None

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coroutine` in the service's loop and wait at most `timeout_s` for its result (TimeoutError); once
        `stop` is set, NodeStopping instead, at once or within STOP_CHECK_S of it."""
        if self.stop.is_set():
            coroutine.close()
            raise NodeStopping(f"the node is stopping: no more {self.namespace} calls")
        return self._run(coroutine, timeout_s, self.stop)

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float, stop: threading.Event | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return result_unless_stopping(future, timeout_s, stop, f"a {self.namespace} call")
        except BaseException:
            future.cancel()
            raise

    def require_p2p(self) -> P2P:
        if self._p2p is None:
            raise RuntimeError(f"the {self.namespace} service is not started")
        return self._p2p


async def linger() -> None:
    """End a streamed answer: wait (at most `LINGER_S`) for the caller to close the stream; hivemind cancels this
    wait when it does. The caller must stop reading at the answer's announced size and close the stream itself.

    Symptom worked around: when the answering side closed the stream right after its last message, about 1 answer
    in 10,000 on loopback reached the caller cut short (after its header, or before it), the sender having sent it
    without error: most likely the daemons' stream close racing the last writes. Once the caller closes first, none
    were cut (SPES expert copies: 5 in 38,000 before, 0 in 29,576 after; SkipPipe hops: see `stage_service`)."""
    await asyncio.sleep(LINGER_S)


async def _daemon_listen_maddr(_dht: hivemind.DHT, node: Any) -> Multiaddr:
    return node.p2p.daemon_listen_maddr


async def _cancel_other_tasks() -> None:
    """Cancel what hivemind's p2p client left running in our loop, so stopping it leaves no pending task."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def drain(requests: AsyncIterator[Any], max_frames: int = DRAIN_FRAMES, timeout_s: float = DRAIN_S) -> None:
    """Read what is left of a caller's stream before refusing it, at most `max_frames` frames for `timeout_s`.

    Symptom worked around: hivemind's stream handler closes the stream as soon as the handler raises; a stream
    closed with the caller's frames (or its end-of-stream marker) still unread can be reset under the refusal, and
    the caller got no sentence, an empty answer or a BrokenPipeError while still writing (about 1 run of the suite
    in 3). Once the input is read to its end, the refusal reaches the caller."""

    async def read_to_end() -> None:
        count = 0
        async for _ in requests:
            count += 1
            if count >= max_frames:
                return

    with contextlib.suppress(Exception):
        await asyncio.wait_for(read_to_end(), timeout_s)
