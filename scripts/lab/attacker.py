"""A `crowdtrain run` daemon whose gradients are poisoned: the malicious peer of the trust benchmark.

Everything is the real daemon (DHT, plan, averaging, state download); only its model is built with a hook on
every parameter that multiplies each micro-batch's gradient by `--scale` (`scaled`) or makes it NaN (`nan`),
so the parts it sends into every all-reduce are poisoned while its loss looks normal. It attacks as a sender
only: as the reducer of its share of the vector it averages the others' parts honestly (a malicious reducer
is a different attack, not defended by robust aggregation).

Used as the launcher of a daemon (`lab.swarm.start_daemon(..., launcher=attacker_launcher())`), which runs,
with scripts/ on the child's path (`lab.processes.lab_module`):

    python -m lab.attacker --gradients scaled --scale 1e6 -- python -m crowdtrain run ...
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lab.processes import lab_module
from lab.swarm import CROWDTRAIN

KINDS = ("scaled", "nan")


def attacker_launcher(kind: str, scale: float = 1e6) -> list[str]:
    """The launcher that starts a daemon as this module's attacker."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return [*lab_module("attacker"), "--gradients", kind, "--scale", f"{scale:g}", "--"]


def poisoning(build: Callable[..., torch.nn.Module], kind: str, scale: float) -> Callable[..., torch.nn.Module]:
    """`build` (a model builder) whose models poison every parameter's gradient."""
    factor = float("nan") if kind == "nan" else scale

    def build_poisoned(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = build(*args, **kwargs)
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.register_hook(lambda gradient: gradient * factor)
        return model

    return build_poisoned


def main(argv: Sequence[str] | None = None) -> int:
    """Run the crowdtrain command after `--` in this process, its model's gradients poisoned."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gradients", choices=KINDS, required=True, help="how the gradients are poisoned")
    parser.add_argument("--scale", type=float, default=1e6, help="the factor of `scaled` gradients (1e6)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the crowdtrain command line")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if tuple(command[: len(CROWDTRAIN)]) != CROWDTRAIN:
        parser.error(f"the command must start with {' '.join(CROWDTRAIN)}")
    from crowdtrain.cli.main import main as crowdtrain_main
    from crowdtrain.training import loop

    loop.build_model = poisoning(loop.build_model, args.gradients, args.scale)  # type: ignore[assignment]
    return crowdtrain_main(command[len(CROWDTRAIN) :])


if __name__ == "__main__":
    raise SystemExit(main())
