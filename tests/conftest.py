"""Shared fixtures: every daemon a test starts is killed, with its whole process group, after it; DHT nodes
signing with keys of their own, as daemons' do."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
from hivemind.utils.crypto import RSAPrivateKey
from lab import procfs

from crowdtrain.dht.validator import make_validators
from tests.harness import kill_all_started, logs_summary

NUM_KEYED_DHTS = 3
STACKS_BEFORE_TIMEOUT_S = 5.0
"""How long before a test's timeout the processes it forked print their stacks."""

# Inherited by every process forked from here (hivemind's DHT and averager processes): SIGUSR1 prints its threads'
# stacks to fd 2, which pytest captures with the test's output.
faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test's report ends with what the logs in its tmp_path said (`logs_summary`): a CI run shows the
    report, and the folder with the daemons' logs is gone by then."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.when == "call" and report.failed and isinstance(tmp_path, Path):
        summary = logs_summary(tmp_path)
        if summary:
            report.sections.append(("logs in the test's tmp_path: warnings, then the last lines", summary))


@pytest.fixture(scope="session", autouse=True)
def _one_data_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every daemon and command the suite starts shares one tokenised-data cache (`data_cache_dir`): each run's
    corpus is tokenised once, not once per daemon (about 1 s of CPU each, hundreds of daemons)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CROWDTRAIN_DATA_CACHE_DIR", str(tmp_path_factory.mktemp("data-cache")))
        yield


@pytest.fixture(autouse=True)
def _kill_started_daemons() -> Iterator[None]:
    yield
    kill_all_started()


@pytest.fixture(autouse=True)
def _forked_stacks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test about to reach its timeout has every process it forked print its stacks: pytest-timeout prints only
    pytest's own, and a hang inside a DHT or averager process (a state download that never answers) showed nothing."""
    marker = request.node.get_closest_marker("timeout")
    timeout_s = float(marker.args[0] if marker and marker.args else request.config.getini("timeout") or 0)
    if timeout_s <= STACKS_BEFORE_TIMEOUT_S:
        yield
        return
    timer = threading.Timer(timeout_s - STACKS_BEFORE_TIMEOUT_S, signal_forked_children, [signal.SIGUSR1])
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()


def signal_forked_children(signum: int) -> None:
    """Send `signum` to every descendant of this process that is a fork of it (same command line), not to the
    programs it started (p2pd, daemons), for which SIGUSR1 would be fatal."""
    own = procfs.command_line(os.getpid())
    for pid in procfs.descendants(os.getpid()):
        if procfs.command_line(pid) == own:
            with contextlib.suppress(OSError):  # gone since
                os.kill(pid, signum)


@pytest.fixture
def keyed_dhts() -> Iterator[list[tuple[hivemind.DHT, RSAPrivateKey]]]:
    """Three in-process DHT nodes on loopback, each storing the records under its own owner marker signed with its
    own RSA key (the key's peer ID is not the node's p2p one), all validating the records of the `replicas` run."""
    nodes: list[tuple[hivemind.DHT, RSAPrivateKey]] = []
    try:
        for _ in range(NUM_KEYED_DHTS):
            key = RSAPrivateKey()
            initial_peers = nodes[0][0].get_visible_maddrs() if nodes else []
            dht = hivemind.DHT(
                start=True,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=initial_peers,
                record_validators=make_validators(key, ["replicas"]),
            )
            nodes.append((dht, key))
        yield nodes
    finally:
        for dht, _ in reversed(nodes):
            dht.shutdown()


LAST_TEST_FILE = Path(".pytest-last-test")
"""The test started last, for `make test` to name when pytest dies mid-run (an abort prints no test name)."""


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    LAST_TEST_FILE.write_text(nodeid + "\n")
