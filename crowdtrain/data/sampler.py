"""Random training windows from the token stream, different on every peer, reproducible per step.

The stream's last 1% (at least one window) is held out: training never samples it, and every
peer evaluates on the same fixed windows from it, so their losses compare.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from crowdtrain.errors import BadInputError

HELD_OUT_FRACTION = 0.01
"""Share of the stream, at its end, reserved for evaluation."""


def peer_seed_from_peer_id(peer_id: str) -> int:
    """A stable 63-bit seed from a peer ID, the same on every machine and Python run."""
    return _hash_to_seed(peer_id)


class WindowSampler:
    """Draws [batch, sequence_length] windows of consecutive tokens from the training part of a stream."""

    def __init__(self, tokens: np.ndarray, sequence_length: int, peer_seed: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if sequence_length < 1:
            raise ValueError(f"sequence_length must be positive, got {sequence_length}")
        self.tokens = tokens
        self.sequence_length = sequence_length
        self.peer_seed = peer_seed
        num_held_out = max(math.ceil(len(tokens) * HELD_OUT_FRACTION), sequence_length)
        self.train_end = len(tokens) - num_held_out
        """Training windows lie in tokens[:train_end]; the rest is held out."""
        if self.train_end < sequence_length:
            raise BadInputError(
                f"The training data has {len(tokens)} tokens, too few for windows of {sequence_length} "
                f"tokens plus a held-out window; it needs at least {2 * sequence_length}."
            )

    @property
    def num_held_out_tokens(self) -> int:
        """Tokens at the end of the stream that training never sees."""
        return len(self.tokens) - self.train_end

    def batch(self, epoch: int, batch_size: int, step: int) -> torch.Tensor:
        """Random training windows, int64 [batch_size, sequence_length]; fixed by (peer_seed, epoch, step)."""
        generator = torch.Generator().manual_seed(_hash_to_seed(f"{self.peer_seed}:{epoch}:{step}"))
        num_starts = self.train_end - self.sequence_length + 1
        starts = torch.randint(0, num_starts, (batch_size,), generator=generator).numpy()
        return self._windows(starts)

    def eval_batches(self, batch_size: int, num_batches: int) -> list[torch.Tensor]:
        """Fixed held-out windows, the same on every peer, spread evenly over the held-out tail."""
        last_start = len(self.tokens) - self.sequence_length
        starts = np.linspace(self.train_end, last_start, num=batch_size * num_batches).round().astype(np.int64)
        return [self._windows(chunk) for chunk in starts.reshape(num_batches, batch_size)]

    def _windows(self, starts: np.ndarray) -> torch.Tensor:
        """The windows beginning at `starts`, as int64 [len(starts), sequence_length]."""
        positions = starts[:, None] + np.arange(self.sequence_length)
        return torch.from_numpy(np.asarray(self.tokens[positions], dtype=np.int64))


def _hash_to_seed(text: str) -> int:
    """A 63-bit integer from blake2b, so seeds are stable across machines (unlike `hash()`)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
