"""The averaging benchmark's smallest mode runs end to end and reports finite positive numbers (not the suite).

Only one benchmark's smoke mode runs in CI, for the suite's time; `bench_moe.py --smoke` is run by hand.
"""

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


@pytest.mark.parametrize("preset", ["llama-20m", "llama-85m", "demo"])
def test_the_real_model_benchmark_writes_a_run_file_that_reads_back(
    preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every optional manifest section added since (spes, ...) once made bench_realmodel stop before its first arm.
    import importlib.util

    from crowdtrain.manifest import PRESETS

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "scripts"))  # its sibling scripts, as when run

    spec = importlib.util.spec_from_file_location(
        "bench_realmodel", Path(__file__).parent.parent / "scripts" / "bench_realmodel.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_realmodel", bench)  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    bench.write_run_file(PRESETS[preset](), tmp_path / "run.toml")  # raises unless it reads back as the manifest
    assert "[model]" in (tmp_path / "run.toml").read_text()
