"""The expert host's loop: place experts by coverage, take over the ones whose hosts vanished, restart crashes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import hivemind

from crowdtrain.dht.registry import list_peer_statuses
from crowdtrain.manifest import RunManifest, expert_uids
from crowdtrain.moe.hosting import ExpertHost, HostOptions
from crowdtrain.moe.placement import choose_experts

logger = logging.getLogger(__name__)

EXPERT_HOST_ROLE = "expert-host"
LOOKUP_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SupervisorOptions:
    """How often an expert host looks at the swarm, and how much it serves."""

    max_experts: int
    """The most experts this host serves."""
    recheck_s: float = 5.0
    """Seconds between two looks at the grid's coverage."""
    checkpoint_every_s: float = 60.0
    """Seconds between two checkpoints of every served expert."""


class ExpertSupervisor:
    """Serves the experts placement assigns to this host until `stop` is set, then checkpoints them."""

    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        manifest: RunManifest,
        peer_id: str,
        host_options: HostOptions,
        options: SupervisorOptions,
        on_change: Callable[[tuple[str, ...]], None],
    ):
        self.dht, self.manifest, self.peer_id = dht, manifest, peer_id
        self.options, self.on_change = options, on_change
        self.host = ExpertHost(dht, manifest, host_options)
        self.grid = expert_uids(manifest)

    def run(self, stop: threading.Event) -> None:
        next_checkpoint_at = time.monotonic() + self.options.checkpoint_every_s
        try:
            while True:
                self.recheck(self._other_hosts())
                if time.monotonic() >= next_checkpoint_at:
                    next_checkpoint_at = time.monotonic() + self.options.checkpoint_every_s
                    self.host.save_checkpoints()
                if stop.wait(self.options.recheck_s):
                    break
        finally:
            self.host.shutdown()
            logger.info(f"checkpointed {len(self.host.hosted)} experts")

    def recheck(self, others: Mapping[str, tuple[str, ...]]) -> None:
        """Re-place this host's experts against the other hosts'; restart the server if it crashed."""
        current = self.host.hosted
        wanted = choose_experts(
            self.grid,
            others,
            self.peer_id,
            self.options.max_experts,
            current=current,
            checkpoints=self.host.checkpointed(),
        )
        if wanted != current:
            self._log_change(current, wanted, others)
            self.host.serve(wanted)
            self.on_change(wanted)
        elif not self.host.is_healthy():
            logger.warning("the expert server stopped working; restarting it")
            self.host.restart()

    def _log_change(
        self, current: tuple[str, ...], wanted: tuple[str, ...], others: Mapping[str, tuple[str, ...]]
    ) -> None:
        served_elsewhere = {uid for uids in others.values() for uid in uids}
        taken_over = [uid for uid in wanted if uid not in current and uid not in served_elsewhere]
        if current and taken_over:
            logger.info(f"taking over {len(taken_over)} experts no live host serves: {', '.join(taken_over)}")
        dropped = [uid for uid in current if uid not in wanted]
        if dropped:
            logger.info(f"leaving {len(dropped)} experts to their other hosts: {', '.join(dropped)}")

    def _other_hosts(self) -> dict[str, tuple[str, ...]]:
        statuses = list_peer_statuses(self.dht, self.manifest.run_id, LOOKUP_TIMEOUT_S)
        return {
            status.peer_id: tuple(status.experts)
            for status in statuses
            if EXPERT_HOST_ROLE in status.roles and status.peer_id != self.peer_id
        }
