"""The experts a DMoE run's hosts serve: their architecture, initial weights and hivemind backends."""

from __future__ import annotations

import hashlib

import torch
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.utils.tensor_descr import BatchTensorDescriptor
from torch import nn

from crowdtrain.manifest import RunManifest

MAX_BATCH_SEQUENCES = 64
"""Sequences hivemind's task pool batches into one expert call at most."""


class FeedForwardExpert(nn.Module):
    """One expert: Linear, GELU, Linear on every token of [batch, sequence, hidden]."""

    def __init__(self, hidden_size: int, expert_hidden_size: int):
        super().__init__()
        self.up = nn.Linear(hidden_size, expert_hidden_size)
        self.down = nn.Linear(expert_hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(hidden)))


def build_expert(manifest: RunManifest, uid: str) -> nn.Module:
    """A freshly initialised expert; the same run and uid give the same weights on every host."""
    assert manifest.moe is not None
    digest = hashlib.blake2b(f"{manifest.run_id}:{manifest.created_at}:{uid}".encode(), digest_size=8).digest()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest, "big") % (2**31))
        return FeedForwardExpert(int(manifest.model.config["hidden_size"]), manifest.moe.expert_hidden_size)


def make_backend(manifest: RunManifest, uid: str, expert: nn.Module, optimizer: torch.optim.Optimizer) -> ModuleBackend:
    """A hivemind ModuleBackend for one expert: it takes and returns [batch, sequence_length, hidden_size] float32.

    The output schema is given, not found by a trial forward: hivemind's trial runs on CPU zeros and fails
    for an expert already on a GPU (seen on an H100: the host exited at start).
    """
    sample = torch.empty(1, manifest.data.sequence_length, int(manifest.model.config["hidden_size"]))
    schema = BatchTensorDescriptor.from_tensor(sample)
    return ModuleBackend(
        name=uid,
        module=expert,
        optimizer=optimizer,
        args_schema=(schema,),
        outputs_schema=schema,
        min_batch_size=1,
        max_batch_size=MAX_BATCH_SEQUENCES,
    )
