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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import hivemind
from hivemind.utils.multiaddr import Multiaddr
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from crowdtrain import __version__, proto
from crowdtrain.cli.reader import join_as_reader
from crowdtrain.cli.runs import choose_run
from crowdtrain.dht.registry import await_runs, list_peer_statuses
from crowdtrain.dht.validator import CrowdtrainRecordValidator
from crowdtrain.links.probes import MAX_PROBED_PEERS, ProbeReport, ProbeService
from crowdtrain.links.protocol import AddressVerdict
from crowdtrain.manifest import RunManifest, demo
from crowdtrain.models import load_tokenizer, precision_for_device, spec_parameter_count
from crowdtrain.models.device import describe_device, resolve_device
from crowdtrain.modes.registry import mode_class
from crowdtrain.node.addresses import DEFAULT_PORT, resolve_listen
from crowdtrain.node.config import CheckConfig
from crowdtrain.node.membership import with_join_token
from crowdtrain.planning.plan import compute_plan
from crowdtrain.planning.planner import OwnCapabilities, plan_problem, swarm_capabilities
from crowdtrain.roles import Role
from crowdtrain.training.throughput import CACHE_FILE as THROUGHPUT_CACHE
from crowdtrain.training.throughput import measure_throughput

logger = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 10.0
NO_PEERS = "not measured: no peers given"


@dataclass(frozen=True, slots=True)
class LinkCheck:
    """What the probes against the swarm's peers found about this machine's links; nothing without peers."""

    peer_id: str | None
    """This check's own peer ID in the swarm; None without peers."""
    upload_mbps: float | None
    download_mbps: float | None
    reachable: bool | None
    """None: nobody tried to dial this machine back."""
    not_measured: str | None
    """Why the links were not measured, or None."""
    listen_port: int | None
    """The TCP port `run` with the same flags would be dialed on."""
    addresses: tuple[AddressVerdict, ...]
    observed_ips: tuple[str, ...]
    probed_peers: tuple[str, ...]
    problems: tuple[str, ...]
    fix: str | None
    """The steps that make an unreachable machine reachable, or None."""

    @classmethod
    def without_peers(cls) -> LinkCheck:
        """The links of a check given no peers: not measured."""
        return cls(
            peer_id=None,
            upload_mbps=None,
            download_mbps=None,
            reachable=None,
            not_measured=NO_PEERS,
            listen_port=None,
            addresses=(),
            observed_ips=(),
            probed_peers=(),
            problems=(),
            fix=None,
        )


@dataclass(frozen=True, slots=True)
class NotPlanned:
    """Why the check could not compute the role this machine would take."""

    reason: str

    def to_json(self) -> dict[str, Any]:
        """The "plan" object of `check --json` when there is no plan."""
        return {"roles": None, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class RolePlan:
    """The role the DeDLOC plan gives this machine among the run's peers, with what had to be assumed."""

    roles: tuple[Role, ...]
    """Empty: the plan needs neither this machine's compute nor its links."""
    aggregation_share: float
    computes: bool
    num_peers: int
    swarm_samples_per_second: float
    averaging_time_s: float
    solver: str
    assumptions: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The "plan" object of `check --json`."""
        return {
            "roles": [role.value for role in self.roles],
            "aggregation_share": self.aggregation_share,
            "computes": self.computes,
            "num_peers": self.num_peers,
            "swarm_samples_per_second": self.swarm_samples_per_second,
            "averaging_time_s": self.averaging_time_s,
            "solver": self.solver,
            "assumptions": list(self.assumptions),
        }


@dataclass(frozen=True, slots=True)
class CheckReport:
    """The pre-flight of this machine: what `check` renders as a table or prints as JSON."""

    version: str
    run_id: str | None
    """The run checked against; None without peers (the demo model is measured)."""
    model: str
    links: LinkCheck
    device: str
    precision: str
    samples_per_second: float
    """The run's model on this device, measured (or cached)."""
    plan: RolePlan | NotPlanned

    def to_json(self) -> dict[str, Any]:
        """The `check --json` object (a contract: keys, their order and nulls as before)."""
        links = self.links
        return {
            "version": self.version,
            "run_id": self.run_id,
            "model": self.model,
            "peer_id": links.peer_id,
            "upload_mbps": links.upload_mbps,
            "download_mbps": links.download_mbps,
            "reachable": links.reachable,
            "not_measured": links.not_measured,
            "listen_port": links.listen_port,
            "addresses": [asdict(verdict) for verdict in links.addresses],
            "observed_ips": list(links.observed_ips),
            "probed_peers": list(links.probed_peers),
            "problems": list(links.problems),
            "fix": links.fix,
            "device": self.device,
            "precision": self.precision,
            "samples_per_second": self.samples_per_second,
            "plan": self.plan.to_json(),
        }


@dataclass(frozen=True, slots=True)
class _Target:
    """What the check measures against: the run's manifest, its peers' statuses and this machine's links."""

    manifest: RunManifest
    run_id: str | None
    statuses: tuple[proto.PeerStatus, ...]
    links: LinkCheck


def run_check(config: CheckConfig) -> CheckReport:
    """Measure this machine (and its links, with initial peers) and return the report."""
    device = resolve_device(config.device)
    if not config.initial_peers:
        target = _Target(manifest=demo(), run_id=None, statuses=(), links=LinkCheck.without_peers())
    else:
        target = _swarm_target(config)
    manifest = target.manifest
    device_text = describe_device(device)
    precision = precision_for_device(manifest.model.precision, device).name
    samples_per_second = measure_throughput(
        manifest,
        device,
        config.micro_batch_size,
        config.num_threads,
        config.state_path / THROUGHPUT_CACHE,
        duration_s=config.throughput_s,
        data_cache_dir=config.data_cache_path,
    )
    return CheckReport(
        version=__version__,
        run_id=target.run_id,
        model=manifest.model.architecture,
        links=target.links,
        device=device_text,
        precision=precision,
        samples_per_second=samples_per_second,
        plan=_plan(manifest, target.links, samples_per_second, target.statuses),
    )


def _swarm_target(config: CheckConfig) -> _Target:
    config = with_join_token(config)
    listen = resolve_listen(config.listen)
    dht, _ = join_as_reader(config, listen=listen, announce=config.announce)
    try:
        founder = config.run_key or None
        runs = await_runs(dht, config.run_id, LOOKUP_TIMEOUT_S, founder)
        chosen = choose_run(runs, config.run_id, founder=founder, empty_note="; there is nothing to check against")
        listing = runs[chosen]
        manifest = listing.published.manifest
        dht.add_validators([CrowdtrainRecordValidator([manifest.run_id])])
        statuses = list_peer_statuses(dht, manifest.run_id, LOOKUP_TIMEOUT_S)
        own = [str(address) for address in dht.get_visible_maddrs()]
        peer_id, report = _probe(dht, statuses, config, own)
    finally:
        dht.shutdown()  # before the throughput probe, which wants the CPU to itself
    port = _daemon_port(config.listen, config.announce)
    links = LinkCheck(
        peer_id=peer_id,
        upload_mbps=report.upload_mbps,
        download_mbps=report.download_mbps,
        reachable=report.reachable,
        not_measured=None if report.answered_peers else "not measured: no peer answered the probes",
        listen_port=port,
        addresses=tuple(report.verdicts),
        observed_ips=tuple(report.observed_ips),
        probed_peers=tuple(report.answered_peers),
        problems=(*report.failures, *_port_note(listen, own, port)),
        fix=_fix(report, port) if report.reachable is False else None,
    )
    return _Target(manifest=manifest, run_id=manifest.run_id, statuses=tuple(statuses), links=links)


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
        peers = {peer: addresses.get(peer, []) for peer in list(dict.fromkeys(candidates))[:MAX_PROBED_PEERS]}
        return service.peer_id, service.measure(peers, own, config.probe_timeout_s)
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
        f"machine and pass --announce {ip_flag}/tcp/{port} to crowdtrain run. Without it the node trains but "
        "never aggregates, and a few minutes after it starts peers can call it through a public peer's relay "
        "(`relay` in crowdtrain status), at that peer's uplink's cost."
    )


def _is_public(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_global
    except ValueError:
        return False


def _plan(
    manifest: RunManifest, links: LinkCheck, samples_per_second: float, statuses: Sequence[proto.PeerStatus]
) -> RolePlan | NotPlanned:
    """The role the DeDLOC plan gives this machine among the run's peers, with what had to be assumed."""
    if links.peer_id is None:
        return NotPlanned("not planned: no peers given")
    if links.upload_mbps is None or links.download_mbps is None:
        return NotPlanned("not planned: this machine's bandwidth was not measured")
    me = links.peer_id
    own = OwnCapabilities(
        samples_per_second=samples_per_second,
        upload_mbps=links.upload_mbps,
        download_mbps=links.download_mbps,
        reachable=bool(links.reachable),
    )
    # The daemons' own planning code, so the role shown is the one the node would take.
    peers = swarm_capabilities(me, own, statuses, aggregate_only=mode_class(manifest).has_auxiliary_aggregators)
    num_parameters = spec_parameter_count(manifest.model, load_tokenizer(manifest.model).vocab_size)
    plan = compute_plan(peers, plan_problem(manifest, num_parameters))
    return RolePlan(
        roles=tuple(Role(role) for role in plan.roles[me]),
        aggregation_share=plan.shares.get(me, 0.0),
        computes=plan.computes[me],
        num_peers=len(peers),
        swarm_samples_per_second=plan.samples_per_second,
        averaging_time_s=plan.averaging_time_s,
        solver=plan.solver,
        assumptions=tuple(_assumptions(me, statuses)),
    )


def _assumptions(me: str, statuses: Sequence[proto.PeerStatus]) -> list[str]:
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


def print_check(report: CheckReport, as_json: bool, console: Console) -> None:
    """One JSON object, or a table for people."""
    if as_json:
        console.file.write(json.dumps(report.to_json()) + "\n")
        console.file.flush()
    else:
        console.print(render_check(report))


def render_check(report: CheckReport) -> Group:
    """The pre-flight as a two-column table, then problems and the fix."""
    links = report.links
    table = Table(box=None, show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    table.add_row("run", f"{report.run_id or 'none (no peers given)'}  model {report.model}")
    table.add_row("device", report.device)
    table.add_row("throughput", f"{report.samples_per_second:.1f} samples/s of the run's model in {report.precision}")
    for direction, value in (("upload", links.upload_mbps), ("download", links.download_mbps)):
        table.add_row(direction, links.not_measured or "—" if value is None else f"{value:.1f} Mbit/s")
    table.add_row("reachable", _reachable_text(links))
    for verdict in links.addresses:
        detail = f" ({verdict.detail})" if verdict.detail else ""
        table.add_row("", f"{verdict.multiaddr}: {verdict.verdict}{detail}")
    table.add_row("role", _role_text(report.plan))
    lines: list[Any] = [table]
    lines += [Text(f"note: {problem}", style="yellow") for problem in links.problems]
    if links.fix:
        lines.append(Text(f"fix: {links.fix}", style="bold red"))
    return Group(*lines)


def _reachable_text(links: LinkCheck) -> str:
    if links.reachable is None:
        return links.not_measured or "unknown: no peer answered the dial-back probe"
    return "yes: peers can dial this machine" if links.reachable else "no: peers cannot dial this machine"


def _role_text(plan: RolePlan | NotPlanned) -> str:
    if isinstance(plan, NotPlanned):
        return plan.reason
    roles = ", ".join(plan.roles) or "none (the plan needs neither its compute nor its links)"
    share = f", aggregates {plan.aggregation_share:.0%} of each all-reduce" if plan.aggregation_share else ""
    return f"{roles}{share} (plan over {plan.num_peers} peers)"
