"""Join the DHT as a server (a daemon) or a client (`status`), in bounded time, with plain errors."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2PDaemonError
from hivemind.utils.auth import AuthorizerBase

from crowdtrain.dht.frames import install_frame_cap
from crowdtrain.errors import CrowdtrainError, SwarmUnreachableError

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
P2PD_STARTUP_TIMEOUT_S = 15.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmOptions:
    """How this process joins the DHT."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs (with /p2p/ID) of peers already in the swarm; empty to start a new swarm."""
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    """Multiaddrs p2pd listens on."""
    announce: tuple[str, ...] = ()
    """Multiaddrs peers should dial instead of the listen addresses (e.g. a forwarded public port)."""
    identity_path: str | None = None
    """libp2p private key file that fixes the peer ID; None for a throwaway identity."""
    client_mode: bool = False
    """True: never accept DHT requests or store records (status readers, undialable nodes)."""
    bootstrap_timeout_s: float = 20.0
    """Give up when no initial peer answered within this many seconds."""
    request_timeout_s: float = 5.0
    """One DHT RPC is deemed lost after this many seconds."""
    authorizer: AuthorizerBase | None = None
    """An invite-only run's admission (crowdtrain/dht/admission.py): signs our DHT requests, checks peers'."""
    relay: bool = False
    """Behind a NAT, reserve a slot on a circuit relay among the initial peers, so peers can call this node through
    it (`crowdtrain.links.relays`); only with initial peers."""

    @property
    def auto_relay(self) -> bool:
        """Whether p2pd looks for a relay: asked to, and with initial peers to ask."""
        return self.relay and bool(self.initial_peers)

    def __post_init__(self) -> None:
        if not self.bootstrap_timeout_s > 0 or not self.request_timeout_s > 0:
            raise ValueError("bootstrap_timeout_s and request_timeout_s must be positive")


class SupervisedDHT(hivemind.DHT):
    """hivemind.DHT whose background process, and the p2pd it started, die with their parent (only).

    Symptom worked around: when the daemon is SIGKILLed (OOM killer, `kill -9`), hivemind's DHT
    process and its p2pd live on as orphans that keep the port and answer for a dead node.
    """

    def run(self) -> None:
        # Its own process group, so a terminal's Ctrl-C reaches only the daemon, which then leaves the
        # swarm through this process and its p2pd (Go's p2pd would otherwise exit on the SIGINT at once).
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, _kill_children_and_exit)
        die_with_parent(self._parent_pid, signal.SIGTERM)  # SIGTERM: the handler takes p2pd down too
        self._inner_pipe: Any = RequestPipe(self._inner_pipe)  # type: ignore[has-type]  # hivemind sets it untyped
        super().run()

    async def _dropped_request(self) -> None:
        """What a request RequestPipe could not read becomes: nothing to do, nobody awaits it."""


class RequestPipe:
    """The DHT process's end of hivemind's request pipe, which drops a request whose sender has exited.

    Symptom worked around: each request carries its sender's result pipe, which the DHT process fetches from the
    sender's multiprocessing resource sharer while unpickling the request. A request from a process that exited
    before the DHT read it (an averager shut down at Ctrl-C) fails there (FileNotFoundError, ConnectionRefused- or
    ConnectionResetError), and hivemind then sleeps `wait_timeout` (5 s) before reading the next request: a few of
    them at a daemon's shutdown held up every DHT call of its leave, the status withdrawal included, for 20 s. The
    request's bytes were read whole, so the stream is intact: the next request is read at once.
    """

    def __init__(self, connection: Connection):
        self._connection = connection

    def fileno(self) -> int:
        return self._connection.fileno()

    def poll(self, timeout: float = 0.0) -> bool:
        return self._connection.poll(timeout)

    def close(self) -> None:
        self._connection.close()

    def recv(self) -> Any:
        payload = self._connection.recv_bytes()  # the pipe's own failures (EOF, errors) reach hivemind as before
        try:
            return ForkingPickler.loads(payload)
        except OSError as error:
            logger.warning(f"dropped a DHT request from a process that has exited ({type(error).__name__}: {error})")
            return "_dropped_request", [], {}


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """Have the kernel send `signum` to this process when its parent dies (Linux PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signum)


def make_forked_children_die_with_this_process() -> None:
    """Every process this one forks from now on (hivemind's DHT and averagers) dies when it dies.

    Symptom worked around: after `kill -9` or the OOM killer, hivemind's averager processes (about
    370 MiB each) lived on as orphans. The hook is inherited, and uvloop runs it in p2pd's fork too, so
    p2pd also dies with the DHT process that started it.
    Caveat (Linux): the "parent" is the forking *thread*: a child forked from a thread that later ends is
    signalled then. The daemon forks only from its main thread; keep it that way (found by bench_dht).
    """
    os.register_at_fork(after_in_child=lambda: die_with_parent(os.getppid()))


def _kill_children_and_exit(*_: object) -> None:
    signal_children(signal.SIGKILL)
    os._exit(0)


def signal_children(signum: int) -> None:
    """Send `signum` to every direct child of this process (p2pd, hivemind's DHT and averager processes)."""
    for pid in _child_pids(os.getpid()):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _child_pids(parent_pid: int) -> list[int]:
    return [pid for pid, fields in process_stats() if int(fields[1]) == parent_pid]


def process_stats() -> list[tuple[int, list[bytes]]]:
    """(pid, fields of /proc/<pid>/stat after the command name) of every process: state, ppid, pgrp, session..."""
    stats = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                stats.append((int(entry), stat.read().rsplit(b")", 1)[1].split()))
        except OSError:
            continue
    return stats


def join_swarm(options: SwarmOptions, validators: Sequence[RecordValidatorBase]) -> SupervisedDHT:
    """Start a DHT node and wait until it is bootstrapped; raises with a sentence a user can act on. From then on
    no peer's stream frame makes this process, or any it forks, read more than MAX_STREAM_FRAME_BYTES."""
    install_frame_cap()
    dht = SupervisedDHT(
        start=False,
        record_validators=validators,
        **p2p_options(options),
    )
    try:
        dht.run_in_background(await_ready=True, timeout=P2PD_STARTUP_TIMEOUT_S + options.bootstrap_timeout_s)
    except BaseException as e:
        _stop(dht)
        raise _explain_start_failure(e, options) from None
    return dht


def p2p_options(options: SwarmOptions) -> dict[str, Any]:
    """hivemind.DHT's arguments for how its p2pd joins and serves the swarm.

    Every node's p2pd serves as a circuit relay v2 for others (p2pd's default): with p2pd's limits (16 circuits
    and 128 reservations per peer, 4 GiB or 30 min per relayed connection) once libp2p's AutoNAT finds it public,
    and beside that a service with libp2p's default limits (128 KiB or 2 min per relayed connection).
    With `relay`, a node AutoNAT finds private reserves a slot on its initial peers (p2pd's trusted relays default to
    its bootstrap peers) and announces a /p2p-circuit address: libp2p's autorelay does so once it knows 4 relay
    candidates, or after a 3-minute boot delay with fewer."""
    return dict(
        initial_peers=list(options.initial_peers) or None,
        host_maddrs=list(options.listen),
        announce_maddrs=list(options.announce) or None,
        identity_path=options.identity_path,
        client_mode=options.client_mode,
        use_ipfs=False,  # never dial the public IPFS bootstrap nodes
        check_if_identity_free=False,  # the state-dir lock already keeps one identity to one daemon
        wait_timeout=options.request_timeout_s,
        bootstrap_timeout=options.bootstrap_timeout_s,
        startup_timeout=P2PD_STARTUP_TIMEOUT_S,
        authorizer=options.authorizer,
        use_auto_relay=options.auto_relay,
    )


def _explain_start_failure(error: BaseException, options: SwarmOptions) -> BaseException:
    if isinstance(error, KeyboardInterrupt):
        return error
    peers = ", ".join(options.initial_peers)
    if isinstance(error, TimeoutError) or "bootstrap" in str(error).lower():
        if options.initial_peers:
            admission = (
                "that your join token is for the run there"
                if options.authorizer is not None
                else "that the run there is open (an invite-only run needs --join-token)"
            )
            return SwarmUnreachableError(
                f"No initial peer answered within {options.bootstrap_timeout_s:g} s ({peers}); "
                f"check the address, that the peer is running and {admission}, or raise --bootstrap-timeout."
            )
        return CrowdtrainError(f"The p2p daemon did not start within {P2PD_STARTUP_TIMEOUT_S:g} s.")
    if isinstance(error, P2PDaemonError) and "address already in use" in str(error).lower():
        return CrowdtrainError(f"Cannot listen on {', '.join(options.listen)}: the port is already in use.")
    logger.debug("DHT start failed", exc_info=error)
    return CrowdtrainError(f"Could not start the DHT node: {error}.")


def _stop(dht: hivemind.DHT) -> None:
    if dht.is_alive():
        dht.terminate()  # SIGTERM: our handler kills p2pd, then the process exits
        dht.join(5)
