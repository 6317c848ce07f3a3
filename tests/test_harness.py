"""The test harness's own helpers."""

from __future__ import annotations

from pathlib import Path

from tests.harness import LAST_LINES_SHOWN, LOG_FILES_SHOWN, WARNINGS_SHOWN, logs_summary


def test_a_failed_tests_logs_summary_shows_each_logs_warnings_and_last_lines_bounded(tmp_path: Path) -> None:
    lines = [f"09:07:{i:02d} INFO    [founder] epoch {i}" for i in range(40)]
    lines[5] = "09:07:05 WARN    [founder] refused the state of peer Qm...: 67 tensors where this node's state has 80"
    lines += [f"09:08:{i:02d} WARN    [founder] averaging failed {i}" for i in range(20)]
    (tmp_path / "founder.log").write_text("\n".join(lines))
    (tmp_path / "founder").mkdir()
    (tmp_path / "founder" / "node.json").write_text("{}")
    (tmp_path / "joiner.log").write_text("")
    summary = logs_summary(tmp_path)
    assert "--- founder.log (60 lines, 21 warnings)" in summary and "--- joiner.log (0 lines, 0 warnings)" in summary
    assert "averaging failed 19" in summary and "averaging failed 11" not in summary, "the last warnings"
    assert summary.count("averaging failed") == WARNINGS_SHOWN + LAST_LINES_SHOWN  # the last lines repeat two of them
    assert "node.json" not in summary
    for index in range(20):
        (tmp_path / f"node{index:02d}.log").write_text("x" * 1000)
    summary = logs_summary(tmp_path)
    assert summary.count("--- ") == LOG_FILES_SHOWN and max(map(len, summary.splitlines())) <= 300
