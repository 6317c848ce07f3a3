"""Shared fixtures: every daemon a test starts is killed, with its whole process group, after it; DHT nodes
signing with keys of their own, as daemons' do."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import hivemind
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.dht.validator import make_validators
from tests.harness import kill_all_started

NUM_KEYED_DHTS = 3


@pytest.fixture(autouse=True)
def _kill_started_daemons() -> Iterator[None]:
    yield
    kill_all_started()


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
