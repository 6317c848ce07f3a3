"""Streaming DiLoCo's fragments: the synchronised tensors cut into F parts, one averaged per outer round, in turn.

Streaming DiLoCo (Douillard et al. 2025) synchronises the model in fragments at staggered times: with F fragments
and rounds of H/F global batches, round r averages fragment r mod F, whose pseudo-gradient spans its last F rounds
(H global batches), so every fragment is still averaged every H global batches while a round sends, and with
overlap keeps in flight, only 1/F of the model.

`Fragments` cuts the tensors, in parameter order (a fragment is a run of consecutive layers), at the tensor
boundaries nearest k/F of the total count of values, so the fragments differ by about one tensor's size; every node
cuts alike from the same shapes. With F > 1 the averager carries one flat buffer as long as the largest
fragment: a round writes its fragment's tensors into it one after another (the rest zero) and reads the average
back the same way. With F = 1 the buffers are the tensors' own shapes, as without fragments.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Fragments:
    """Which tensors each fragment holds, and how a fragment travels in the averager's buffers."""

    members: tuple[tuple[int, ...], ...]
    """The indices of each fragment's tensors, in order; every tensor in exactly one fragment."""
    shapes: tuple[torch.Size, ...]
    """Every synchronised tensor's shape, by index."""

    @classmethod
    def split(cls, shapes: Sequence[torch.Size], count: int) -> Fragments:
        """`count` fragments of consecutive tensors of about equal size; ValueError when there are fewer tensors."""
        if count < 1:
            raise ValueError(f"fragments must be at least 1, got {count}")
        if count > len(shapes):
            raise ValueError(f"{count} fragments need {count} tensors to synchronise or more, not {len(shapes)}")
        cumulative = list(itertools.accumulate(shape.numel() for shape in shapes))
        cuts, last = [], -1  # the index of each fragment's last tensor, but the last fragment's
        for boundary in range(1, count):
            target = cumulative[-1] * boundary / count
            room = range(last + 1, len(shapes) - (count - boundary))  # leave a tensor for every later fragment
            last = min(room, key=lambda index: (abs(cumulative[index] - target), index))
            cuts.append(last)
        bounds = [-1, *cuts, len(shapes) - 1]
        members = [tuple(range(start + 1, end + 1)) for start, end in itertools.pairwise(bounds)]
        return cls(members=tuple(members), shapes=tuple(torch.Size(shape) for shape in shapes))

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def flat(self) -> bool:
        """Whether the averager carries one flat buffer (F > 1) instead of the tensors' shapes."""
        return self.count > 1

    def of_round(self, round_: int) -> int:
        """The fragment outer round `round_` averages."""
        return round_ % self.count

    def numel(self, fragment: int) -> int:
        return sum(self.shapes[index].numel() for index in self.members[fragment])

    def buffer_shapes(self) -> list[torch.Size]:
        """The averager's tensors: the tensors' shapes, or one flat buffer as long as the largest fragment."""
        if not self.flat:
            return list(self.shapes)
        return [torch.Size([max(self.numel(fragment) for fragment in range(self.count))])]

    def write(self, buffers: Sequence[torch.Tensor], fragment: int, values: Iterable[torch.Tensor]) -> None:
        """Copy the fragment's tensors (`values`, one per member, in order) into the averager's buffers."""
        if not self.flat:
            for buffer, value in zip(buffers, values, strict=True):
                buffer.copy_(value)
            return
        (flat,) = buffers
        offset = 0
        for index, value in zip(self.members[fragment], values, strict=True):
            size = self.shapes[index].numel()
            flat[offset : offset + size].copy_(value.reshape(-1))
            offset += size
        flat[offset:].zero_()

    def read(self, buffers: Sequence[torch.Tensor], fragment: int) -> list[torch.Tensor]:
        """The fragment's tensors as the buffers hold them (views into them), one per member, in order."""
        if not self.flat:
            return list(buffers)
        (flat,) = buffers
        views, offset = [], 0
        for index in self.members[fragment]:
            size = self.shapes[index].numel()
            views.append(flat[offset : offset + size].view(self.shapes[index]))
            offset += size
        return views
