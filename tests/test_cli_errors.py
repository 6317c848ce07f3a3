"""Bad input: one plain sentence, the contract's exit code, no traceback, no state corrupted."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lab.processes import await_condition
from lab.swarm import crowdtrain

from crowdtrain.node.identity import load_or_create_identity
from crowdtrain.node.membership import RUN_KEYS_FILE, pin_founder
from tests.harness import start_daemon

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

FAKE_PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def assert_plain_failure(result, exit_code: int, *phrases: str) -> None:
    assert result.returncode == exit_code, f"exit {result.returncode}: {result.stderr}"
    assert "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("crowdtrain: "), result.stderr
    for phrase in phrases:
        assert phrase in message, message


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port nothing listens on (bound, never listening, so nobody else takes it)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]


def test_malformed_multiaddr_exits_2(tmp_path: Path) -> None:
    result = crowdtrain("run", "--state-dir", str(tmp_path), "--initial-peers", "/ip4/999.0.0.1/tcp/1")
    assert_plain_failure(result, 2, "/ip4/999.0.0.1/tcp/1", "not a valid multiaddr")
    assert not (tmp_path / "identity.key").exists(), "bad input must not create state"


def test_initial_peer_without_peer_id_exits_2(tmp_path: Path) -> None:
    result = crowdtrain("run", "--state-dir", str(tmp_path), "--initial-peers", "/ip4/127.0.0.1/tcp/31330")
    assert_plain_failure(result, 2, "/p2p/")


def test_unreachable_initial_peer_exits_3_in_bounded_time(tmp_path: Path, closed_port: int) -> None:
    address = f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/{FAKE_PEER}"
    started = time.monotonic()
    result = crowdtrain(
        "run",
        "--state-dir",
        str(tmp_path),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--initial-peers",
        address,
        "--bootstrap-timeout",
        "5",
    )
    assert_plain_failure(result, 3, "No initial peer answered", address)
    assert time.monotonic() - started < 45
    assert not (tmp_path / "node.json").exists()


def test_status_without_daemon_exits_3(tmp_path: Path) -> None:
    assert_plain_failure(crowdtrain("status", "--state-dir", str(tmp_path)), 3, "No crowdtrain daemon")


@pytest.mark.parametrize(
    ("content", "phrases"),
    [
        ("[optimizer]\nlearnig_rate = 1\n", ("unknown field 'optimizer.learnig_rate'",)),
        ('target_batch_size = "big"\n', ("target_batch_size", "integer")),
        ('[training]\nmode = "magic"\n', ("training", "mode")),
        ("run_id = [\n", ("not valid TOML",)),
    ],
)
def test_invalid_run_file_exits_2_naming_the_field(tmp_path: Path, content: str, phrases: tuple[str, ...]) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(content)
    result = crowdtrain("run", "--state-dir", str(tmp_path / "state"), "--run-file", str(run_file))
    assert_plain_failure(result, 2, *phrases)


def test_a_run_file_extending_an_unknown_preset_exits_2_naming_the_presets(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text('preset = "llama-86m"\ntarget_batch_size = 64\n')
    result = crowdtrain("run", "--state-dir", str(tmp_path / "state"), "--run-file", str(run_file))
    assert_plain_failure(result, 2, "unknown preset 'llama-86m'", "demo, demo-moe, llama-20m, llama-85m")
    assert not (tmp_path / "state" / "node.json").exists()


def test_printing_an_unknown_preset_exits_2_naming_the_presets() -> None:
    result = crowdtrain("preset", "llama-86m")
    assert_plain_failure(result, 2, "Unknown preset 'llama-86m'", "llama-85m", "spes-250m")
    assert result.stdout == ""


def test_unreadable_config_exits_2(tmp_path: Path) -> None:
    result = crowdtrain("run", "--state-dir", str(tmp_path), "--config", str(tmp_path / "missing.toml"))
    assert_plain_failure(result, 2, "Cannot read config file")


def test_identity_that_is_not_a_key_exits_2_untouched(tmp_path: Path) -> None:
    identity = tmp_path / "not-a-key"
    identity.write_bytes(b"-----BEGIN NONSENSE-----\n")
    result = crowdtrain("run", "--state-dir", str(tmp_path / "state"), "--identity", str(identity))
    assert_plain_failure(result, 2, "is not a crowdtrain identity")
    assert identity.read_bytes() == b"-----BEGIN NONSENSE-----\n"


def test_port_in_use_exits_2(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = crowdtrain("run", "--state-dir", str(tmp_path), "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    assert_plain_failure(result, 2, f"port {port} is already in use")


def test_second_daemon_on_same_state_dir_is_refused(tmp_path: Path) -> None:
    first = start_daemon(tmp_path / "node").await_ready()
    node_json = (tmp_path / "node" / "node.json").read_bytes()
    identity = (tmp_path / "node" / "identity.key").read_bytes()
    result = crowdtrain("run", "--state-dir", str(tmp_path / "node"), "--listen", "/ip4/127.0.0.1/tcp/0")
    assert_plain_failure(result, 2, "already using state dir", f"pid {first.process.pid}")
    assert (tmp_path / "node" / "node.json").read_bytes() == node_json
    assert (tmp_path / "node" / "identity.key").read_bytes() == identity
    assert first.process.poll() is None


def test_joiner_of_a_swarm_with_two_runs_must_choose(tmp_path: Path) -> None:
    founder = start_daemon(tmp_path / "a").await_ready()
    # It looks for a run named "other" before founding one, for as long as its bootstrap timeout (20 s by default).
    second_run = start_daemon(
        tmp_path / "b", "--run-file", "demo", "--run-id", "other", "--bootstrap-timeout", "5",
        initial_peers=[founder.address],
    ).await_ready()  # fmt: skip
    assert second_run.info["run_id"] == "other"

    def joiner_lists_both() -> object:
        result = crowdtrain(
            "run",
            "--state-dir",
            str(tmp_path / "c"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--initial-peers",
            founder.address,
            "--bootstrap-timeout",
            "10",
        )
        return result if result.returncode == 2 and "other" in result.stderr else None

    result = await_condition(joiner_lists_both, timeout_s=60, what="a joiner listing both runs", poll_s=1)
    assert_plain_failure(result, 2, "holds 2 runs", "demo", "other", "--run-id")
    chosen = start_daemon(tmp_path / "c", "--run-id", "other", initial_peers=[founder.address]).await_ready()
    assert chosen.info["run_id"] == "other"


def test_run_file_with_an_unbuildable_model_exits_2_before_publishing(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text("[model.config]\nhidden_sizee = 64\n")
    result = crowdtrain("run", "--state-dir", str(tmp_path / "state"), "--run-file", str(run_file))
    assert_plain_failure(result, 2, "hidden_sizee")
    assert not (tmp_path / "state" / "node.json").exists()


def test_invite_with_no_identities_exits_2(tmp_path: Path) -> None:
    result = crowdtrain("invite", "--state-dir", str(tmp_path), "--max-identities", "0")
    assert_plain_failure(result, 2, "--max-identities must be between 1 and 1024, not 0.")


@pytest.mark.parametrize("what", ["nobody", "abcdef", "ctjoin1.garbage"])
def test_revoking_what_was_never_issued_exits_2(tmp_path: Path, what: str) -> None:
    identity = load_or_create_identity(tmp_path / "identity.key")
    pin_founder(tmp_path / RUN_KEYS_FILE, "mine", identity.peer_id.to_base58())
    result = crowdtrain("invite", "--state-dir", str(tmp_path), "--revoke", what)
    assert_plain_failure(result, 2, "join token")
    assert not (tmp_path / "revocations").exists()
