"""Shared fixtures: every daemon a test starts is killed, with its whole process group, after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import kill_all_started


@pytest.fixture(autouse=True)
def _kill_started_daemons() -> Iterator[None]:
    yield
    kill_all_started()
