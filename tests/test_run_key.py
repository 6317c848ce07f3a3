"""A pinned run: joiners accept only the manifest of the run's founder key, and a later other founder is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import hivemind
import pytest
from hivemind.utils.crypto import RSAPrivateKey
from lab.processes import await_condition
from lab.swarm import crowdtrain

from crowdtrain.dht.records import owner_marker, sign_manifest
from crowdtrain.dht.registry import list_runs, publish_manifest
from crowdtrain.dht.validator import make_validators
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import demo
from crowdtrain.node.membership import pin_founder
from tests.harness import start_daemon
from tests.test_cli_errors import assert_plain_failure


def test_the_first_founder_is_pinned_and_another_refused(tmp_path: Path) -> None:
    pins = tmp_path / "runs.json"
    pin_founder(pins, "tiny", "QmFounder")
    pin_founder(pins, "tiny", "QmFounder")  # the same founder again: fine
    pin_founder(pins, "other", "QmSomeoneElse")  # another run: its own pin
    with pytest.raises(BadInputError, match="--run-key QmAttacker"):
        pin_founder(pins, "tiny", "QmAttacker")
    assert json.loads(pins.read_text()) == {"other": "QmSomeoneElse", "tiny": "QmFounder"}


def test_a_corrupt_pin_file_is_one_sentence(tmp_path: Path) -> None:
    pins = tmp_path / "runs.json"
    pins.write_text("[1, 2")
    with pytest.raises(BadInputError, match="fix or remove it"):
        pin_founder(pins, "tiny", "QmFounder")


@pytest.mark.swarm
def test_a_forged_older_manifest_does_not_take_the_run_from_its_founder(tmp_path: Path) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text('run_id = "pinned"\n')
    founder = start_daemon(tmp_path / "founder", "--run-file", str(run_file)).await_ready()
    # an attacker publishes a manifest for the same run id, with an older created_at: before, joiners took it
    attacker_key = RSAPrivateKey()
    dht = hivemind.DHT(
        initial_peers=[founder.address], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False,
        record_validators=make_validators(attacker_key),
    )  # fmt: skip
    try:
        forged = dataclasses.replace(demo(), run_id="pinned", target_batch_size=7, created_at=1.0)
        assert publish_manifest(dht, sign_manifest(forged, attacker_key), owner_marker(attacker_key), 300, 10)
        await_condition(lambda: list_runs(dht, 10)["pinned"].published.manifest.target_batch_size == 7, 30,
                        "the forged manifest to win the unpinned listing")  # fmt: skip
        joiner = start_daemon(
            tmp_path / "joiner", "--run-key", founder.peer_id, initial_peers=[founder.address]
        ).await_ready()
        assert f"founded by {founder.peer_id}" in joiner.log()
        # the founder printed the key next to the join command
        assert f"--run-key {founder.peer_id}" in founder.log()
        # a node that never saw this key refuses a key nobody founded a run with
        result = crowdtrain("run", "--state-dir", str(tmp_path / "lost"), "--initial-peers", founder.address,
                            "--run-key", "QmNobodyFoundedThis", "--bootstrap-timeout", "3")  # fmt: skip
        assert_plain_failure(result, 2, "no run founded by QmNobodyFoundedThis")
        # status with the key shows the founder's manifest, not the forged older one; with a wrong key, a sentence
        shown = json.loads(crowdtrain("status", "--json", "--initial-peers", founder.address,
                                      "--run-key", founder.peer_id).stdout)  # fmt: skip
        assert shown["run"]["founder"] == founder.peer_id and shown["run"]["target_batch_size"] != 7
        result = crowdtrain(
            "status", "--initial-peers", founder.address, "--run-key", "QmNobodyFoundedThis", "--bootstrap-timeout", "3"
        )
        assert_plain_failure(result, 2, "no run founded by QmNobodyFoundedThis")
    finally:
        dht.shutdown()
