"""One node of the NAT relay experiment (scripts/lab/nat_relay.py): a hivemind DHT whose p2pd serves an echo and a
bulk stream, and optionally calls another node's, found by a DHT key. It writes its state as JSON lines to --out.

    python scripts/lab/relay_node.py --out FILE --listen /ip4/10.x.0.1/tcp/0 [--initial-peers ADDR]
        [--auto-relay] [--reachability public|private] [--announce-as KEY] [--call KEY] [--bulk-bytes N]

Every line it writes is one JSON object with an `event` and `t_s` (seconds since the DHT started).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import hivemind
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from crowdtrain.dht.swarm import SwarmOptions, p2p_options

BULK = "relaylab.bulk"
ECHO = "relaylab.echo"
CHUNK_BYTES = 1 << 20


class Events:
    """The node's JSON-lines log: what happened and when, in seconds since `start`."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)
        self.start = time.monotonic()

    def write(self, event: str, **fields: Any) -> None:
        fields = {"event": event, "t_s": round(time.monotonic() - self.start, 3), **fields}
        self.file.write(json.dumps(fields) + "\n")


async def serve_bulk(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read an 8-byte size, then send that many bytes and close."""
    size = int.from_bytes(await reader.readexactly(8), "big")
    chunk = os.urandom(CHUNK_BYTES)
    while size > 0:
        writer.write(chunk[: min(size, CHUNK_BYTES)])
        await writer.drain()
        size -= CHUNK_BYTES
    writer.close()


def echo_server(p2p: P2P, events: Events):
    """Answer one line with the caller's peer id as we see it, and what we read. A line `dialback ADDR...` first
    dials the caller at those addresses (connection reversal: a NATed node can open what nobody can open to it)."""

    async def serve_echo(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readline()).decode().strip()
        if line.startswith("dialback "):
            try:
                addrs = [Multiaddr(address) for address in line.split()[1:]]
                await asyncio.wait_for(p2p._client.connect(info.peer_id, addrs), 10)
                events.write("dialed_back", peer=info.peer_id.to_base58(), ok=True)
            except Exception as e:
                events.write("dialed_back", peer=info.peer_id.to_base58(), ok=False, error=repr(e))
        writer.write(f"{info.peer_id.to_base58()} {line}\n".encode())
        await writer.drain()
        writer.close()

    return serve_echo


async def call(
    p2p: P2P, events: Events, target: PeerID, bulk_bytes: int, timeout_s: float, dialback: bool = False
) -> None:
    """Echo once (asking `target` to dial us back with `dialback`), then pull `bulk_bytes` from it; logs each outcome
    and the connections used."""
    started = time.monotonic()
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(target, ECHO), timeout_s)
        own = " ".join(str(address).split("/p2p/")[0] for address in await p2p.get_visible_maddrs())
        writer.write(f"dialback {own}\n".encode() if dialback else b"hello\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.readline(), timeout_s)
        writer.close()
        events.write("echo", ok=bool(answer.strip()), seconds=round(time.monotonic() - started, 3))
    except Exception as e:
        events.write("echo", ok=False, error=f"{type(e).__name__}: {e}", seconds=round(time.monotonic() - started, 3))
        return
    await log_connections(p2p, events, target)
    if bulk_bytes <= 0:
        return
    started = time.monotonic()
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(target, BULK), timeout_s)
        writer.write(bulk_bytes.to_bytes(8, "big"))
        await writer.drain()
        received = 0
        while received < bulk_bytes:
            data = await asyncio.wait_for(reader.read(CHUNK_BYTES), timeout_s)
            if not data:
                break
            received += len(data)
        seconds = time.monotonic() - started
        writer.close()
        events.write("bulk", ok=received == bulk_bytes, bytes=received, seconds=round(seconds, 3),
                     mbit_s=round(received * 8 / seconds / 1e6, 2))  # fmt: skip
    except Exception as e:
        events.write("bulk", ok=False, error=f"{type(e).__name__}: {e}")
    await log_connections(p2p, events, target)


async def log_connections(p2p: P2P, events: Events, target: PeerID) -> None:
    peers = await p2p.list_peers()
    addrs = [str(addr) for peer in peers if peer.peer_id == target for addr in peer.addrs]
    events.write("connections", peer=target.to_base58(), addrs=addrs)


async def main(args: argparse.Namespace) -> None:
    events = Events(args.out)
    kwargs: dict[str, Any] = {}
    if args.reachability:
        kwargs["force_reachability"] = args.reachability
    if args.trusted_relays:
        kwargs["trusted_relays"] = args.trusted_relays
    if args.p2pd_args:  # flags hivemind does not expose (relay limits): appended to p2pd's command line
        make_args = P2P._make_process_args
        P2P._make_process_args = staticmethod(lambda *a, **k: make_args(*a, **k) + args.p2pd_args.split())
    # the p2pd of a crowdtrain node (relays as `crowdtrain run` asks for them), with the experiment's overrides
    options = SwarmOptions(
        initial_peers=tuple(args.initial_peers), listen=(args.listen,), client_mode=args.client_mode,
        relay=args.auto_relay,
    )  # fmt: skip
    dht = hivemind.DHT(start=True, **{**p2p_options(options), **kwargs})
    try:
        p2p = await dht.replicate_p2p()
        events.write("started", peer_id=p2p.peer_id.to_base58(), maddrs=[str(a) for a in dht.get_visible_maddrs()])
        await p2p.add_binary_stream_handler(ECHO, echo_server(p2p, events))
        await p2p.add_binary_stream_handler(BULK, serve_bulk)
        if args.announce_as:
            stored = dht.store(args.announce_as, p2p.peer_id.to_base58(), get_dht_time() + 3600)
            events.write("announced", key=args.announce_as, ok=bool(stored))
        seen: list[str] = []
        called, next_echo = False, 0.0
        deadline = time.monotonic() + args.lifetime_s
        while time.monotonic() < deadline:
            maddrs = sorted(str(a) for a in await p2p.get_visible_maddrs(latest=True))
            if maddrs != seen:
                seen = maddrs
                events.write("maddrs", maddrs=maddrs, circuit=any("p2p-circuit" in a for a in maddrs))
            if args.call and not called:
                found = dht.get(args.call, latest=True)
                if found is not None:
                    called = True
                    events.write("found", key=args.call, peer_id=found.value)
                    target = PeerID.from_base58(found.value)
                    await call(p2p, events, target, args.bulk_bytes, args.call_timeout_s, args.dialback)
                    events.write("done")
                    next_echo = time.monotonic() + args.echo_every_s
            if called and args.echo_every_s and time.monotonic() >= next_echo:
                await call(p2p, events, target, 0, args.call_timeout_s)
                next_echo = time.monotonic() + args.echo_every_s
            await asyncio.sleep(0.5)
    finally:
        dht.shutdown()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--auto-relay", action="store_true")
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--reachability", choices=("public", "private"))
    parser.add_argument("--trusted-relays", nargs="*", default=[])
    parser.add_argument("--p2pd-args", default="", help="space-separated, e.g. '-relayDataLimit=1073741824'")
    parser.add_argument("--announce-as")
    parser.add_argument("--call")
    parser.add_argument("--echo-every-s", type=float, default=0.0, help="after the call, echo again this often")
    parser.add_argument("--dialback", action="store_true", help="ask the called node to dial us first")
    parser.add_argument("--bulk-bytes", type=int, default=10_000_000)
    parser.add_argument("--call-timeout-s", type=float, default=60.0)
    parser.add_argument("--lifetime-s", type=float, default=180.0)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    signal.alarm(int(arguments.lifetime_s) + 30)  # a hard bound whatever happens
    asyncio.run(main(arguments))
    sys.exit(0)
