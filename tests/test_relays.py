"""A node's relays, read from the addresses its p2pd announces, and when its p2pd asks for one; a read of the DHT
process that fails in any way is one ordinary error (pure logic; the NAT lab's tests/test_nat_relay.py shows a NATed
node called through a relay)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

import pytest

from crowdtrain.dht.calls import DHTCallFailed, dht_answer
from crowdtrain.dht.swarm import SwarmOptions, p2p_options
from crowdtrain.links import relays
from crowdtrain.links.relays import MAX_RELAYS, RelayWatch, reachability, relay_peers

SELF = "12D3KooWNJTL6RejcW9JoRrQdanAFJsqKaVhUbFzBrkwrqUTcUK9"
RELAY = "12D3KooWDNkqWoWJ33umxCUcojcHqy7HcfPx4Q6V9NS1nid13rCP"
OTHER = "12D3KooWEZkbXFmfhotvbiSVHMgFpBT5cxWjj9dyRA9hdK3nyrSd"
DIRECT = f"/ip4/192.168.3.2/tcp/42619/p2p/{SELF}"


def circuit(relay: str) -> str:
    return f"/ip4/11.42.0.1/tcp/37723/p2p/{relay}/p2p-circuit/p2p/{SELF}"


def test_the_relays_are_the_peers_before_each_circuit() -> None:
    assert relay_peers([DIRECT]) == ()
    assert relay_peers([DIRECT, circuit(RELAY), circuit(OTHER), circuit(RELAY)]) == tuple(sorted((RELAY, OTHER)))
    assert relay_peers([f"/ip4/11.42.0.1/tcp/1/p2p-circuit/p2p/{SELF}"]) == (), "a circuit with no relay ID"
    many = [circuit(f"12D3KooW{index:044d}") for index in range(10)]
    assert len(relay_peers(many)) == MAX_RELAYS


def test_a_node_is_reachable_directly_untried_through_a_relay_or_not_at_all() -> None:
    assert reachability(True, True, ()) == "yes" and reachability(True, False, ()) == "assumed"
    assert reachability(False, True, (RELAY,)) == "relay" and reachability(False, True, ()) == "no"
    assert reachability(True, True, (RELAY,)) == "yes", "a dial-back beats a relay"


def test_the_watch_rereads_after_its_interval_logs_each_change_and_keeps_its_answer_when_a_read_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr(relays.time, "monotonic", lambda: now[0])
    # A read the DHT process cancelled or closed raises CancelledError or GeneratorExit here (once, the latter ended a
    # daemon's heartbeat thread): a failed read like any other.
    failures = [TimeoutError("busy"), asyncio.CancelledError(), GeneratorExit()]
    answers: list[object] = [[DIRECT], [DIRECT, circuit(RELAY)], *failures, [DIRECT]]

    def addresses() -> list[str]:
        future: Future[list[str]] = Future()
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)  # type: ignore[arg-type]
        return dht_answer(future, 1.0, "this node's addresses")

    watch = RelayWatch(addresses, interval_s=15)
    caplog.set_level(logging.INFO, logger=relays.__name__)
    assert watch.relays() == ()
    now[0] += 10
    assert watch.relays() == () and len(answers) == 5, "read again before its interval"
    now[0] += 5
    assert watch.relays() == (RELAY,)
    assert f"through the relay of …{RELAY[-8:]}" in caplog.text
    for _ in failures:
        now[0] += 15
        assert watch.relays() == (RELAY,), "a failed read keeps the last answer"
    now[0] += 15
    assert watch.relays() == ()
    assert "holds no relay reservation any more" in caplog.text


def test_a_dht_call_that_does_not_answer_in_time_is_cancelled_and_fails_as_any_other() -> None:
    unanswered: Future[int] = Future()
    with pytest.raises(DHTCallFailed, match="the swarm's progress: no answer within 0.05 s"):
        dht_answer(unanswered, 0.05, "the swarm's progress")
    assert unanswered.cancelled()
    closed: Future[int] = Future()
    closed.set_exception(GeneratorExit())
    with pytest.raises(DHTCallFailed, match="GeneratorExit"):
        dht_answer(closed, 1.0, "a read")


@pytest.mark.parametrize(
    ("initial_peers", "relay", "auto_relay"),
    [((f"/ip4/11.42.0.1/tcp/37723/p2p/{RELAY}",), True, True), ((), True, False), ((DIRECT,), False, False)],
)
def test_p2pd_looks_for_a_relay_only_when_asked_to_and_it_has_peers_to_ask(
    initial_peers: tuple[str, ...], relay: bool, auto_relay: bool
) -> None:
    swarm = SwarmOptions(initial_peers=initial_peers, relay=relay)
    options = p2p_options(swarm)
    assert options["use_auto_relay"] is auto_relay and swarm.auto_relay is auto_relay, "the heartbeat watches then"
    assert options["use_ipfs"] is False
