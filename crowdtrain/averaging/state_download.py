"""A joiner's state download from peers, verified before anything is loaded (issue 14, "verified state").

hivemind downloads from the donor with the highest *self-declared* priority, keeps every streamed byte,
and loads what came: a NaN tensor, a one-element tensor that `copy_` broadcasts over a whole parameter, a
negative Adam second moment, optimizer hyperparameters of the donor's choosing, or an epoch of 2**62 that
makes the learning-rate scheduler step forever. Here the download is checked against a template of this
node's own state: the number of tensors, every shape and dtype, finiteness, the sign of quantities that
can't be negative, the total bytes (bounded while streaming), and an epoch no higher than the run could
have reached since its manifest was created (`epoch_ceiling`); the optimizer's hyperparameters are always
this node's own. A donor whose state is malformed is remembered and not asked again; the download goes on
with the next donor. A stream that ends early is not malformed: hivemind ends a stream whose connection closed as if
it had ended, and a donor that no longer shares its state sends an empty one, so such a donor is asked again after a
pause that doubles with each short stream in a row (`CutShortPauses`). A fresh-clone CI run showed why: a two-peer
swarm's only donor was cut off once mid-download, the joiner held it against the donor, and never joined.

A well-formed state can still be wrong (random weights, weights scaled by 0.5), so other donors corroborate it where
peers at one epoch hold one state (`states_agree_at_epoch`: DeDLOC's gradient mode and DiLoCo's outer state, where
every peer applies the same averaged step; not Moshpit SGD's parameter mode, where peers step alone between rounds;
nor a DiLoCo peer resyncing after a round it stepped alone, as others may have too). The joiner draws a random seed
and, as the download starts (training moves on while a large state streams), asks up to NUM_CORROBORATORS other
donors for a sketch of their state (`rpc_state_digest`, served beside hivemind's `rpc_download_state` by every
averager that serves its state; averaging/state_digest.py), and compares each answer with the same sketch of the
downloaded state. An answer at another epoch can't corroborate (training moved on) and is skipped; when none came
at the state's epoch, the donors that answered from an earlier one (their step to it still to come) are asked again
as they catch up, CATCH_UP_TRIES times CATCH_UP_S apart. A donor whose state at that epoch is one it downloaded
itself serves no digest of it (`echoes`): it would only repeat its own donor. Every answer at
the state's epoch agrees: the state is loaded. One disagrees: one further donor is asked, and the state is loaded
only if a majority of the sketches at its epoch, its own included, agree with it; otherwise it is refused with a
warning and the next donor is tried, and if a majority agree with each other against it, its donor is marked bad as
well. No other donor, or none answering at the state's epoch by DIGEST_GRACE_S after the download: the state is
loaded with an INFO line saying it was not corroborated, since a swarm of two has nobody to compare with and refusing
would leave its joiners with no state. The whole search ends DEADLINE_MARGIN_S before its caller's timeout.

Measured so far: in fresh-clone runs of the daemon swarm tests (gradient mode, 3-4 peers) 6 of 17 downloads with
other donors were corroborated, then 1 of 4; with the catch-up asks and no echoed digests, 2 of 5 and 3 of 7. The
rest found no digest at the state's epoch in time (donors ahead, or catching up themselves) and loaded
uncorroborated, so a liar's well-formed state can still be loaded then.

What this does not stop: a state changed in a few values only (the sketch samples 16 per tensor); sybils that serve
the liar's state outvote the honest donors. And honest donors can disagree at one epoch: briefly in gradient mode (a
peer that stepped alone until it resyncs; a parameter-averaging round, which leaves the epoch as it was, done on one
peer before another), where the joiner then tries the next donor, and for good in a swarm larger than one averaging
group, where a joiner may find no majority, load nothing and try again later.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.state_averager import dump_optimizer_state
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from crowdtrain import proto
from crowdtrain.averaging.state_digest import (
    Corroboration,
    DigestLimiter,
    Judgement,
    MalformedDigestError,
    Sketch,
    judge,
    read_digest,
    sketch_state,
    sketches_agree,
    to_digest,
)

logger = logging.getLogger(__name__)

MAX_GLOBAL_STEPS_PER_S = 20.0
"""No run makes global steps faster than this (the demo model on one CPU makes about 3 per second)."""
EPOCH_SLACK = 100_000
"""Epochs allowed beyond the time bound, for clocks that disagree (an hour at the maximum rate)."""
NON_NEGATIVE_STATE = frozenset({"step", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer_norm"})
"""Optimizer state entries that are never negative (a negative second moment makes Adam's step NaN)."""
STREAM_OVERHEAD_BYTES = 1 << 20
"""Serialization overhead allowed beyond the template's own bytes."""
NUM_CORROBORATORS = 2
"""Other donors first asked for a digest of their state, at once."""
MAX_DIGEST_REQUESTS = 4
"""Donors asked for a digest per downloaded state at most, the further ones after a disagreement included."""
DIGEST_TIMEOUT_S = 5.0
"""A donor's digest answer later than this is no answer. For an 85M-parameter model the donor fetches its state from
its training process as for a download (views of the live tensors in gradient mode; DiLoCo copies its outer state
and moves it to shared memory, 1-2.5 s on a loaded 2-core machine) and sketches it (30-80 ms on one core)."""
DIGEST_GRACE_S = 1.0
"""Digests were asked for as the download started; once it is done, the state waits this much longer for them
(not DIGEST_TIMEOUT_S: every state download, a gradient-mode peer's catch-up included, would pay it)."""
CATCH_UP_TRIES = 2
CATCH_UP_S = 1.0
"""No other donor answered at the downloaded state's epoch, and some answered from an earlier one (mid-step, or
their step still to come): those are asked again, up to CATCH_UP_TRIES times this far apart."""
DEADLINE_MARGIN_S = 5.0
"""A state download in the averager process ends this long before its caller's timeout."""
CUT_SHORT_PAUSE_S = 5.0
MAX_CUT_SHORT_PAUSE_S = 600.0
"""A donor whose state stream ended early is asked again after this pause, doubled after each further stream in a row
that ended early, up to the maximum: a cut connection is no proof of malice, and a donor that always stops short
costs at most one download per maximum pause."""


class UnacceptableStateError(ValueError):
    """A downloaded state that does not fit this node's own: never loaded, and its donor is not asked again."""


class EpochTooHighError(UnacceptableStateError):
    """A state claiming an epoch beyond the bound: not loaded; the donor may be asked again later."""


class StaleStateError(UnacceptableStateError):
    """A state older than this node's own: not loaded; nothing wrong with the donor."""


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


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What one tensor of a state must look like."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    non_negative: bool = False


@dataclass(frozen=True, slots=True)
class StateTemplate:
    """This node's own state as a download must match it, and the highest epoch it may claim."""

    tensors: tuple[TensorSpec, ...]
    epoch_ceiling: int
    epoch_floor: int = 0
    """A state older than this is of no use to this node (it is not held against the donor)."""

    @property
    def max_bytes(self) -> int:
        """Bytes the whole download may take on the wire."""
        return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in self.tensors) + STREAM_OVERHEAD_BYTES


def epoch_ceiling(created_at: float, now: float) -> int:
    """The highest epoch a donor may claim: the global steps a run created at `created_at` (the signed manifest's
    time) can have made by `now`, at the fastest plausible rate, plus slack for clocks."""
    return int(max(0.0, now - created_at) * MAX_GLOBAL_STEPS_PER_S) + EPOCH_SLACK


def check_state(metadata: Any, tensors: Sequence[Any], template: StateTemplate) -> int:
    """The state's epoch when `metadata` and `tensors` fit `template`; else UnacceptableStateError."""
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if type(epoch) is not int or epoch < 0:
        raise UnacceptableStateError(f"epoch {epoch!r} is not a non-negative integer")
    if epoch > template.epoch_ceiling:
        raise EpochTooHighError(f"epoch {epoch} is beyond the {template.epoch_ceiling} this run can have reached")
    if epoch < template.epoch_floor:
        raise StaleStateError(f"epoch {epoch} is older than this node's {template.epoch_floor}")
    if len(tensors) != len(template.tensors):
        raise UnacceptableStateError(f"{len(tensors)} tensors where this node's state has {len(template.tensors)}")
    for index, (tensor, spec) in enumerate(zip(tensors, template.tensors, strict=True)):
        _check_tensor(index, tensor, spec)
    return epoch


def _check_tensor(index: int, tensor: Any, spec: TensorSpec) -> None:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        found = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise UnacceptableStateError(f"tensor {index} is {found}, expected {spec.shape} {spec.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise UnacceptableStateError(f"tensor {index} holds NaN or infinite values")
    if spec.non_negative and tensor.numel() and bool((tensor < 0).any()):
        raise UnacceptableStateError(f"tensor {index} holds negative values where none can be")


def optimizer_tensor_specs(optimizer: torch.optim.Optimizer) -> list[TensorSpec]:
    """Specs of the optimizer's state tensors in the order hivemind streams them (`dump_optimizer_state`)."""
    names = [name for name, value in _flatten_named(optimizer.state_dict()) if isinstance(value, torch.Tensor)]
    _, tensors = dump_optimizer_state(optimizer)
    pairs = zip(names, tensors, strict=True)  # fails loudly if hivemind's flattening order ever changes
    return [TensorSpec(tuple(tensor.shape), tensor.dtype, name in NON_NEGATIVE_STATE) for name, tensor in pairs]


def _flatten_named(value: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    # The order of hivemind.utils.nested.nested_flatten (lists in order, dicts by sorted key), with each leaf's
    # innermost dict key, so a tensor's role (exp_avg_sq, step, ...) is known.
    if isinstance(value, list | tuple):
        for item in value:
            yield from _flatten_named(item, name)
    elif isinstance(value, dict):
        for key, item in sorted(value.items()):
            yield from _flatten_named(item, str(key))
    else:
        yield name, value


DigestAnswer = tuple[int, Sketch] | None
"""A donor's answer to a digest request: its state's epoch and sketch; None for none or a malformed one."""


class VerifiedStateDownloadMixin:
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
        corroborate: bool = True,
    ) -> Any:
        """hivemind's DecentralizedAverager.load_state_from_peers, verified; returns (metadata, tensors) or None.
        `above_priority`: ask only donors that declared a higher priority than this. `corroborate`: have other
        donors corroborate the state (with `states_agree_at_epoch`); False where they may differ from it honestly."""
        future: MPFuture = MPFuture()
        template = self.state_template()
        corroborate = corroborate and self.states_agree_at_epoch
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
            loaded = future.result(timeout=timeout)
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
        # Runs in the averager process. hivemind's own _load_state_from_peers, with the checks of this module.
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
        """The state of `donor` if it fits `template` and `others` don't refute it (module docstring); else None.
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
            judgement, elsewhere = await self._corroborate(epoch, mine, first, further, seed, sizes)
        finally:
            for _, task in first:
                task.cancel()
        if not self._accept(donor, epoch, judgement, bad_donors):
            return None
        if judgement.verdict is Corroboration.CORROBORATED:
            corroboration = f"corroborated: {judgement.num_agreeing} of {judgement.num_sketches} sketches agree"
        elif others:
            answered = f" (answers at epochs {', '.join(map(str, sorted(elsewhere)))})" if elsewhere else ""
            corroboration = f"not corroborated: none of the {len(first)} other donors asked answered at its epoch"
            corroboration += answered
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

    @staticmethod
    def _accept(donor: PeerID, epoch: int, judgement: Judgement, bad_donors: set[PeerID]) -> bool:
        """Whether a state others' digests judged so may be loaded; a refuted donor is not asked again."""
        counts = f"{judgement.num_agreeing} of {judgement.num_sketches} sketches at epoch {epoch} agree with it"
        if judgement.verdict is Corroboration.REFUTED:
            bad_donors.add(donor)
            logger.warning(f"refused the state of peer {donor}: only {counts}, the others with each other; "
                           "it will not be asked again")  # fmt: skip
            return False
        if judgement.verdict is Corroboration.DISPUTED:
            logger.warning(f"refused the state of peer {donor} for now: only {counts}")
            return False
        return True

    async def _corroborate(
        self,
        epoch: int,
        mine: Sketch,
        first: Sequence[tuple[PeerID, asyncio.Task[DigestAnswer]]],
        further: list[PeerID],
        seed: int,
        sizes: list[int],
    ) -> tuple[Judgement, list[int]]:
        """What others say of a downloaded state of `epoch` whose sketch is `mine`: the answers of `first`; those
        that answered from an earlier epoch asked again as they catch up; after a disagreement one more answer at
        `epoch` from `further`. Answers at another epoch don't count; their epochs come back for the log."""
        if first:  # asked as the download started: what has not come DIGEST_GRACE_S after it does not count
            await asyncio.wait([task for _, task in first], timeout=DIGEST_GRACE_S)
        finished = [(peer, task.result()) for peer, task in first if task.done() and not task.cancelled()]
        answered = [(peer, answer) for peer, answer in finished if answer is not None]
        sketches = [sketch for _, (answer_epoch, sketch) in answered if answer_epoch == epoch]
        elsewhere = [answer_epoch for _, (answer_epoch, _) in answered if answer_epoch != epoch]
        behind = [peer for peer, (answer_epoch, _) in answered if answer_epoch < epoch]
        for _ in range(CATCH_UP_TRIES if not sketches else 0):
            if not behind:
                break
            await asyncio.sleep(CATCH_UP_S)
            again = await asyncio.gather(*(self._ask_digest(peer, seed, sizes) for peer in behind))
            sketches = [answer[1] for answer in again if answer is not None and answer[0] == epoch]
            if sketches:
                break
            behind = [peer for peer, answer in zip(behind, again, strict=True) if answer and answer[0] < epoch]
        disputed = any(not sketches_agree(mine, sketch) for sketch in sketches)
        for peer in further if disputed else []:
            answer = await self._ask_digest(peer, seed, sizes)
            if answer is not None and answer[0] == epoch:
                sketches.append(answer[1])
                break
        return judge(mine, sketches), elsewhere

    async def _ask_digest(self, peer: PeerID, seed: int, sizes: list[int]) -> DigestAnswer:
        """`peer`'s (epoch, sketch of its state for `seed`) if it answers in time and well-formed; else None."""
        averager: Any = self
        try:
            stub = averager.get_stub(averager._p2p, peer, namespace=self.prefix)
            digest = await stub.rpc_state_digest(proto.StateDigestRequest(seed=seed), timeout=DIGEST_TIMEOUT_S)
            return read_digest(digest, sizes)
        except MalformedDigestError as e:
            logger.warning(f"ignored the state digest of peer {peer}: {e}")
        except Exception as e:  # gone, too slow, or a version without the RPC: one donor fewer to compare with
            logger.debug(f"peer {peer} sent no state digest: {e!r}")
        return None

    async def rpc_state_digest(self, request: proto.StateDigestRequest, context: P2PContext) -> proto.StateDigest:
        """A sketch, drawn with the asker's seed, of the state rpc_download_state would stream now."""
        averager: Any = self
        limiter: DigestLimiter = self.__dict__.setdefault("_digest_limiter", DigestLimiter())
        if not averager.allow_state_sharing or not limiter.admit(context.remote_id.to_base58()):
            return proto.StateDigest(served=False)
        metadata, tensors, _ = await averager._get_current_state_from_host_process()
        metadata = self.serializer.loads(metadata)
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if type(epoch) is not int or not 0 <= epoch < 2**64 or self.echoes(epoch):
            return proto.StateDigest(served=False)
        sketch = await asyncio.get_running_loop().run_in_executor(None, sketch_state, tensors, request.seed)
        return to_digest(epoch, sketch)

    def echoes(self, epoch: int) -> bool:
        """Whether this node's state at `epoch` is one it downloaded at that epoch: a copy of its donor's, so no
        independent opinion of a joiner's state of `epoch` (two joiners of one donor would corroborate each other).
        From its next step on, its state is its own again."""
        return self.__dict__.get("_downloaded_epoch") == epoch

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


def parameter_specs(tensors: Sequence[torch.Tensor]) -> list[TensorSpec]:
    """Specs of parameters or other plain tensors: shape and dtype, any sign."""
    return [TensorSpec(tuple(tensor.shape), tensor.dtype) for tensor in tensors]
