"""Node configuration: flags beat CROWDTRAIN_* variables beat the TOML file beat the defaults."""

from __future__ import annotations

import hashlib
from dataclasses import fields
from pathlib import Path

import pytest
from hivemind.p2p import PeerID

from crowdtrain.errors import BadInputError
from crowdtrain.node.config import (
    CheckConfig,
    MachineSettings,
    NodeConfig,
    StatusConfig,
    SwarmSettings,
    resolve_config,
)
from crowdtrain.roles import Role

PEER_ID = PeerID(b"\x12\x20" + hashlib.sha256(b"a peer").digest()).to_base58()
INITIAL_PEER = f"/ip4/127.0.0.1/tcp/31330/p2p/{PEER_ID}"


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "crowdtrain.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_defaults_with_nothing_given() -> None:
    assert resolve_config(NodeConfig, {}, env={}) == NodeConfig()
    assert NodeConfig().identity_path == Path("~/.crowdtrain/identity.key").expanduser()


def test_flags_beat_env_beat_toml_beat_defaults(tmp_path: Path) -> None:
    config_file = write_toml(
        tmp_path,
        'status_interval_s = 3.0\ndevice = "cpu"\nrole = "trainer"\nbootstrap_timeout_s = 7\n',
    )
    env = {"CROWDTRAIN_STATUS_INTERVAL_S": "2", "CROWDTRAIN_DEVICE": "cuda:1", "UNRELATED": "x"}
    flags = {"status_interval_s": 1.0, "device": None, "role": None}
    config = resolve_config(NodeConfig, flags, env=env, config_file=config_file)
    assert config.status_interval_s == 1.0  # flag over env over file
    assert config.device == "cuda:1"  # env over file; a None flag is "not given"
    assert config.role == "trainer"  # file over default
    assert config.bootstrap_timeout_s == 7.0  # file over default, int taken as float
    assert config.status_ttl_s == NodeConfig().status_ttl_s  # default
    assert config.log_format == "text"


def test_env_beats_toml_for_every_kind_of_field(tmp_path: Path) -> None:
    config_file = write_toml(tmp_path, 'verbose = 1\nlisten = ["/ip4/127.0.0.1/tcp/1"]\nstate_dir = "/from/file"\n')
    env = {"CROWDTRAIN_VERBOSE": "2", "CROWDTRAIN_LISTEN": "/ip4/127.0.0.1/tcp/2", "CROWDTRAIN_STATE_DIR": "/env"}
    config = resolve_config(NodeConfig, {}, env=env, config_file=config_file)
    assert (config.verbose, config.listen, config.state_dir) == (2, ("/ip4/127.0.0.1/tcp/2",), "/env")
    assert config.identity_path == Path("/env/identity.key")


def test_env_lists_split_on_commas_and_whitespace() -> None:
    env = {"CROWDTRAIN_LISTEN": " /ip4/127.0.0.1/tcp/1,/ip4/127.0.0.1/tcp/2  /ip4/127.0.0.1/tcp/3,\n"}
    config = resolve_config(NodeConfig, {}, env=env)
    assert config.listen == ("/ip4/127.0.0.1/tcp/1", "/ip4/127.0.0.1/tcp/2", "/ip4/127.0.0.1/tcp/3")


def test_empty_env_list_is_empty() -> None:
    assert resolve_config(NodeConfig, {}, env={"CROWDTRAIN_ANNOUNCE": " , "}).announce == ()


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("CROWDTRAIN_STATUS_INTERVAL_S", "soon"),
        ("CROWDTRAIN_VERBOSE", "2.5"),
        ("CROWDTRAIN_BOOTSTRAP_TIMEOUT_S", ""),
    ],
)
def test_bad_env_value_names_the_variable(variable: str, text: str) -> None:
    with pytest.raises(BadInputError, match=variable) as caught:
        resolve_config(NodeConfig, {}, env={variable: text})
    assert repr(text) in str(caught.value)


def test_env_booleans() -> None:
    assert resolve_config(StatusConfig, {}, env={"CROWDTRAIN_JSON": "yes"}).json is True
    assert resolve_config(StatusConfig, {}, env={"CROWDTRAIN_JSON": "0"}).json is False
    with pytest.raises(BadInputError, match="CROWDTRAIN_JSON"):
        resolve_config(StatusConfig, {}, env={"CROWDTRAIN_JSON": "maybe"})


@pytest.mark.parametrize("field", ["initial_peers", "listen", "announce"])
def test_malformed_multiaddr_is_bad_input_quoting_it(field: str) -> None:
    with pytest.raises(BadInputError, match="not a valid multiaddr") as caught:
        resolve_config(NodeConfig, {field: ["/ip4/300.1.2.3/tcp/1"]}, env={})
    assert "/ip4/300.1.2.3/tcp/1" in str(caught.value) and field in str(caught.value)


def test_malformed_multiaddr_from_env_is_bad_input_quoting_it() -> None:
    with pytest.raises(BadInputError, match="not-a-multiaddr"):
        resolve_config(NodeConfig, {}, env={"CROWDTRAIN_INITIAL_PEERS": f"{INITIAL_PEER},not-a-multiaddr"})


def test_initial_peer_without_peer_id_is_bad_input() -> None:
    with pytest.raises(BadInputError, match="/p2p/") as caught:
        resolve_config(NodeConfig, {"initial_peers": ["/ip4/127.0.0.1/tcp/31330"]}, env={})
    assert "/ip4/127.0.0.1/tcp/31330" in str(caught.value)
    with pytest.raises(BadInputError, match="/p2p/"):
        resolve_config(StatusConfig, {"initial_peers": ["/ip4/127.0.0.1/tcp/31330"]}, env={})


def test_initial_peer_with_peer_id_is_accepted() -> None:
    config = resolve_config(NodeConfig, {}, env={"CROWDTRAIN_INITIAL_PEERS": INITIAL_PEER})
    assert config.initial_peers == (INITIAL_PEER,)


def test_listen_and_announce_need_no_peer_id() -> None:
    flags = {"listen": ["/ip4/0.0.0.0/tcp/0"], "announce": ["/ip4/8.8.8.8/tcp/31330"]}
    config = resolve_config(NodeConfig, flags, env={})
    assert config.listen == ("/ip4/0.0.0.0/tcp/0",) and config.announce == ("/ip4/8.8.8.8/tcp/31330",)


@pytest.mark.parametrize(("interval_s", "ttl_s"), [(5.0, 5.0), (10.0, 5.0)])
def test_status_ttl_must_outlive_the_refresh_interval(interval_s: float, ttl_s: float) -> None:
    flags = {"status_interval_s": interval_s, "status_ttl_s": ttl_s}
    with pytest.raises(BadInputError, match="status_ttl_s"):
        resolve_config(NodeConfig, flags, env={})


def test_status_ttl_check_applies_across_layers(tmp_path: Path) -> None:
    config_file = write_toml(tmp_path, "status_ttl_s = 4.0\n")
    with pytest.raises(BadInputError, match="status_ttl_s"):
        resolve_config(NodeConfig, {}, env={"CROWDTRAIN_STATUS_INTERVAL_S": "4"}, config_file=config_file)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        ({"device": "gpu"}, "device"),
        ({"role": "boss"}, "role"),
        ({"bootstrap_timeout_s": 0}, "bootstrap_timeout_s"),
        ({"checkpoint_interval_s": 0}, "checkpoint_interval_s"),
        ({"log_format": "xml"}, "log_format"),
        ({"verbose": -1}, "verbose"),
        ({"status_interval_s": "fast"}, "status_interval_s"),
        ({"throughput_s": 0}, "throughput_s"),
        ({"listen": "/ip4/127.0.0.1/tcp/1"}, "listen"),
    ],
)
def test_invalid_flag_names_the_field(flags: dict[str, object], field: str) -> None:
    with pytest.raises(BadInputError, match=field):
        resolve_config(NodeConfig, flags, env={})


@pytest.mark.parametrize(
    ("field", "default", "taken", "refused"),
    [
        ("eval_every", 0, 5, (-1, 1_000_001)),  # held-out scoring off by default
        ("metrics_port", 0, 9464, (-1, 65536)),  # the metrics endpoint off by default; else a TCP port
        ("start_with_peers", 1, 4, (0, 10_001)),  # training never waits for peers by default
    ],
)
def test_a_bounded_setting_has_its_default_takes_a_value_and_refuses_out_of_bounds_naming_itself(
    field: str, default: int, taken: int, refused: tuple[int, ...]
) -> None:
    assert getattr(NodeConfig(), field) == default
    assert getattr(NodeConfig(**{field: taken}), field) == taken  # type: ignore[arg-type]
    for bad in refused:
        with pytest.raises(ValueError, match=field):
            NodeConfig(**{field: bad})  # type: ignore[arg-type]


def test_checkpoint_interval_from_env_and_toml(tmp_path: Path) -> None:
    assert NodeConfig().checkpoint_interval_s == 600.0
    config_file = write_toml(tmp_path, "checkpoint_interval_s = 120\n")
    assert resolve_config(NodeConfig, {}, env={}, config_file=config_file).checkpoint_interval_s == 120.0
    env = {"CROWDTRAIN_CHECKPOINT_INTERVAL_S": "0.5"}
    assert resolve_config(NodeConfig, {}, env=env, config_file=config_file).checkpoint_interval_s == 0.5
    with pytest.raises(BadInputError, match="CROWDTRAIN_CHECKPOINT_INTERVAL_S"):
        resolve_config(NodeConfig, {}, env={"CROWDTRAIN_CHECKPOINT_INTERVAL_S": "hourly"})


def test_unknown_toml_key_is_rejected_by_name(tmp_path: Path) -> None:
    config_file = write_toml(tmp_path, 'device = "cpu"\nstatus_intervall_s = 1\n')
    with pytest.raises(BadInputError, match="status_intervall_s"):
        resolve_config(NodeConfig, {}, env={}, config_file=config_file)


def test_wrong_type_in_toml_names_the_field(tmp_path: Path) -> None:
    config_file = write_toml(tmp_path, 'initial_peers = "one"\n')
    with pytest.raises(BadInputError, match="initial_peers.*must be a list"):
        resolve_config(NodeConfig, {}, env={}, config_file=config_file)


def test_invalid_toml_file_is_bad_input(tmp_path: Path) -> None:
    config_file = write_toml(tmp_path, "device = \n")
    with pytest.raises(BadInputError, match="not valid TOML") as caught:
        resolve_config(NodeConfig, {}, env={}, config_file=config_file)
    assert config_file in str(caught.value)


def test_missing_toml_file_is_bad_input(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.toml")
    with pytest.raises(BadInputError, match="Cannot read config file") as caught:
        resolve_config(NodeConfig, {}, env={}, config_file=missing)
    assert missing in str(caught.value)


def test_status_config_layers_the_same_way(tmp_path: Path) -> None:
    config_file = write_toml(tmp_path, 'run_id = "file"\nwatch_s = 2.0\n')
    config = resolve_config(StatusConfig, {"watch_s": 0.5}, env={"CROWDTRAIN_RUN_ID": "env"}, config_file=config_file)
    assert (config.run_id, config.watch_s) == ("env", 0.5)
    with pytest.raises(BadInputError, match="watch"):
        resolve_config(StatusConfig, {"watch_s": -1.0}, env={})


SHARED_ENV = {
    "CROWDTRAIN_INITIAL_PEERS": INITIAL_PEER,
    "CROWDTRAIN_STATE_DIR": "/env/state",
    "CROWDTRAIN_RUN_ID": "env-run",
    "CROWDTRAIN_BOOTSTRAP_TIMEOUT_S": "3",
    "CROWDTRAIN_LOG_FORMAT": "json",
    "CROWDTRAIN_VERBOSE": "2",
}


@pytest.mark.parametrize("cls", [NodeConfig, StatusConfig, CheckConfig])
def test_every_command_takes_the_swarm_settings_from_the_same_variables(cls: type[SwarmSettings]) -> None:
    config = resolve_config(cls, {}, env=SHARED_ENV)
    assert (config.initial_peers, config.state_dir, config.run_id) == ((INITIAL_PEER,), "/env/state", "env-run")
    assert (config.bootstrap_timeout_s, config.log_format, config.verbose) == (3.0, "json", 2)
    assert config.state_path == Path("/env/state")
    with pytest.raises(BadInputError, match="bootstrap_timeout_s must be positive"):
        resolve_config(cls, {"bootstrap_timeout_s": 0.0}, env={})
    with pytest.raises(BadInputError, match="initial_peers .* lacks the peer id"):
        resolve_config(cls, {"initial_peers": ("/ip4/127.0.0.1/tcp/31330",)}, env={})


@pytest.mark.parametrize("cls", [NodeConfig, CheckConfig])
def test_run_and_check_share_the_machine_settings(cls: type[MachineSettings], tmp_path: Path) -> None:
    config_file = write_toml(tmp_path, 'device = "cpu"\nmicro_batch_size = 4\nlisten = ["/ip4/127.0.0.1/tcp/1"]\n')
    config = resolve_config(cls, {"num_threads": 2}, env={"CROWDTRAIN_DEVICE": "cuda:1"}, config_file=config_file)
    assert (config.device, config.micro_batch_size, config.num_threads) == ("cuda:1", 4, 2)
    assert config.listen == ("/ip4/127.0.0.1/tcp/1",)
    with pytest.raises(BadInputError, match="device must be auto, cpu, cuda or cuda:N"):
        resolve_config(cls, {"device": "tpu"}, env={})
    with pytest.raises(BadInputError, match="num_threads must not be negative"):
        resolve_config(cls, {"num_threads": -1}, env={})


def test_the_shared_settings_are_defined_once() -> None:
    shared = {field.name for field in fields(SwarmSettings)}
    machine = {field.name for field in fields(MachineSettings)} - shared
    assert shared == {
        "initial_peers", "state_dir", "run_id", "run_key", "join_token", "bootstrap_timeout_s", "log_format", "verbose"
    }  # fmt: skip
    assert machine == {
        "listen", "announce", "device", "micro_batch_size", "num_threads", "throughput_s", "data_cache_dir"
    }  # fmt: skip
    assert issubclass(NodeConfig, MachineSettings) and issubclass(CheckConfig, MachineSettings)
    assert issubclass(StatusConfig, SwarmSettings) and not issubclass(StatusConfig, MachineSettings)


def test_the_data_cache_is_the_state_dirs_unless_one_is_named() -> None:
    assert NodeConfig(state_dir="/srv/ct").data_cache_path == Path("/srv/ct/data-cache")
    assert NodeConfig(state_dir="/srv/ct", data_cache_dir="~/tokens").data_cache_path == Path.home() / "tokens"


@pytest.mark.parametrize(
    ("role", "fixed"), [("auto", None), ("trainer", Role.TRAINER), ("expert-host", Role.EXPERT_HOST)]
)
def test_fixed_role_is_the_role_or_none_for_auto(role: str, fixed: Role | None) -> None:
    assert NodeConfig(role=role).fixed_role is fixed
    with pytest.raises(ValueError, match="role must be one of auto, trainer, aggregator, expert-host, client"):
        NodeConfig(role="boss")
