"""`crowdtrain eval`: held-out loss and perplexity of a checkpoint, through the whole model or a subset of its stages.

A researcher's look at what a run trained, and SkipPipe's question (issue 17): how much worse is the model when some
of its pipeline stages are missing? The model is built from the run file the run was founded with (a preset or a
TOML file: a checkpoint holds weights, not the manifest), its weights come from a checkpoint (`--checkpoint`, or the
newest one the node at `--state-dir` wrote for the run, verified against its checksum and the model's shapes), and
it is scored on the run's held-out windows: the last 1% of the token stream, which training never samples, the same
windows on every machine (data/sampler.py).

With `--stages S` the decoder's layers are cut into S stages as SkipPipe cuts them (modes/skippipe/stages.py: stage 0
holds the embeddings, the first layers and the head), and `--drop` leaves stages out of the forward; `--sweep` scores
every subset of the stages 1..S-1, grouped by how many are left out. Without stages the model's own training loss
is scored (masked LMs with a fixed masking draw). A DMoE run's experts live on their hosts, not in a checkpoint:
such runs are refused.

A SkipPipe run's nodes each train one stage, so no node's checkpoint holds the trained model. With
`--initial-peers`, eval reads the run's roster from the swarm and takes each stage's weights from a node serving
it (`rpc_stage_state`, checked: the stage's exact size, finite), cut into the run's stages; a stage no node serves
keeps its initial weights and is named in the output.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from crowdtrain.cli.reader import join_as_reader
from crowdtrain.data import WindowSampler, load_token_stream
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import RunManifest, load_run_file
from crowdtrain.models import build_model, load_tokenizer, model_kind
from crowdtrain.modes.registry import mode_class
from crowdtrain.modes.skippipe.evaluation import load_swarm_stages
from crowdtrain.modes.skippipe.settings import skippipe_spec
from crowdtrain.modes.skippipe.stages import StagedModel, check_path
from crowdtrain.node.config import MachineSettings, SwarmSettings
from crowdtrain.node.membership import with_join_token
from crowdtrain.training.checkpoint import Checkpoint, CheckpointError, load_checkpoint, load_latest_checkpoint
from crowdtrain.training.held_out import window_losses

MAX_WINDOWS = 4096
"""Held-out windows scored at most (`--batches` × `--batch-size`)."""
MAX_SWEEP_STAGES = 9
"""`--sweep` scores 2^(S-1) paths: 256 at most."""


@dataclass(frozen=True, slots=True)
class PathScore:
    """The held-out loss along one path of stages."""

    path: tuple[int, ...]
    """Stages run, in order; the whole model when there are no stages."""
    dropped: tuple[int, ...]
    loss: float
    perplexity: float


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What `crowdtrain eval` found: the checkpoint scored and its score along each path."""

    run_id: str
    checkpoint: str
    epoch: int
    num_stages: int
    windows: int
    tokens_per_window: int
    scores: tuple[PathScore, ...]
    untrained_stages: tuple[int, ...] = ()
    """SkipPipe from the swarm: stages no node served, left at their initial weights."""


def evaluate(
    run_file: str,
    *,
    run_id: str | None,
    checkpoint: str | None,
    state_dir: str,
    num_stages: int,
    drop: Sequence[int],
    sweep: bool,
    batches: int,
    batch_size: int,
    initial_peers: Sequence[str] = (),
    join_token: str = "",
    data_cache_dir: str = "",
) -> Evaluation:
    """Score the checkpoint's model (or, with `initial_peers`, a SkipPipe swarm's stages) on the run's held-out
    windows; raises BadInputError with a sentence."""
    if batches < 1 or batch_size < 1 or batches * batch_size > MAX_WINDOWS:
        raise BadInputError(f"--batches × --batch-size must be between 1 and {MAX_WINDOWS} windows.")
    manifest = load_run_file(run_file, run_id=run_id)
    if initial_peers:
        num_stages = _swarm_stages_count(manifest, num_stages)
    if num_stages < 1:
        raise BadInputError(f"--stages must be at least 1, got {num_stages}.")
    if (drop or sweep) and num_stages < 2:
        raise BadInputError("--drop and --sweep need --stages of 2 or more (stage 0 can't be left out).")
    if sweep and num_stages > MAX_SWEEP_STAGES:
        raise BadInputError(f"--sweep scores every subset of the stages: at most --stages {MAX_SWEEP_STAGES}.")
    if manifest.moe is not None:
        raise BadInputError(
            f"Run '{manifest.run_id}' is a DMoE run: its experts live on their hosts, not in a checkpoint; "
            "eval scores dense models."
        )
    tokenizer = load_tokenizer(manifest.model)
    model = build_model(manifest.model, tokenizer.vocab_size)
    untrained: tuple[int, ...] = ()
    if initial_peers:
        settings = SwarmSettings(initial_peers=tuple(initial_peers), join_token=join_token)
        source, epoch, untrained = swarm_stages(settings, manifest, StagedModel(model, num_stages))
    else:
        loaded = _checkpoint(checkpoint, state_dir, manifest, model)
        model.load_state_dict(loaded.model_state)
        source, epoch = str(loaded.path), loaded.epoch
    model.eval()
    cache = MachineSettings(state_dir=state_dir, data_cache_dir=data_cache_dir).data_cache_path  # as the daemon's
    tokens = load_token_stream(manifest.data, tokenizer, cache)
    sampler = WindowSampler(tokens, manifest.data.sequence_length, peer_seed=0)
    windows = sampler.eval_batches(batch_size, batches)
    with torch.no_grad():
        if num_stages == 1:
            scores = [_score((0,), _model_losses(model, manifest, windows), num_stages)]
        else:
            scores = _staged_scores(model, num_stages, drop, sweep, windows)
    return Evaluation(
        run_id=manifest.run_id,
        checkpoint=source,
        epoch=epoch,
        num_stages=num_stages,
        windows=sum(len(window) for window in windows),
        tokens_per_window=manifest.data.sequence_length,
        scores=tuple(scores),
        untrained_stages=untrained,
    )


def _swarm_stages_count(manifest: RunManifest, num_stages: int) -> int:
    """The stages to score a SkipPipe swarm in: the run's (`--stages` may only repeat them)."""
    if mode_class(manifest).holds_whole_model:
        raise BadInputError(
            f"--initial-peers reads a SkipPipe run's stages from the swarm; run '{manifest.run_id}' is a "
            f"{manifest.training.mode} run: pass a checkpoint instead."
        )
    stages = skippipe_spec(manifest).stages
    if num_stages not in (1, stages):
        raise BadInputError(f"--stages must be the run's {stages} (or left out).")
    return stages


def swarm_stages(
    settings: SwarmSettings, manifest: RunManifest, staged: StagedModel
) -> tuple[str, int, tuple[int, ...]]:
    """Load each stage of `staged` from a node of the SkipPipe swarm serving it; (where from, the oldest iteration
    taken, the stages no node served)."""
    settings = with_join_token(dataclasses.replace(settings, run_id=manifest.run_id))
    dht, reader_key = join_as_reader(settings, run_ids=[manifest.run_id])
    try:
        iteration, untrained = load_swarm_stages(dht, reader_key, manifest, staged)
    finally:
        dht.shutdown()
    return f"the swarm at {settings.initial_peers[0]}", iteration, untrained


def _checkpoint(checkpoint: str | None, state_dir: str, manifest: RunManifest, model: torch.nn.Module) -> Checkpoint:
    """`--checkpoint`, or the newest usable one the node at `state_dir` wrote for the run (as the daemon resumes)."""
    if checkpoint is not None:
        path = Path(checkpoint).expanduser()
        if not path.is_file():
            raise BadInputError(f"--checkpoint {checkpoint} is not a file.")
        try:
            return load_checkpoint(path, model)
        except CheckpointError as e:
            raise BadInputError(f"Cannot evaluate {path}: {e}.") from None
    directory = Path(state_dir).expanduser() / "checkpoints" / manifest.run_id
    loaded = load_latest_checkpoint(directory, model) if directory.is_dir() else None
    if loaded is None:
        raise BadInputError(
            f"No checkpoint of run '{manifest.run_id}' in {directory}; pass --checkpoint, or the --state-dir "
            "and --run-id of the node that trained it."
        )
    return loaded


def _model_losses(model: torch.nn.Module, manifest: RunManifest, windows: list[torch.Tensor]) -> list[float]:
    return window_losses(model, model_kind(manifest.model), windows)


def _staged_scores(
    model: torch.nn.Module, num_stages: int, drop: Sequence[int], sweep: bool, windows: list[torch.Tensor]
) -> list[PathScore]:
    try:
        staged = StagedModel(model, num_stages)
    except ValueError as e:
        raise BadInputError(f"Cannot cut the model into {num_stages} stages: {e}.") from None
    middle = range(1, num_stages)
    check_drop(drop, num_stages)
    if sweep:  # the whole path first, then every subset, by how many stages are left out
        kept_sets = [kept for count in range(num_stages - 1, -1, -1) for kept in itertools.combinations(middle, count)]
    else:  # the whole path, for comparison, then the one without `drop`
        kept_sets = [tuple(middle)] + ([tuple(stage for stage in middle if stage not in drop)] if drop else [])
    scores = []
    for kept in kept_sets:
        path = check_path((0, *kept), num_stages)  # valid by construction; checked all the same
        scores.append(_score(path, [float(staged.loss(window, path)) for window in windows], num_stages))
    return scores


def _score(path: tuple[int, ...], losses: list[float], num_stages: int) -> PathScore:
    loss = statistics.fmean(losses)
    dropped = tuple(stage for stage in range(num_stages) if stage not in path)
    return PathScore(path=path, dropped=dropped, loss=loss, perplexity=math.exp(min(loss, 700.0)))


def check_drop(drop: Sequence[int], num_stages: int) -> None:
    """`--drop` names stages 1..S-1 only."""
    bad = [stage for stage in drop if not 1 <= stage < num_stages]
    if bad:
        raise BadInputError(f"--drop {bad[0]}: only stages 1 to {num_stages - 1} can be left out (stage 0 holds the "
                            "embeddings and the head).")  # fmt: skip


def print_evaluation(evaluation: Evaluation, as_json: bool) -> None:
    """One JSON object, or a line per path with its change in perplexity from the whole model's."""
    if as_json:
        print(json.dumps(asdict(evaluation)))
        return
    print(f"run '{evaluation.run_id}', epoch {evaluation.epoch} ({evaluation.checkpoint})")
    print(f"held-out: {evaluation.windows} windows of {evaluation.tokens_per_window} tokens")
    whole = evaluation.scores[0]
    for score in evaluation.scores:
        what = "whole model" if evaluation.num_stages == 1 else f"stages {' '.join(map(str, score.path))}"
        if score.dropped:
            what += f" (without {' '.join(map(str, score.dropped))})"
        change = "" if score is whole else f"  {math.exp(score.loss - whole.loss) - 1:+.1%} perplexity"
        print(f"  {what:<36} loss {score.loss:.4f}  perplexity {score.perplexity:.3f}{change}")
    if evaluation.untrained_stages:
        print(f"  no node serves stage(s) {' '.join(map(str, evaluation.untrained_stages))}: initial weights there")
