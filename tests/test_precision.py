"""Mixed precision: the setting resolved per device, and the fp16 micro-step that skips overflowing gradients."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import demo
from crowdtrain.models import MicroStep, Precision, autocast, resolve_precision
from crowdtrain.training.throughput import cache_key, measure_throughput


@pytest.mark.parametrize("setting, name", [("auto", "fp32"), ("fp32", "fp32"), ("bf16", "bf16")])
def test_cpu_resolves_auto_to_fp32_and_allows_bf16(setting: str, name: str) -> None:
    precision = resolve_precision(setting, "cpu", bf16_supported=True)
    assert precision.name == name
    assert precision.autocast_dtype == (torch.bfloat16 if name == "bf16" else None)
    assert not precision.uses_grad_scaler and not precision.allows_tf32


def test_cpu_refuses_fp16_in_one_sentence() -> None:
    with pytest.raises(BadInputError, match=r"^The run's precision is fp16, which needs a CUDA GPU; .*\.$"):
        resolve_precision("fp16", "cpu", bf16_supported=False)


def test_cuda_with_bf16_resolves_auto_to_bf16_with_tf32() -> None:
    precision = resolve_precision("auto", "cuda:0", bf16_supported=True)
    assert precision == Precision(name="bf16", autocast_dtype=torch.bfloat16, uses_grad_scaler=False, allows_tf32=True)


def test_cuda_without_bf16_resolves_auto_to_fp16_with_a_scaler() -> None:
    precision = resolve_precision("auto", "cuda:1", bf16_supported=False)
    assert precision == Precision(name="fp16", autocast_dtype=torch.float16, uses_grad_scaler=True, allows_tf32=False)


def test_explicit_settings_on_cuda() -> None:
    assert resolve_precision("fp32", "cuda:0", bf16_supported=True).allows_tf32 is False  # exact fp32
    fp16 = resolve_precision("fp16", "cuda:0", bf16_supported=True)
    assert fp16.uses_grad_scaler and fp16.allows_tf32
    with pytest.raises(BadInputError, match="does not support"):
        resolve_precision("bf16", "cuda:0", bf16_supported=False)


def test_unknown_device_type_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu or cuda"):
        resolve_precision("auto", "mps", bf16_supported=False)


def test_precision_fields_must_agree() -> None:
    with pytest.raises(ValueError, match="autocasts"):
        Precision(name="bf16", autocast_dtype=None, uses_grad_scaler=False, allows_tf32=False)
    with pytest.raises(ValueError, match="scaler"):
        Precision(name="bf16", autocast_dtype=torch.bfloat16, uses_grad_scaler=True, allows_tf32=False)


def test_cpu_bf16_autocast_runs_matmuls_in_bf16_and_keeps_weights_fp32() -> None:
    model = torch.nn.Linear(4, 2)
    with autocast(resolve_precision("bf16", "cpu", bf16_supported=False), "cpu"):
        output = model(torch.ones(3, 4))
    assert output.dtype == torch.bfloat16 and model.weight.dtype == torch.float32
    output.float().sum().backward()
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float32


class RecordingOptimizer:
    """hivemind.Optimizer's surface for a micro-step: param_groups, step and zero_grad; records its calls."""

    def __init__(self, model: torch.nn.Module):
        self.param_groups = [{"params": list(model.parameters())}]
        self.num_steps = 0
        self.grads_at_step: list[torch.Tensor] = []

    def step(self) -> None:
        self.num_steps += 1
        self.grads_at_step = [param.grad.clone() for param in self.param_groups[0]["params"]]

    def zero_grad(self) -> None:
        for param in self.param_groups[0]["params"]:
            param.grad = None


FP16 = Precision(name="fp16", autocast_dtype=torch.float16, uses_grad_scaler=True, allows_tf32=False)


def scaled_micro_step(clock: list[float]) -> MicroStep:
    """An fp16 MicroStep on CPU (fp16 is refused there for training, but the scaler logic is the same)."""
    return MicroStep(FP16, "cpu", clock=lambda: clock[0])


def test_fp16_step_hands_the_optimizer_unscaled_gradients() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    inputs = torch.randn(5, 3)
    model(inputs).sum().backward()
    expected = [param.grad.clone() for param in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    optimizer, micro_step = RecordingOptimizer(model), scaled_micro_step([0.0])
    micro_step.backward(model(inputs).sum())
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 1000 * expected[0].abs().sum()
    assert micro_step.step(optimizer) is True
    assert optimizer.num_steps == 1 and micro_step.num_skipped == 0
    for got, want in zip(optimizer.grads_at_step, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_fp16_overflow_skips_the_step_and_leaves_no_gradients(caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 1)
    model.weight.register_hook(lambda grad: grad * float("inf"))  # the loss is finite, a gradient overflows
    optimizer, clock = RecordingOptimizer(model), [100.0]
    micro_step = scaled_micro_step(clock)
    with caplog.at_level(logging.WARNING, logger="crowdtrain.models.precision"):
        for second in (100.0, 101.0, 170.0):
            clock[0] = second
            loss = model(torch.ones(2, 3)).sum()
            assert torch.isfinite(loss)
            micro_step.backward(loss)
            assert micro_step.step(optimizer) is False
            assert all(param.grad is None or not param.grad.any() for param in model.parameters())
    assert optimizer.num_steps == 0 and micro_step.num_skipped == 3
    assert micro_step.scaler is not None and micro_step.scaler.get_scale() == 65536.0 / 8  # backed off each time
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2, warnings  # at most one a minute: 100 s and 170 s, not 101 s
    assert warnings[1].startswith("skipped 2 micro-step(s)")


def test_fp32_step_is_plain_backward_and_step() -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = RecordingOptimizer(model)
    micro_step = MicroStep(resolve_precision("auto", "cpu", bf16_supported=False), "cpu")
    assert micro_step.scaler is None
    micro_step.backward(model(torch.ones(2, 3)).sum())
    assert micro_step.step(optimizer) is True and optimizer.num_steps == 1


def test_throughput_cache_key_depends_on_the_precision() -> None:
    fp32, bf16 = (resolve_precision(setting, "cpu", bf16_supported=False) for setting in ("fp32", "bf16"))
    assert cache_key(demo(), "cpu", 8, 1, fp32) != cache_key(demo(), "cpu", 8, 1, bf16)


def test_throughput_probe_refuses_fp16_on_cpu_before_measuring(tmp_path: Path) -> None:
    manifest = dataclasses.replace(demo(), model=dataclasses.replace(demo().model, precision="fp16"))
    with pytest.raises(BadInputError, match="fp16"):
        measure_throughput(manifest, "cpu", 2, 1, tmp_path / "throughput.json")
    assert not list(tmp_path.iterdir())
