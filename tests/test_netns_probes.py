"""`crowdtrain check` in the WAN lab: measured bandwidth matches the link caps; an undialable address makes a client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import FAST_HEARTBEAT_ENV, await_condition

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

from wanlab import Host, HostSpec, Lab, Scenario  # noqa: E402

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None, reason="needs root and iproute2"
    ),
]

ENV = {**os.environ, **FAST_HEARTBEAT_ENV, "CROWDTRAIN_NUM_THREADS": "1", "CROWDTRAIN_THROUGHPUT_S": "0.5"}
UPLOAD_CAP_MBPS, DOWNLOAD_CAP_MBPS = 20, 40
TOLERANCE = 0.3


def read_node_file(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / "node.json").read_text())
    except (OSError, ValueError):
        return None


def check_in(host: Host, *args: str) -> dict[str, Any]:
    result = subprocess.run(
        ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "crowdtrain", "check", "--json", *args],
        capture_output=True, text=True, timeout=180, env=ENV, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, f"check failed ({result.returncode}): {result.stderr}"
    return json.loads(result.stdout)


def test_check_measures_the_caps_and_an_undialable_node_is_a_client(tmp_path: Path) -> None:
    scenario = Scenario(
        name="probes",
        hosts=(
            HostSpec(name="fast", upload_mbps=200, download_mbps=200),
            HostSpec(name="slow", upload_mbps=UPLOAD_CAP_MBPS, download_mbps=DOWNLOAD_CAP_MBPS),
        ),
    )
    with Lab(scenario) as lab:
        fast, slow = lab.hosts
        with open(tmp_path / "fast.log", "w") as log:
            lab.spawn(fast, [sys.executable, "-m", "crowdtrain", "run", "--state-dir", str(tmp_path / "fast")],
                      stdout=log, stderr=subprocess.STDOUT, env=ENV)  # fmt: skip
        founder = await_condition(lambda: read_node_file(tmp_path / "fast"), 180, "the founder's node.json", poll_s=1)
        address = next(address for address in founder["multiaddrs"] if f"/ip4/{fast.address}/" in address)
        state = ["--state-dir", str(tmp_path / "slow")]  # both checks share it: the second one's throughput is cached

        report = check_in(slow, "--initial-peers", address, *state)
        assert report["probed_peers"] == [founder["peer_id"]], report["problems"]
        upload, download = report["upload_mbps"], report["download_mbps"]
        print(f"slow host: upload {upload:.1f} Mbit/s (cap {UPLOAD_CAP_MBPS}), download {download:.1f} (cap 40)")
        assert abs(upload - UPLOAD_CAP_MBPS) <= TOLERANCE * UPLOAD_CAP_MBPS, report
        assert abs(download - DOWNLOAD_CAP_MBPS) <= TOLERANCE * DOWNLOAD_CAP_MBPS, report
        assert report["reachable"] is True and "client" not in report["plan"]["roles"], report

        closed = f"/ip4/{slow.address}/tcp/9"  # nothing listens on the discard port
        report = check_in(
            slow, "--initial-peers", address, "--announce", closed, "--listen", "/ip4/0.0.0.0/tcp/0", *state
        )
        assert report["reachable"] is False, report
        assert [(a["multiaddr"].split("/p2p/")[0], a["verdict"]) for a in report["addresses"]] == [(closed, "refused")]
        assert "client" in report["plan"]["roles"], report["plan"]
        assert "--announce /ip4/" in report["fix"] and "--role client" in report["fix"]
