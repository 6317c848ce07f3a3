"""SkipPipe as a training mode, at a realistic size: the same daemons in `skippipe` and in `gradients` mode.

Issue 17's daemon mode on a model of realistic shape: N `crowdtrain run` daemons on loopback (one founder, the
rest joining), each with one torch thread, first with the model cut into stages (`training.mode = "skippipe"`:
each node takes a stage, the stage-0 nodes drive the iteration's microbatches along scheduled paths), then with
the same model, micro-batch and samples per step trained data-parallel (`gradients`, DeDLOC: every node computes
the whole model and the swarm averages gradients at each global step). After the swarm settles and a warm-up,
each arm is measured over the same window from `crowdtrain status --json --watch`:
- samples/s of the swarm: skippipe, from the iterations every node completed (M microbatches of B samples each);
  gradients, from the global steps' progress (`progress_rate`);
- the training loss the nodes publish at the window's end, and the samples the swarm trained in the window;
- each skippipe node's stage, and the iterations in the window.
With N nodes sharing 2 cores, neither arm can show a parallel speed-up; what it shows is whether the mode trains
at real sizes and what its hops and roster cost against data-parallel training of the same samples. With
`--scenario` (a WAN-lab scenario of N hosts, e.g. scripts/scenarios/home.toml: four 20/20 Mbit/s home links; run
as root) each daemon runs in a host of its own, and the bytes each sent are read from its Prometheus counters
(SkipPipe's hops and gradient exchange; the all-reduce in `gradients`).

    python scripts/bench_skippipe_daemons.py --model llama-20m --nodes 4 --window-s 90 [--scenario FILE]
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_diloco_wan import METRICS_PORT, metrics_in_host
from bench_realmodel import write_run_file
from benchlib import (
    bench_parser,
    environment_json,
    print_table,
    progress_rate,
    record_failure,
    say,
    with_children,
    write_json,
)
from lab.processes import ProcessGroups, await_condition, child_env
from lab.swarm import StatusWatcher, start_swarm
from lab.wanlab import Lab, Scenario

from crowdtrain.manifest import PRESETS, AveragingSpec, RunManifest, SkipPipeSpec, TrainingSpec

STATUS_INTERVAL_S = 2.0
SETTLE_TIMEOUT_S = 300.0


def manifest_for(args: Any, mode: str) -> RunManifest:
    """The preset at the benchmark's sequence length, in `mode`; a global step of `gradients` is one iteration's
    samples (M microbatches of B)."""
    preset = PRESETS[args.model]()
    averaging = preset.averaging
    skippipe = None
    if mode == "skippipe":
        skippipe = SkipPipeSpec(stages=args.stages, skip_ratio=args.skip_ratio, microbatches=args.microbatches)
    else:
        averaging = AveragingSpec(**{**dataclasses.asdict(averaging), "matchmaking_time_s": 2.0})
    return dataclasses.replace(
        preset,
        run_id=f"bench-{mode}",
        training=TrainingSpec(mode=mode),
        target_batch_size=args.microbatches * args.micro_batch,
        data=dataclasses.replace(preset.data, sequence_length=args.sequence_length),
        averaging=averaging,
        skippipe=skippipe,
    )


def measure(args: Any, groups: ProcessGroups, root: Path, mode: str) -> dict[str, Any]:
    """One arm, on loopback or in a WAN lab of `--scenario` (torn down, its daemons killed, however the arm ends)."""
    if not args.scenario:
        return measure_in(args, groups, root, mode, None)
    with Lab(Scenario.load(args.scenario), public_octet=args.public_octet) as lab:
        if len(lab.hosts) != args.nodes:
            raise ValueError(f"the scenario has {len(lab.hosts)} hosts, not --nodes {args.nodes}")
        try:
            return measure_in(args, groups, root, mode, lab)
        finally:
            groups.kill_all()  # before the lab's namespaces go


def measure_in(args: Any, groups: ProcessGroups, root: Path, mode: str, lab: Lab | None) -> dict[str, Any]:
    manifest = manifest_for(args, mode)
    run_file = root / f"{mode}.toml"
    write_run_file(manifest, run_file)
    env = child_env(
        CROWDTRAIN_DEVICE="cpu",
        CROWDTRAIN_MICRO_BATCH_SIZE=str(args.micro_batch),
        CROWDTRAIN_NUM_THREADS="1",
        CROWDTRAIN_STATUS_INTERVAL_S=f"{STATUS_INTERVAL_S:g}",
        **({"CROWDTRAIN_METRICS_PORT": str(METRICS_PORT)} if lab else {}),  # read inside each host
    )
    placements = [(f"/ip4/{h.address}/tcp/0", ("ip", "netns", "exec", h.namespace)) for h in lab.hosts] if lab else None
    say(f"{mode}: {args.nodes} daemons" + (f" in the WAN lab's {lab.scenario.name} hosts" if lab else ""))
    nodes = start_swarm(groups, root / mode, args.nodes, ["--run-file", str(run_file)], env, placements)
    peer_ids = [node.node_info["peer_id"] for node in nodes]
    launcher = placements[0][1] if placements else ()
    watcher = StatusWatcher(groups, nodes[0].address, STATUS_INTERVAL_S, root / f"{mode}-status.log", launcher)

    def settled() -> bool:
        for node in nodes:
            node.check_alive()
        peers = {peer["peer_id"]: peer for peer in (watcher.latest() or {}).get("peers", [])}
        if set(peers) != set(peer_ids):
            return False
        if mode == "skippipe":  # every node runs iterations with every other
            return all(_last_roster_size(node) == args.nodes for node in nodes)
        return all((peer.get("loss") is not None) for peer in peers.values())

    await_condition(settled, SETTLE_TIMEOUT_S, f"the {mode} swarm to train with every node", poll_s=1)
    say(f"{mode}: the swarm trains; {args.warmup_s:g} s warm-up, then measuring {args.window_s:g} s")
    time.sleep(args.warmup_s)  # a warm-up interval, not a synchronisation: both arms get the same
    started = time.monotonic()
    sent_before = _bytes_sent(lab)
    while (left_s := started + args.window_s - time.monotonic()) > 0:
        for node in nodes:
            node.check_alive()
        time.sleep(min(2.0, left_s))
    sent_in_window = _bytes_sent(lab) - sent_before
    snapshots = [
        (t, s)
        for t, s in watcher.between(started, time.monotonic())
        if len(s["peers"]) == args.nodes and all(peer.get("training") for peer in s["peers"])
    ]
    for process in [watcher.process, *(node.process for node in nodes)]:
        groups.kill(process)
    if len(snapshots) < 3:
        raise RuntimeError(f"{mode}: fewer than 3 status snapshots listed every node in the window")
    result = window_result(args, mode, snapshots)
    if lab:
        result["kib_sent_per_sample"] = sent_in_window / 1024 / max(result["samples_in_window"], 1)
    return result


def window_result(args: Any, mode: str, snapshots: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """The arm's numbers from the status snapshots of its window."""
    (t0, first), (t1, last) = snapshots[0], snapshots[-1]
    losses = [peer["loss"] for peer in last["peers"] if peer.get("loss") is not None]
    result: dict[str, Any] = {"loss_at_end": sum(losses) / len(losses) if losses else None}
    if mode == "skippipe":
        done = [
            min(peer["training"]["skippipe_iteration"] for peer in s["peers"]) for _, s in (snapshots[0], snapshots[-1])
        ]
        samples = (done[1] - done[0]) * args.microbatches * args.micro_batch
        result.update(
            iterations_in_window=done[1] - done[0],
            seconds_per_iteration=(t1 - t0) / max(done[1] - done[0], 1),
            samples_per_second=samples / (t1 - t0),
            stages={peer["peer_id"][-8:]: peer["training"]["skippipe_stage"] for peer in last["peers"]},
        )
    else:
        rate = progress_rate(snapshots)
        result.update(
            global_steps_in_window=last["run"]["epoch"] - first["run"]["epoch"],
            samples_per_second=rate,
            partial_averages_in_window=last["run"]["partial_averages"] - first["run"]["partial_averages"],
        )
        samples = (rate or 0) * (t1 - t0)
    result["samples_in_window"] = round(samples)
    return result


def _bytes_sent(lab: Lab | None) -> float:
    """What the daemons in the lab's hosts have sent to peers (averaging, hops), by their counters; 0 on loopback."""
    if lab is None:
        return 0.0
    return sum(metrics_in_host(host.namespace).get("crowdtrain_averaging_sent_bytes", 0.0) for host in lab.hosts)


def _last_roster_size(node: Any) -> int:
    """How many nodes the last roster change a daemon logged counts (0 before any: it runs no iteration yet)."""
    sizes = re.findall(r"iteration \d+: (\d+) nodes", node.log())
    return int(sizes[-1]) if sizes else 0


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="llama-20m", help="a dense LLaMA preset (default llama-20m)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--skip-ratio", type=float, default=0.25)
    parser.add_argument("--microbatches", type=int, default=8, help="M: microbatches per iteration (default 8)")
    parser.add_argument("--micro-batch", type=int, default=4, help="B: samples per microbatch (default 4)")
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--window-s", type=float, default=90.0)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--arms", nargs="+", choices=("skippipe", "gradients"), default=["skippipe", "gradients"])
    parser.add_argument("--scenario", type=Path, help="a WAN-lab scenario of --nodes hosts: one daemon in each")
    parser.add_argument(
        "--public-octet", type=int, default=10, help="the lab bridge's first octet (11: public to libp2p, for relays)"
    )
    args = parser.parse_args()
    settings = vars(args) | {"out": str(args.out), "scenario": str(args.scenario) if args.scenario else None}
    results: dict[str, Any] = {"settings": settings, "environment": environment_json(False)}

    def body(groups: ProcessGroups, root: Path) -> None:
        for mode in args.arms:
            try:
                results[mode] = measure(args, groups, root, mode)
            except Exception as e:  # the other arm's numbers are still worth having
                record_failure(results, mode, e)
            write_json(args.out / "skippipe_daemons.json", results)

    with_children("crowdtrain-bench-skippipe-daemons-", args.out / "logs" / "skippipe_daemons", body)
    rows = []
    for mode in args.arms:
        result = results[mode]
        if "error" in result:
            rows.append([mode, result["error"][:60], "", "", "", ""])
            continue
        steps = result.get("iterations_in_window", result.get("global_steps_in_window"))
        rows.append([mode, f"{result['samples_per_second']:.2f}", steps, result["samples_in_window"],
                     result["loss_at_end"], result.get("kib_sent_per_sample")])  # fmt: skip
    where = f", WAN lab {args.scenario}" if args.scenario else ", loopback"
    print_table(
        f"{args.nodes} daemons, {args.model}, B={args.micro_batch}, M={args.microbatches}, {args.window_s:g} s window"
        + where,
        ["arm", "samples/s", "steps in window", "samples in window", "loss at end", "KiB sent per sample"],
        rows,
    )
    return 0 if all("error" not in results[mode] for mode in args.arms) else 1


if __name__ == "__main__":
    sys.exit(main())
