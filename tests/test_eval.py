"""`crowdtrain eval`: a checkpoint's held-out loss through the whole model or a subset of its stages (issue 17)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lab.fixtures import tiny_run_file
from lab.swarm import crowdtrain

from crowdtrain.cli.evaluate import Evaluation, evaluate
from crowdtrain.data import WindowSampler, load_token_stream
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import load_run_file
from crowdtrain.models import build_model, load_tokenizer, training_loss
from crowdtrain.training.checkpoint import save_checkpoint
from tests.test_cli_errors import assert_plain_failure

RUN_FILE = tiny_run_file("evalrun", 64).replace("num_hidden_layers = 2", "num_hidden_layers = 4")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, float]:
    """A state dir holding two checkpoints of the 4-layer tiny model, untrained (epoch 0) and 20 steps on, and the
    trained model's held-out loss computed here, whole and with its last two layers deleted."""
    root = tmp_path_factory.mktemp("eval")
    (root / "run.toml").write_text(RUN_FILE)
    manifest = load_run_file(str(root / "run.toml"))
    tokenizer = load_tokenizer(manifest.model)
    model = build_model(manifest.model, tokenizer.vocab_size, seed=0)
    directory = root / "state" / "checkpoints" / "evalrun"
    save_checkpoint(directory, 0, model, {}, keep=5)
    tokens = load_token_stream(manifest.data, tokenizer, root / "state" / "data-cache")
    sampler = WindowSampler(tokens, manifest.data.sequence_length, peer_seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for step in range(20):
        training_loss(model, sampler.batch(0, 8, step), "causal").backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(directory, 20, model, {}, keep=5)
    model.eval()
    windows = sampler.eval_batches(8, 8)  # the held-out windows any sampler of the stream gives, whatever its seed
    whole = held_out_loss(model, windows)
    # Without stage 2 of 3 (layers 2 and 3 of 4): the same model with those layers deleted.
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:2])
    model.config.num_hidden_layers = 2
    return root, whole, held_out_loss(model, windows)


def held_out_loss(model: torch.nn.Module, windows: list[torch.Tensor]) -> float:
    with torch.no_grad():
        losses = [float(training_loss(model, window, "causal")) for window in windows]
    return sum(losses) / len(losses)


def scores(root: Path, **options: Any) -> Evaluation:
    settings: dict[str, Any] = dict(num_stages=1, drop=(), sweep=False, batches=8, batch_size=8, checkpoint=None)
    settings.update({"state_dir": str(root / "state"), **options})
    return evaluate(str(root / "run.toml"), run_id=None, **settings)


def test_eval_scores_the_newest_checkpoint_and_paths_that_leave_stages_out(
    trained: tuple[Path, float, float], tmp_path: Path
) -> None:
    root, whole_loss, shallow_loss = trained
    newest = scores(root, data_cache_dir=str(tmp_path / "cache"))
    assert newest.epoch == 20 and newest.windows == 64 and newest.tokens_per_window == 32
    (whole,) = newest.scores
    assert whole.loss == pytest.approx(whole_loss, abs=1e-6), "the newest checkpoint, on the held-out windows"
    assert any((tmp_path / "cache").iterdir()), "the data tokenised into the data cache it was given"
    untrained = scores(root, checkpoint=str(root / "state/checkpoints/evalrun/epoch-00000000.pt"))
    assert untrained.epoch == 0 and untrained.scores[0].loss > whole.loss + 0.5
    full, without = scores(root, num_stages=3, drop=(2,)).scores
    assert full.path == (0, 1, 2) and without.path == (0, 1) and without.dropped == (2,)
    assert full.loss == pytest.approx(whole.loss, abs=1e-4), "the whole path of stages is the model's forward"
    assert without.loss == pytest.approx(shallow_loss, abs=1e-4), "stage 2 left out: its layers not run"
    assert abs(without.loss - full.loss) > 1e-3
    sweep = scores(root, num_stages=3, sweep=True)
    assert [score.path for score in sweep.scores] == [(0, 1, 2), (0, 1), (0, 2), (0,)]


def test_the_eval_command_prints_json_and_refuses_bad_input_with_one_sentence(
    trained: tuple[Path, float, float], tmp_path: Path
) -> None:
    root, _, _ = trained
    base = ["eval", "--run-file", str(root / "run.toml")]
    result = crowdtrain(*base, "--state-dir", str(root / "state"), "--stages", "2", "--sweep", "--json")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["epoch"] == 20 and [score["path"] for score in printed["scores"]] == [[0, 1], [0]]
    corrupt = tmp_path / "epoch-00000001.pt"
    corrupt.write_bytes((root / "state/checkpoints/evalrun/epoch-00000020.pt").read_bytes()[:1000])
    assert_plain_failure(crowdtrain(*base, "--checkpoint", str(corrupt)), 2, "Cannot evaluate")
    # the other refusals, in this process (each is the same BadInputError the command prints as above)
    for options, sentence in [
        (dict(state_dir=str(tmp_path)), "No checkpoint of run 'evalrun'"),
        (dict(num_stages=3, drop=(0,)), "--drop 0"),
        (dict(num_stages=9), "9 stages"),
        (dict(drop=(1,)), "--stages of 2 or more"),
        (dict(batches=4097), "--batches"),
        (dict(num_stages=10, sweep=True), "at most --stages 9"),
    ]:
        with pytest.raises(BadInputError, match=sentence):
            scores(root, **options)
    with pytest.raises(BadInputError, match="The join token is not one `crowdtrain invite` made"):
        # a SkipPipe swarm is read with the reader's join token (an invite-only run's DHT admits no other), checked
        # before any swarm is dialled
        evaluate("skippipe-demo", run_id=None, checkpoint=None, state_dir=str(tmp_path), num_stages=1, drop=(),
                 sweep=False, batches=1, batch_size=1, initial_peers=("/ip4/127.0.0.1/tcp/9",),
                 join_token="x")  # fmt: skip
    with pytest.raises(BadInputError, match="DMoE run"):
        evaluate("demo-moe", run_id=None, checkpoint=None, state_dir=str(tmp_path), num_stages=1, drop=(),
                 sweep=False, batches=1, batch_size=1)  # fmt: skip
