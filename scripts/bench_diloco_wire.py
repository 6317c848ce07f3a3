"""Bytes on the wire in one DiLoCo outer round, fp16 against int8 and top-k, with the llama-20m preset's model.

Each of `--peers` peers is a real DiLoCoMode in this process (its averager process, progress tracker and DHT on
loopback) over its own replica of llama-20m (25.4M parameters). Every peer first takes `--inner-steps` AdamW
steps from the same initial weights on its own windows of the embedded corpus; then, per compression, fresh
modes run one outer round on those same pseudo-gradients. The bytes are the averager's own counters: the
serialized tensor parts each peer sent and received (after compression; message framing and matchmaking are
left out). For top-k the table also gives the fraction of nonzero values in the averaged pseudo-gradient (what
reducers send back is the average of the group's sparse parts).

    python scripts/bench_diloco_wire.py --peers 2 --inner-steps 4 --fractions 0.01 0.02 0.05
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
from benchlib import print_table, say
from lab.diloco import diloco_peers
from lab.processes import await_condition

from crowdtrain.data.corpus import load_token_stream
from crowdtrain.data.sampler import WindowSampler
from crowdtrain.manifest import DiLoCoSpec, RunManifest, TrainingSpec, llama_20m
from crowdtrain.models import build_model, load_tokenizer

MIB = 2**20


def inner_steps(manifest: RunManifest, args: argparse.Namespace) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """θ₀ and each peer's θ after its inner AdamW steps on its own windows of the corpus."""
    tokenizer = load_tokenizer(manifest.model)
    with TemporaryDirectory() as cache:
        tokens = load_token_stream(manifest.data, tokenizer, Path(cache))
    model = build_model(manifest.model, tokenizer.vocab_size, seed=0)
    start = [parameter.detach().clone() for parameter in model.parameters()]
    finals = []
    for peer in range(args.peers):
        with torch.no_grad():
            for parameter, value in zip(model.parameters(), start, strict=True):
                parameter.copy_(value)
        optimizer = torch.optim.AdamW(model.parameters(), lr=manifest.optimizer.learning_rate)
        sampler = WindowSampler(tokens, args.sequence_length, peer_seed=peer)
        for step in range(args.inner_steps):
            batch = sampler.batch(0, args.micro_batch_size, step)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        say(f"peer {peer}: {args.inner_steps} inner steps, loss {loss.item():.3f}")
        finals.append([parameter.detach().clone() for parameter in model.parameters()])
    return start, finals


def one_round(run: RunManifest, start: list[torch.Tensor], finals: list[list[torch.Tensor]]) -> dict[str, float]:
    """One outer round of these pseudo-gradients: MiB each peer sent and received, the average's density."""
    with diloco_peers(run, len(finals), start) as modes:
        for mode, final in zip(modes, finals, strict=True):
            with torch.no_grad():
                for parameter, value in zip(mode.parameters, final, strict=True):
                    parameter.copy_(value)
            mode.samples = 64
            mode.tracker.report_local_progress(0, mode.samples)
        await_condition(
            lambda: all(mode.tracker.global_progress.num_peers == len(modes) for mode in modes), 60, "the trackers"
        )
        started = time.monotonic()
        with ThreadPoolExecutor(len(modes)) as pool:
            list(pool.map(lambda mode: mode._outer_round(), modes))
        elapsed_s = time.monotonic() - started
        if any(mode.num_local_rounds for mode in modes):
            raise RuntimeError(f"the {run.diloco.compression if run.diloco else ''} round was not averaged")
        totals = [mode.context.traffic.totals() for mode in modes]
        with modes[0].averager.get_tensors() as averaged:
            nonzero = sum(int(torch.count_nonzero(tensor)) for tensor in averaged)
            numel = sum(tensor.numel() for tensor in averaged)
    return {
        "sent_mib": sum(sent for sent, _ in totals) / len(totals) / MIB,
        "received_mib": sum(received for _, received in totals) / len(totals) / MIB,
        "average_density": nonzero / numel,
        "round_s": elapsed_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    base = llama_20m()
    start, finals = inner_steps(base, args)
    num_parameters = sum(value.numel() for value in start)
    say(f"llama-20m: {num_parameters / 1e6:.1f}M parameters, {args.peers} peers")
    arms = [("fp16", 0.02), ("int8", 0.02)] + [("topk", fraction) for fraction in args.fractions]
    rows, fp16_sent = [], None
    for compression, fraction in arms:
        run = dataclasses.replace(
            base,
            run_id=f"wire-{compression}-{int(fraction * 1000)}",
            training=TrainingSpec(mode="diloco"),
            averaging=dataclasses.replace(base.averaging, group_size=4, matchmaking_time_s=2.0),
            diloco=DiLoCoSpec(inner_steps=1, compression=compression, topk_fraction=fraction),
        )
        result = one_round(run, start, finals)
        fp16_sent = fp16_sent or result["sent_mib"]
        label = f"topk {fraction:g}" if compression == "topk" else compression
        rows.append(
            [
                label,
                round(result["sent_mib"], 3),
                round(result["received_mib"], 3),
                round(fp16_sent / result["sent_mib"], 1),
                round(result["average_density"], 4),
                round(result["round_s"], 1),
            ]
        )
    header = ["compression", "MiB sent/peer", "MiB received/peer", "fp16 ÷ this", "nonzero in average", "round s"]
    print_table(f"one outer round, llama-20m ({num_parameters / 1e6:.1f}M), {args.peers} peers", header, rows)


if __name__ == "__main__":
    main()
