"""A joiner's state download from peers, verified before anything is loaded (issue 14, "verified state").

hivemind downloads from the donor with the highest *self-declared* priority, keeps every streamed byte,
and loads what came: a NaN tensor, a one-element tensor that `copy_` broadcasts over a whole parameter, a
negative Adam second moment, optimizer hyperparameters of the donor's choosing, or an epoch of 2**62 that
makes the learning-rate scheduler step forever. Here the download is checked against a template of this
node's own state (state/template.py): the number of tensors, every shape and dtype, finiteness, the sign of
quantities that can't be negative, the total bytes (bounded while streaming), and an epoch no higher than the run
could have reached since its manifest was created (`epoch_ceiling`); the optimizer's hyperparameters are always
this node's own. A donor whose state is malformed is remembered and not asked again; the download goes on
with the next donor. A stream that ends early is not malformed: hivemind ends a stream whose connection closed as if
it had ended, and a donor that no longer shares its state sends an empty one, so such a donor is asked again after a
pause that doubles with each short stream in a row (`CutShortPauses`). A fresh-clone CI run showed why: a two-peer
swarm's only donor was cut off once mid-download, the joiner held it against the donor, and never joined.

A state that fits is then corroborated by other donors' digests (state/corroboration.py). The whole search ends
DEADLINE_MARGIN_S before its caller's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from crowdtrain.rpc.service import result_unless_stopping
from crowdtrain.state.corroboration import MAX_DIGEST_REQUESTS, NUM_CORROBORATORS, StateCorroborationMixin
from crowdtrain.state.digest import Corroboration, sketch_state
from crowdtrain.state.template import (
    EpochTooHighError,
    StaleStateError,
    StateTemplate,
    UnacceptableStateError,
    check_state,
)

logger = logging.getLogger(__name__)

DEADLINE_MARGIN_S = 5.0
"""A state download in the averager process ends this long before its caller's timeout."""
CUT_SHORT_PAUSE_S = 5.0
MAX_CUT_SHORT_PAUSE_S = 600.0
"""A donor whose state stream ended early is asked again after this pause, doubled after each further stream in a row
that ended early, up to the maximum: a cut connection is no proof of malice, and a donor that always stops short
costs at most one download per maximum pause."""


class CutShortError(ValueError):
    """A state stream that ended before all of the template's tensors came: what a cut connection looks like
    (hivemind ends a stream whose connection closed as if it were complete), so the donor is asked again later."""


@dataclass(slots=True)
class CutShortPauses:
    """Donors whose last state streams ended early, and when each may be asked again (CUT_SHORT_PAUSE_S)."""

    _cut: dict[PeerID, tuple[int, float]] = field(default_factory=dict)
    """Per donor: its short streams in a row, and when it may be asked again."""

    def cut_short(self, donor: PeerID, now: float) -> float:
        """Note a stream of `donor` that ended early; the seconds until it may be asked again."""
        streak = self._cut.get(donor, (0, 0.0))[0] + 1
        pause = min(CUT_SHORT_PAUSE_S * 2 ** (streak - 1), MAX_CUT_SHORT_PAUSE_S)
        self._cut[donor] = (streak, now + pause)
        return pause

    def completed(self, donor: PeerID) -> None:
        """A whole state came from `donor`: its streak ends."""
        self._cut.pop(donor, None)

    def paused(self, donor: PeerID, now: float) -> bool:
        return self._cut.get(donor, (0, 0.0))[1] > now


class VerifiedStateDownloadMixin(StateCorroborationMixin):
    """Mixed into a hivemind DecentralizedAverager subclass, ahead of DecentralizedAverager in the MRO.

    The host process builds the template (`state_template`) and sends it with the request; the averager
    process downloads, bounded and checked, trying donors by priority and skipping those that failed before, and
    has other donors corroborate the state; it serves them digests of its own (`rpc_state_digest`).
    """

    _outer_pipe: Any
    peer_id: PeerID
    prefix: str
    next_chunk_timeout: float | None
    request_timeout: float
    serializer: Any
    last_loaded_epoch: int | None = None
    """The epoch of the state the last download loaded; None when no donor gave an acceptable one."""
    states_agree_at_epoch: bool = True
    """Whether honest peers at one epoch hold one state, so that other donors' digests can corroborate a download:
    false in Moshpit SGD's parameter mode, where peers step alone between averaging rounds."""

    def state_template(self) -> StateTemplate:
        """This node's own state as a download must match it; subclasses list their tensors."""
        raise NotImplementedError

    def trusted_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """The downloaded metadata with whatever this node must not take from a peer replaced by its own."""
        return metadata

    def load_state_from_peers(
        self,
        wait: bool = True,
        timeout: float | None = None,
        above_priority: float | None = None,
        stop: threading.Event | None = None,
    ) -> Any:
        """hivemind's DecentralizedAverager.load_state_from_peers, verified; returns (metadata, tensors) or None.
        `above_priority`: ask only donors that declared a higher priority than this. Other donors corroborate the
        state wherever honest ones hold one state per epoch (`states_agree_at_epoch`): no caller can switch that off
        (a round that failed must not open the door to an unverified state). `stop`: the node's stop event; once
        set, the wait ends with NodeStopping and the averager process finishes or abandons the download by itself
        (not for hivemind.Optimizer, which retries whatever a download raises but KeyboardInterrupt)."""
        future: MPFuture = MPFuture()
        template = self.state_template()
        corroborate = self.states_agree_at_epoch
        self.last_loaded_epoch = None  # until this download loads one: a timed-out one must not report the last's
        # The averager gives up a little before this caller would: a late answer is lost, and hivemind logs the
        # caller's TimeoutError with a traceback.
        deadline_s = None if timeout is None else max(timeout - DEADLINE_MARGIN_S, 1.0)
        request = dict(
            future=future,
            template=template,
            above_priority=above_priority,
            corroborate=corroborate,
            deadline_s=deadline_s,
        )
        self._outer_pipe.send(("_load_verified_state", [], request))
        if not wait:
            return future
        try:
            loaded = result_unless_stopping(future, timeout, stop, "a state download")
        except TimeoutError:
            # The averager process gives up DEADLINE_MARGIN_S earlier; on a saturated link its answer can still come
            # late. hivemind's caller would log the TimeoutError with a traceback and retry at once; DiLoCo's would
            # stop training. No state, said plainly: the caller goes on with its own and asks again later.
            logger.warning(f"no verified state came within {timeout:g} s; this node goes on with its own")
            return None
        self.last_loaded_epoch = None if loaded is None else int(loaded[0]["epoch"])
        return None if loaded is None else (self.trusted_metadata(loaded[0]), loaded[1])

    async def _load_verified_state(
        self,
        future: MPFuture,
        template: StateTemplate,
        above_priority: float | None,
        corroborate: bool,
        deadline_s: float | None = None,
    ) -> None:
        # Runs in the averager process. hivemind's own _load_state_from_peers, with the checks of state/template.py.
        try:
            searching = self._first_verified_state(template, above_priority, corroborate)
            loaded = await asyncio.wait_for(searching, deadline_s)
            if loaded is not None:
                self.__dict__["_downloaded_epoch"] = loaded[0]["epoch"]  # checked by check_state: an int
            future.set_result(loaded)
        except TimeoutError:
            logger.warning(f"found no verified state within {deadline_s:g} s; this node goes on with its own")
        finally:
            if not future.done():
                future.set_result(None)

    async def _first_verified_state(
        self, template: StateTemplate, above_priority: float | None, corroborate: bool
    ) -> tuple[Any, list[torch.Tensor]] | None:
        bad_donors: set[PeerID] = self.__dict__.setdefault("_bad_donors", set())
        ranked = await self._ranked_donors(bad_donors)
        paused = 0
        for donor in [peer for peer, priority in ranked if above_priority is None or priority > above_priority]:
            if donor in bad_donors:  # refuted while corroborating an earlier donor's state
                continue
            if self._cut_short.paused(donor, time.monotonic()):
                paused += 1
                continue
            others = [peer for peer, _ in ranked if peer != donor and peer not in bad_donors]
            state = await self._verified_state(donor, template, others if corroborate else None, bad_donors)
            if state is not None:
                self.__dict__["_no_donor_said"] = None
                return state
        if above_priority is None:
            self._say_no_donor(len(bad_donors), paused)
        return None

    def _say_no_donor(self, refused: int, paused: int) -> None:
        # A joiner that found no state to load can't catch up with the swarm; said once per change, not per step.
        said = self.__dict__.get("_no_donor_said")
        self.__dict__["_no_donor_said"] = (refused, paused)
        if (refused or paused) and said != (refused, paused):
            logger.warning(f"no peer can give this node the swarm's state now ({refused} refused for good, {paused} "
                           "paused after a stream cut short); it goes on with its own until one can")  # fmt: skip

    async def _verified_state(
        self, donor: PeerID, template: StateTemplate, others: list[PeerID] | None, bad_donors: set[PeerID]
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """The state of `donor` if it fits `template` and `others` don't refute it (state/corroboration.py); else None.
        `others` None: nobody is asked, as donors' states may differ honestly."""
        seed = secrets.randbits(64)
        sizes = [math.prod(spec.shape) for spec in template.tensors]
        # Others are asked as the download starts, so that they describe the epoch the donor's state has: a large
        # state streams for minutes while training moves on. The seed is never sent to the donor.
        first = [
            (peer, asyncio.create_task(self._ask_digest(peer, seed, sizes)))
            for peer in (others or [])[:NUM_CORROBORATORS]
        ]
        try:
            started = time.monotonic()
            downloaded = await self._checked_download(donor, template, bad_donors)
            if downloaded is None:
                return None
            metadata, tensors, epoch = downloaded
            seconds = time.monotonic() - started
            further = (others or [])[NUM_CORROBORATORS:MAX_DIGEST_REQUESTS]
            mine = await asyncio.get_running_loop().run_in_executor(None, sketch_state, tensors, seed) if first else ()
            judgement, answered = await self._corroborate(epoch, mine, first, further, seed, sizes)
        finally:
            for _, task in first:
                task.cancel()
        if not self._accept(donor, epoch, judgement, answered, bad_donors):
            return None
        elsewhere = sorted(answer for answer in answered if answer != epoch)
        if judgement.verdict is Corroboration.CORROBORATED:
            corroboration = f"corroborated: {judgement.num_agreeing} of {judgement.num_sketches} sketches agree"
        elif others:
            corroboration = f"not corroborated: none of the {len(first)} other donors asked answered at its epoch"
            corroboration += f" (answers at epochs {', '.join(map(str, elsewhere))})" if elsewhere else ""
        elif others is not None:
            corroboration = "not corroborated: no other donor to ask"
        else:
            corroboration = "not corroborated: donors' states may differ honestly here"
        logger.info(f"downloaded and verified the state of epoch {epoch} from {donor} in {seconds:.1f} s; "
                    f"{corroboration}")  # fmt: skip
        return metadata, tensors

    async def _checked_download(
        self, donor: PeerID, template: StateTemplate, bad_donors: set[PeerID]
    ) -> tuple[Any, list[torch.Tensor], int] | None:
        """(metadata, tensors, epoch) of `donor`'s state if it fits `template`; else None, and a malformed state's
        donor joins `bad_donors`."""
        chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            metadata, tensors = await self._download(donor, template, chunk_timeout)
            epoch = check_state(metadata, tensors, template)
            self._cut_short.completed(donor)
            return metadata, tensors, epoch
        except CutShortError as e:
            pause = self._cut_short.cut_short(donor, time.monotonic())
            logger.warning(f"the state of peer {donor} {e}; it will be asked again in {pause:g} s")
        except StaleStateError as e:
            logger.debug(f"skipped the state of peer {donor}: {e}")
        except UnacceptableStateError as e:
            if not isinstance(e, EpochTooHighError):
                bad_donors.add(donor)
            again = "" if isinstance(e, EpochTooHighError) else "; it will not be asked again"
            logger.warning(f"refused the state of peer {donor}: {e}{again}")
        except Exception as e:
            logger.warning(f"could not download the state of peer {donor}: {e!r}")
        return None

    async def _ranked_donors(self, bad_donors: set[PeerID]) -> list[tuple[PeerID, float]]:
        """Peers that declared they serve their state, with their priority, highest first (ties broken at random);
        neither this node nor a bad donor."""
        averager: Any = self
        key_manager = averager._matchmaking.group_key_manager
        found = await averager.dht.get(f"{key_manager.prefix}.all_averagers", latest=True, return_future=True)
        priorities, _ = found or ({}, None)
        if not isinstance(priorities, dict):
            return []
        ranked = {
            PeerID(peer_id): (float(info.value), random.random())
            for peer_id, info in priorities.items()
            if isinstance(info, ValueWithExpiration) and isinstance(info.value, float | int)
        }
        donors = sorted(ranked, key=ranked.__getitem__, reverse=True)
        return [(donor, ranked[donor][0]) for donor in donors if donor != self.peer_id and donor not in bad_donors]

    async def _download(
        self, donor: PeerID, template: StateTemplate, chunk_timeout: float
    ) -> tuple[Any, list[torch.Tensor]]:
        averager: Any = self
        stub = averager.get_stub(averager._p2p, donor, namespace=self.prefix)
        # Opening the stream (dialling the donor) is bounded like every chunk after it.
        stream = await asyncio.wait_for(stub.rpc_download_state(averaging_pb2.DownloadRequest()), chunk_timeout)
        metadata: Any = None
        parts: list[Any] = []
        tensors: list[torch.Tensor] = []
        received = 0
        async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
            received += len(message.metadata) + len(message.tensor_part.buffer)
            if received > template.max_bytes:
                raise UnacceptableStateError(f"sent more than the {template.max_bytes} bytes its state can take")
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(_deserialize(parts, len(tensors)))
                parts = []
                if len(tensors) > len(template.tensors):
                    raise UnacceptableStateError(f"sent more than the {len(template.tensors)} tensors of a state")
            parts.append(message.tensor_part)
        if not received:  # hivemind's donor that no longer shares its state sends nothing, as does a cut connection
            raise CutShortError("came empty")
        return _whole_state(metadata, tensors, parts, template)

    @property
    def _cut_short(self) -> CutShortPauses:
        pauses: CutShortPauses = self.__dict__.setdefault("_cut_short_pauses", CutShortPauses())
        return pauses


def _whole_state(
    metadata: Any, tensors: list[torch.Tensor], parts: list[Any], template: StateTemplate
) -> tuple[Any, list[torch.Tensor]]:
    """The state a stream that ended brought: `tensors` with the last one's `parts`; CutShortError if it stopped
    before all of `template`'s tensors came."""
    if parts:
        try:
            tensors = [*tensors, _deserialize(parts, len(tensors))]
        except UnacceptableStateError:  # the stream may have ended inside it
            raise CutShortError(f"ended inside tensor {len(tensors)} of {len(template.tensors)}") from None
    if not metadata:
        raise UnacceptableStateError("sent no metadata")
    if len(tensors) < len(template.tensors):
        raise CutShortError(f"ended after {len(tensors)} of its {len(template.tensors)} tensors")
    return metadata, tensors


def _deserialize(parts: list[Any], index: int) -> torch.Tensor:
    try:
        return deserialize_torch_tensor(combine_from_streaming(parts))
    except Exception as e:  # a buffer of the wrong length, an unknown dtype or compression, ...
        raise UnacceptableStateError(f"tensor {index} does not deserialize: {e}") from None
