"""The benchmarks' smallest modes run end to end and report finite positive numbers (not the suite)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.swarm]

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def run_smoke(script: str, out: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`script --smoke`; past `timeout_s` it gets SIGTERM first, so that it kills the daemons it started."""
    command = [sys.executable, str(SCRIPTS / script), "--smoke", "--out", str(out)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            stdout, stderr = process.communicate(timeout=60)
            pytest.fail(f"{script} --smoke ran past {timeout_s:g} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def assert_finite_positive(result: dict, keys: tuple[str, ...]) -> None:
    for key in keys:
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, (key, result)


@pytest.mark.timeout(210)  # 140 s, then a minute to tear the lab down
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2")
def test_averaging_smoke_reports_finite_positive_numbers(tmp_path: Path) -> None:
    run = run_smoke("bench_averaging.py", tmp_path, timeout_s=140)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    uniform = json.loads((tmp_path / "averaging.json").read_text())["uniform"]
    assert_finite_positive(uniform, ("bound_s", "averaging_time_over_bound", "averaging_speedup_vs_gloo"))
    for variant in ("crowdtrain", "gloo"):
        assert uniform["variants"][variant]["num_good_rounds"] == 1, uniform["variants"][variant]


@pytest.mark.timeout(240)
def test_moe_smoke_reports_finite_positive_numbers(tmp_path: Path) -> None:
    # About 85 s on 2 lightly loaded cores (two expert servers, then 2 hosts and a trainer); the bound is for busy ones.
    run = run_smoke("bench_moe.py", tmp_path, timeout_s=170)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "moe.json").read_text())
    serving_keys = (
        "moe_expert_calls_per_s",
        "moe_expert_p50_ms",
        "moe_expert_p99_ms",
        "moe_speedup_vs_hivemind_server",
    )
    assert_finite_positive(results["serving"], serving_keys)
    training_keys = ("moe_samples_per_s", "moe_samples_per_s_after_kill", "moe_samples_per_s_after_kill_ratio")
    assert_finite_positive(results["training"], training_keys)
