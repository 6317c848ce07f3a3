"""The state this node serves to joiners (hivemind's `rpc_download_state`), admitted like every bulk answer.

Each answer makes a whole copy of the state (in the host process, then through the averager's pipe) before its first
byte goes out, so a grant is taken first (crowdtrain/rpc/bulk.py): MAX_STATE_ANSWERS at once, one per peer, each
counted at the most a state of this run can weigh (`StateTemplate.max_bytes`). Past them the asker gets an empty
answer, which a downloader takes as "ask the next donor" (state/download.py). An answer is cut short past
STATE_ANSWER_S: a slow home uplink sends a whole state well within it, and a peer that stops reading holds its slot
no longer (the grant ends by itself a grace period later).
"""

from __future__ import annotations

import logging
import typing
from typing import Any

from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from crowdtrain.rpc.bulk import BulkGate, BulkLimits, within_time
from crowdtrain.state.template import StateTemplate

logger = logging.getLogger(__name__)

MAX_STATE_ANSWERS = 2
"""States this node serves at once, to all joiners together (each is a whole copy in memory)."""
STATE_ANSWER_S = 600.0
"""Seconds one answer may take from its grant."""


def state_limits(template: StateTemplate) -> BulkLimits:
    """What serving states may take of this node at once: MAX_STATE_ANSWERS copies, one per peer."""
    return BulkLimits(
        max_answers=MAX_STATE_ANSWERS,
        max_answers_per_peer=1,
        max_bytes=MAX_STATE_ANSWERS * template.max_bytes,
        answer_time_s=STATE_ANSWER_S,
    )


class StateServingMixin:
    """Mixed into an averager (before hivemind's DecentralizedAverager) that has a `state_template()`."""

    state_template: typing.Callable[[], StateTemplate]
    """What a state of this run looks like (the averager's own method)."""

    @property
    def state_answers(self) -> BulkGate:
        """The admission of the states this node serves, made at the first request (in the averager's process)."""
        gate = self.__dict__.get("_state_answers")
        if gate is None:
            gate = self.__dict__["_state_answers"] = BulkGate(state_limits(self.state_template()))
        return typing.cast(BulkGate, gate)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's answer (the state's metadata, then its tensors in parts), once a grant is had; else empty."""
        peer = context.remote_id.to_base58()
        grant = self.state_answers.admit(peer, self.state_template().max_bytes)
        if grant is None:
            logger.info(f"refused to serve its state to peer {peer[-8:]}: as many are being served as may be")
            return
        parent: Any = super()
        answer = parent.rpc_download_state(request, context)
        with grant:
            async for message in within_time(grant, answer, f"a state for peer {peer[-8:]}"):
                yield message
