"""The daemon's lifecycle: lock the state dir, load the identity, join the DHT and the run, heartbeat, leave."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind

from crowdtrain import __version__, proto
from crowdtrain.dht.admission import InviteAuthorizer
from crowdtrain.dht.calls import DHT_CALL_FAILED
from crowdtrain.dht.gate import AdmissionGate, set_process_gate
from crowdtrain.dht.records import owner_marker
from crowdtrain.dht.registry import (
    fetch_admission,
    list_peer_statuses,
    list_runs,
    publish_manifest,
    publish_peer_status,
)
from crowdtrain.dht.swarm import (
    SwarmOptions,
    join_swarm,
    make_forked_children_die_with_this_process,
    signal_children,
)
from crowdtrain.dht.validator import CrowdtrainRecordValidator, make_validators
from crowdtrain.errors import BadInputError, CrowdtrainError
from crowdtrain.links.probes import ProbeService
from crowdtrain.links.relays import RelayWatch, announced_addresses, reachability
from crowdtrain.manifest import RunManifest
from crowdtrain.models import load_tokenizer, spec_parameter_count
from crowdtrain.models.device import describe_device, resolve_device
from crowdtrain.modes.progress import Progress
from crowdtrain.modes.registry import mode_class
from crowdtrain.moe import ExpertSupervisor
from crowdtrain.node.addresses import JoinAddress, join_address, resolve_listen
from crowdtrain.node.admission_watch import AdmissionRefused, AdmissionWatch, JoinTokenExpired, revocations_path
from crowdtrain.node.config import NodeConfig
from crowdtrain.node.expert_host import make_expert_supervisor
from crowdtrain.node.identity import Identity, load_or_create_identity
from crowdtrain.node.logs import set_log_peer
from crowdtrain.node.membership import Membership, node_authorizer, resolve_membership, with_join_token
from crowdtrain.node.metrics import MetricsEndpoint, start_metrics_endpoint
from crowdtrain.node.statedir import exclusive_state_dir, remove_node_file, write_node_file
from crowdtrain.planning.planner import plan_problem
from crowdtrain.planning.roles import LinkProber, NodeRoles
from crowdtrain.roles import Role
from crowdtrain.training.loop import Trainer, TrainerOptions
from crowdtrain.training.throughput import CACHE_FILE as THROUGHPUT_CACHE_FILE
from crowdtrain.training.throughput import measure_throughput

logger = logging.getLogger(__name__)

MANIFEST_TTL_S = 90.0
"""A manifest record outlives its publisher's last refresh by this long."""
MANIFEST_REFRESH_S = 30.0
MANIFEST_PUBLISHERS = 5
"""Members beyond this many don't republish the manifest: enough copies, less DHT traffic."""
SWARM_LOG_INTERVAL_S = 60.0
DHT_CALL_TIMEOUT_S = 10.0
LEAVE_DEADLINE_S = 28.0
"""A node leaves within 30 s of SIGINT/SIGTERM (the CLI contract), forcibly if it must."""


@dataclass(frozen=True, slots=True)
class ReadyInfo:
    """What the CLI prints once the node is up."""

    peer_id: str
    run_id: str
    founded: bool
    multiaddrs: tuple[str, ...]
    join: JoinAddress
    """The address the join command names, and whose it is (`node.addresses.join_address`): never this node's LAN
    address when it joined through a peer that reaches farther."""
    role: Role | None
    """The role `--role` fixed, or None when measurement and the plan choose it (`--role auto`)."""
    device: str
    run_key: str
    """The founder's peer ID: joiners pass it as --run-key to accept no other founder's manifest."""


class Daemon:
    """One crowdtrain node. `run()` blocks until `stop` is set, then leaves the swarm cleanly."""

    def __init__(self, config: NodeConfig, stop: threading.Event, on_ready: Callable[[ReadyInfo], None]):
        self.config = config
        self.stop = stop
        self.on_ready = on_ready
        self.device = "cpu"
        self.probes: ProbeService | None = None
        self.authorizer: InviteAuthorizer | None = None

    def run(self) -> None:
        make_forked_children_die_with_this_process()
        with exclusive_state_dir(self.config.state_path):
            self.config = with_join_token(self.config)  # the run and run key a join token names
            identity = load_or_create_identity(self.config.identity_path)
            set_log_peer(identity.peer_id.to_base58())
            self.device = resolve_device(self.config.device)
            device = describe_device(self.device)
            self.authorizer = node_authorizer(self.config, identity)
            options = self._swarm_options(identity)
            dht = join_swarm(options, make_validators(identity.private_key))
            try:
                self._serve(dht, identity, device, options.auto_relay)
            finally:
                dht.shutdown()

    def _swarm_options(self, identity: Identity) -> SwarmOptions:
        return SwarmOptions(
            initial_peers=self.config.initial_peers,
            listen=resolve_listen(self.config.listen),
            announce=self.config.announce,
            identity_path=str(identity.path),
            client_mode=self.config.fixed_role == Role.CLIENT,
            bootstrap_timeout_s=self.config.bootstrap_timeout_s,
            authorizer=self.authorizer,
            relay=self.config.relay,
        )

    def _serve(self, dht: hivemind.DHT, identity: Identity, device: str, auto_relay: bool) -> None:
        membership = resolve_membership(dht, self.config, identity)
        run_id = membership.manifest.run_id
        _check_role_fits(self.config.fixed_role, membership.manifest)
        dht.add_validators([CrowdtrainRecordValidator([run_id])])
        admission = self._admission(dht, identity, membership)  # before any servicer registers its handlers
        multiaddrs = tuple(str(address) for address in dht.get_visible_maddrs())
        progress = Progress()
        metrics: MetricsEndpoint | None = None
        if self.config.metrics_port:  # before anything else starts: a port in use stops the node right away
            metrics = start_metrics_endpoint(progress, self.config.metrics_port)
            logger.info(f"serving metrics on http://127.0.0.1:{metrics.port}/metrics")
        if self.config.fixed_role not in (Role.CLIENT, Role.EXPERT_HOST):
            # Serving peers' probes from before node.json exists: a node that says it is up answers them.
            self.probes = ProbeService(dht)
            self.probes.start()
        heartbeat = Heartbeat(dht, identity, membership, self.config, device, multiaddrs, progress, auto_relay)
        heartbeat.admission = admission
        heartbeat.beat()
        state_path = self.config.state_path
        joining = join_address(multiaddrs, self.config.initial_peers)
        write_node_file(state_path, _node_info(identity, multiaddrs, run_id, joining.address))
        self.on_ready(
            ReadyInfo(
                peer_id=identity.peer_id.to_base58(),
                run_id=run_id,
                founded=membership.founded,
                multiaddrs=multiaddrs,
                join=joining,
                role=self.config.fixed_role,
                device=device,
                run_key=membership.founder_peer_id,
            )
        )
        beating = threading.Thread(target=heartbeat.run, args=(self.stop,), name="heartbeat", daemon=True)
        beating.start()
        left = threading.Event()
        threading.Thread(target=_enforce_leave_deadline, args=(self.stop, left, state_path), daemon=True).start()
        try:
            if self.config.fixed_role == Role.EXPERT_HOST:
                self._expert_host(dht, identity, membership, heartbeat).run()
            else:
                # Measured after the node is up and visible: the model's first import and the probes take a while.
                roles = heartbeat.roles = self._measure(dht, identity, membership.manifest, multiaddrs)
                if not self.stop.is_set():
                    self._trainer(dht, identity, membership, progress, roles).run(self.stop)
        finally:
            self.stop.set()
            beating.join(timeout=DHT_CALL_TIMEOUT_S + 1)
            if self.probes is not None:
                self.probes.close()
            logger.info("leaving the swarm")
            heartbeat.withdraw()
            remove_node_file(state_path)
            if metrics is not None:
                metrics.close()
            left.set()
        if heartbeat.dht_died:
            raise CrowdtrainError("The DHT process died unexpectedly; restart the daemon (see the log above).")
        if heartbeat.refusal is not None:
            raise heartbeat.refusal

    def _admission(self, dht: hivemind.DHT, identity: Identity, membership: Membership) -> AdmissionWatch | None:
        """An invite-only run: gate every RPC handler this process and the averagers it forks register, and watch
        this node's own admission; None in an open run."""
        run_id = membership.manifest.run_id
        if membership.manifest.admission == "invite" and self.authorizer is None:
            raise BadInputError(f"Run {run_id!r} is invite-only; ask its founder for a join token (--join-token).")
        if self.authorizer is None:
            return None
        peer_id = identity.peer_id.to_base58()
        gate = AdmissionGate(self.authorizer.checker, functools.partial(fetch_admission, dht, run_id), peer_id)
        set_process_gate(gate)
        own_list = revocations_path(self.config.state_path, run_id) if membership.founder_peer_id == peer_id else None
        owner = owner_marker(identity.private_key)
        return AdmissionWatch(dht, self.authorizer, gate, peer_id, owner, own_list, DHT_CALL_TIMEOUT_S)

    def _expert_host(
        self, dht: hivemind.DHT, identity: Identity, membership: Membership, heartbeat: Heartbeat
    ) -> ExpertSupervisor:
        return make_expert_supervisor(
            dht=dht,
            manifest=membership.manifest,
            peer_id=identity.peer_id.to_base58(),
            config=self.config,
            device=self.device,
            on_change=heartbeat.set_experts,
            stop=self.stop,
        )

    def _measure(
        self, dht: hivemind.DHT, identity: Identity, manifest: RunManifest, multiaddrs: tuple[str, ...]
    ) -> NodeRoles:
        """Measure throughput, links and reachability, serve peers' probes, and make the first plan."""
        peer_id, run_id = identity.peer_id.to_base58(), manifest.run_id
        auxiliary_aggregators = mode_class(manifest).has_auxiliary_aggregators

        def statuses() -> list[proto.PeerStatus]:
            return list_peer_statuses(dht, run_id, DHT_CALL_TIMEOUT_S)

        samples_per_second = measure_throughput(
            manifest,
            self.device,
            self.config.micro_batch_size,
            self.config.num_threads,
            self.config.state_path / THROUGHPUT_CACHE_FILE,
            duration_s=self.config.throughput_s,
            data_cache_dir=self.config.data_cache_path,
        )
        num_parameters = spec_parameter_count(manifest.model, load_tokenizer(manifest.model).vocab_size)
        roles = NodeRoles(
            peer_id=peer_id,
            problem=plan_problem(manifest, num_parameters),
            role=self.config.fixed_role,
            list_statuses=statuses,
            aggregate_only=auxiliary_aggregators,
            observed_uploads=dict if self.probes is None else self.probes.observations.fastest,
        )
        roles.record_throughput(samples_per_second)
        if self.config.fixed_role != Role.CLIENT:
            assert self.probes is not None, "started in _serve, before the node announced itself ready"
            prober = LinkProber(self.probes, roles, statuses, peer_id, multiaddrs)
            prober.probe_once()  # before the optimizer is built: a node nobody can dial must be a client
            interval_s = self.config.bandwidth_probe_interval_s
            threading.Thread(target=prober.run, args=(self.stop, interval_s), name="probes", daemon=True).start()
        roles.replan()
        return roles

    def _trainer(
        self, dht: hivemind.DHT, identity: Identity, membership: Membership, progress: Progress, roles: NodeRoles
    ) -> Trainer:
        run_id = membership.manifest.run_id
        state = self.config.state_path
        roles.running_auxiliary = _is_auxiliary(roles, membership.manifest)
        options = TrainerOptions(
            micro_batch_size=self.config.micro_batch_size,
            checkpoint_dir=state / "checkpoints" / run_id,
            checkpoint_keep=self.config.checkpoint_keep,
            checkpoint_interval_s=self.config.checkpoint_interval_s,
            eval_every=self.config.eval_every,
            start_with_peers=self.config.start_with_peers,
            data_cache_dir=self.config.data_cache_path,
            client_mode=roles.is_client,
            auxiliary=roles.running_auxiliary,
            upload_mbps=roles.own.upload_mbps,
            download_mbps=roles.own.download_mbps,
            show_bar=self.config.log_format == "text" and sys.stderr.isatty(),
            num_threads=self.config.num_threads,
            device=self.device,
        )

        def known_peers() -> list[proto.PeerStatus]:
            statuses = list_peer_statuses(dht, run_id, DHT_CALL_TIMEOUT_S)
            # Pure expert hosts never average: counting them would misplace Moshpit keys and raise false alarms.
            return [status for status in statuses if set(status.roles) != {Role.EXPERT_HOST}]

        return Trainer(
            dht=dht,
            manifest=membership.manifest,
            peer_id=identity.peer_id.to_base58(),
            private_key=identity.private_key,
            options=options,
            progress=progress,
            known_peers=known_peers,
            read_plan_share=roles.replan,
        )


class Heartbeat:
    """Publishes this node's status every interval, republishes the manifest, logs the swarm's size."""

    def __init__(
        self,
        dht: hivemind.DHT,
        identity: Identity,
        membership: Membership,
        config: NodeConfig,
        device: str,
        multiaddrs: tuple[str, ...],
        progress: Progress,
        auto_relay: bool = False,
    ):
        self.dht, self.membership, self.config, self.progress = dht, membership, config, progress
        self.roles: NodeRoles | None = None
        """Set once the node has measured itself; until then its status carries the defaults."""
        self.owner = owner_marker(identity.private_key)
        self.status = proto.PeerStatus(
            peer_id=identity.peer_id.to_base58(),
            version=__version__,
            device=device,
            multiaddrs=multiaddrs,
            run_id=membership.manifest.run_id,
            # until measured: what the node was told, and reachable unless it said otherwise
            roles=[(config.fixed_role or Role.TRAINER).value],
            reachable=config.fixed_role != Role.CLIENT,
            role_override=config.fixed_role.value if config.fixed_role else "",
        )
        self.next_manifest_at = 0.0
        self.experts: tuple[str, ...] = ()
        self.next_swarm_log_at = time.monotonic() + SWARM_LOG_INTERVAL_S
        self.failed_beats = 0
        self.dht_died = False
        self.withdrawing = False
        self.admission: AdmissionWatch | None = None
        """An invite-only run's admission: the beat publishes this node's record and watches its standing."""
        self.refusal: AdmissionRefused | None = None
        """Set when the node stopped because its join token no longer admits it; the daemon exits with it."""
        self.relay_watch = RelayWatch(functools.partial(announced_addresses, dht)) if auto_relay else None
        """Where this node's p2pd looks for a relay (`SwarmOptions.auto_relay`): the relays it holds, for the beat."""

    def run(self, stop: threading.Event) -> None:
        """Beat every status interval until `stop` is set, then withdraw at once; a DHT that died ends the daemon.

        The withdrawal comes first thing as the node leaves, before the trainer shuts its averagers down: an
        averager process that exits leaves its last DHT requests unreadable (their reply pipe went with it), and
        hivemind's DHT process then pauses its request loop for each one, which made a later withdrawal time out.
        """
        while not stop.wait(self.config.status_interval_s):
            if not self.dht.is_alive():
                logger.error("the DHT process died unexpectedly; stopping")
                self.dht_died = True
                stop.set()
                return
            try:
                self.beat()
            except JoinTokenExpired as e:
                logger.error(f"{e}; stopping")
                stop.set()
                break
            except AdmissionRefused as e:
                logger.error(f"{e} Stopping.")
                self.refusal = e
                stop.set()
                break
            except DHT_CALL_FAILED:
                logger.exception("heartbeat failed; retrying at the next interval")
        self.withdraw()

    def set_experts(self, uids: tuple[str, ...]) -> None:
        """The DMoE experts this node now serves; the next beat publishes them (called from another thread)."""
        self.experts = uids

    def beat(self) -> None:
        progress = self.progress
        if self.roles is not None:
            self.roles.fill_status(self.status)
        _replace(self.status.experts, self.experts)
        if self.relay_watch is not None:
            _replace(self.status.relays, self.relay_watch.relays())
        self.status.epoch, self.status.samples_accumulated = progress.epoch, progress.samples_accumulated
        self.status.samples_per_second = progress.samples_per_second
        self.status.partial_averages = progress.num_partial_averages
        self.status.local_steps = progress.num_local_steps
        if progress.phase_times is not None:
            self.status.phase_times.CopyFrom(progress.phase_times.to_proto())
        del self.status.excluded_peers[:]
        self.status.excluded_peers.extend(progress.excluded_peer_statuses())
        training = progress.training_status()
        if training is not None:
            self.status.training.CopyFrom(training)
        if progress.loss is not None:
            self.status.loss = progress.loss
        status = self.status
        progress.reachability = reachability(status.reachable, status.reachability_measured, status.relays)
        self.status.last_seen = time.time()
        if self.admission is not None:
            self.admission.beat()
        stored = publish_peer_status(self.dht, self.status, self.owner, self.config.status_ttl_s, DHT_CALL_TIMEOUT_S)
        self.failed_beats = 0 if stored else self.failed_beats + 1
        if self.failed_beats in (1, 10):
            logger.warning("could not refresh this node's status in the DHT; peers may not see it")
        if time.monotonic() >= self.next_manifest_at:
            self._republish_manifest()
        if time.monotonic() >= self.next_swarm_log_at:
            self.next_swarm_log_at = time.monotonic() + SWARM_LOG_INTERVAL_S
            peers = list_peer_statuses(self.dht, self.status.run_id, DHT_CALL_TIMEOUT_S)
            logger.info(f"run {self.status.run_id!r}: {len(peers)} peers online")

    def _republish_manifest(self) -> None:
        self.next_manifest_at = time.monotonic() + MANIFEST_REFRESH_S
        if not self.membership.founded:
            listing = list_runs(self.dht, DHT_CALL_TIMEOUT_S, self.membership.founder_peer_id).get(self.status.run_id)
            others = listing.publishers - {self.owner} if listing else frozenset()
            already_publishing = listing is not None and self.owner in listing.publishers
            if len(others) >= MANIFEST_PUBLISHERS and not already_publishing:
                return
        publish_manifest(self.dht, self.membership.signed_bytes, self.owner, MANIFEST_TTL_S, DHT_CALL_TIMEOUT_S)

    def withdraw(self) -> None:
        """Replace our status with an OFFLINE one, so readers drop this node at once; tried once."""
        if self.dht_died or self.withdrawing:
            return  # nothing to write with (the record expires by itself), or tried already
        self.withdrawing = True
        self.status.state = proto.PeerStatus.OFFLINE
        self.status.last_seen = time.time()
        if not publish_peer_status(self.dht, self.status, self.owner, self.config.status_ttl_s, DHT_CALL_TIMEOUT_S):
            logger.warning("could not withdraw this node's status; it will expire by itself")


def _replace(field: Any, values: Sequence[str]) -> None:
    """Set a repeated string field of the status record to `values`."""
    if tuple(field) != tuple(values):
        del field[:]
        field.extend(values)


def _enforce_leave_deadline(stop: threading.Event, left: threading.Event, state_path: Path) -> None:
    """Once asked to stop, exit within LEAVE_DEADLINE_S even if hivemind blocks (e.g. on a dead DHT process).

    The deadline holds until the process has exited, not only until it has left: the DHT's shutdown and the
    interpreter's exit (which joins hivemind's processes and threads) come after, and have hung there. A node that
    left cleanly (checkpoint written, status withdrawn) still exits 0 then."""
    stop.wait()
    deadline = time.monotonic() + LEAVE_DEADLINE_S
    if not left.wait(LEAVE_DEADLINE_S):
        logger.error(f"could not leave the swarm cleanly within {LEAVE_DEADLINE_S:g} s; exiting now")
        _exit_now(state_path, 1)
    time.sleep(max(0.0, deadline - time.monotonic()))  # returns only if the process is still here then
    logger.warning(f"left the swarm, but its processes were not shut down within {LEAVE_DEADLINE_S:g} s; exiting now")
    _exit_now(state_path, 0)


def _exit_now(state_path: Path, code: int) -> None:
    remove_node_file(state_path)
    signal_children(signal.SIGTERM)  # the DHT process takes its p2pd down; averagers just end
    logging.shutdown()
    os._exit(code)


def _check_role_fits(role: Role | None, manifest: RunManifest) -> None:
    """Refuse, with a sentence, a --role this run has no use for."""
    if role == Role.EXPERT_HOST and manifest.moe is None:
        raise BadInputError(
            f"Run {manifest.run_id!r} is a dense run with no experts to host; use --role trainer, or found a DMoE "
            "run (e.g. --run-file demo-moe)."
        )
    if role == Role.AGGREGATOR and not mode_class(manifest).has_auxiliary_aggregators:
        raise BadInputError(
            f"Run {manifest.run_id!r} trains in {manifest.training.mode} mode, where every peer steps its own "
            "replica, so --role aggregator has nothing to aggregate; use --role auto or trainer."
        )


def _is_auxiliary(roles: NodeRoles, manifest: RunManifest) -> bool:
    """The plan has this reachable node aggregate without computing (only in modes that have such peers)."""
    return not roles.computes and not roles.is_client and mode_class(manifest).has_auxiliary_aggregators


def _node_info(identity: Identity, multiaddrs: tuple[str, ...], run_id: str, join: str) -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "peer_id": identity.peer_id.to_base58(),
        "multiaddrs": list(multiaddrs),
        "join_address": join,
        "run_id": run_id,
        "version": __version__,
        "started_at": time.time(),
    }
