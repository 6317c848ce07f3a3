"""`crowdtrain status`: read the run's records as a DHT client and show the swarm."""

from __future__ import annotations

import json
import math
import threading
import time
from typing import Any

import hivemind
from hivemind.utils.crypto import RSAPrivateKey
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from crowdtrain import proto
from crowdtrain.averaging.phases import PhaseTimes
from crowdtrain.cli.runs import choose_run
from crowdtrain.dht.registry import RunListing, list_peer_statuses, list_runs
from crowdtrain.dht.swarm import SwarmOptions, join_swarm
from crowdtrain.dht.validator import CrowdtrainRecordValidator, make_validators
from crowdtrain.manifest import RunManifest, expert_uids
from crowdtrain.moe.placement import grid_coverage
from crowdtrain.node.addresses import shareable_address
from crowdtrain.node.config import StatusConfig
from crowdtrain.node.statedir import find_local_daemon

LOOKUP_TIMEOUT_S = 10.0


def show_status(config: StatusConfig, stop: threading.Event, console: Console) -> None:
    """Print the swarm once, or refresh it every `watch_s` seconds until `stop` is set."""
    initial_peers, run_id = _target(config)
    dht = join_swarm(
        SwarmOptions(
            initial_peers=initial_peers,
            client_mode=True,  # a reader: never announced, never stores records, never counted
            bootstrap_timeout_s=config.bootstrap_timeout_s,
        ),
        make_validators(RSAPrivateKey()),
    )
    try:
        run_id = choose_run(list_runs(dht, LOOKUP_TIMEOUT_S), run_id)
        dht.add_validators([CrowdtrainRecordValidator([run_id])])
        if config.watch_s == 0:
            _print_once(dht, run_id, config.json, console)
        elif config.json:
            while True:
                _print_once(dht, run_id, True, console)
                if stop.wait(config.watch_s):
                    break
        else:
            _watch_table(dht, run_id, config.watch_s, stop, console)
    finally:
        dht.shutdown()


def _target(config: StatusConfig) -> tuple[tuple[str, ...], str]:
    if config.initial_peers:
        return config.initial_peers, config.run_id
    daemon = find_local_daemon(config.state_path)
    addresses = sorted(daemon["multiaddrs"], key=lambda address: "/ip4/127." not in address)
    return tuple(addresses), config.run_id or str(daemon.get("run_id", ""))


def collect(dht: hivemind.DHT, run_id: str) -> dict[str, Any]:
    """The status JSON object of one run: {"run": {...}, "peers": [...]}."""
    listing = list_runs(dht, LOOKUP_TIMEOUT_S).get(run_id)
    statuses = list_peer_statuses(dht, run_id, LOOKUP_TIMEOUT_S)
    return summarize(run_id, listing, statuses)


def summarize(run_id: str, listing: RunListing | None, statuses: list[proto.PeerStatus]) -> dict[str, Any]:
    """Pure: the run summary and peer list from the manifest and the peers' status records."""
    peers = [_peer_json(status) for status in statuses]
    epoch = max((peer["epoch"] for peer in peers), default=0)
    accumulated = sum(peer["samples_accumulated"] for peer in peers if peer["epoch"] == epoch)
    samples_per_second = sum(peer["samples_per_second"] for peer in peers)
    manifest = listing.published.manifest if listing else None
    target = manifest.target_batch_size if manifest else None
    run: dict[str, Any] = {
        "run_id": run_id,
        "epoch": epoch,
        "samples_accumulated": accumulated,
        "target_batch_size": target,
        "samples_per_second": samples_per_second,
        "eta_s": _eta_s(accumulated, target, samples_per_second),
        "num_peers": len(peers),
        "partial_averages": sum(peer["partial_averages"] for peer in peers),
        "num_aggregators": sum(1 for peer in peers if peer["aggregation_share"] > 0),
        "plans_agree": _plans_agree(peers),
        "model": manifest.model.architecture if manifest else None,
        "founder": listing.published.founder_peer_id if listing else None,
        "created_at": manifest.created_at if manifest else None,
        "expert_grid": _expert_grid(manifest, peers),
    }
    return {"run": run, "peers": peers}


def _expert_grid(manifest: RunManifest | None, peers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A DMoE run's coverage: experts served by a live host out of the grid, and replicas per expert."""
    if manifest is None or manifest.moe is None:
        return None
    return grid_coverage(expert_uids(manifest), [peer["experts"] for peer in peers]).to_json()


def _plans_agree(peers: list[dict[str, Any]]) -> bool | None:
    """Whether every peer that has a plan follows the same one (None until any has one)."""
    digests = {peer["plan_digest"] for peer in peers if peer["plan_digest"]}
    return None if not digests else len(digests) == 1


def _eta_s(accumulated: int, target: int | None, samples_per_second: float) -> float | None:
    if target is None or samples_per_second <= 0:
        return None
    return max(target - accumulated, 0) / samples_per_second


def _peer_json(status: proto.PeerStatus) -> dict[str, Any]:
    def optional(name: str) -> float | None:
        return getattr(status, name) if status.HasField(name) else None

    return {
        "peer_id": status.peer_id,
        "roles": list(status.roles),
        "device": status.device,
        "samples_per_second": status.samples_per_second,
        "samples_accumulated": status.samples_accumulated,
        "epoch": status.epoch,
        "loss": optional("loss"),
        "upload_mbps": optional("upload_mbps"),
        "download_mbps": optional("download_mbps"),
        "reachable": status.reachable,
        "reachability_measured": status.reachability_measured,
        "aggregation_share": status.aggregation_share,
        "plan_digest": status.plan_digest or None,
        "measured_samples_per_second": status.measured_samples_per_second,
        "role_override": status.role_override or None,
        "experts": list(status.experts),
        "version": status.version,
        "last_seen": status.last_seen,
        "multiaddrs": list(status.multiaddrs),
        "partial_averages": status.partial_averages,
        "local_steps": status.local_steps,
        "phase_times_s": _phase_times_json(status),
    }


def _phase_times_json(status: proto.PeerStatus) -> dict[str, float] | None:
    """Phase name -> seconds of the peer's last completed global step; None until it completed one."""
    return PhaseTimes.from_proto(status.phase_times).to_json() if status.HasField("phase_times") else None


def render(snapshot: dict[str, Any], now: float) -> Group:
    """A one-line run summary over a table of peers."""
    run = snapshot["run"]
    eta = "—" if run["eta_s"] is None else f"{run['eta_s']:.0f} s"
    target = run["target_batch_size"] if run["target_batch_size"] is not None else "?"
    summary = Text.assemble(
        ("run ", "dim"),
        (run["run_id"], "bold"),
        f"  epoch {run['epoch']}  samples {run['samples_accumulated']}/{target}",
        f"  {run['samples_per_second']:.1f} samples/s  ETA {eta}  {run['num_peers']} peers",
        (f"  {run['partial_averages']} partial averages rejected", "yellow") if run["partial_averages"] else "",
        _describe_expert_grid(run.get("expert_grid")),
    )
    table = Table(box=None, header_style="bold")  # columns never wrap: a narrow terminal crops instead
    numeric = ("samples/s", "epoch", "loss", "solo steps", "up/dn Mbit/s", "share")
    columns = ("peer", "roles", "device", "samples/s", "epoch", "loss", "solo steps", "up/dn Mbit/s", "reach")
    for column in (*columns, "share", "last seen", "address"):
        table.add_column(column, justify="right" if column in numeric else "left", no_wrap=True)
    for peer in snapshot["peers"]:
        # Every cell as plain Text: these strings come from peers' records, and rich parses a str cell as markup
        # (a device named "[/bold]" crashed `crowdtrain status`).
        cells = (
            "…" + peer["peer_id"][-8:],
            ",".join(peer["roles"]),
            peer["device"],
            f"{peer['samples_per_second']:.1f}",
            str(peer["epoch"]),
            "—" if peer["loss"] is None or math.isnan(peer["loss"]) else f"{peer['loss']:.3f}",
            str(peer["local_steps"]),
            f"{_mbps(peer['upload_mbps'])}/{_mbps(peer['download_mbps'])}",
            _reachability(peer),
            f"{peer['aggregation_share']:.0%}" if peer["aggregation_share"] else "—",
            f"{max(now - peer['last_seen'], 0):.0f} s ago",
            shareable_address(peer["multiaddrs"]) if peer["multiaddrs"] else "—",
        )
        table.add_row(*(Text(cell) for cell in cells))
    return Group(summary, table)


def _mbps(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def _reachability(peer: dict[str, Any]) -> str:
    if not peer["reachable"]:
        return "no"
    return "yes" if peer["reachability_measured"] else "assumed"


def _describe_expert_grid(grid: dict[str, Any] | None) -> tuple[str, str] | str:
    if grid is None:
        return ""
    style = "" if grid["live"] == grid["total"] else "yellow"
    return (
        f"  experts {grid['live']}/{grid['total']} live, replicas {grid['min_replicas']}-{grid['max_replicas']}",
        style,
    )


def _print_once(dht: hivemind.DHT, run_id: str, as_json: bool, console: Console) -> None:
    snapshot = collect(dht, run_id)
    if as_json:
        console.file.write(json.dumps(snapshot) + "\n")
        console.file.flush()
    else:
        console.print(render(snapshot, time.time()))


def _watch_table(dht: hivemind.DHT, run_id: str, interval_s: float, stop: threading.Event, console: Console) -> None:
    with Live(render(collect(dht, run_id), time.time()), console=console, auto_refresh=False) as live:
        while not stop.wait(interval_s):
            live.update(render(collect(dht, run_id), time.time()), refresh=True)
