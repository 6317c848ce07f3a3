"""Serve a set of experts through hivemind's MoE Server; change the set; keep their checkpoints.

hivemind's Server forks its connection handlers and task pools at start, so the experts it serves
are fixed for its lifetime: a new set means a new Server over the same expert modules, whose
weights and optimizer state live in this process and carry over.
"""

from __future__ import annotations

import io
import logging
import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
import torch
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.moe.server.server import Server

from crowdtrain.files import read_checksummed, write_checksummed
from crowdtrain.manifest import RunManifest
from crowdtrain.moe.connection import BoundedConnectionHandler
from crowdtrain.moe.experts import MAX_BATCH_SEQUENCES, build_expert, make_backend
from crowdtrain.moe.replicas import mix_into
from crowdtrain.optimizer import build_optimizer

logger = logging.getLogger(__name__)

SERVER_START_TIMEOUT_S = 60.0
NUM_CONNECTION_HANDLERS = 2
"""Processes accepting expert calls; each replicates the p2p daemon's connection, so keep them few on a CPU."""


class _ExpertServer(Server):
    """hivemind's MoE Server, minus shutting down the DHT it was given, with every request checked.

    Symptom worked around: Server.shutdown() ends with `self.dht.shutdown()`, which would take the
    daemon's DHT (and its status records, and the trainer) down whenever the host changes its experts.
    """

    def __init__(
        self, dht: hivemind.DHT, backends: dict[str, ModuleBackend], *, num_connection_handlers: int, **kwargs: Any
    ):
        super().__init__(dht, backends, num_connection_handlers=0, **kwargs)
        # hivemind's handlers run whatever a caller sends (moe/requests.py): ours check it first
        self.conn_handlers = [
            BoundedConnectionHandler(dht, self.module_backends, max_batch_size=MAX_BATCH_SEQUENCES)
            for _ in range(num_connection_handlers)
        ]

    def shutdown(self) -> None:
        self.ready.clear()
        for handler in self.conn_handlers:
            if handler.is_alive():
                handler.shutdown()
        if self.module_backends and self.dht_handler_thread.is_alive():
            self.dht_handler_thread.stop.set()
            self.dht_handler_thread.join()
        if not self.runtime.shutdown_trigger.is_set():
            self.runtime.shutdown()


_children_reset = False


def _make_forked_children_obey_terminate() -> None:
    """Children forked from now on (hivemind's task pools, connection handlers) die on SIGTERM, ignore SIGINT.

    Symptom worked around: forked children inherit the CLI's Python signal handlers, so when hivemind
    stops a task pool with `terminate()` (SIGTERM), the pool logs "leaving the swarm" instead of
    exiting, and the Runtime's `join()` hangs the daemon's shutdown until the forced exit. SIGINT is
    ignored because a terminal's Ctrl-C reaches the whole process group: the daemon stops them itself.
    """
    global _children_reset
    if not _children_reset:
        _children_reset = True
        os.register_at_fork(after_in_child=_default_signals)


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass(frozen=True, kw_only=True, slots=True)
class HostOptions:
    """Node-local settings of an expert host."""

    checkpoint_dir: Path
    """Where this run's expert checkpoints live, one file per expert uid."""
    device: str = "cpu"
    """The torch device the experts run on."""
    declare_period_s: float = 10.0
    """Seconds between two announcements of the served experts in the DHT."""
    declare_ttl_s: float = 30.0
    """Seconds an announcement outlives its last refresh (how long a dead host's experts stay findable)."""


@dataclass(slots=True)
class _Expert:
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer


class ExpertHost:
    """The experts this node serves, behind one hivemind Server at a time."""

    def __init__(self, dht: hivemind.DHT, manifest: RunManifest, options: HostOptions):
        self.dht, self.manifest, self.options = dht, manifest, options
        self._experts: dict[str, _Expert] = {}
        self._server: _ExpertServer | None = None
        self._learning_rate_factor = 1.0
        options.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        _make_forked_children_obey_terminate()

    @property
    def hosted(self) -> tuple[str, ...]:
        return tuple(self._experts)

    def checkpointed(self) -> set[str]:
        """Uids of the experts with a checkpoint in the state dir."""
        return {path.stem for path in self.options.checkpoint_dir.glob("*.pt")}

    def set_learning_rate_factor(self, factor: float) -> None:
        """Follow the run's schedule: every expert's learning rate becomes the manifest's times `factor`.

        The schedule counts the swarm's global steps, so experts warm up and decay with the dense model
        however many updates each of them takes. A plain assignment the runtime's next step picks up.
        """
        self._learning_rate_factor = factor
        for expert in self._experts.values():
            self._apply_learning_rate(expert.optimizer)

    def _apply_learning_rate(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self.manifest.optimizer.learning_rate * self._learning_rate_factor

    def learning_rate(self, uid: str) -> float | None:
        """The served expert `uid`'s current learning rate, or None if not served."""
        expert = self._experts.get(uid)
        return float(expert.optimizer.param_groups[0]["lr"]) if expert is not None else None

    def module(self, uid: str) -> torch.nn.Module | None:
        """The served expert `uid`'s module (its weights live in this process), or None if not served."""
        expert = self._experts.get(uid)
        return expert.module if expert is not None else None

    def serve(self, uids: Iterable[str], replica_values: Mapping[str, torch.Tensor] | None = None) -> None:
        """Serve exactly `uids`: keep the weights of experts already served, set up the others.

        A new expert with an entry in `replica_values` (a live replica's flat parameters) starts from
        those weights with a fresh optimizer; the others are restored from their checkpoint or created.
        """
        wanted = list(dict.fromkeys(uids))
        self.stop_server()
        for uid in set(self._experts) - set(wanted):
            self._save(uid)
            del self._experts[uid]
        for uid in wanted:
            if uid not in self._experts:
                values = (replica_values or {}).get(uid)
                self._experts[uid] = self._load_or_create(uid) if values is None else self._from_replica(uid, values)
                self._apply_learning_rate(self._experts[uid].optimizer)
        self._experts = {uid: self._experts[uid] for uid in wanted}  # `hosted` in the caller's (grid) order
        if wanted:
            self._start_server()

    def is_healthy(self) -> bool:
        """Whether the server serves: its thread, runtime, task pools and connection handlers all run."""
        if not self._experts:
            return True
        server = self._server
        if server is None or not server.is_alive() or not server.ready.is_set():
            return False
        pools_alive = all(pool.is_alive() for pool in server.runtime.pools)
        return pools_alive and all(handler.is_alive() for handler in server.conn_handlers)

    def restart(self) -> None:
        """Start a fresh server over the same experts (after a crash of one of its parts)."""
        self.stop_server()
        if self._experts:
            self._start_server()

    def save_checkpoints(self) -> None:
        for uid in self._experts:
            self._save(uid)

    def shutdown(self) -> None:
        """Stop serving and checkpoint every expert."""
        self.stop_server()
        self.save_checkpoints()

    def stop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.join(timeout=10)

    def _start_server(self) -> None:
        backends = {
            uid: make_backend(self.manifest, uid, expert.module, expert.optimizer)
            for uid, expert in self._experts.items()
        }
        server = _ExpertServer(
            self.dht,
            backends,
            num_connection_handlers=NUM_CONNECTION_HANDLERS,
            update_period=self.options.declare_period_s,
            expiration=self.options.declare_ttl_s,
            device=torch.device(self.options.device),
        )
        server.daemon = True
        self._server = server
        server.run_in_background(await_ready=True, timeout=SERVER_START_TIMEOUT_S)
        logger.info(f"serving {len(backends)} experts: {', '.join(backends)}")

    def _checkpoint_path(self, uid: str) -> Path:
        return self.options.checkpoint_dir / f"{uid}.pt"

    def _load_or_create(self, uid: str) -> _Expert:
        module = build_expert(self.manifest, uid).to(self.options.device)
        expert = _Expert(module, build_optimizer(module.parameters(), self.manifest.optimizer))
        path = self._checkpoint_path(uid)
        if path.exists():
            try:
                data = read_checksummed(path)
                state = torch.load(io.BytesIO(data), map_location=self.options.device, weights_only=True)
                expert.module.load_state_dict(state["module"])
                expert.optimizer.load_state_dict(state["optimizer"])
                logger.info(f"restored expert {uid} from its checkpoint")
            except Exception as e:  # a torn or foreign file: start the expert afresh rather than not at all
                logger.warning(f"ignored the unreadable checkpoint {path.name}: {e}")
                module = build_expert(self.manifest, uid).to(self.options.device)
                expert = _Expert(module, build_optimizer(module.parameters(), self.manifest.optimizer))
        return expert

    def _from_replica(self, uid: str, values: torch.Tensor) -> _Expert:
        module = build_expert(self.manifest, uid).to(self.options.device)
        mix_into(module, values, 1.0)
        return _Expert(module, build_optimizer(module.parameters(), self.manifest.optimizer))

    def _save(self, uid: str) -> None:
        expert = self._experts[uid]
        path = self._checkpoint_path(uid)
        buffer = io.BytesIO()
        torch.save({"module": expert.module.state_dict(), "optimizer": expert.optimizer.state_dict()}, buffer)
        # atomic and checksummed: a crash mid-save leaves the previous checkpoint, a torn or flipped file is refused
        write_checksummed(path, buffer.getbuffer())
