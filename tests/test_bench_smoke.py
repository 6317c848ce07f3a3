"""The averaging benchmark's smallest mode runs end to end and reports finite positive numbers (not the suite)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.timeout(150),
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None, reason="needs root and iproute2"),
]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_averaging.py"


def test_averaging_smoke_reports_finite_positive_numbers(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    uniform = json.loads((tmp_path / "averaging.json").read_text())["uniform"]
    for key in ("bound_s", "averaging_time_over_bound", "averaging_speedup_vs_gloo"):
        assert isinstance(uniform[key], float) and math.isfinite(uniform[key]) and uniform[key] > 0, (key, uniform)
    for variant in ("crowdtrain", "gloo"):
        assert uniform["variants"][variant]["num_good_rounds"] == 1, uniform["variants"][variant]
