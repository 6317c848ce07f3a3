"""Benchmark SkipPipe's partial and reordered paths against the full pipeline: convergence, makespan, removed stages.

One process, one model: the demo LLaMA made 8 layers deep (hidden 256) and cut into 4 stages of 2 layers
(`crowdtrain.modes.skippipe.stages`; stage 0 also runs the embeddings, the final norm and the head). Each arm trains its
own copy from the same initial weights on the same samples, for the same optimizer steps: each step is one
iteration of M microbatches whose gradients accumulate, then one AdamW step. The arms differ only in the paths
their microbatches take:

    full              every microbatch through stages 0, 1, 2, 3 (`planning.skippipe.full_pipeline`)
    random-skip       k = 0.25: each microbatch skips one of stages 1..3, drawn at random (`random_skipping`)
    skippipe          k = 0.25, the least-visited stages on the earliest-finishing replicas (`schedule_microbatches`)
    skippipe-reorder  the same, visiting the chosen stages in the order their nodes come free (reorder=True)

The schedulers route over 4 stages x 2 replicas (s0a, s0b, ..., s3b) where s2b runs 4x slower, as in
tests/test_skippipe_schedule.py. Here the replicas exist only for the scheduler's timeline: in this process all
replicas of a stage share one copy of its layers, so replica choice changes the simulated makespan, never the
training. A node's seconds per microbatch are the measured wall seconds of one microbatch's forward and backward
over its stage's part on this CPU (stage 0: embeddings, its layers, norm, head and loss), times 4 for s2b; links
take the scheduler's default latency and memory never binds (M slots per node). Torch runs one thread: on
shared cores, two threads' OpenMP barriers made a microbatch 50x slower whenever other processes competed.

Reported per arm: the held-out loss along the full path at regular points, the mean simulated makespan of an
iteration (`simulate`, through the Schedule), and at the end the held-out perplexity with stages removed: all of
stages 1..3 present, each one removed (1 of 4 stages, 25% of the layers; mean and worst), and two removed
(2 of 4 stages, 50% of the layers; mean and worst). SkipPipe reports about 7% worse perplexity with half the
stages removed for its skip-trained models.

    python scripts/bench_skippipe.py [--steps 120] [--microbatches 4] [--micro-batch-size 4] [--arms ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
from benchlib import (
    bench_parser,
    environment_json,
    plot_to_png,
    print_table,
    say,
    say_plotted,
    write_json,
)
from skippipe_schedulers import full_pipeline, random_skipping

from crowdtrain.data import WindowSampler, load_token_stream
from crowdtrain.manifest import ModelSpec, RunManifest, demo
from crowdtrain.models import ByteTokenizer, build_model
from crowdtrain.modes.skippipe.roster.schedule import (
    DEFAULT_LATENCY_S,
    NodeInfo,
    Schedule,
    SkipPipeProblem,
    schedule_microbatches,
)
from crowdtrain.modes.skippipe.stages import StagedModel
from crowdtrain.optimizer import learning_rate_factor

ARMS = ("full", "random-skip", "skippipe", "skippipe-reorder")
NUM_LAYERS = 8
NUM_STAGES = 4
REPLICAS = ("a", "b")
SLOW_NODE = "s2b"
SLOWDOWN = 4.0
"""How many times slower SLOW_NODE is than its stage's measured cost."""
SKIP_RATIO = 0.25
"""k of the skipping arms: with 4 stages, each microbatch skips 1 of stages 1..3."""
EVAL_BATCHES = 8
EVAL_BATCH_SIZE = 8
"""The held-out set: EVAL_BATCHES x EVAL_BATCH_SIZE fixed windows from the stream's held-out tail, every arm."""
TIMING_REPEATS = 5
"""Microbatches timed per stage (after one warm-up); the median is kept."""
SCHEDULERS: dict[str, Callable[[SkipPipeProblem], Schedule]] = {
    "full": full_pipeline,
    "random-skip": random_skipping,
    "skippipe": schedule_microbatches,
    "skippipe-reorder": schedule_microbatches,
}


def bench_run() -> RunManifest:
    """The demo run with its LLaMA made NUM_LAYERS deep, so that each of the 4 stages has 2 layers."""
    base = demo()
    model = ModelSpec(
        architecture=base.model.architecture,
        config={**base.model.config, "num_hidden_layers": NUM_LAYERS},
        tokenizer=base.model.tokenizer,
    )
    return dataclasses.replace(base, run_id="bench-skippipe", model=model)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RemovedStages:
    """Held-out perplexity along every path that leaves out `num_removed` of stages 1..S-1."""

    num_removed: int
    """How many of stages 1..S-1 the paths skip."""
    paths: list[list[int]]
    """The paths evaluated, stage 0 first."""
    perplexities: list[float]
    """The held-out perplexity along each path, in `paths` order."""

    @property
    def mean(self) -> float:
        """The mean over the paths."""
        return statistics.fmean(self.perplexities)

    @property
    def worst(self) -> float:
        """The highest perplexity of the paths."""
        return max(self.perplexities)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ArmResult:
    """What one arm's training gave."""

    held_out_loss: list[float]
    """The held-out loss along the full path at each point of `samples`."""
    samples: list[int]
    """Training windows seen at each evaluation point."""
    makespan_s: list[float]
    """The simulated makespan of each iteration, in seconds."""
    stage_visits: list[int]
    """How many microbatches ran each stage, by stage."""
    train_s: float
    """Wall seconds spent training in this process (forward, backward, optimizer), evaluations excluded."""
    removed: list[RemovedStages]
    """Held-out perplexity with 0, 1, ..., S-2 of stages 1..S-1 removed."""


class Data:
    """Every arm's samples: microbatch m of step t is the same windows in every arm; the held-out windows."""

    def __init__(self, run: RunManifest, micro_batch_size: int, cache: Path) -> None:
        tokens = load_token_stream(run.data, ByteTokenizer(), cache)
        self.sampler = WindowSampler(tokens, run.data.sequence_length, peer_seed=0)
        self.micro_batch_size = micro_batch_size
        self.held_out = self.sampler.eval_batches(EVAL_BATCH_SIZE, EVAL_BATCHES)

    def batch(self, step: int, microbatch: int) -> torch.Tensor:
        """[micro_batch_size, sequence_length] token ids."""
        return self.sampler.batch(step, self.micro_batch_size, microbatch)


def measure_stage_seconds(staged: StagedModel, batch: torch.Tensor) -> list[float]:
    """Median wall seconds of one microbatch's forward and backward over each stage's part, by stage."""
    seconds = []
    for stage in range(staged.num_stages):
        timings = []
        for _ in range(TIMING_REPEATS + 1):
            with torch.no_grad():
                inputs = staged.embed(batch)
            hidden = inputs.hidden_states.detach().requires_grad_()
            began = time.perf_counter()
            if stage == 0:  # the path (0,): embeddings, stage 0's layers, norm, head and loss
                staged.loss(batch, (0,)).backward()
            else:
                outputs = staged.run_stage(stage, dataclasses.replace(inputs, hidden_states=hidden))
                outputs.hidden_states.backward(torch.ones_like(outputs.hidden_states))
            timings.append(time.perf_counter() - began)
        staged.model.zero_grad(set_to_none=True)
        seconds.append(statistics.median(timings[1:]))
    return seconds


def topology(stage_seconds: Sequence[float], num_microbatches: int) -> tuple[NodeInfo, ...]:
    """4 stages x 2 replicas at the measured costs, SLOW_NODE SLOWDOWN times slower; memory never binds."""
    return tuple(
        NodeInfo(
            peer_id=f"s{stage}{replica}",
            stage=stage,
            seconds_per_microbatch=seconds * (SLOWDOWN if f"s{stage}{replica}" == SLOW_NODE else 1.0),
            memory_microbatches=num_microbatches,
        )
        for stage, seconds in enumerate(stage_seconds)
        for replica in REPLICAS
    )


def schedule_step(arm: str, nodes: tuple[NodeInfo, ...], num_microbatches: int, step: int) -> Schedule:
    """The arm's routes for one iteration; the step is the seed."""
    problem = SkipPipeProblem(
        num_stages=NUM_STAGES,
        nodes=nodes,
        num_microbatches=num_microbatches,
        skip_ratio=0.0 if arm == "full" else SKIP_RATIO,
        reorder=arm == "skippipe-reorder",
        seed=step,
    )
    return SCHEDULERS[arm](problem)


def held_out_loss(staged: StagedModel, data: Data, path: Sequence[int]) -> float:
    """The mean loss of the held-out batches along `path`."""
    staged.model.eval()
    with torch.no_grad():
        losses = [float(staged.loss(batch, path)) for batch in data.held_out]
    staged.model.train()
    return statistics.fmean(losses)


def removed_stages(staged: StagedModel, data: Data) -> list[RemovedStages]:
    """Held-out perplexity with each subset of stages 1..S-1 left out, grouped by how many are left out."""
    middle = range(1, staged.num_stages)
    results = []
    for num_removed in range(staged.num_stages - 1):
        paths = [[0, *kept] for kept in itertools.combinations(middle, len(middle) - num_removed)]
        perplexities = [math.exp(held_out_loss(staged, data, path)) for path in paths]
        results.append(RemovedStages(num_removed=num_removed, paths=paths, perplexities=perplexities))
    return results


def train_arm(args: argparse.Namespace, arm: str, data: Data, nodes: tuple[NodeInfo, ...]) -> ArmResult:
    """Train a fresh model along the arm's paths for `args.steps` iterations of `args.microbatches` microbatches."""
    run = bench_run()
    staged = StagedModel(build_model(run.model, ByteTokenizer().vocab_size, seed=0), NUM_STAGES)
    optimizer = torch.optim.AdamW(staged.model.parameters(), lr=run.optimizer.learning_rate,
                                  weight_decay=run.optimizer.weight_decay)  # fmt: skip
    losses, samples = [held_out_loss(staged, data, staged.full_path)], [0]
    makespans, visits, train_s = [], [0] * NUM_STAGES, 0.0
    for step in range(args.steps):
        schedule = schedule_step(arm, nodes, args.microbatches, step)
        makespans.append(schedule.makespan_s)
        for group in optimizer.param_groups:
            group["lr"] = run.optimizer.learning_rate * learning_rate_factor(step, run.optimizer)
        began = time.perf_counter()
        for route in schedule.routes:
            (staged.loss(data.batch(step, route.microbatch), route.stages) / args.microbatches).backward()
            for stage in route.stages:
                visits[stage] += 1
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - began
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            losses.append(held_out_loss(staged, data, staged.full_path))
            samples.append((step + 1) * args.microbatches * args.micro_batch_size)
            say(f"{arm} step {step + 1}: held-out loss {losses[-1]:.4f}")
    return ArmResult(held_out_loss=losses, samples=samples, makespan_s=makespans, stage_visits=visits,
                     train_s=train_s, removed=removed_stages(staged, data))  # fmt: skip


@plot_to_png(1, 2, figsize=(12, 4.5))
def plot_results(results: dict[str, Any], axes: Any) -> None:
    for arm, result in results["arms"].items():
        axes[0].plot(result["samples"], result["held_out_loss"], label=arm, marker=".")
        removed = result["removed"]
        counts = [group["num_removed"] for group in removed]
        (line,) = axes[1].plot(counts, [statistics.fmean(group["perplexities"]) for group in removed],
                               label=f"{arm} (mean)", marker="o")  # fmt: skip
        axes[1].scatter(counts, [max(group["perplexities"]) for group in removed], color=line.get_color(), marker="x")
    axes[0].set_xlabel("training windows")
    axes[0].set_ylabel("held-out loss (full path)")
    axes[0].set_title(f"{NUM_STAGES} stages, {results['microbatches']} microbatches per step")
    axes[0].legend()
    axes[1].set_xlabel(f"stages of 1..{NUM_STAGES - 1} removed at evaluation")
    axes[1].set_ylabel("held-out perplexity (x: worst path)")
    axes[1].set_xticks(range(NUM_STAGES - 1))
    axes[1].legend()


def show(results: dict[str, Any], arms: dict[str, ArmResult]) -> None:
    full_makespan = statistics.fmean(arms["full"].makespan_s) if "full" in arms else None
    rows = []
    for arm, result in arms.items():
        makespan = statistics.fmean(result.makespan_s)
        everything, one, two = result.removed
        rows.append([arm, result.held_out_loss[-1], everything.mean, one.mean, one.worst, two.mean, two.worst,
                     makespan, None if full_makespan is None else makespan / full_makespan,
                     "/".join(str(count) for count in result.stage_visits[1:]), result.train_s])  # fmt: skip
    print_table(
        f"SkipPipe, {NUM_LAYERS}-layer demo LLaMA in {NUM_STAGES} stages, {results['steps']} steps of "
        f"{results['microbatches']} x {results['micro_batch_size']} windows (held-out perplexity by stages removed)",
        ["arm", "loss", "ppl all", "ppl -1 mean", "-1 worst", "ppl -2 mean", "-2 worst", "makespan s/iter",
         "vs full", "visits s1/s2/s3", "train s"],
        rows,
    )  # fmt: skip
    first = next(iter(arms.values()))
    print_table(
        "held-out loss along the full path",
        ["windows", *arms],
        [[samples, *(arms[arm].held_out_loss[index] for arm in arms)] for index, samples in enumerate(first.samples)],
    )


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per arm (default 120)")
    parser.add_argument("--microbatches", type=int, default=4, help="M, microbatches per step (default 4)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="windows per microbatch (default 4)")
    parser.add_argument("--eval-every", type=int, help="steps between held-out evaluations (default steps/6)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see the docstring)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.eval_every = args.eval_every or max(1, args.steps // 6)
    environment = environment_json(quick=False)
    run = bench_run()
    with TemporaryDirectory() as cache:
        data = Data(run, args.micro_batch_size, Path(cache))
        probe = StagedModel(build_model(run.model, ByteTokenizer().vocab_size, seed=0), NUM_STAGES)
        stage_seconds = measure_stage_seconds(probe, data.batch(0, 0))
        say("measured seconds per microbatch (forward + backward) by stage: "
            + ", ".join(f"{stage}: {seconds:.3f}" for stage, seconds in enumerate(stage_seconds)))  # fmt: skip
        nodes = topology(stage_seconds, args.microbatches)
        arms = {}
        for arm in args.arms:
            say(f"arm {arm}")
            arms[arm] = train_arm(args, arm, data, nodes)
    results: dict[str, Any] = {
        "environment": {**environment, "load_average_at_end": os.getloadavg()},
        "model": f"demo LLaMA with {NUM_LAYERS} layers, hidden {run.model.config['hidden_size']}",
        "stages": [list(layers) for layers in probe.stages],
        "steps": args.steps,
        "microbatches": args.microbatches,
        "micro_batch_size": args.micro_batch_size,
        "sequence_length": run.data.sequence_length,
        "skip_ratio": SKIP_RATIO,
        "slow_node": SLOW_NODE,
        "slowdown": SLOWDOWN,
        "latency_s": DEFAULT_LATENCY_S,
        "stage_seconds_per_microbatch": stage_seconds,
        "torch_threads": torch.get_num_threads(),
        "arms": {arm: dataclasses.asdict(result) for arm, result in arms.items()},
    }
    show(results, arms)
    write_json(args.out / "skippipe.json", results)
    say_plotted(args.out, "skippipe", plot_results, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
