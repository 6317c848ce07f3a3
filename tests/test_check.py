"""`crowdtrain check`: plain errors with the right exit codes, and a full pre-flight against a running daemon."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import LOOPBACK, await_condition, crowdtrain, peer_ids, start_daemon, status_json

FAST_CHECK_ENV = {"CROWDTRAIN_THROUGHPUT_S": "0.5", "CROWDTRAIN_NUM_THREADS": "1"}
SOME_PEER_ID = "12D3KooWJ7UtzFe9wbyrjmmU4BWCBmeXZ2ei7Mm8NUUGgWPFYCpb"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--initial-peers", "/ip4/127.0.0.1/tcp/1"), "lacks the peer id"),
        (("--device", "tpu"), "device must be auto, cpu, cuda or cuda:N"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_input_is_one_sentence_and_exit_code_2(flags: tuple[str, ...], message: str) -> None:
    result = crowdtrain("check", *flags, timeout_s=50)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_no_answer_from_the_initial_peer_exits_3(tmp_path: Path) -> None:
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{SOME_PEER_ID}"  # the discard port: nothing answers
    result = crowdtrain(
        "check", "--initial-peers", dead, "--bootstrap-timeout", "3", "--listen", LOOPBACK,
        "--state-dir", str(tmp_path), timeout_s=80,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "No initial peer answered" in result.stderr


@pytest.mark.swarm
@pytest.mark.timeout(420)
def test_check_against_a_daemon_measures_links_throughput_and_role(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "a", env={"CROWDTRAIN_NUM_THREADS": "1"}).await_ready(150)
    await_condition(lambda: daemon.peer_id in peer_ids(status_json("--state-dir", str(tmp_path / "a"))), 90,
                    "the daemon's status in the DHT", poll_s=1)  # fmt: skip
    result = crowdtrain(
        "check", "--initial-peers", daemon.address, "--json", "--listen", LOOPBACK,
        "--state-dir", str(tmp_path / "check"), env=FAST_CHECK_ENV, timeout_s=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["run_id"] == "demo" and report["device"].startswith("cpu")
    assert report["samples_per_second"] > 0 and report["precision"] == "fp32"
    assert report["upload_mbps"] > 0 and report["download_mbps"] > 0, report["problems"]
    assert report["reachable"] is True and report["fix"] is None
    assert report["probed_peers"] == [daemon.peer_id]
    assert {address["verdict"] for address in report["addresses"]} == {"dialed"}
    plan = report["plan"]
    assert plan["num_peers"] == 2 and "client" not in plan["roles"], plan
    assert (tmp_path / "check" / "throughput.json").exists()
    assert peer_ids(status_json("--state-dir", str(tmp_path / "a"))) == {daemon.peer_id}, "check is no peer"
