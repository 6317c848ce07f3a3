"""`crowdtrain check`: a volunteer's pre-flight: device, throughput, links, reachability and the role to expect.

With initial peers it joins the swarm as a listening DHT client (never counted as a peer, no status
published), reads the run's manifest and peer statuses, measures its links against up to 3 peers and asks
them to dial it back, then computes the DeDLOC plan over every peer's published capabilities and its own.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
from dataclasses import asdict
from typing import Any

import hivemind
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from crowdtrain import __version__, proto
from crowdtrain.cli.runs import choose_run
from crowdtrain.dht.registry import list_peer_statuses, list_runs
from crowdtrain.dht.swarm import SwarmOptions, join_swarm
from crowdtrain.dht.validator import CrowdtrainRecordValidator, make_validators
from crowdtrain.links.probes import MAX_PROBED_PEERS, ProbeReport, ProbeService
from crowdtrain.manifest import RunManifest, demo
from crowdtrain.models import load_tokenizer, precision_for_device, spec_parameter_count
from crowdtrain.models.device import describe_device, resolve_device
from crowdtrain.node.addresses import DEFAULT_PORT, resolve_listen
from crowdtrain.node.config import CheckConfig
from crowdtrain.planning.plan import compute_plan
from crowdtrain.planning.planner import OwnCapabilities, plan_problem, swarm_capabilities
from crowdtrain.training.modes import mode_class
from crowdtrain.training.throughput import CACHE_FILE as THROUGHPUT_CACHE
from crowdtrain.training.throughput import measure_throughput

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 10.0
NO_PEERS = "not measured: no peers given"


def run_check(config: CheckConfig) -> dict[str, Any]:
    """Measure this machine (and its links, with initial peers) and return the report as a JSON-able dict."""
    device = resolve_device(config.device)
    if not config.initial_peers:
        result = _local_report(demo())
    else:
        result = _swarm_report(config)
    manifest: RunManifest = result.pop("manifest")
    result["device"] = describe_device(device)
    result["precision"] = precision_for_device(manifest.model.precision, device).name
    result["samples_per_second"] = measure_throughput(
        manifest,
        device,
        config.micro_batch_size,
        config.num_threads,
        config.state_path / THROUGHPUT_CACHE,
        duration_s=config.throughput_s,
    )
    result["plan"] = _plan(manifest, result, result.pop("statuses"))
    return result


def _local_report(manifest: RunManifest) -> dict[str, Any]:
    return {
        "version": __version__,
        "manifest": manifest,
        "run_id": None,
        "model": manifest.model.architecture,
        "peer_id": None,
        "upload_mbps": None,
        "download_mbps": None,
        "reachable": None,
        "not_measured": NO_PEERS,
        "listen_port": None,
        "addresses": [],
        "observed_ips": [],
        "probed_peers": [],
        "problems": [],
        "fix": None,
        "statuses": [],
    }


def _swarm_report(config: CheckConfig) -> dict[str, Any]:
    listen = resolve_listen(config.listen)
    dht = join_swarm(
        SwarmOptions(
            initial_peers=config.initial_peers,
            listen=listen,
            announce=config.announce,
            client_mode=True,  # never stores records nor answers DHT queries: not counted as a peer
            bootstrap_timeout_s=config.bootstrap_timeout_s,
        ),
        make_validators(RSAPrivateKey()),
    )
    try:
        runs = list_runs(dht, LOOKUP_TIMEOUT_S)
        listing = runs[choose_run(runs, config.run_id, empty_note="; there is nothing to check against")]
        manifest = listing.published.manifest
        dht.add_validators([CrowdtrainRecordValidator([manifest.run_id])])
        statuses = list_peer_statuses(dht, manifest.run_id, LOOKUP_TIMEOUT_S)
        own = [str(address) for address in dht.get_visible_maddrs()]
        peer_id, report = _probe(dht, statuses, config, own)
    finally:
        dht.shutdown()  # before the throughput probe, which wants the CPU to itself
    port = _daemon_port(config.listen, config.announce)
    return {
        "version": __version__,
        "manifest": manifest,
        "run_id": manifest.run_id,
        "model": manifest.model.architecture,
        "peer_id": peer_id,
        "upload_mbps": report.upload_mbps,
        "download_mbps": report.download_mbps,
        "reachable": report.reachable,
        "not_measured": None if report.answered_peers else "not measured: no peer answered the probes",
        "listen_port": port,
        "addresses": [asdict(verdict) for verdict in report.verdicts],
        "observed_ips": list(report.observed_ips),
        "probed_peers": list(report.answered_peers),
        "problems": list(report.failures) + _port_note(listen, own, port),
        "fix": _fix(report, port) if report.reachable is False else None,
        "statuses": statuses,
    }


def _probe(
    dht: hivemind.DHT, statuses: list[proto.PeerStatus], config: CheckConfig, own: list[str]
) -> tuple[str, ProbeReport]:
    """Measure against up to 3 peers: reachable ones first, in random order, then the initial peers."""
    addresses = {status.peer_id: list(status.multiaddrs) for status in statuses}
    candidates = [status.peer_id for status in statuses]
    random.shuffle(candidates)
    candidates.sort(key=lambda peer: not next(s.reachable for s in statuses if s.peer_id == peer))
    for address in config.initial_peers:  # a swarm whose statuses expired still has its initial peers
        peer = Multiaddr(address)["p2p"]
        candidates.append(peer)
        addresses.setdefault(peer, []).append(address)
    service = ProbeService(dht)
    service.start(serve=False)  # a check only asks; it serves nobody
    try:
        peers = list(dict.fromkeys(candidates))[:MAX_PROBED_PEERS]
        return service.peer_id, service.measure(peers, addresses, own, config.probe_timeout_s)
    finally:
        service.close()


def _daemon_port(listen: tuple[str, ...], announce: tuple[str, ...]) -> int:
    """The TCP port `run` with the same flags would be dialed on."""
    for address in announce + listen:
        parsed = Multiaddr(address)
        if "tcp" in parsed and int(parsed["tcp"]):
            return int(parsed["tcp"])
    return DEFAULT_PORT


def _port_note(listen: tuple[str, ...], own: list[str], port: int) -> list[str]:
    ports = {int(Multiaddr(address)["tcp"]) for address in own if "tcp" in Multiaddr(address)}
    if listen == ("/ip4/0.0.0.0/tcp/0",) and port not in ports:
        return [
            f"port {port} is in use (a daemon running here?), so this check listened on port "
            f"{', '.join(map(str, sorted(ports)))}: the reachability verdict is about that port, not {port}"
        ]
    return []


def _fix(report: ProbeReport, port: int) -> str:
    """The exact steps that make an unreachable node reachable, or the alternative."""
    public = next((ip for ip in report.observed_ips if _is_public(ip)), None)
    ip_flag = f"/ip4/{public}" if public and ":" not in public else f"/ip6/{public}" if public else "/ip4/<public-ip>"
    return (
        f"Peers cannot open connections to this machine. Forward TCP port {port} on your router to this "
        f"machine and pass --announce {ip_flag}/tcp/{port} to crowdtrain run; or run with --role client: "
        "the node then trains but never aggregates, needing no open port (crowdtrain does not enable "
        "hivemind's relays, so nobody can dial it through one)."
    )


def _is_public(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_global
    except ValueError:
        return False


def _plan(manifest: RunManifest, result: dict[str, Any], statuses: list[proto.PeerStatus]) -> dict[str, Any]:
    """The role the DeDLOC plan gives this machine among the run's peers, with what had to be assumed."""
    if result["peer_id"] is None:
        return {"roles": None, "reason": "not planned: no peers given"}
    if result["upload_mbps"] is None or result["download_mbps"] is None:
        return {"roles": None, "reason": "not planned: this machine's bandwidth was not measured"}
    me = result["peer_id"]
    own = OwnCapabilities(
        samples_per_second=result["samples_per_second"],
        upload_mbps=result["upload_mbps"],
        download_mbps=result["download_mbps"],
        reachable=bool(result["reachable"]),
    )
    # The daemons' own planning code, so the role shown is the one the node would take.
    peers = swarm_capabilities(me, own, statuses, aggregate_only=mode_class(manifest).has_auxiliary_aggregators)
    num_parameters = spec_parameter_count(manifest.model, load_tokenizer(manifest.model).vocab_size)
    plan = compute_plan(peers, plan_problem(manifest, num_parameters))
    return {
        "roles": list(plan.roles[me]),
        "aggregation_share": plan.shares.get(me, 0.0),
        "computes": plan.computes[me],
        "num_peers": len(peers),
        "swarm_samples_per_second": plan.samples_per_second,
        "averaging_time_s": plan.averaging_time_s,
        "solver": plan.solver,
        "assumptions": _assumptions(me, statuses),
    }


def _assumptions(me: str, statuses: list[proto.PeerStatus]) -> list[str]:
    """What the plan had to assume for peers that have not measured everything yet."""
    assumptions = []
    for status in statuses:
        if status.peer_id == me:
            continue
        missing = [name for name in ("upload_mbps", "download_mbps") if not status.HasField(name)]
        if missing:
            assumptions.append(f"peer …{status.peer_id[-8:]} published no {' or '.join(missing)}: the peers' median")
        if not status.measured_samples_per_second:
            assumptions.append(f"peer …{status.peer_id[-8:]} published no measured throughput: its training rate")
    return assumptions


def print_check(result: dict[str, Any], as_json: bool, console: Console) -> None:
    """One JSON object, or a table for people."""
    if as_json:
        console.file.write(json.dumps(result) + "\n")
        console.file.flush()
    else:
        console.print(render_check(result))


def render_check(result: dict[str, Any]) -> Group:
    """The pre-flight as a two-column table, then problems and the fix."""
    table = Table(box=None, show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    table.add_row("run", f"{result['run_id'] or 'none (no peers given)'}  model {result['model']}")
    table.add_row("device", result["device"])
    table.add_row(
        "throughput", f"{result['samples_per_second']:.1f} samples/s of the run's model in {result['precision']}"
    )
    for direction in ("upload", "download"):
        value = result[f"{direction}_mbps"]
        table.add_row(direction, result["not_measured"] or "—" if value is None else f"{value:.1f} Mbit/s")
    table.add_row("reachable", _reachable_text(result))
    for verdict in result["addresses"]:
        detail = f" ({verdict['detail']})" if verdict["detail"] else ""
        table.add_row("", f"{verdict['multiaddr']}: {verdict['verdict']}{detail}")
    table.add_row("role", _role_text(result["plan"]))
    lines: list[Any] = [table]
    lines += [Text(f"note: {problem}", style="yellow") for problem in result["problems"]]
    if result["fix"]:
        lines.append(Text(f"fix: {result['fix']}", style="bold red"))
    return Group(*lines)


def _reachable_text(result: dict[str, Any]) -> str:
    if result["reachable"] is None:
        return result["not_measured"] or "unknown: no peer answered the dial-back probe"
    return "yes: peers can dial this machine" if result["reachable"] else "no: peers cannot dial this machine"


def _role_text(plan: dict[str, Any]) -> str:
    if plan["roles"] is None:
        return str(plan["reason"])
    roles = ", ".join(plan["roles"]) or "none (the plan needs neither its compute nor its links)"
    share = f", aggregates {plan['aggregation_share']:.0%} of each all-reduce" if plan["aggregation_share"] else ""
    return f"{roles}{share} (plan over {plan['num_peers']} peers)"
