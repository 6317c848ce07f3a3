"""Log set-up: hivemind's expected averaging failures are one warning line, other errors keep their traceback."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from hivemind.averaging.allreduce import AllreduceException

from crowdtrain.node.logs import setup_logging


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root, hivemind = logging.getLogger(), logging.getLogger("hivemind")
    saved = (root.handlers[:], root.level, hivemind.level)
    yield
    root.handlers[:], root.level, hivemind.level = saved  # hivemind's own handler mode stays "nowhere"


def log_failure(error: BaseException, *loggers: str) -> None:
    try:
        raise error
    except type(error) as e:
        for name in loggers:
            logging.getLogger(name).exception(e)


def test_a_failed_averaging_round_is_one_warning_line(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("text", 0)
    log_failure(
        AllreduceException("Averaging step failed: could not find a group"),
        "hivemind.averaging.averager",
        "hivemind.optim.state_averager",  # hivemind logs the same failure again further up
    )
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and "averaging round failed: Averaging step failed: could not find a group" in lines[0]

    log_failure(AllreduceException("a second round"), "hivemind.averaging.averager")
    assert "a second round" in capsys.readouterr().err, "a new failure is reported again"


def test_other_errors_and_verbose_runs_keep_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("text", 0)
    log_failure(RuntimeError("something else broke"), "hivemind.optim.optimizer")
    assert "Traceback" in capsys.readouterr().err

    setup_logging("text", 1)
    log_failure(AllreduceException("could not find a group"), "hivemind.averaging.averager")
    err = capsys.readouterr().err
    assert "Traceback" in err and "ERROR" in err


def test_a_task_cancelled_while_its_generator_closed_is_not_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    # hivemind.utils.asyncio.await_cancelled logs "Exception in <Task cancelling ...>" with a GeneratorExit
    # traceback when a pre-scheduled round is dropped mid-matchmaking: it failed a test's "no Traceback" check.
    setup_logging("text", 0)
    log_failure(GeneratorExit(), "hivemind.utils.asyncio")
    assert capsys.readouterr().err == ""
    log_failure(RuntimeError("a real error"), "hivemind.utils.asyncio")
    assert "Traceback" in capsys.readouterr().err
