"""Benchmark SkipPipe's repairs on a model of realistic shape: the drift fingerprint, a drifted replica's state, a move.

The model (`--model llama-20m`: 25.4M parameters, 8 layers; or the demo LLaMA made 8 layers deep) is cut into 4
stages of 2 layers, as in bench_skippipe_swarm.py. Measured, each against what an iteration costs anyway:

    fingerprint   the values at 1024 fixed positions that every published gradient carries
                  (`drift.fingerprint`): seconds per call for stage 1, against one microbatch's
                  forward and backward of the stage (an iteration runs several per node)
    adopt         a replica that drifted apart takes another's state of the iteration (`SkipPipeNode._adopt`):
                  two replicas of stage 1, each with its own hivemind DHT and p2pd on loopback; seconds and bytes
                  (parameters and both AdamW moments, float32), and whether the two hold the same bits after
    move          a node moving to a stage that lost its last node (`StageService.set_stage`, a fresh AdamW and
                  runner, as `SkipPipeMode._move` does): seconds

    python scripts/bench_skippipe_repair.py [--model demo|llama-20m] [--repeats 5]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import hivemind
import torch
from bench_skippipe_swarm import NUM_STAGES, bench_run, staged_model
from benchlib import bench_parser, environment_json, print_table, say, write_json

from crowdtrain.manifest import RunManifest
from crowdtrain.modes.skippipe.hops import HopLimits, StageService
from crowdtrain.modes.skippipe.iteration import SkipPipeNode
from crowdtrain.modes.skippipe.replicas.drift import fingerprint, fingerprint_positions
from crowdtrain.modes.skippipe.replicas.stage_state import STATE_PARTS
from crowdtrain.modes.skippipe.roster.schedule import NodeInfo
from crowdtrain.modes.skippipe.stages import StagedModel

STAGE = 1
MICRO_BATCH_SIZE = 4


def microbatch_seconds(run: RunManifest, staged: StagedModel, repeats: int) -> float:
    """Median seconds of one microbatch's forward and backward through the stage."""
    shape = (MICRO_BATCH_SIZE, run.data.sequence_length, int(run.model.config["hidden_size"]))
    times = []
    for _ in range(repeats + 1):
        hidden = torch.randn(shape, requires_grad=True)
        started = time.perf_counter()
        staged.run_stage(STAGE, staged.activations(hidden)).hidden_states.sum().backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def fingerprint_seconds(staged: StagedModel, repeats: int) -> float:
    parameters = staged.stage_parameters(STAGE)
    positions = fingerprint_positions(parameters)
    times = []
    for _ in range(repeats * 10):
        started = time.perf_counter()
        fingerprint(parameters, positions)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def replica(run: RunManifest, dht: hivemind.DHT, nodes: list[NodeInfo] | None = None) -> SkipPipeNode:
    staged = staged_model(run)
    limits = HopLimits(max_batch=MICRO_BATCH_SIZE, max_sequence=run.data.sequence_length, hidden_size=1)
    service = StageService(dht, staged, STAGE, limits)
    service.start()
    optimizer = torch.optim.AdamW(staged.stage_parameters(STAGE), lr=1e-3)
    return SkipPipeNode(
        service=service,
        nodes=nodes or [],
        num_microbatches=1,
        skip_ratio=0.0,
        reorder=False,
        optimizer=optimizer,
        batch=lambda iteration, microbatch: torch.zeros(0),
    )


def step(runner: SkipPipeNode, seed: int) -> None:
    """One AdamW step on made-up gradients: the replica's state moves (and its moments fill)."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in runner.parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-2
    runner.optimizer.step()


def adopt_and_move(run: RunManifest, repeats: int) -> dict[str, Any]:
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False)
    second = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs(), use_ipfs=False
    )
    source, drifted = replica(run, first), replica(run, second)
    try:
        adopt_s, same = [], True
        for iteration in range(repeats):
            step(source, seed=2 * iteration)
            step(drifted, seed=2 * iteration + 1)  # stepped on other gradients: drifted apart
            source.last_iteration = drifted.last_iteration = iteration
            started = time.perf_counter()
            assert drifted._adopt(source.peer_id, iteration) == source.peer_id
            adopt_s.append(time.perf_counter() - started)
            same = same and all(
                torch.equal(mine, theirs) for mine, theirs in zip(drifted.parameters, source.parameters, strict=True)
            )
        numel = sum(parameter.numel() for parameter in source.parameters)
        move_s = []
        for target in (2, 3, 1):
            started = time.perf_counter()
            drifted.service.set_stage(target, 4)
            optimizer = torch.optim.AdamW(drifted.service.staged.stage_parameters(target), lr=1e-3)
            SkipPipeNode(
                service=drifted.service,
                nodes=[],
                num_microbatches=1,
                skip_ratio=0.0,
                reorder=False,
                optimizer=optimizer,
                batch=lambda iteration, microbatch: torch.zeros(0),
            )
            move_s.append(time.perf_counter() - started)
        return {
            "stage_parameters": numel,
            "state_bytes": STATE_PARTS * numel * 4,
            "adopt_s": statistics.median(adopt_s),
            "adopt_s_each": adopt_s,
            "same_bits_after": same,
            "move_s": statistics.median(move_s),
        }
    finally:
        for runner in (source, drifted):
            runner.service.close()
        second.shutdown()
        first.shutdown()


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", choices=("demo", "llama-20m"), default="llama-20m")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = bench_run(args.model)
    staged = staged_model(run)
    with TemporaryDirectory():
        say(f"stage {STAGE} of {args.model}: one microbatch's forward and backward")
        microbatch_s = microbatch_seconds(run, staged, args.repeats)
        say("the fingerprint")
        fingerprint_s = fingerprint_seconds(staged, args.repeats)
        say("a drifted replica takes another's state; a move")
        repairs = adopt_and_move(run, args.repeats)
    parameters = sum(p.numel() for p in staged.model.parameters())
    results = {
        "environment": environment_json(quick=False),
        "model": f"{args.model} ({parameters / 1e6:.1f}M parameters, 8 layers, {NUM_STAGES} stages)",
        "microbatch_forward_backward_s": microbatch_s,
        "fingerprint_s": fingerprint_s,
        **repairs,
    }
    print_table(
        f"SkipPipe repairs, stage {STAGE} of {results['model']} ({repairs['stage_parameters'] / 1e6:.2f}M parameters)",
        ["what", "seconds", "against"],
        [
            ["fingerprint (per gradient)", fingerprint_s, f"{fingerprint_s / microbatch_s:.2%} of a microbatch"],
            ["adopt a replica's state (loopback)", repairs["adopt_s"], f"{repairs['state_bytes'] / 1e6:.0f} MB"],
            ["move to another stage", repairs["move_s"], "—"],
            ["one microbatch forward+backward", microbatch_s, f"batch {MICRO_BATCH_SIZE}"],
        ],
    )
    print(f"the two replicas hold the same bits after each adoption: {repairs['same_bits_after']}")
    write_json(Path(args.out) / "skippipe_repair.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
