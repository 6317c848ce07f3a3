"""The node's configuration, parsed once at the edge: flags > env CROWDTRAIN_* > TOML file > defaults."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from crowdtrain.errors import BadInputError
from crowdtrain.roles import AUTO, Role
from crowdtrain.structured import FieldError, from_mapping

T = TypeVar("T")

ENV_PREFIX = "CROWDTRAIN_"
DEFAULT_STATE_DIR = "~/.crowdtrain"
ROLES = (AUTO, *Role)


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmSettings:
    """The settings every command shares (`_add_swarm_flags`): which swarm, which run, where the state is, logs.

    Defined once: `run`, `status` and `check` take them from the same flags, CROWDTRAIN_* variables and TOML keys.
    """

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs ending in /p2p/<peer id> of peers already in the swarm. Empty: `run` founds a new run,
    `status` asks the local daemon (found through node.json), `check` measures this machine alone (the demo model)."""
    state_dir: str = DEFAULT_STATE_DIR
    """This node's state: identity, node.json, lock, checkpoints and the cached throughput measurement."""
    run_id: str = ""
    """The run to join, show or check when the swarm holds several, or the name of a run being founded."""
    run_key: str = ""
    """The founder's peer ID the run's manifest must be signed by (printed next to the join command): `run`,
    `status` and `check` look at no manifest another key signed. Empty: `run` takes the first founder this node
    saw for the run (kept in <state_dir>/runs.json), and no other after; `status` and `check` the oldest."""
    join_token: str = ""
    """A token from the founder of an invite-only run (`crowdtrain invite`); it names the run and its run key.
    A secret: prefer CROWDTRAIN_JOIN_TOKEN or the TOML file to the flag, which other users can see in `ps`."""
    bootstrap_timeout_s: float = 20.0
    """Give up when no initial peer answers within this many seconds."""
    log_format: str = "text"
    """Log lines for people (text) or machines (json); `--json` chooses the output format of status and check."""
    verbose: int = 0
    """`run`: 0 crowdtrain's info, 1 hivemind's info too; `status` and `check`: 0 warnings only, 1 info; 2: debug."""

    @property
    def state_path(self) -> Path:
        """`state_dir` with ~ expanded."""
        return Path(self.state_dir).expanduser()


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineSettings(SwarmSettings):
    """The settings of the commands that use this machine's network and device: `run` and `check`."""

    listen: tuple[str, ...] = ()
    """Multiaddrs to listen on; empty: all interfaces on the default port, or a free one if taken."""
    announce: tuple[str, ...] = ()
    """Multiaddrs peers should dial (e.g. a public address with a forwarded port); empty: the listen addresses."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass on this node (lower it when memory is short); the throughput probe's too."""
    num_threads: int = 0
    """CPU threads torch may use for training; 0 leaves torch's default (one per core)."""
    throughput_s: float = 3.0
    """Seconds of timed training steps in the throughput probe (when not cached in the state dir)."""
    data_cache_dir: str = ""
    """Where the run's tokenised training data is cached; empty: <state_dir>/data-cache. Daemons of one machine
    (one per GPU) may share one, so each run's data is tokenised once."""

    @property
    def data_cache_path(self) -> Path:
        """`data_cache_dir` with ~ expanded, or the state dir's data-cache."""
        return Path(self.data_cache_dir).expanduser() if self.data_cache_dir else self.state_path / "data-cache"


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig(MachineSettings):
    """Everything `crowdtrain run` needs; validated on construction."""

    identity: str = ""
    """Path of the identity key; empty means <state_dir>/identity.key."""
    run_file: str = ""
    """Founder only: a run manifest TOML file or a preset name (demo)."""
    role: str = AUTO
    """auto (decided by the swarm), trainer, aggregator, expert-host or client."""
    status_interval_s: float = 5.0
    """Seconds between two refreshes of this node's status record."""
    status_ttl_s: float = 20.0
    """Seconds a status record outlives its last refresh (how long a crashed node stays listed)."""
    bandwidth_probe_interval_s: float = 600.0
    """Seconds between two measurements of this node's links against peers (the first comes at start)."""
    max_experts: int = 16
    """As an expert-host: the most DMoE experts this node serves."""
    replica_average_interval_s: float = 30.0
    """As an expert-host: seconds between two averagings of each replicated expert with another replica."""
    checkpoint_keep: int = 3
    """How many checkpoints of the run to keep in the state dir."""
    checkpoint_interval_s: float = 600.0
    """Seconds between two checkpoints while training, written in the background; one more at exit."""
    metrics_port: int = 0
    """TCP port of a Prometheus endpoint on 127.0.0.1 (never on other interfaces); 0 turns it off."""
    start_with_peers: int = 1
    """Before its first micro-batch of a run at epoch 0, wait (at most 10 minutes) until this many nodes, this one
    included, have measured themselves and planned, so an experiment starts with its whole swarm instead of one node
    racing ahead and the others downloading its state; 1 never waits."""
    eval_every: int = 0
    """Every this many epochs (global steps; outer rounds in diloco and spes), score this node's replica on the
    run's 32 fixed held-out windows, log the loss and export it (`crowdtrain_held_out_loss`); 0 never. Not in
    skippipe runs (a node there holds one stage)."""
    data_paths: tuple[str, ...] = ()
    """Local folders a run joined from the swarm may train on; a joiner reads no other local path a remote
    manifest names (the founder's own run file is not limited)."""
    max_parameters: int = 2_000_000_000
    """The largest model, in parameters, this node accepts from a run it joins."""
    relay: bool = True
    """Behind a NAT, reserve a slot on a circuit relay among the initial peers, so peers can call this node
    through it (it announces a /p2p-circuit address, shown as `relay` in `status`); false: only peers this node
    dials can reach it."""

    def __post_init__(self) -> None:
        _check_machine_settings(self)
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port (1-65535) or 0 for off, got {self.metrics_port}")
        if not 1 <= self.start_with_peers <= 10_000:
            raise ValueError(f"start_with_peers must be between 1 (never wait) and 10000, got {self.start_with_peers}")
        if not 0 <= self.eval_every <= 1_000_000:
            raise ValueError(f"eval_every must be between 0 (never) and 1000000 epochs, got {self.eval_every}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        _check_positive(self, "status_interval_s", "status_ttl_s")
        _check_positive(
            self,
            "checkpoint_keep",
            "checkpoint_interval_s",
            "bandwidth_probe_interval_s",
            "max_experts",
            "replica_average_interval_s",
            "max_parameters",
        )
        if self.status_ttl_s <= self.status_interval_s:
            raise ValueError("status_ttl_s must be longer than status_interval_s, or records expire between refreshes")

    @property
    def fixed_role(self) -> Role | None:
        """The role `--role` fixes, or None for `--role auto` (measurement and the plan decide)."""
        return None if self.role == AUTO else Role(self.role)

    @property
    def identity_path(self) -> Path:
        """The identity key's path: `identity`, or <state_dir>/identity.key."""
        return Path(self.identity).expanduser() if self.identity else self.state_path / "identity.key"


@dataclass(frozen=True, kw_only=True, slots=True)
class StatusConfig(SwarmSettings):
    """Everything `crowdtrain status` needs."""

    json: bool = False
    """Print one JSON object instead of a table."""
    watch_s: float = 0.0
    """Refresh every this many seconds until Ctrl-C; 0 prints once."""

    def __post_init__(self) -> None:
        _check_swarm_settings(self)
        if self.watch_s < 0:
            raise ValueError(f"watch must not be negative, got {self.watch_s}")


def check_multiaddrs(values: tuple[str, ...], name: str, *, need_peer_id: bool = False) -> None:
    """Raise ValueError naming the option unless every value is a multiaddr (with /p2p/ if needed)."""
    if not values:
        return
    from hivemind.utils.multiaddr import Multiaddr  # imports all of hivemind (and torch): only where it is needed

    for value in values:
        try:
            parsed = Multiaddr(value)
        except Exception:
            raise ValueError(
                f"{name} {value!r} is not a valid multiaddr (expected e.g. /ip4/203.0.113.5/tcp/31330/p2p/Qm...)"
            ) from None
        if need_peer_id and "p2p" not in parsed:
            raise ValueError(
                f"{name} {value!r} lacks the peer id: it must end with /p2p/<peer id>, "
                "as in the join command the first daemon printed"
            )


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(config, name)}")


def _check_log_options(log_format: str, verbose: int) -> None:
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {log_format!r}")
    if verbose < 0:
        raise ValueError("verbose must not be negative")


def _check_swarm_settings(settings: SwarmSettings) -> None:
    check_multiaddrs(settings.initial_peers, "initial_peers", need_peer_id=True)
    _check_positive(settings, "bootstrap_timeout_s")
    _check_log_options(settings.log_format, settings.verbose)


def _check_machine_settings(settings: MachineSettings) -> None:
    _check_swarm_settings(settings)
    check_multiaddrs(settings.listen, "listen")
    check_multiaddrs(settings.announce, "announce")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", settings.device):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {settings.device!r}")
    _check_positive(settings, "micro_batch_size", "throughput_s")
    if settings.num_threads < 0:
        raise ValueError(f"num_threads must not be negative, got {settings.num_threads}")


def resolve_config(
    cls: type[T], flags: Mapping[str, Any], *, env: Mapping[str, str], config_file: str | None = None
) -> T:
    """Layer flags over CROWDTRAIN_* variables over a TOML file over the defaults of `cls`."""
    layered: dict[str, Any] = {}
    if config_file:
        layered.update(_read_toml(config_file))
    layered.update(_from_env(cls, env))
    layered.update({name: value for name, value in flags.items() if value is not None})
    try:
        return from_mapping(cls, layered)
    except FieldError as e:
        raise BadInputError(f"Invalid configuration: {e}.") from None


def _read_toml(path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"Cannot read config file {path}: {getattr(e, 'strerror', None) or e}.") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInputError(f"Config file {path} is not valid TOML: {e}.") from None


def _from_env(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        text = env.get(ENV_PREFIX + field.name.upper())
        if text is not None:
            values[field.name] = _parse_env_value(hints[field.name], text, ENV_PREFIX + field.name.upper())
    return values


def _parse_env_value(hint: Any, text: str, variable: str) -> Any:
    try:
        if typing.get_origin(hint) is tuple:
            return tuple(item for item in re.split(r"[\s,]+", text) if item)
        if hint is bool:
            if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return text.lower() in ("1", "true", "yes")
        return hint(text)
    except ValueError:
        raise BadInputError(f"Environment variable {variable}={text!r} is not a valid {hint.__name__}.") from None


def environment() -> dict[str, str]:
    """The process environment, read only here at the edge."""
    return dict(os.environ)


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig(MachineSettings):
    """Everything `crowdtrain check` needs: the pre-flight of a volunteer's machine."""

    json: bool = False
    """Print one JSON object instead of a table."""
    probe_timeout_s: float = 60.0
    """Bound on the bandwidth and dial-back probes against all peers together."""

    def __post_init__(self) -> None:
        _check_machine_settings(self)
        _check_positive(self, "probe_timeout_s")
