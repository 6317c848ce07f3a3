"""The join command a node prints: an address that works from where the joiner is, never a LAN address when the
node joined through a peer that reaches farther, and a plain sentence where it works only on the node's network."""

from __future__ import annotations

from crowdtrain.cli.main import join_lines
from crowdtrain.node.addresses import JoinAddress, JoinVia, join_address

PEER_A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
FOUNDER = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
LOOPBACK = f"/ip4/127.0.0.1/tcp/31330/p2p/{PEER_A}"
LAN = f"/ip4/192.168.1.20/tcp/31330/p2p/{PEER_A}"
PUBLIC = f"/ip4/8.8.4.4/tcp/31330/p2p/{PEER_A}"
FOUNDER_PUBLIC = f"/ip4/1.1.1.1/tcp/31330/p2p/{FOUNDER}"
FOUNDER_LAN = f"/ip4/10.0.0.7/tcp/31330/p2p/{FOUNDER}"
FOUNDER_LOOPBACK = f"/ip4/127.0.0.1/tcp/41000/p2p/{FOUNDER}"
FOUNDER_NAME = f"/dns4/founder.example.org/tcp/31330/p2p/{FOUNDER}"


def test_a_node_with_a_public_address_names_its_own() -> None:
    assert join_address([LOOPBACK, LAN, PUBLIC], []) == JoinAddress(PUBLIC, JoinVia.OWN)
    assert join_address([LOOPBACK, PUBLIC], [FOUNDER_PUBLIC]) == JoinAddress(PUBLIC, JoinVia.OWN)


def test_a_joiner_behind_a_nat_names_the_peer_it_joined_through_not_its_lan_address() -> None:
    assert join_address([LOOPBACK, LAN], [FOUNDER_PUBLIC]) == JoinAddress(FOUNDER_PUBLIC, JoinVia.INITIAL_PEER)
    assert join_address([LOOPBACK, LAN], [FOUNDER_LAN]) == JoinAddress(FOUNDER_LAN, JoinVia.INITIAL_PEER)
    # of several initial peers, the one that reaches farthest; a DNS name counts as public
    assert join_address([LAN], [FOUNDER_LAN, FOUNDER_PUBLIC]).address == FOUNDER_PUBLIC
    assert join_address([LAN], [FOUNDER_LAN, FOUNDER_NAME]).address == FOUNDER_NAME
    assert join_address([LAN], [FOUNDER_PUBLIC, FOUNDER_NAME]).address == FOUNDER_PUBLIC, "the first of the best"
    # on one machine (loopback tests): the founder's loopback address
    assert join_address([LOOPBACK], [FOUNDER_LOOPBACK]) == JoinAddress(FOUNDER_LOOPBACK, JoinVia.INITIAL_PEER)


def test_a_joiner_keeps_its_own_lan_address_over_a_peer_that_reaches_less_far() -> None:
    # joined through a founder on the same machine: its own LAN address works on more machines than loopback
    assert join_address([LOOPBACK, LAN], [FOUNDER_LOOPBACK]) == JoinAddress(LAN, JoinVia.LOCAL_ONLY)


def test_a_founder_with_only_private_addresses_names_its_own_as_local_only() -> None:
    assert join_address([LOOPBACK, LAN], []) == JoinAddress(LAN, JoinVia.LOCAL_ONLY)
    assert join_address([LOOPBACK], []) == JoinAddress(LOOPBACK, JoinVia.LOCAL_ONLY)


def test_the_printed_lines_say_where_the_command_works_and_how_to_be_reachable() -> None:
    public = join_lines(JoinAddress(PUBLIC, JoinVia.OWN), FOUNDER)
    assert public == [
        "To join from another machine, run:",
        f"  crowdtrain run --initial-peers {PUBLIC} --run-key {FOUNDER}",
    ]
    through = join_lines(JoinAddress(FOUNDER_PUBLIC, JoinVia.INITIAL_PEER), FOUNDER)
    assert f"crowdtrain run --initial-peers {FOUNDER_PUBLIC} " in through[1]
    assert "the peer this node joined through" in through[0]
    local = join_lines(JoinAddress(LAN, JoinVia.LOCAL_ONLY), FOUNDER)
    assert f"crowdtrain run --initial-peers {LAN} " in local[1]
    assert local[0] == "To join from another machine on this network, run:"
    assert local[2].startswith("This address works only on this node's own network;")
    assert "forward TCP port 31330" in local[2] and "--announce /ip4/<your public IP>/tcp/31330" in local[2]
    alone = join_lines(JoinAddress(LOOPBACK, JoinVia.LOCAL_ONLY), FOUNDER)
    assert alone[0] == "To join from this machine, run:" and "works only on this machine" in alone[2]
