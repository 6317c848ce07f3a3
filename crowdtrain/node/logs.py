"""Logging set-up for the CLI: readable text or JSON lines, with hivemind's chatter below -v."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_PEER = {"id": "-"}


class _PeerFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.peer = _PEER["id"]
        return True


class _AveragingFailureFilter(logging.Filter):
    """hivemind logs a failed averaging round (no group found, peers gone) as an error with a traceback, in the
    averager and again further up. For a volunteer that is an expected event, not a crash: it becomes one warning
    line, and the same exception logged again in this process is dropped (the averager runs in a child process,
    so a failure may still show once there and once in the trainer). A task of hivemind's whose generator closed
    while it was cancelled is not logged at all. With -v the records pass unchanged."""

    def __init__(self) -> None:
        super().__init__()
        from hivemind.averaging.allreduce import AllreduceException
        from hivemind.averaging.matchmaking import MatchmakingException

        self._expected = (AllreduceException, MatchmakingException)
        self._last: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.name.startswith("hivemind") and isinstance(error, GeneratorExit):
            # hivemind's await_cancelled logs a matchmaking task whose generator closed while it was being
            # cancelled (a pre-scheduled round dropped when no peer was there): nothing failed.
            return False
        if not record.name.startswith("hivemind") or not isinstance(error, self._expected):
            return True
        if error is self._last:
            return False  # the same failure, logged again further up the stack
        self._last = error
        record.msg, record.args, record.exc_info, record.exc_text = (
            f"averaging round failed: {error}; this node keeps training and joins the next round",
            (),
            None,
            None,
        )
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class _CurrentStderr:
    """Whatever sys.stderr is at write time, so a live progress bar can print log lines above itself."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, peer, message (and exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "peer": getattr(record, "peer", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(log_format: str, verbose: int, *, quiet: bool = False) -> None:
    """Configure the root logger once; hivemind and p2pd stay at warnings unless -v."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    handler = logging.StreamHandler(_CurrentStderr())
    handler.addFilter(_PeerFilter())
    if verbose == 0:
        handler.addFilter(_AveragingFailureFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)-7s [%(peer)s] %(message)s", "%H:%M:%S")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING if quiet else logging.INFO)
    logging.getLogger("hivemind").setLevel(
        logging.DEBUG if verbose >= 2 else logging.INFO if verbose == 1 else logging.ERROR
    )
    # hivemind's averager processes leave cancelled asyncio tasks behind ("Task exception was never
    # retrieved ... InvalidStateError") when a round times out; that is chatter, not a user's problem.
    logging.getLogger("asyncio").setLevel(logging.DEBUG if verbose >= 1 else logging.CRITICAL)
    os.environ.setdefault("GOLOG_LOG_LEVEL", "debug" if verbose >= 2 else "info" if verbose == 1 else "error")


def set_log_peer(peer_id: str) -> None:
    """Tag every later log line with the short peer ID."""
    _PEER["id"] = peer_id[-8:]
