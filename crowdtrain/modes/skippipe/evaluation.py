"""A SkipPipe swarm's trained model, read from its nodes: each stage's parameters from a node serving it.

No node of a SkipPipe run holds the whole model, so `crowdtrain eval --initial-peers` takes each stage's weights
from a node the run's newest roster lists on it (`rpc_stage_state`, checked: the stage's exact size, finite).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from crowdtrain.dht.records import owner_marker
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import RunManifest
from crowdtrain.modes.skippipe.hops import HopFailedError, HopLimits, StageService
from crowdtrain.modes.skippipe.replicas.stage_state import STATE_PARTS, state_timeout_s
from crowdtrain.modes.skippipe.roster.membership import StageDirectory
from crowdtrain.modes.skippipe.stages import StagedModel


def load_swarm_stages(
    dht: Any, reader_key: Any, manifest: RunManifest, staged: StagedModel
) -> tuple[int, tuple[int, ...]]:
    """Load each stage of `staged` from a node of the swarm `dht` reads (as a reader with `reader_key`) serving it;
    (the oldest iteration taken, the stages no node served). Raises BadInputError when the swarm holds no roster."""
    limits = HopLimits(max_batch=1, max_sequence=1, hidden_size=1)  # this reader serves no hop
    service = StageService(dht, staged, 0, limits)
    try:
        directory = StageDirectory(
            dht=dht, run_id=manifest.run_id, owner=owner_marker(reader_key), num_stages=staged.num_stages
        )
        roster = directory.roster()
        if not roster:
            raise BadInputError(f"The swarm holds no SkipPipe roster of run '{manifest.run_id}'.")
        service.start(serve=False)
        iterations, untrained = [], []
        for stage in range(staged.num_stages):
            peers = sorted(node.peer_id for node in roster[-1].members if node.stage == stage)
            iteration = _load_stage(service, staged, stage, peers)
            if iteration is None:
                untrained.append(stage)
            else:
                iterations.append(iteration)
    finally:
        service.close()
    return min(iterations, default=0), tuple(untrained)


def _load_stage(service: StageService, staged: StagedModel, stage: int, peers: Sequence[str]) -> int | None:
    """Copy `stage`'s parameters from the first of `peers` that sends its state; the iteration it is from, or
    None if none did."""
    parameters = staged.stage_parameters(stage)
    numel = sum(parameter.numel() for parameter in parameters)
    for peer in peers:
        try:
            header, values = service.fetch_state(
                peer, STATE_PARTS * numel, state_timeout_s(STATE_PARTS * numel), stage=stage
            )
        except HopFailedError as e:
            print(f"stage {stage}: {e}; asking another node", file=sys.stderr)
            continue
        with torch.no_grad():
            offset = 0
            for parameter in parameters:
                parameter.copy_(values[offset : offset + parameter.numel()].view_as(parameter))
                offset += parameter.numel()
        return int(header.iteration)
    return None
