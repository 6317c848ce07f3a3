"""The trust benchmark's malicious peer poisons exactly its gradients (scripts/lab/attacker.py)."""

from __future__ import annotations

import pytest
import torch
from lab.attacker import attacker_launcher, main, poisoning


def gradients(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(1)
    model(torch.randn(3, 4)).square().sum().backward()
    return torch.cat([parameter.grad.flatten() for parameter in model.parameters()])  # type: ignore[union-attr]


def linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


def test_scaled_and_nan_attackers_poison_the_gradients_not_the_forward() -> None:
    clean = gradients(linear(0))
    scaled_model = poisoning(linear, "scaled", 1e6)(0)
    assert torch.allclose(gradients(scaled_model), clean * 1e6)
    assert torch.equal(scaled_model(torch.ones(1, 4)), linear(0)(torch.ones(1, 4))), "its loss looks normal"
    assert gradients(poisoning(linear, "nan", 1e6)(0)).isnan().all()


def test_the_attacker_runs_only_a_crowdtrain_command() -> None:
    assert attacker_launcher("nan")[-1] == "--"
    with pytest.raises(ValueError, match="kind must be one of"):
        attacker_launcher("flip")
    with pytest.raises(SystemExit) as exit_info:
        main(["--gradients", "nan", "--", "rm", "-rf", "/tmp/x"])
    assert exit_info.value.code == 2
