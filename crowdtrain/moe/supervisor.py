"""The expert host's loop: place experts by coverage, take over vanished ones, average replicas, restart crashes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import hivemind
import torch

from crowdtrain.dht.registry import list_peer_statuses
from crowdtrain.manifest import RunManifest, expert_uids
from crowdtrain.moe.epoch import ExpertEpoch
from crowdtrain.moe.experts import build_expert
from crowdtrain.moe.hosting import ExpertHost, HostOptions
from crowdtrain.moe.placement import choose_experts
from crowdtrain.moe.replicas import ReplicaError, ReplicaService, flat_parameters, mix_into, num_values
from crowdtrain.optimizer import learning_rate_factor
from crowdtrain.roles import Role
from crowdtrain.rpc.service import NodeStopping

logger = logging.getLogger(__name__)

EXPERT_HOST_ROLE = Role.EXPERT_HOST
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
    average_every_s: float = 30.0
    """Seconds between two averagings of every replicated expert with one of its other replicas."""


class ExpertSupervisor:
    """Serves the experts placement assigns to this host until `stop` is set, then checkpoints them: at once, even
    while it copies an expert from a peer that no longer answers."""

    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        manifest: RunManifest,
        peer_id: str,
        host_options: HostOptions,
        options: SupervisorOptions,
        on_change: Callable[[tuple[str, ...]], None],
        stop: threading.Event | None = None,
    ):
        self.dht, self.manifest, self.peer_id = dht, manifest, peer_id
        self.options, self.on_change = options, on_change
        self.stop = threading.Event() if stop is None else stop
        """The node's stop event: `run` ends once it is set, and copies from peers under way end at once."""
        self.host = ExpertHost(dht, manifest, host_options)
        self.replicas = ReplicaService(dht, self.host.module, self.stop)
        self.grid = expert_uids(manifest)
        self._rounds = 0
        self.epoch = ExpertEpoch(run_created_at=manifest.created_at)

    def run(self) -> None:
        self.replicas.start()
        next_checkpoint_at = time.monotonic() + self.options.checkpoint_every_s
        next_average_at = time.monotonic() + self.options.average_every_s
        try:
            while True:
                others, claims = self._look()
                epoch = self.epoch.update(claims, time.time())
                self.host.set_learning_rate_factor(learning_rate_factor(epoch, self.manifest.optimizer))
                self.recheck(others)
                if time.monotonic() >= next_average_at:
                    next_average_at = time.monotonic() + self.options.average_every_s
                    self.average_replicas(others)
                if time.monotonic() >= next_checkpoint_at:
                    next_checkpoint_at = time.monotonic() + self.options.checkpoint_every_s
                    self.host.save_checkpoints()
                if self.stop.wait(self.options.recheck_s):
                    break
        except NodeStopping:
            pass  # a copy from a peer cut short: the experts as they are now are checkpointed below
        finally:
            self.replicas.close()
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
        if set(wanted) != set(current):  # a new set restarts the server: never for a mere reordering
            self._log_change(current, wanted, others)
            new = [uid for uid in wanted if uid not in current]
            self.host.serve(wanted, replica_values=self._copy_replicas(new, others))
            self.on_change(wanted)
        elif not self.host.is_healthy():
            logger.warning("the expert server stopped working; restarting it")
            self.host.restart()

    def average_replicas(self, others: Mapping[str, tuple[str, ...]]) -> int:
        """Move each served expert's weights halfway to one other replica's (a different one each round).

        Returns how many experts were averaged; a replica that fails to answer is skipped this round.
        """
        self._rounds += 1
        averaged, distances = 0, []
        for uid in self.host.hosted:
            holders = _holders(uid, others)
            module = self.host.module(uid)
            if not holders or module is None:
                continue
            peer_id = holders[self._rounds % len(holders)]
            try:
                values = self.replicas.fetch(peer_id, uid, num_values(module))
            except ReplicaError as e:
                logger.warning(f"skipped averaging expert {uid} this round: {e}")
                continue
            own = flat_parameters(module)
            distances.append(float((own - values).norm() / own.norm().clamp_min(1e-12)))
            mix_into(module, values, 0.5)
            averaged += 1
        if averaged:
            logger.info(
                f"averaged {averaged} replicated experts with another replica each "
                f"(largest relative difference before: {max(distances):.3g})"
            )
        return averaged

    def _copy_replicas(self, uids: list[str], others: Mapping[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
        """The live replicas' weights of the experts in `uids` that other hosts serve (the first that answers)."""
        copied: dict[str, torch.Tensor] = {}
        for uid in uids:
            expected = num_values(build_expert(self.manifest, uid))
            holders = _holders(uid, others)
            # each holder twice: the first stream to a peer met moments ago failed once with an empty error (CI)
            for peer_id in (*holders, *holders):
                try:
                    copied[uid] = self.replicas.fetch(peer_id, uid, expected)
                except ReplicaError as e:
                    logger.warning(f"could not copy expert {uid} from a replica: {e}")
                    continue
                logger.info(f"starting expert {uid} from the weights of its replica on peer {peer_id[-8:]}")
                break
        return copied

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

    def _look(self) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
        """Every other live expert host's served experts, by peer ID; and the epoch each trainer claims."""
        statuses = list_peer_statuses(self.dht, self.manifest.run_id, LOOKUP_TIMEOUT_S)
        others = {
            status.peer_id: tuple(status.experts)
            for status in statuses
            if EXPERT_HOST_ROLE in status.roles and status.peer_id != self.peer_id
        }
        claims = {status.peer_id: status.epoch for status in statuses if EXPERT_HOST_ROLE not in status.roles}
        return others, claims


def _holders(uid: str, others: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The other hosts serving `uid`, in a stable order."""
    return sorted(peer_id for peer_id, uids in others.items() if uid in uids)
