"""The one optimizer factory: a run's optimizer name, clipping and schedule mean the same in every mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from crowdtrain.manifest import OptimizerSpec, demo
from crowdtrain.optimizer import build_optimizer, learning_rate_factor, set_scheduled_learning_rate

SPEC = OptimizerSpec(name="sgd", learning_rate=0.5, weight_decay=0.0, warmup_steps=4, total_steps=20)


def _one_step(spec: OptimizerSpec, gradient: torch.Tensor, step: int = 0) -> torch.Tensor:
    """The change one step of the factory's optimizer makes to a zero parameter whose gradient is `gradient`."""
    parameter = torch.nn.Parameter(torch.zeros_like(gradient))
    optimizer = build_optimizer([parameter], spec)
    set_scheduled_learning_rate(optimizer, spec, step)
    parameter.grad = gradient.clone()
    optimizer.step()
    return parameter.detach().clone()


@pytest.mark.parametrize("name, kind", [("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW)])
def test_the_name_picks_the_optimizer_and_weight_decay_goes_with_it(name: str, kind: type) -> None:
    spec = dataclasses.replace(SPEC, name=name, weight_decay=0.05)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(3))], spec)
    assert type(optimizer) is kind
    assert optimizer.param_groups[0]["weight_decay"] == 0.05


def test_every_step_clips_the_gradient_to_max_grad_norm() -> None:
    gradient = torch.tensor([30.0, 40.0])  # norm 50
    lr = SPEC.learning_rate * learning_rate_factor(7, SPEC)
    clipped = _one_step(dataclasses.replace(SPEC, max_grad_norm=2.0), gradient, step=7)
    assert torch.allclose(clipped, -lr * gradient / 25), "SGD's first step: lr times the gradient scaled to norm 2"
    unclipped = _one_step(dataclasses.replace(SPEC, max_grad_norm=0.0), gradient, step=7)
    assert torch.allclose(unclipped, -lr * gradient), "max_grad_norm = 0: no clipping"
    small = _one_step(dataclasses.replace(SPEC, max_grad_norm=100.0), gradient, step=7)
    assert torch.allclose(small, -lr * gradient), "a gradient under the norm is left as it is"


def test_the_schedule_sets_the_learning_rate_of_every_group() -> None:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(2))]}]
    optimizer = build_optimizer(groups, SPEC)
    for step, expected in [(0, 0.5 / 5), (3, 0.5 * 4 / 5), (4, 0.5), (20, 0.0)]:
        set_scheduled_learning_rate(optimizer, SPEC, step)
        assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([expected, expected])


def test_skippipe_refuses_sgd_in_one_sentence() -> None:
    from crowdtrain.manifest import skippipe_demo

    run = skippipe_demo()
    with pytest.raises(ValueError, match="(?i)skippipe") as refused:
        dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer, name="sgd"))
    assert "\n" not in str(refused.value)


def test_the_demo_run_clips_by_default() -> None:
    assert demo().optimizer.max_grad_norm > 0


@pytest.mark.parametrize("mode", ["diloco", "spes"])
def test_a_diloco_or_spes_inner_step_takes_the_runs_optimizer_clipping_and_schedule(mode: str) -> None:
    from lab.diloco import computing_peers

    from crowdtrain.manifest import TrainingSpec, spes_demo
    from crowdtrain.modes.diloco.mode import DiLoCoMode
    from crowdtrain.modes.spes.mode import SPESMode

    base = spes_demo() if mode == "spes" else dataclasses.replace(demo(), training=TrainingSpec(mode="diloco"))
    spec = dataclasses.replace(SPEC, max_grad_norm=1e-3, learning_rate=0.1)
    run = dataclasses.replace(base, optimizer=spec, target_batch_size=10_000)
    mode_class = SPESMode if mode == "spes" else DiLoCoMode
    with computing_peers(run, 1, mode_class) as (peer,):
        assert type(peer.inner_optimizer) is torch.optim.SGD
        stepped = [p for group in peer.inner_optimizer.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in stepped]
        batch = torch.randint(0, 256, (4, run.data.sequence_length))
        assert peer.train_micro_batch(batch) is not None
        change = torch.cat([(p.detach() - b).flatten() for p, b in zip(stepped, before, strict=True)])
    # SGD's first step moves the parameters by lr times the gradient clipped to norm 1e-3 (no weight decay).
    expected = spec.learning_rate * learning_rate_factor(0, spec) * spec.max_grad_norm
    assert float(change.norm()) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("use_local_updates", [False, True], ids=["gradients", "parameters"])
def test_a_gradients_or_parameters_run_steps_the_runs_optimizer_clipping_and_schedule(use_local_updates: bool) -> None:

    from lab.diloco import collaborative_optimizer, loopback_dht

    from crowdtrain.averaging.groups import join_request_timeout_s

    spec = dataclasses.replace(SPEC, max_grad_norm=1e-3)
    run = dataclasses.replace(demo(), optimizer=spec, target_batch_size=4)
    parameter = torch.nn.Parameter(torch.zeros(2))
    dht = loopback_dht([])
    optimizer = collaborative_optimizer(dht, run, [parameter], 4, use_local_updates=use_local_updates)
    try:
        averagers = [optimizer.state_averager] + ([optimizer.grad_averager] if optimizer.grad_averager else [])
        for averager in averagers:  # below the matchmaking time: hivemind's matchmaking deadlocks otherwise
            kwargs = averager.matchmaking_kwargs
            assert kwargs["request_timeout"] == join_request_timeout_s(run.averaging) < kwargs["min_matchmaking_time"]
        inner = optimizer.state_averager.optimizer
        assert type(inner) is torch.optim.SGD
        assert inner.param_groups[0]["lr"] == pytest.approx(spec.learning_rate * learning_rate_factor(0, spec))
        parameter.grad = torch.tensor([30.0, 40.0])
        optimizer.step()  # a lone peer with the whole global batch: one global step
        assert optimizer.local_epoch == 1
        expected = spec.learning_rate * learning_rate_factor(0, spec) * spec.max_grad_norm * torch.tensor([0.6, 0.8])
        assert torch.allclose(parameter.detach(), -expected, rtol=1e-3), "SGD's step on the gradient clipped to 1e-3"
        parameter.grad = torch.tensor([30.0, 40.0])
        optimizer.step()
        assert optimizer.local_epoch == 2
        # hivemind's local-updates mode steps its scheduler before it counts the epoch: one epoch behind
        scheduled = 1 if use_local_updates else 2
        assert inner.param_groups[0]["lr"] == pytest.approx(spec.learning_rate * learning_rate_factor(scheduled, spec))
    finally:
        optimizer.shutdown()
        dht.shutdown()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("poison", [float("inf"), float("nan"), 3e38])
def test_a_step_on_a_gradient_that_is_not_finite_is_skipped(
    name: str, poison: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Clipping an infinite norm made the gradient NaN and the step wrote NaN into the weights for good: now the
    step is skipped (3e38 twice: finite values whose norm overflows), in one line, and the next one is taken."""
    spec = dataclasses.replace(SPEC, name=name, max_grad_norm=1.0)
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = build_optimizer([parameter], spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # wraps `step`: still works
    parameter.grad = torch.tensor([poison, poison, 1.0])
    with caplog.at_level("WARNING", logger="crowdtrain.optimizer"):
        optimizer.step()
    assert torch.equal(parameter.detach(), torch.ones(3)) and not optimizer.state
    assert torch.equal(parameter.grad, torch.zeros(3)), "the skipped gradient is zeroed"
    assert len(caplog.records) == 1 and "skipped an optimizer step" in caplog.records[0].getMessage()
    parameter.grad = torch.tensor([1.0, 0.0, 0.0])
    optimizer.step()
    scheduler.step()
    assert bool(torch.isfinite(parameter).all()) and parameter[0] < 1.0, "the next finite step is taken"
