"""`crowdtrain status`: read the run's records as a DHT client and show the swarm."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hivemind
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from crowdtrain import proto
from crowdtrain.averaging.phases import PhaseTimes
from crowdtrain.cli.reader import join_as_reader
from crowdtrain.cli.runs import choose_run
from crowdtrain.dht.registry import RunListing, await_runs, list_peer_statuses, list_runs
from crowdtrain.dht.validator import CrowdtrainRecordValidator
from crowdtrain.links.relays import reachability
from crowdtrain.manifest import RunManifest, expert_uids
from crowdtrain.modes.settings import MODE_SETTINGS, SUMMARIZED_MODES
from crowdtrain.moe.placement import GridCoverage, grid_coverage
from crowdtrain.node.addresses import shareable_address
from crowdtrain.node.config import StatusConfig
from crowdtrain.node.membership import with_join_token
from crowdtrain.node.statedir import find_local_daemon

LOOKUP_TIMEOUT_S = 10.0


def show_status(config: StatusConfig, stop: threading.Event, console: Console) -> None:
    """Print the swarm once, or refresh it every `watch_s` seconds until `stop` is set."""
    config = with_join_token(config)
    initial_peers, run_id = _target(config)
    dht, _ = join_as_reader(dataclasses.replace(config, initial_peers=initial_peers))
    try:
        founder = config.run_key or None
        run_id = choose_run(await_runs(dht, run_id, LOOKUP_TIMEOUT_S, founder), run_id, founder=founder)
        dht.add_validators([CrowdtrainRecordValidator([run_id])])
        read = functools.partial(collect, dht, run_id, founder)
        if config.watch_s == 0:
            _print_once(read(), config.json, console)
        elif config.json:
            while True:
                _print_once(read(), True, console)
                if stop.wait(config.watch_s):
                    break
        else:
            _watch_table(read, config.watch_s, stop, console)
    finally:
        dht.shutdown()


def _target(config: StatusConfig) -> tuple[tuple[str, ...], str]:
    if config.initial_peers:
        return config.initial_peers, config.run_id
    daemon = find_local_daemon(config.state_path)
    addresses = sorted(daemon["multiaddrs"], key=lambda address: "/ip4/127." not in address)
    return tuple(addresses), config.run_id or str(daemon.get("run_id", ""))


@dataclass(frozen=True, slots=True)
class PeerView:
    """One peer as `status` shows it, from its status record; fields in the order of its JSON object."""

    peer_id: str
    roles: tuple[str, ...]
    """As the peer published them (any peer's record may carry any string: never parsed into Role here)."""
    device: str
    samples_per_second: float
    samples_accumulated: int
    epoch: int
    loss: float | None
    upload_mbps: float | None
    download_mbps: float | None
    reachable: bool
    reachability_measured: bool
    aggregation_share: float
    plan_digest: str | None
    measured_samples_per_second: float
    role_override: str | None
    experts: tuple[str, ...]
    version: str
    last_seen: float
    multiaddrs: tuple[str, ...]
    partial_averages: int
    local_steps: int
    phase_times: PhaseTimes | None
    """The peer's last completed global step; None until it completed one."""
    training: proto.TrainingStatus | None
    """The peer's training mode and its last completed round (a copy of its record's); None until it completed
    one."""
    excluded_peers: tuple[tuple[str, str, float], ...]
    """(peer ID, reason, seconds left) of each peer this peer keeps out of its averaging groups."""
    more: dict[str, Any]
    """Every other field of the record but those `status` leaves out (_NOT_SHOWN), by name, as in the message: a
    field added to PeerStatus shows in `status --json` with no code here (the bound it carries in crowdtrain.proto
    was checked when the record was read)."""

    @classmethod
    def from_status(cls, status: proto.PeerStatus) -> PeerView:
        """The view of one status record; unset optional fields are None."""

        def optional(name: str) -> float | None:
            return getattr(status, name) if status.HasField(name) else None

        return cls(
            peer_id=status.peer_id,
            roles=tuple(status.roles),
            device=status.device,
            samples_per_second=status.samples_per_second,
            samples_accumulated=status.samples_accumulated,
            epoch=status.epoch,
            loss=optional("loss"),
            upload_mbps=optional("upload_mbps"),
            download_mbps=optional("download_mbps"),
            reachable=status.reachable,
            reachability_measured=status.reachability_measured,
            aggregation_share=status.aggregation_share,
            plan_digest=status.plan_digest or None,
            measured_samples_per_second=status.measured_samples_per_second,
            role_override=status.role_override or None,
            experts=tuple(status.experts),
            version=status.version,
            last_seen=status.last_seen,
            multiaddrs=tuple(status.multiaddrs),
            partial_averages=status.partial_averages,
            local_steps=status.local_steps,
            phase_times=PhaseTimes.from_proto(status.phase_times) if status.HasField("phase_times") else None,
            training=_copy(status.training) if status.HasField("training") else None,
            excluded_peers=tuple((entry.peer_id, entry.reason, entry.remaining_s) for entry in status.excluded_peers),
            more=message_json(status, leave_out=_NOT_SHOWN | _VIEWED),
        )

    def to_json(self) -> dict[str, Any]:
        """The peer's object in `status --json` (a contract: keys, order and nulls as documented in docs/status.md)."""
        return {
            "peer_id": self.peer_id,
            "roles": list(self.roles),
            "device": self.device,
            "samples_per_second": self.samples_per_second,
            "samples_accumulated": self.samples_accumulated,
            "epoch": self.epoch,
            "loss": self.loss,
            "upload_mbps": self.upload_mbps,
            "download_mbps": self.download_mbps,
            "reachable": self.reachable,
            "reachability_measured": self.reachability_measured,
            "aggregation_share": self.aggregation_share,
            "plan_digest": self.plan_digest,
            "measured_samples_per_second": self.measured_samples_per_second,
            "role_override": self.role_override,
            "experts": list(self.experts),
            "version": self.version,
            "last_seen": self.last_seen,
            "multiaddrs": list(self.multiaddrs),
            "partial_averages": self.partial_averages,
            "local_steps": self.local_steps,
            "phase_times_s": None if self.phase_times is None else self.phase_times.to_json(),
            "training": None if self.training is None else message_json(self.training),
            "excluded_peers": [
                {"peer_id": peer_id, "reason": reason, "remaining_s": remaining_s}
                for peer_id, reason, remaining_s in self.excluded_peers
            ],
            **self.more,
        }


_NOT_SHOWN = frozenset({"state", "run_id", "observed_uploads"})
"""PeerStatus fields `status` leaves out: offline records are dropped, the run is the report's, and the uploads a
peer timed are the plan's input (their effect shows in upload_mbps and the plan)."""
_VIEWED = frozenset(field.name for field in dataclasses.fields(PeerView)) - {"more"}


def message_json(message: Any, leave_out: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A message's fields by name, in their order, as JSON values: an unset optional field is null, a message an
    object, a repeated field a list (the record validation has bounded every one)."""
    return {
        field.name: _field_json(message, field) for field in message.DESCRIPTOR.fields if field.name not in leave_out
    }


def _field_json(message: Any, field: Any) -> Any:
    value = getattr(message, field.name)
    as_json = message_json if field.message_type is not None else lambda item: item
    if field.is_repeated:
        return [as_json(item) for item in value]
    if field.has_presence and not message.HasField(field.name):
        return None
    return as_json(value)


def _copy(training: proto.TrainingStatus) -> proto.TrainingStatus:
    copy = proto.TrainingStatus()
    copy.CopyFrom(training)
    return copy


def _describe_training(training: proto.TrainingStatus) -> str:
    """The table's mode cell, e.g. "diloco 3/8 int8", "spes 3/8 fp16, owns 4/32 experts", "skippipe float16, stage 2,
    iteration 41" or "gradients fp16": what every mode reports, then what the peer's mode adds."""
    step = f" {training.inner_step}/{training.inner_steps}" if training.inner_steps else ""
    mode = MODE_SETTINGS.get(training.mode)  # a peer's record may name any mode
    detail = "" if mode is None or mode.peer_detail is None else mode.peer_detail(training)
    return f"{training.mode}{step} {training.compression}".strip() + detail


@dataclass(frozen=True, slots=True)
class RunSummary:
    """The run as `status` sums it up from its manifest and its peers; fields in the order of its JSON object."""

    run_id: str
    epoch: int
    """The newest epoch any peer is at."""
    samples_accumulated: int
    """Samples toward the newest epoch (peers at older ones are stragglers)."""
    target_batch_size: int | None
    samples_per_second: float
    eta_s: float | None
    num_peers: int
    partial_averages: int
    num_aggregators: int
    plans_agree: bool | None
    """Whether every peer that has a plan follows the same one (None until any has one)."""
    model: str | None
    founder: str | None
    created_at: float | None
    expert_grid: GridCoverage | None
    """A DMoE run's coverage; None for a dense run or without a manifest."""
    excluded_peers: dict[str, int]
    """Peers kept out of averaging groups for sending bad parts: by how many peers, most excluded first."""
    mode_summary: ModeSummary | None = None
    """What the run's training mode shows of it beside the above (SkipPipe: its stages and their replicas); None
    for a mode that shows nothing more, or without a manifest."""

    def to_json(self) -> dict[str, Any]:
        """The "run" object of `status --json`."""
        return {
            "run_id": self.run_id,
            "epoch": self.epoch,
            "samples_accumulated": self.samples_accumulated,
            "target_batch_size": self.target_batch_size,
            "samples_per_second": self.samples_per_second,
            "eta_s": self.eta_s,
            "num_peers": self.num_peers,
            "partial_averages": self.partial_averages,
            "num_aggregators": self.num_aggregators,
            "plans_agree": self.plans_agree,
            "model": self.model,
            "founder": self.founder,
            "created_at": self.created_at,
            "expert_grid": None if self.expert_grid is None else self.expert_grid.to_json(),
            "excluded_peers": self.excluded_peers,
            **{mode: None for mode in SUMMARIZED_MODES},
            **({} if self.mode_summary is None else {self.mode_summary.mode: self.mode_summary.json}),
        }


@dataclass(frozen=True, slots=True)
class ModeSummary:
    """What a run's training mode shows of it (modes/settings.py's `run_summary`)."""

    mode: str
    json: dict[str, Any]
    """`status --json`'s object under the mode's name."""
    line: str
    """The table's line under the run's."""
    healthy: bool
    """False: the line is shown as a warning (e.g. a SkipPipe stage that no node serves)."""


@dataclass(frozen=True, slots=True)
class StatusReport:
    """One snapshot of a run: what `status` renders as a table or prints as JSON."""

    run: RunSummary
    peers: tuple[PeerView, ...]

    def to_json(self) -> dict[str, Any]:
        """The `status --json` object: {"run": {...}, "peers": [...]}."""
        return {"run": self.run.to_json(), "peers": [peer.to_json() for peer in self.peers]}


def collect(dht: hivemind.DHT, run_id: str, founder: str | None = None) -> StatusReport:
    """The status report of one run, from the swarm's records."""
    listing = list_runs(dht, LOOKUP_TIMEOUT_S, founder).get(run_id)
    statuses = list_peer_statuses(dht, run_id, LOOKUP_TIMEOUT_S)
    return summarize(run_id, listing, statuses)


def summarize(run_id: str, listing: RunListing | None, statuses: list[proto.PeerStatus]) -> StatusReport:
    """Pure: the run summary and peer list from the manifest and the peers' status records."""
    peers = tuple(PeerView.from_status(status) for status in statuses)
    epoch = max((peer.epoch for peer in peers), default=0)
    accumulated = sum(peer.samples_accumulated for peer in peers if peer.epoch == epoch)
    samples_per_second = sum(peer.samples_per_second for peer in peers)
    manifest = listing.published.manifest if listing else None
    target = manifest.target_batch_size if manifest else None
    run = RunSummary(
        run_id=run_id,
        epoch=epoch,
        samples_accumulated=accumulated,
        target_batch_size=target,
        samples_per_second=samples_per_second,
        eta_s=_eta_s(accumulated, target, samples_per_second),
        num_peers=len(peers),
        partial_averages=sum(peer.partial_averages for peer in peers),
        num_aggregators=sum(1 for peer in peers if peer.aggregation_share > 0),
        plans_agree=_plans_agree(peers),
        model=manifest.model.architecture if manifest else None,
        founder=listing.published.founder_peer_id if listing else None,
        created_at=manifest.created_at if manifest else None,
        expert_grid=_expert_grid(manifest, peers),
        excluded_peers=_excluded_peers(peers),
        mode_summary=_mode_summary(manifest, peers),
    )
    return StatusReport(run=run, peers=peers)


def _mode_summary(manifest: RunManifest | None, peers: Sequence[PeerView]) -> ModeSummary | None:
    summarize_run = None if manifest is None else MODE_SETTINGS[manifest.training.mode].run_summary
    if manifest is None or summarize_run is None:
        return None
    trainings = [peer.training for peer in peers if peer.training is not None]
    summary, line, healthy = summarize_run(manifest, trainings)
    return ModeSummary(mode=manifest.training.mode, json=summary, line=line, healthy=healthy)


def _excluded_peers(peers: Sequence[PeerView]) -> dict[str, int]:
    """How many peers keep each excluded peer out of their groups, most excluded first. Each peer's word counts
    once: it is what that peer saw, and a lone accusation may be a liar's."""
    counts = Counter(peer_id for peer in peers for peer_id in {entry[0] for entry in peer.excluded_peers})
    return dict(counts.most_common())


def _expert_grid(manifest: RunManifest | None, peers: Sequence[PeerView]) -> GridCoverage | None:
    """A DMoE run's coverage: experts served by a live host out of the grid, and replicas per expert."""
    if manifest is None or manifest.moe is None:
        return None
    return grid_coverage(expert_uids(manifest), [peer.experts for peer in peers])


def _plans_agree(peers: Sequence[PeerView]) -> bool | None:
    """Whether every peer that has a plan follows the same one (None until any has one)."""
    digests = {peer.plan_digest for peer in peers if peer.plan_digest}
    return None if not digests else len(digests) == 1


def _eta_s(accumulated: int, target: int | None, samples_per_second: float) -> float | None:
    if target is None or samples_per_second <= 0:
        return None
    return max(target - accumulated, 0) / samples_per_second


def render(report: StatusReport, now: float) -> Group:
    """A one-line run summary over a table of peers."""
    run = report.run
    eta = "—" if run.eta_s is None else f"{run.eta_s:.0f} s"
    target = run.target_batch_size if run.target_batch_size is not None else "?"
    summary = Text.assemble(
        ("run ", "dim"),
        (run.run_id, "bold"),
        f"  epoch {run.epoch}  samples {run.samples_accumulated}/{target}",
        f"  {run.samples_per_second:.1f} samples/s  ETA {eta}  {run.num_peers} peers",
        (f"  {run.partial_averages} partial averages rejected", "yellow") if run.partial_averages else "",
        _describe_expert_grid(run.expert_grid),
        _describe_mode(run.mode_summary),
    )
    table = Table(box=None, header_style="bold")  # columns never wrap: a narrow terminal crops instead
    numeric = ("samples/s", "epoch", "loss", "solo steps", "computing", "sent/round", "up/dn Mbit/s", "share")
    columns = ("peer", "roles", "device", "samples/s", "epoch", "loss", "solo steps", "mode", "computing")
    for column in (*columns, "sent/round", "up/dn Mbit/s", "reach", "share", "last seen", "address"):
        table.add_column(column, justify="right" if column in numeric else "left", no_wrap=True)
    for peer in report.peers:
        # Every cell as plain Text: these strings come from peers' records, and rich parses a str cell as markup
        # (a device named "[/bold]" crashed `crowdtrain status`).
        cells = (
            "…" + peer.peer_id[-8:],
            ",".join(peer.roles),
            peer.device,
            f"{peer.samples_per_second:.1f}",
            str(peer.epoch),
            "—" if peer.loss is None or math.isnan(peer.loss) else f"{peer.loss:.3f}",
            str(peer.local_steps),
            "—" if peer.training is None else _describe_training(peer.training),
            "—" if peer.training is None else f"{peer.training.compute_utilisation:.0%}",
            "—" if peer.training is None else f"{peer.training.round_bytes_sent / 2**20:.1f} MiB",
            f"{_mbps(peer.upload_mbps)}/{_mbps(peer.download_mbps)}",
            _reachability(peer),
            f"{peer.aggregation_share:.0%}" if peer.aggregation_share else "—",
            f"{max(now - peer.last_seen, 0):.0f} s ago",
            shareable_address(list(peer.multiaddrs)) if peer.multiaddrs else "—",
        )
        table.add_row(*(Text(cell) for cell in cells))
    return Group(summary, table, *_describe_excluded(report))


def _describe_excluded(report: StatusReport) -> list[Text]:
    """A line per peer kept out of averaging groups: by how many peers, and one reason given."""
    reasons = {peer_id: reason for peer in report.peers for peer_id, reason, _ in peer.excluded_peers}
    return [
        Text(
            f"peer …{peer_id[-8:]} kept out of averaging groups by {count} of {report.run.num_peers} peers: "
            f"it sent {reasons[peer_id]}",
            style="red",
        )  # fmt: skip
        for peer_id, count in report.run.excluded_peers.items()
    ]


def _mbps(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def _reachability(peer: PeerView) -> str:
    return reachability(peer.reachable, peer.reachability_measured, peer.more.get("relays") or ())


def _describe_mode(summary: ModeSummary | None) -> tuple[str, str] | str:
    if summary is None:
        return ""
    return f"  {summary.line}", "" if summary.healthy else "yellow"


def _describe_expert_grid(grid: GridCoverage | None) -> tuple[str, str] | str:
    if grid is None:
        return ""
    coverage = grid.to_json()  # the replica range as the JSON shows it
    style = "" if grid.num_live == grid.num_total else "yellow"
    return (
        f"  experts {grid.num_live}/{grid.num_total} live, "
        f"replicas {coverage['min_replicas']}-{coverage['max_replicas']}",
        style,
    )


def _print_once(report: StatusReport, as_json: bool, console: Console) -> None:
    if as_json:
        console.file.write(json.dumps(report.to_json()) + "\n")
        console.file.flush()
    else:
        console.print(render(report, time.time()))


def _watch_table(read: Callable[[], StatusReport], interval_s: float, stop: threading.Event, console: Console) -> None:
    with Live(render(read(), time.time()), console=console, auto_refresh=False) as live:
        while not stop.wait(interval_s):
            live.update(render(read(), time.time()), refresh=True)
