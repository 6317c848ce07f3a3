"""Benchmark SPES against DiLoCo and centralized training: the same MoE model and samples, side by side.

Four peers in this process, each a real training mode (DiLoCoMode or SPESMode: its own model replica, real forward
and backward passes, its averager process, its progress tracker and a DHT on loopback), trained in lockstep: each
round, every peer takes H inner steps on its own micro-batches, then all run the outer round at once. Every arm
sees the same samples: peer p's micro-batch i of round r is the same windows in every arm, and `centralized`
trains one model with AdamW on the four peers' micro-batches of each step together (one global batch).

Arms: `centralized`, `diloco` (every peer trains the whole model; pseudo-gradients of all of it averaged),
`spes` (dense pseudo-gradients averaged, experts trained by their owners and fetched as int8 changes), and
`spes-warmup` (SPES with the expert-merging warm-up); by name, DiLoCo's variants `diloco-int8`, `diloco-topk` and
`diloco-overlap` (the outer step one round late; each point is the replica as the peer holds it then). For each
it prints the held-out loss after each round (the first peer's replica; the same windows for every arm), the
trainable state per node (gradients and AdamW moments of what the node trains; DiLoCo's outer state, the round's
start and its momentum, beside it), the bytes each node sent per round (all-reduce parts plus served experts),
and tokens/s per node over its inner steps. With
`--rss`, each mode also trains alone in a child process, as one of four peers, to give a node's peak RSS.

    python scripts/bench_spes.py [--preset spes-demo] [--rounds 8] [--inner-steps 8] [--arms ...] [--rss]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
from benchlib import bench_parser, plot_to_png, print_table, say, say_plotted, write_json
from lab.diloco import computing_peer, computing_peers, loopback_dhts
from lab.processes import await_condition
from lab.procfs import peak_rss_kib

from crowdtrain import proto
from crowdtrain.data import WindowSampler, load_token_stream
from crowdtrain.manifest import PRESETS, DiLoCoSpec, RunManifest, SPESSpec, TrainingSpec
from crowdtrain.models import ByteTokenizer, build_model, training_loss
from crowdtrain.modes.diloco.mode import DiLoCoMode
from crowdtrain.modes.spes.mode import SPESMode
from crowdtrain.optimizer import learning_rate_factor

ARMS = (
    "centralized", "diloco", "spes", "spes-warmup", "diloco-int8", "diloco-topk", "diloco-overlap",
    "spes-replicas", "spes-kill", "spes-replicas-kill",
)  # fmt: skip
DEFAULT_ARMS = ARMS[:4]
"""The DiLoCo variants (issue 15's loss per sample: int8 and top-k pseudo-gradients, the one-round-late outer step
of `overlap`) and the SPES replica arms run when named: `spes-replicas` gives each expert two owners
(`spes.replicas = 2`); the `-kill` arms close the fourth peer mid-run (after its inner steps of the middle round,
before that round's end: its experts' training of the round goes with it unless another owner has them)."""
NUM_PEERS = 4
EVAL_BATCHES = 8


def run_for(args: argparse.Namespace, arm: str) -> RunManifest:
    base = PRESETS[args.preset]()
    merge = SPESSpec(
        merge_every=args.merge_every,
        merge_neighbours=2,
        merge_alpha=0.1,
        merge_warmup_steps=args.rounds * args.inner_steps,
    )
    plain = SPESSpec(replicas=2 if "replicas" in arm else 1)
    return dataclasses.replace(
        base,
        run_id=f"bench-{arm}",
        target_batch_size=1_000_000_000,  # rounds end when the benchmark says: every arm takes the same steps
        training=TrainingSpec(mode="spes" if arm.startswith("spes") else "diloco"),
        averaging=dataclasses.replace(base.averaging, group_size=4, matchmaking_time_s=2.0, timeout_s=120.0),
        diloco=DiLoCoSpec(
            inner_steps=args.inner_steps,
            compression={"diloco-int8": "int8", "diloco-topk": "topk"}.get(arm, args.compression),
            overlap=arm == "diloco-overlap",
        ),
        spes=merge if arm == "spes-warmup" else (plain if arm.startswith("spes") else None),
    )  # fmt: skip


class Data:
    """Every arm's samples: peer p's micro-batch `step` of round r, and the held-out windows."""

    def __init__(self, run: RunManifest, micro_batch_size: int, cache: Path):
        tokens = load_token_stream(run.data, ByteTokenizer(), cache)
        sequence = run.data.sequence_length
        self.samplers = [WindowSampler(tokens, sequence, peer_seed=peer) for peer in range(NUM_PEERS)]
        self.micro_batch_size = micro_batch_size
        self.held_out = self.samplers[0].eval_batches(micro_batch_size, EVAL_BATCHES)

    def batch(self, peer: int, round_: int, step: int) -> torch.Tensor:
        return self.samplers[peer].batch(round_, self.micro_batch_size, step)


def held_out_loss(model: torch.nn.Module, data: Data) -> float:
    model.eval()
    with torch.no_grad():
        losses = [float(training_loss(model, batch, "causal")) for batch in data.held_out]
    model.train()
    return sum(losses) / len(losses)


def centralized(args: argparse.Namespace, data: Data) -> dict[str, Any]:
    run = run_for(args, "centralized")
    model = build_model(run.model, 260, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.optimizer.learning_rate,
                                  weight_decay=run.optimizer.weight_decay)  # fmt: skip
    losses, compute_s, tokens = [held_out_loss(model, data)], 0.0, 0
    for round_ in range(args.rounds):
        for group in optimizer.param_groups:  # the modes' schedule: one step per round of H global batches
            group["lr"] = run.optimizer.learning_rate * learning_rate_factor(round_ * args.inner_steps, run.optimizer)
        for step in range(args.inner_steps):
            batch = torch.cat([data.batch(peer, round_, step) for peer in range(NUM_PEERS)])
            began = time.perf_counter()
            training_loss(model, batch, "causal").backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            compute_s += time.perf_counter() - began
            tokens += batch.numel()
        losses.append(held_out_loss(model, data))
        say(f"centralized round {round_ + 1}: held-out loss {losses[-1]:.4f}")
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return {
        "held_out_loss": losses,
        "trainable_state_bytes": state_bytes(optimizer, trained),
        "outer_state_bytes": 0,
        "bytes_sent_per_round": 0.0,
        "tokens_per_s_per_node": tokens / compute_s,  # one node doing the four peers' work
    }


def swarm(args: argparse.Namespace, arm: str, data: Data) -> dict[str, Any]:
    run = run_for(args, arm)
    mode_class: type[DiLoCoMode] = SPESMode if arm.startswith("spes") else DiLoCoMode
    with computing_peers(run, NUM_PEERS, mode_class, micro_batch_size=data.micro_batch_size) as modes:
        losses = [held_out_loss(modes[0].context.compute.model, data)]  # type: ignore[union-attr]
        compute_s, tokens = [0.0] * NUM_PEERS, 0
        sent_before = [bytes_sent(mode) for mode in modes]
        kill_round = args.rounds // 2 if arm.endswith("-kill") else None
        for round_ in range(args.rounds):
            for step in range(args.inner_steps):
                for peer, mode in enumerate(modes):
                    batch = data.batch(peer, round_, step)
                    began = time.perf_counter()
                    mode.train_micro_batch(batch)
                    compute_s[peer] += time.perf_counter() - began
                    tokens += batch.numel() if peer == 0 else 0
            if round_ == kill_round:
                vanish(modes)
            outer_round(modes)
            if round_ == args.rounds - 1 and modes[0].overlapped:  # the last round's average, applied at the end
                with ThreadPoolExecutor(len(modes)) as pool:
                    list(pool.map(lambda mode: mode._finish_round_in_flight(wait=True), modes))
            losses.append(held_out_loss(modes[0].context.compute.model, data))  # type: ignore[union-attr]
            say(f"{arm} round {round_ + 1}: held-out loss {losses[-1]:.4f}, "
                f"{sum(mode.num_local_rounds for mode in modes)} solo rounds")  # fmt: skip
        sent = [(bytes_sent(mode) - before) / args.rounds for mode, before in zip(modes, sent_before, strict=False)]
        result: dict[str, Any] = {
            "held_out_loss": losses,
            "trainable_state_bytes": max(state_bytes(mode.inner_optimizer, trained(mode)) for mode in modes),
            "outer_state_bytes": max(outer_bytes(mode) for mode in modes),
            "bytes_sent_per_round": sum(sent) / len(sent),
            "bytes_sent_per_round_max": max(sent),
            "tokens_per_s_per_node": tokens / (sum(compute_s[: len(modes)]) / len(modes)),
            "solo_rounds": sum(mode.num_local_rounds for mode in modes),
        }
        if isinstance(modes[0], SPESMode):
            result["experts_owned"] = [len(mode.owned) for mode in modes]  # type: ignore[attr-defined]
            result["expert_fetch_failures"] = sum(mode.fetch_failures for mode in modes)  # type: ignore[attr-defined]
            result["experts_stale"] = sum(mode.stale_experts for mode in modes)  # type: ignore[attr-defined]
        return result


def vanish(modes: list[DiLoCoMode]) -> None:
    """The last peer goes without a word, as a SIGKILLed one: its exchange, its averager and its DHT stop."""
    gone = modes.pop()
    gone.close()
    gone.context.dht.shutdown()
    say(f"peer {len(modes)} is gone")


def outer_round(modes: Sequence[DiLoCoMode]) -> None:
    await_condition(lambda: all(mode.tracker.global_progress.num_peers >= len(modes) for mode in modes), 120,
                    "every peer's tracker to see the others")  # fmt: skip
    with ThreadPoolExecutor(len(modes)) as pool:
        # with overlap, the round's average goes on in the background: the next round's end applies it
        list(pool.map(lambda mode: mode._outer_round(), modes))


def trained(mode: DiLoCoMode) -> list[torch.Tensor]:
    return [parameter for group in mode.inner_optimizer.param_groups for parameter in group["params"]]


def state_bytes(optimizer: torch.optim.Optimizer, parameters: Sequence[torch.Tensor]) -> int:
    """Gradients of `parameters` plus the optimizer's state tensors, in bytes."""
    gradients = sum(p.grad.numel() * p.grad.element_size() for p in parameters if p.grad is not None)
    moments = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    return gradients + moments


def outer_bytes(mode: DiLoCoMode) -> int:
    """DiLoCo's outer state (the round's start, its momentum) and, in SPES, the owned experts' published copies."""
    starts = sum(t.numel() * t.element_size() for t in mode.global_parameters)
    momenta = sum(
        v.numel() * v.element_size() for s in mode.outer_optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )  # fmt: skip
    bases = sum(t.numel() * t.element_size() for t in getattr(mode, "bases", {}).values())
    return starts + momenta + bases


def bytes_sent(mode: DiLoCoMode) -> int:
    sent = mode.context.traffic.totals()[0]
    return sent + (mode.exchange.bytes_served if isinstance(mode, SPESMode) else 0)


def peak_rss(args: argparse.Namespace, arm: str) -> float:
    """A node's peak RSS (MiB) training `--inner-steps` micro-batches alone as one of four peers, in a child."""
    command = [sys.executable, __file__, "--child-rss", arm, "--preset", args.preset,
               "--inner-steps", str(args.inner_steps), "--micro-batch-size", str(args.micro_batch_size)]  # fmt: skip
    output = subprocess.run(command, check=True, capture_output=True, text=True, timeout=900).stdout
    return float(json.loads(output.strip().splitlines()[-1])["peak_rss_mib"])


def child_rss(args: argparse.Namespace) -> None:
    arm = args.child_rss
    run = run_for(argparse.Namespace(**{**vars(args), "rounds": 1, "compression": "fp16", "merge_every": 0}), arm)
    mode_class: type[DiLoCoMode] = SPESMode if arm.startswith("spes") else DiLoCoMode
    dht = loopback_dhts(1)[0]
    others = [proto.PeerStatus(peer_id=f"absent-peer-{index}") for index in range(NUM_PEERS - 1)]
    mode = computing_peer(run, dht, [proto.PeerStatus(peer_id=dht.peer_id.to_base58()), *others], mode_class)
    generator = torch.Generator().manual_seed(0)
    for _ in range(args.inner_steps):
        mode.train_micro_batch(
            torch.randint(0, 256, (args.micro_batch_size, run.data.sequence_length), generator=generator)
        )
    peak = peak_rss_kib(os.getpid()) / 1024  # not ru_maxrss: a child inherits the parent's across fork and exec
    mode.close()
    dht.shutdown()
    print(json.dumps({"peak_rss_mib": peak}))


@plot_to_png(figsize=(7, 4.5))
def plot_losses(results: dict[str, Any], axes: Any) -> None:
    for arm, result in results["arms"].items():
        if "held_out_loss" in result:
            losses = result["held_out_loss"]
            samples = [round_ * results["samples_per_round"] for round_ in range(len(losses))]
            axes.plot(samples, losses, label=arm, marker=".")
    axes.set_xlabel("samples (all peers)")
    axes.set_ylabel("held-out loss")
    axes.set_title(f"{results['preset']}: {NUM_PEERS} peers, H = {results['inner_steps']}")
    axes.legend()


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--preset", default="spes-demo", choices=list(PRESETS), help="spes-* for the SPES arms")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=8, help="H: inner steps per round (default 8)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--compression", default="fp16", help="the dense all-reduce's encoding, both modes")
    parser.add_argument("--merge-every", type=int, default=4, help="spes-warmup: M, inner steps between merges")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(DEFAULT_ARMS))
    parser.add_argument("--rss", action="store_true", help="also measure a node's peak RSS per mode (child processes)")
    parser.add_argument("--child-rss", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_rss:
        child_rss(args)
        return 0
    results: dict[str, Any] = {
        "preset": args.preset,
        "inner_steps": args.inner_steps,
        "rounds": args.rounds,
        "samples_per_round": NUM_PEERS * args.inner_steps * args.micro_batch_size,
        "arms": {},
    }
    with TemporaryDirectory() as cache:
        data = Data(run_for(args, "spes"), args.micro_batch_size, Path(cache))
        for arm in args.arms:
            say(f"arm {arm}")
            results["arms"][arm] = centralized(args, data) if arm == "centralized" else swarm(args, arm, data)
            if args.rss and arm in ("diloco", "spes"):
                results["arms"][arm]["peak_rss_mib"] = peak_rss(args, arm)
    rows = []
    for arm, result in results["arms"].items():
        rows.append([
            arm, f"{result['held_out_loss'][-1]:.4f}", f"{result['trainable_state_bytes'] / 2**20:.1f}",
            f"{result['outer_state_bytes'] / 2**20:.1f}", f"{result['bytes_sent_per_round'] / 2**20:.2f}",
            f"{result['tokens_per_s_per_node']:.0f}", f"{result.get('peak_rss_mib', float('nan')):.0f}",
            str(result.get("experts_stale", "—")),
        ])  # fmt: skip
    print_table(
        f"{args.preset}, {NUM_PEERS} peers, {args.rounds} rounds of H = {args.inner_steps}",
        [
            "arm",
            "held-out loss",
            "trainable state MiB",
            "outer state MiB",
            "MiB sent/round",
            "tok/s/node",
            "RSS MiB",
            "experts left stale",
        ],  # fmt: skip
        rows,
    )
    write_json(args.out / "spes.json", results)
    say_plotted(args.out, "spes", plot_losses, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
