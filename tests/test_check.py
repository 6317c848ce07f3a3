"""`crowdtrain check`: plain errors with the right exit codes, and a full pre-flight against a running daemon."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from lab.processes import await_condition
from lab.swarm import LOOPBACK, crowdtrain, peer_ids, status_json
from rich.console import Console

from crowdtrain import __version__
from crowdtrain.cli.check import CheckReport, LinkCheck, NotPlanned, RolePlan, render_check
from crowdtrain.links.protocol import AddressVerdict
from crowdtrain.roles import Role
from tests.harness import start_daemon

FAST_CHECK_ENV = {"CROWDTRAIN_THROUGHPUT_S": "0.5", "CROWDTRAIN_NUM_THREADS": "1"}
SOME_PEER_ID = "12D3KooWJ7UtzFe9wbyrjmmU4BWCBmeXZ2ei7Mm8NUUGgWPFYCpb"


VERDICTS = (
    AddressVerdict(peer_id="QmA", multiaddr="/ip4/203.0.113.5/tcp/31330", verdict="refused", detail="no"),
    AddressVerdict(peer_id="QmA", multiaddr="/ip4/10.0.0.2/tcp/31330", verdict="dialed", detail=""),
)


def swarm_report() -> CheckReport:
    links = LinkCheck(
        peer_id="QmMe",
        upload_mbps=12.5,
        download_mbps=None,
        reachable=False,
        not_measured=None,
        listen_port=31330,
        addresses=VERDICTS,
        observed_ips=("203.0.113.5",),
        probed_peers=("QmA",),
        problems=("peer …QmA failed",),
        fix="Forward TCP port 31330",
    )
    plan = RolePlan(
        roles=(Role.TRAINER, Role.CLIENT),
        aggregation_share=0.25,
        computes=True,
        num_peers=3,
        swarm_samples_per_second=99.5,
        averaging_time_s=1.5,
        solver="milp",
        assumptions=("peer …QmB published no upload_mbps: the peers' median",),
    )
    return CheckReport(
        version="0.1.0", run_id="demo", model="LlamaForCausalLM", links=links, device="cpu (8 cores)",
        precision="fp32", samples_per_second=12.34, plan=plan,
    )  # fmt: skip


def local_report() -> CheckReport:
    return CheckReport(
        version=__version__, run_id=None, model="LlamaForCausalLM", links=LinkCheck.without_peers(), device="cpu",
        precision="fp32", samples_per_second=5.0, plan=NotPlanned("not planned: no peers given"),
    )  # fmt: skip


def rendered(report: CheckReport) -> str:
    console = Console(record=True, width=240, color_system=None, file=io.StringIO())  # as `check` piped
    console.print(render_check(report))
    return console.export_text()


def test_check_json_is_the_documented_object_key_for_key() -> None:
    snapshot = swarm_report().to_json()
    assert json.dumps(snapshot) == json.dumps(
        {
            "version": "0.1.0",
            "run_id": "demo",
            "model": "LlamaForCausalLM",
            "peer_id": "QmMe",
            "upload_mbps": 12.5,
            "download_mbps": None,
            "reachable": False,
            "not_measured": None,
            "listen_port": 31330,
            "addresses": [
                {"peer_id": "QmA", "multiaddr": "/ip4/203.0.113.5/tcp/31330", "verdict": "refused", "detail": "no"},
                {"peer_id": "QmA", "multiaddr": "/ip4/10.0.0.2/tcp/31330", "verdict": "dialed", "detail": ""},
            ],
            "observed_ips": ["203.0.113.5"],
            "probed_peers": ["QmA"],
            "problems": ["peer …QmA failed"],
            "fix": "Forward TCP port 31330",
            "device": "cpu (8 cores)",
            "precision": "fp32",
            "samples_per_second": 12.34,
            "plan": {
                "roles": ["trainer", "client"],
                "aggregation_share": 0.25,
                "computes": True,
                "num_peers": 3,
                "swarm_samples_per_second": 99.5,
                "averaging_time_s": 1.5,
                "solver": "milp",
                "assumptions": ["peer …QmB published no upload_mbps: the peers' median"],
            },
        }
    )  # the same string: same keys, in the same order, same values and nulls


def test_check_json_without_peers() -> None:
    assert local_report().to_json() == {
        "version": __version__,
        "run_id": None,
        "model": "LlamaForCausalLM",
        "peer_id": None,
        "upload_mbps": None,
        "download_mbps": None,
        "reachable": None,
        "not_measured": "not measured: no peers given",
        "listen_port": None,
        "addresses": [],
        "observed_ips": [],
        "probed_peers": [],
        "problems": [],
        "fix": None,
        "device": "cpu",
        "precision": "fp32",
        "samples_per_second": 5.0,
        "plan": {"roles": None, "reason": "not planned: no peers given"},
    }


def test_render_check_reads_the_report() -> None:
    text = rendered(swarm_report())
    assert "demo  model LlamaForCausalLM" in text and "12.3 samples/s of the run's model in fp32" in text
    assert "12.5 Mbit/s" in text and "no: peers cannot dial this machine" in text
    assert "/ip4/203.0.113.5/tcp/31330: refused (no)" in text and "/ip4/10.0.0.2/tcp/31330: dialed " in text
    assert "trainer, client, aggregates 25% of each all-reduce (plan over 3 peers)" in text
    assert "note: peer …QmA failed" in text and "fix: Forward TCP port 31330" in text
    local = rendered(local_report())
    assert "none (no peers given)  model LlamaForCausalLM" in local
    assert local.count("not measured: no peers given") == 3 and "not planned: no peers given" in local


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
