"""A seeded sketch of a state, for corroborating a downloaded state with other donors' (issue 14, "verified state").

A joiner draws a random 64-bit seed after its download, so that no donor can tailor an answer in advance. The sketch
of a state is, per tensor, its sum, its L2 norm and its values at `SKETCH_SAMPLES` positions the seed picks: about
150 bytes per tensor, one pass over the values. Two sketches agree when every number is within
`SKETCH_RELATIVE_TOLERANCE` of its scale. A state scaled, shifted or replaced in bulk is caught; a few values changed
among millions slip past the samples (a full hash can't serve: honest peers' last bits differ across hardware).
`judge` applies the majority rule of state/corroboration.py to one downloaded state and other donors' sketches,
`judge_epoch` to its epoch and the epochs other donors answered from.
"""

from __future__ import annotations

import enum
import hashlib
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from crowdtrain import proto

SKETCH_SAMPLES = 16
"""Values sampled per tensor: a liar changing a fraction f of a tensor's values escapes them with odds (1 - f)^16."""
SKETCH_RELATIVE_TOLERANCE = 1e-3
"""How far two honest sketches may differ, relative to each number's scale (a sample's magnitude, floored at the
tensor's RMS; the norm; the sum's bound sqrt(n) * norm). Peers at one epoch applied the same averaged steps, so their
states differ only in the last bits float32 rounds differently on other hardware (~1e-7 relative, summed over a few
reductions); 1e-3 leaves four orders of magnitude for that and still refuses a state scaled by 0.998 or 1.002."""
MAX_TENSOR_SKETCH_BYTES = 256
"""A TensorSketch on the wire: 16 samples and two sums as doubles take about 160 bytes."""
DIGEST_OVERHEAD_BYTES = 64
DIGESTS_PER_PEER_PER_MINUTE = 12
"""Digests one peer may ask of this node in any 60 s: a joiner asks each donor a few times per download."""
DIGESTS_PER_MINUTE = 60
"""Digests all peers together may ask in any 60 s: each costs a pass over this node's state."""


class MalformedDigestError(ValueError):
    """A digest that does not describe a state of this node's shape: not compared, its sender ignored."""


@dataclass(frozen=True, slots=True)
class TensorSketch:
    """A few numbers describing one tensor; `num_values` is the tensor's size (known to both sides)."""

    num_values: int
    total: float
    norm: float
    samples: tuple[float, ...]


Sketch = tuple[TensorSketch, ...]
"""One TensorSketch per tensor of a state, in the order the state streams them."""


def sample_positions(seed: int, tensor_index: int, num_values: int) -> list[int]:
    """The positions in the flattened tensor `tensor_index` that `seed` picks: min(SKETCH_SAMPLES, num_values) of
    them, from BLAKE2b so that every version and platform draws the same ones."""
    positions = []
    for sample in range(min(SKETCH_SAMPLES, num_values)):
        digest = hashlib.blake2b(struct.pack("<QQQ", seed, tensor_index, sample), digest_size=8).digest()
        positions.append(int.from_bytes(digest, "little") % num_values)
    return positions


def sketch_tensor(tensor: torch.Tensor, positions: Sequence[int]) -> TensorSketch:
    """The sketch of one tensor, sampled at `positions`; reads the tensor without copying it (if contiguous)."""
    values = tensor.detach().reshape(-1)
    if not values.is_floating_point():
        values = values.to(torch.float64)  # integer state (counters) is small
    accumulate = torch.float64 if values.dtype == torch.float64 else torch.float32
    total = float(values.sum(dtype=accumulate))
    norm = float(torch.linalg.vector_norm(values, dtype=accumulate))
    if not (math.isfinite(total) and math.isfinite(norm)):  # float32 sums overflow beyond ~1e19 per value
        total, norm = float(values.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(values.double()))
    samples = values[torch.tensor(positions, dtype=torch.long)].double().tolist() if positions else []
    return TensorSketch(values.numel(), total, norm, tuple(samples))


def sketch_state(tensors: Sequence[torch.Tensor], seed: int) -> Sketch:
    """The sketch of a state's tensors for `seed`."""
    return tuple(
        sketch_tensor(tensor, sample_positions(seed, index, tensor.numel())) for index, tensor in enumerate(tensors)
    )


def to_digest(epoch: int, sketch: Sketch) -> proto.StateDigest:
    """What a donor answers: its state's epoch and sketch."""
    tensors = [proto.TensorSketch(sum=part.total, norm=part.norm, samples=part.samples) for part in sketch]
    return proto.StateDigest(served=True, epoch=epoch, tensors=tensors)


def max_digest_bytes(num_tensors: int) -> int:
    """The largest digest of a state of `num_tensors` tensors an asker reads."""
    return num_tensors * MAX_TENSOR_SKETCH_BYTES + DIGEST_OVERHEAD_BYTES


def read_digest(digest: proto.StateDigest, num_values: Sequence[int]) -> tuple[int, Sketch] | None:
    """A peer's digest as (epoch, sketch) once checked against this node's tensor sizes `num_values`; None when the
    peer served none. Raises MalformedDigestError for anything else than one finite sketch per tensor."""
    if not digest.served:
        return None
    if digest.ByteSize() > max_digest_bytes(len(num_values)):
        raise MalformedDigestError(f"it is {digest.ByteSize()} bytes, over {max_digest_bytes(len(num_values))}")
    if len(digest.tensors) != len(num_values):
        raise MalformedDigestError(f"it sketches {len(digest.tensors)} tensors where this state has {len(num_values)}")
    sketch = []
    for index, (part, size) in enumerate(zip(digest.tensors, num_values, strict=True)):
        expected = min(SKETCH_SAMPLES, size)
        if len(part.samples) != expected:
            raise MalformedDigestError(f"its sketch of tensor {index} has {len(part.samples)} samples, not {expected}")
        if not all(map(math.isfinite, [part.sum, part.norm, *part.samples])) or part.norm < 0:
            raise MalformedDigestError(f"its sketch of tensor {index} holds NaN, infinite values or a negative norm")
        sketch.append(TensorSketch(size, part.sum, part.norm, tuple(part.samples)))
    return digest.epoch, tuple(sketch)


def tensor_sketches_agree(mine: TensorSketch, theirs: TensorSketch) -> bool:
    """Whether two sketches of one tensor are within SKETCH_RELATIVE_TOLERANCE of each other."""
    if mine.num_values != theirs.num_values or len(mine.samples) != len(theirs.samples):
        return False
    numbers = [mine.total, mine.norm, theirs.total, theirs.norm, *mine.samples, *theirs.samples]
    if not all(map(math.isfinite, numbers)):
        return False
    tolerance = SKETCH_RELATIVE_TOLERANCE
    norm = max(mine.norm, theirs.norm)
    rms = norm / math.sqrt(max(mine.num_values, 1))
    return (
        abs(mine.norm - theirs.norm) <= tolerance * norm
        and abs(mine.total - theirs.total) <= tolerance * norm * math.sqrt(mine.num_values)  # |sum| <= sqrt(n) norm
        and all(
            abs(a - b) <= tolerance * max(abs(a), abs(b), rms)
            for a, b in zip(mine.samples, theirs.samples, strict=True)
        )
    )


def sketches_agree(mine: Sketch, theirs: Sketch) -> bool:
    """Whether two sketches of a state agree tensor by tensor."""
    return len(mine) == len(theirs) and all(map(tensor_sketches_agree, mine, theirs))


class Corroboration(enum.Enum):
    """What other donors' sketches at the downloaded state's epoch say about it."""

    CORROBORATED = "corroborated"  # a majority of sketches, the downloaded state's own included, agree with it
    UNCORROBORATED = "uncorroborated"  # no other donor answered at its epoch: nothing to compare with
    DISPUTED = "disputed"  # no majority either way
    REFUTED = "refuted"  # a majority agree with each other, not with it


@dataclass(frozen=True, slots=True)
class Judgement:
    """A verdict on a downloaded state, and the counts behind it (for the log)."""

    verdict: Corroboration
    num_agreeing: int
    """Sketches agreeing with the downloaded state, its own included."""
    num_sketches: int
    """Sketches at its epoch, its own included."""


def judge(downloaded: Sketch, others: Sequence[Sketch]) -> Judgement:
    """The verdict of other donors' sketches (all at the downloaded state's epoch) on the downloaded state's."""
    num_sketches = 1 + len(others)
    num_agreeing = 1 + sum(sketches_agree(downloaded, other) for other in others)
    if not others:
        verdict = Corroboration.UNCORROBORATED
    elif 2 * num_agreeing > num_sketches:
        verdict = Corroboration.CORROBORATED
    elif any(2 * sum(sketches_agree(other, peer) for peer in others) > num_sketches for other in others):
        verdict = Corroboration.REFUTED
    else:
        verdict = Corroboration.DISPUTED
    return Judgement(verdict, num_agreeing, num_sketches)


MAX_EPOCH_LEAD = 2
"""How many epochs a downloaded state may be ahead of what most other donors answered from: honest peers of one
swarm are within one or two (a DiLoCo donor's next round in flight with overlap; a gradient-mode peer's step to the
joiner's epoch still to come), so a state further ahead names an epoch nobody else reached. Slack beyond 2 would only
let a liar's state escape comparison at that many epochs ahead."""


def judge_epoch(epoch: int, answered: Sequence[int]) -> Corroboration | None:
    """What other donors' answer epochs say of a downloaded state of `epoch`: REFUTED when a majority of all the
    epochs, the state's own included, are more than MAX_EPOCH_LEAD behind it (two or more answers against it),
    DISPUTED when a majority of the answers are; None (its epoch is plausible, or nobody answered) otherwise."""
    behind = sum(answer < epoch - MAX_EPOCH_LEAD for answer in answered)
    if 2 * behind > len(answered) + 1:
        return Corroboration.REFUTED
    if 2 * behind > len(answered):
        return Corroboration.DISPUTED
    return None


class DigestLimiter:
    """How often a donor computes digests: at most DIGESTS_PER_PEER_PER_MINUTE for one asker, DIGESTS_PER_MINUTE
    for all of them, in any 60 s."""

    WINDOW_S = 60.0

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._served: deque[tuple[float, str]] = deque()  # (time, asker) of the last WINDOW_S

    def admit(self, peer: str) -> bool:
        """Whether `peer` may have a digest now; counts it if so."""
        now = self.clock()
        while self._served and self._served[0][0] <= now - self.WINDOW_S:
            self._served.popleft()
        mine = sum(asker == peer for _, asker in self._served)
        if len(self._served) >= DIGESTS_PER_MINUTE or mine >= DIGESTS_PER_PEER_PER_MINUTE:
            return False
        self._served.append((now, peer))
        return True
