"""The DHT process keeps serving when a request's sender has exited before it was read (crowdtrain/dht/swarm.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import hivemind
from hivemind.utils import get_dht_time

from crowdtrain.dht.swarm import SwarmOptions, join_swarm

REQUEST_TIMEOUT_S = 10.0
"""hivemind's wait_timeout: what it slept after each unreadable request, before RequestPipe."""
DEAD_REQUESTS = 3


def _request_and_exit(dht: hivemind.DHT) -> None:
    dht.get("anything", return_future=True)  # the request carries this process's result pipe; nobody waits for it


def test_requests_of_exited_processes_are_dropped_without_stalling_the_next_caller() -> None:
    dht = join_swarm(SwarmOptions(request_timeout_s=REQUEST_TIMEOUT_S), [])
    try:
        os.kill(dht.pid, signal.SIGSTOP)  # the DHT reads nothing until every sender below has exited
        try:
            for _ in range(DEAD_REQUESTS):
                sender = mp.get_context("fork").Process(target=_request_and_exit, args=(dht,))
                sender.start()
                sender.join(30)
                assert sender.exitcode == 0
        finally:
            os.kill(dht.pid, signal.SIGCONT)
        started = time.monotonic()
        assert dht.store("key", "value", get_dht_time() + 60)
        found = dht.get("key")
        elapsed = time.monotonic() - started
        assert found is not None and found.value == "value"
        # Before, each of the three cost a sleep of REQUEST_TIMEOUT_S (30 s here) ahead of these requests.
        assert elapsed < REQUEST_TIMEOUT_S, f"the DHT answered after {elapsed:.1f} s"
        assert dht.is_alive()
    finally:
        dht.shutdown()
