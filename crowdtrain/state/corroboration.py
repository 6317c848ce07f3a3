"""Other donors corroborate a downloaded state with digests of their own: asked for by a joiner, served by donors.

A well-formed state can still be wrong (random weights, weights scaled by 0.5), so other donors corroborate it where
peers at one epoch hold one state (`states_agree_at_epoch`: DeDLOC's gradient mode and DiLoCo's outer state, where every
peer applies the same averaged step; not Moshpit SGD's parameter mode, where peers step alone between rounds), whatever
the joiner's own last round was: no caller can switch it off. The joiner draws a random seed and, as the download starts
(training moves on while a large state streams), asks up to NUM_CORROBORATORS other donors for a sketch of their state
(`rpc_state_digest`, served beside hivemind's `rpc_download_state` by every averager that serves its state;
state/digest.py), and compares each answer with the same sketch of the downloaded state. An answer at another epoch
can't corroborate (training moved on) and is skipped; when none came at the state's epoch, the donors that answered from
an earlier one (their step to it still to come) are asked again as they catch up, CATCH_UP_TRIES times CATCH_UP_S apart.
A donor whose state at that epoch is one it downloaded itself serves no digest of it (`echoes`): it would only repeat
its own donor; nor does a DiLoCo or SPES donor whose state at that epoch is its own outer step of a round it was not
averaged in (its metadata's "alone"): several whose round failed together would each refuse the others' states. Every
answer at the state's epoch agrees: the state is loaded. One disagrees: one further donor is asked, and the state is
loaded only if a majority of the sketches at its epoch, its own included, agree with it; otherwise it is refused with a
warning and the next donor is tried, and if a majority agree with each other against it, its donor is marked bad as
well. None answering at the state's epoch: its epoch must be the swarm's. If a majority of the other donors that
answered did so from more than MAX_EPOCH_LEAD epochs before it, the state names an epoch nobody else reached (a liar
dodging comparison by labelling its state honest epoch + 5) and is refused the same way (its donor marked bad when two
or more answers say so). No other donor, or none answering by DIGEST_GRACE_S after the download: the state is loaded
with an INFO line saying it was not corroborated, since a swarm of two has nobody to compare with and refusing would
leave its joiners with no state.

Measured so far: in fresh-clone runs of the daemon swarm tests (gradient mode, 3-4 peers) 6 of 17 downloads with
other donors were corroborated, then 1 of 4; with the catch-up asks and no echoed digests, 2 of 5 and 3 of 7. The
rest found no digest at the state's epoch in time (donors ahead, or catching up themselves) and loaded
uncorroborated, so a liar's well-formed state can still be loaded then.

What this does not stop: a state changed in a few values only (the sketch samples 16 per tensor); sybils that serve the
liar's state outvote the honest donors; a liar ranked first after a round every honest member stepped alone (none of
them is a witness then, so its state at that epoch loads uncorroborated, as in a swarm of two). And honest donors can
disagree at one epoch: briefly in gradient mode (a peer that stepped alone until it resyncs; a parameter-averaging
round, which leaves the epoch as it was, done on one peer before another), where the joiner then tries the next donor,
and for good in a swarm larger than one averaging group, where a joiner may find no majority, load nothing and try again
later."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2PContext, PeerID

from crowdtrain import proto
from crowdtrain.state.digest import (
    MAX_EPOCH_LEAD,
    Corroboration,
    DigestLimiter,
    Judgement,
    MalformedDigestError,
    Sketch,
    judge,
    judge_epoch,
    read_digest,
    sketch_state,
    sketches_agree,
    to_digest,
)

logger = logging.getLogger(__name__)

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

DigestAnswer = tuple[int, Sketch] | None
"""A donor's answer to a digest request: its state's epoch and sketch; None for none or a malformed one."""


class StateCorroborationMixin:
    """The digests of VerifiedStateDownloadMixin (state/download.py), its base: other donors asked for a sketch of
    their state and their answers judged (`_corroborate`); this node's own served to joiners (`rpc_state_digest`)."""

    peer_id: PeerID
    prefix: str
    serializer: Any

    @staticmethod
    def _accept(
        donor: PeerID, epoch: int, judgement: Judgement, answered: Sequence[int], bad_donors: set[PeerID]
    ) -> bool:
        """Whether a state of `epoch` that others' digests judged so, and whose other donors answered from the epochs
        `answered`, may be loaded; a refuted donor is not asked again."""
        counts = f"{judgement.num_agreeing} of {judgement.num_sketches} sketches at epoch {epoch} agree with it"
        if judgement.verdict is Corroboration.REFUTED:
            bad_donors.add(donor)
            logger.warning(f"refused the state of peer {donor}: only {counts}, the others with each other; "
                           "it will not be asked again")  # fmt: skip
            return False
        if judgement.verdict is Corroboration.DISPUTED:
            logger.warning(f"refused the state of peer {donor} for now: only {counts}")
            return False
        # Corroborated: another donor holds that state at that epoch. Otherwise its epoch must be the swarm's.
        ahead = judge_epoch(epoch, answered) if judgement.verdict is Corroboration.UNCORROBORATED else None
        if ahead is not None:
            behind = sum(answer < epoch - MAX_EPOCH_LEAD for answer in answered)
            refuted = ahead is Corroboration.REFUTED
            if refuted:
                bad_donors.add(donor)
            logger.warning(f"refused the state of peer {donor}{'' if refuted else ' for now'}: its epoch {epoch} is "
                           f"more than {MAX_EPOCH_LEAD} past those {behind} of the {len(answered)} other donors "
                           f"answered from{'; it will not be asked again' if refuted else ''}")  # fmt: skip
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
        `epoch` from `further`. Answers at another epoch don't count here; the epoch each donor last answered from
        comes back, for `_accept`'s bound on how far the state may be ahead of them."""
        if first:  # asked as the download started: what has not come DIGEST_GRACE_S after it does not count
            await asyncio.wait([task for _, task in first], timeout=DIGEST_GRACE_S)
        finished = [(peer, task.result()) for peer, task in first if task.done() and not task.cancelled()]
        answered = [(peer, answer) for peer, answer in finished if answer is not None]
        epochs = {peer: answer_epoch for peer, (answer_epoch, _) in answered}  # each donor's latest answer
        sketches = [sketch for _, (answer_epoch, sketch) in answered if answer_epoch == epoch]
        behind = [peer for peer, (answer_epoch, _) in answered if answer_epoch < epoch]
        for _ in range(CATCH_UP_TRIES if not sketches else 0):
            if not behind:
                break
            await asyncio.sleep(CATCH_UP_S)
            again = await asyncio.gather(*(self._ask_digest(peer, seed, sizes) for peer in behind))
            epochs.update((peer, answer[0]) for peer, answer in zip(behind, again, strict=True) if answer is not None)
            sketches = [answer[1] for answer in again if answer is not None and answer[0] == epoch]
            if sketches:
                break
            behind = [peer for peer, answer in zip(behind, again, strict=True) if answer and answer[0] < epoch]
        disputed = any(not sketches_agree(mine, sketch) for sketch in sketches)
        for peer in further if disputed else []:
            answer = await self._ask_digest(peer, seed, sizes)
            if answer is not None:
                epochs[peer] = answer[0]
            if answer is not None and answer[0] == epoch:
                sketches.append(answer[1])
                break
        return judge(mine, sketches), list(epochs.values())

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
        """A sketch, drawn with the asker's seed, of the state rpc_download_state would stream now; none of a state
        this node copied (`echoes`) or stepped to alone (its metadata's "alone")."""
        averager: Any = self
        limiter: DigestLimiter = self.__dict__.setdefault("_digest_limiter", DigestLimiter())
        if not averager.allow_state_sharing or not limiter.admit(context.remote_id.to_base58()):
            return proto.StateDigest(served=False)
        metadata, tensors, _ = await averager._get_current_state_from_host_process()
        metadata = self.serializer.loads(metadata)
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        alone = isinstance(metadata, dict) and metadata.get("alone") is True
        if type(epoch) is not int or not 0 <= epoch < 2**64 or self.echoes(epoch) or alone:
            return proto.StateDigest(served=False)
        sketch = await asyncio.get_running_loop().run_in_executor(None, sketch_state, tensors, request.seed)
        return to_digest(epoch, sketch)

    def echoes(self, epoch: int) -> bool:
        """Whether this node's state at `epoch` is one it downloaded at that epoch: a copy of its donor's, so no
        independent opinion of a joiner's state of `epoch` (two joiners of one donor would corroborate each other).
        From its next step on, its state is its own again."""
        return self.__dict__.get("_downloaded_epoch") == epoch
