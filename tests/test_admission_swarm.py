"""An invite-only run with real daemons: a joiner with the founder's token gets in, one without is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from crowdtrain.testing.processes import await_condition
from crowdtrain.testing.swarm import crowdtrain, peer_ids, status_json
from tests.harness import start_daemon

pytestmark = pytest.mark.swarm

INVITE_RUN = 'admission = "invite"\n'


def _invite(state_dir: Path, *args: str) -> str:
    result = crowdtrain("invite", "--state-dir", str(state_dir), *args)
    assert result.returncode == 0, result.stderr
    return next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("ctjoin1."))


def test_an_invite_only_run_admits_token_holders_and_refuses_the_rest(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(INVITE_RUN)
    founder = start_daemon(tmp_path / "founder", "--run-file", str(run_file)).await_ready()
    token = _invite(tmp_path / "founder", "--expires", "1h", "--label", "alice")

    joiner = start_daemon(
        tmp_path / "joiner", "--role", "client", initial_peers=[founder.address], env={"CROWDTRAIN_JOIN_TOKEN": token}
    ).await_ready()
    assert joiner.info["run_id"] == "demo"

    outsider = crowdtrain(
        "run", "--state-dir", str(tmp_path / "outsider"), "--listen", "/ip4/127.0.0.1/tcp/0",
        "--bootstrap-timeout", "5", "--initial-peers", founder.address,
    )  # fmt: skip
    assert outsider.returncode == 3, outsider.stderr
    assert "invite-only run needs --join-token" in outsider.stderr
    assert "Traceback" not in outsider.stderr

    # A reader needs a token as well; with one it sees both members.
    refused = crowdtrain("status", "--json", "--bootstrap-timeout", "5", "--initial-peers", founder.address)
    assert refused.returncode == 3 and "Traceback" not in refused.stderr
    snapshot = await_condition(
        lambda: (
            s
            if len(peer_ids(s := status_json("--initial-peers", founder.address, "--join-token", token))) == 2
            else None
        ),
        60,
        "the reader with a token to see both members",
    )
    assert peer_ids(snapshot) == {founder.peer_id, joiner.peer_id}


def test_a_token_from_another_run_key_is_refused_by_the_swarm(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text(INVITE_RUN)
    founder = start_daemon(tmp_path / "founder", "--run-file", str(run_file)).await_ready()
    # Another founder's run of the same name: its token is well formed but signed by the wrong run key.
    impostor = start_daemon(tmp_path / "impostor", "--run-file", str(run_file), "--role", "aggregator").await_ready()
    forged = _invite(tmp_path / "impostor")
    impostor.signal(2)
    assert impostor.wait() == 0

    result = crowdtrain(
        "run", "--state-dir", str(tmp_path / "joiner"), "--listen", "/ip4/127.0.0.1/tcp/0",
        "--bootstrap-timeout", "5", "--initial-peers", founder.address, "--join-token", forged,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "that your join token is for the run there" in result.stderr
