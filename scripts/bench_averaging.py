"""Benchmark one all-reduce round of S MB over N peers on capped links in WAN-lab namespaces.

Two modes, each a table, JSON and a plot under <out>/:
1. uniform  N hosts at B Mbit/s up and down. The round time of crowdtrain's averaging path (a hivemind
            averager with crowdtrain's settings: PlannedAverager, the demo manifest's group size,
            matchmaking time and fp16 on the wire), of the same with no compression (an equal payload), of
            a plain hivemind DecentralizedAverager with default settings, and of torch.distributed gloo
            all_reduce (one process per namespace, rendezvous over TCP on the lab addresses), against
            the bandwidth-optimal bound 2(N-1)/N * S/B.
2. hetero   scripts/scenarios/hetero.toml (issue 4: one 1 Gbit/s host, three at 20 Mbit/s): the same
            averager with the DeDLOC plan's shares, with an equal split, and with hivemind's load
            balancing fed the hosts' bandwidths. Everything else (fp16, timeouts) is crowdtrain's in all three.
The round time is the all-reduce alone, from the first peer entering it to the last peer leaving it
(matchmaking is reported apart: gloo has none). Every worker checks it holds the exact mean after each round.
Run as root (namespaces); `--worker` is the hidden mode of the processes inside the namespaces.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib as bench
from lab.processes import HarnessError, LineReader, ProcessGroups, child_env, log_tail
from lab.swarm import START_TIMEOUT_S
from lab.wanlab import Host, HostSpec, Lab, Scenario

HETERO_SCENARIO = bench.REPO_ROOT / "scripts" / "scenarios" / "hetero.toml"
BYTES_PER_MB = 1_000_000
"""S is in MB of float32 values (10^6 bytes), B in Mbit/s (10^6 bits/s)."""
GLOO_PORT = 29_500
EXACT_TOLERANCE = 1e-3
"""Largest error of an averaged element against the true mean (values are small integers, exact in fp16)."""
ROUND_TIMEOUT_FLOOR_S = 60.0
"""A worker's round result may take this long at least (matchmaking included) before the round is failed."""
QUICK_MATCHMAKING_S = 2.0
"""The quick run's matchmaking time for crowdtrain's settings (the demo manifest's is 5 s; hivemind's defaults keep
theirs): 8 rounds × 3 s less, and the all-reduce time it measures doesn't include matchmaking."""
TIMEOUT_OVER_BOUND = 8.0
"""Crowdtrain's all-reduce timeout here: this many times the bound (the demo manifest's 20 s is for its
3 MB gradient and would fail large rounds by design)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """One way of averaging, run by one worker per host."""

    name: str
    """Row label and JSON key."""
    kind: str
    """`hivemind` (an averager in each host) or `gloo`."""
    settings: str = "crowdtrain"
    """hivemind only: `crowdtrain` (the daemon's averager settings) or `defaults` (a plain DecentralizedAverager)."""
    compression: str = "fp16"
    """crowdtrain settings only: `fp16` (the daemon's) or `none`."""
    partition: str = "plan"
    """crowdtrain settings only: `plan` (shares given per host), `equal`, or `bandwidth` (hivemind's load balancing)."""
    description: str = ""


UNIFORM_VARIANTS = (
    Variant(name="crowdtrain", kind="hivemind", description="crowdtrain's averager, fp16 on the wire"),
    Variant(name="crowdtrain_fp32", kind="hivemind", compression="none", description="the same without compression"),
    Variant(name="hivemind", kind="hivemind", settings="defaults", description="DecentralizedAverager, defaults"),
    Variant(name="gloo", kind="gloo", description="torch.distributed gloo all_reduce"),
)
HETERO_VARIANTS = (
    Variant(name="plan", kind="hivemind", partition="plan", description="DeDLOC plan shares"),
    Variant(name="equal_split", kind="hivemind", partition="equal", description="equal split"),
    Variant(
        name="hivemind_load_balancing",
        kind="hivemind",
        partition="bandwidth",
        description="hivemind's load balancing, fed the caps",
    ),
)


# --- Inside a namespace: one worker per host ----------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> None:
    """Start, print one `ready` JSON line, then follow stdin: `go` runs one round and prints its timings.

    A hivemind worker keeps its DHT for the whole lab and averages with one averager at a time: a line
    `averager <json>` (the variant's settings) replaces the current one and is answered with a `ready` line.
    """
    import torch

    torch.set_num_threads(1)
    num_elements = args.size_bytes // 4
    tensor = torch.zeros(num_elements, dtype=torch.float32)
    expected_mean = (args.world_size - 1) / 2
    if args.kind == "gloo":
        run_round, ready = _gloo_worker(args, tensor)
        switch = None
    else:
        run_round, ready, switch = _hivemind_worker(args, tensor)
    print(json.dumps({"ready": True, **ready}), flush=True)
    for line in sys.stdin:
        command, _, rest = line.strip().partition(" ")
        if command == "averager" and switch is not None:
            switch(json.loads(rest))
            print(json.dumps({"ready": True}), flush=True)
            continue
        if command != "go":
            break
        result = run_round(float(args.rank))
        result["max_error"] = float((result.pop("tensor") - expected_mean).abs().max())
        print(json.dumps(result), flush=True)


def _gloo_worker(args: argparse.Namespace, tensor: Any) -> tuple[Any, dict[str, Any]]:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # the namespace's link into the lab bridge
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master}:{GLOO_PORT}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout),
    )

    def run_round(value: float) -> dict[str, Any]:
        tensor.fill_(value)
        dist.barrier()
        started = time.time()
        dist.all_reduce(tensor)
        ended = time.time()
        return {
            "ok": True,
            "group_size": args.world_size,
            "start": started,
            "end": ended,
            "tensor": tensor / args.world_size,
        }

    return run_round, {}


def _hivemind_worker(args: argparse.Namespace, tensor: Any) -> tuple[Any, dict[str, Any], Any]:
    import tempfile

    import hivemind

    from crowdtrain.node.identity import load_or_create_identity

    with tempfile.TemporaryDirectory() as directory:  # p2pd reads the key as it starts
        identity = load_or_create_identity(Path(directory) / "identity.key")
        dht = hivemind.DHT(
            initial_peers=[args.initial_peer] if args.initial_peer else None,
            host_maddrs=[f"/ip4/{args.address}/tcp/0"],
            use_ipfs=False,
            identity_path=str(identity.path),
            start=True,
        )
    current: dict[str, Any] = {}

    def switch(variant: dict[str, Any]) -> None:
        """Shut the current averager down and start the variant's, under a prefix of its own."""
        if "averager" in current:
            current["averager"].shutdown()
        print(f"averager for variant {variant['name']}", file=sys.stderr, flush=True)
        timing = mp.Array("d", 2)  # (start, end) of this peer's last all-reduce, written in the averager's process
        current["timing"] = timing
        current["averager"] = make_averager(args, variant, tensor, dht, timing, identity.private_key)

    def run_round(value: float) -> dict[str, Any]:
        averager, timing = current["averager"], current["timing"]
        with averager.get_tensors() as tensors:
            tensors[0].fill_(value)
        timing[0] = timing[1] = 0.0
        began = time.time()
        try:
            gathered = averager.step(timeout=args.timeout)
            ok, group_size, error = gathered is not None, len(gathered or ()), None
        except Exception as e:  # a failed round is a result: recorded, and the next round still runs
            ok, group_size, error = False, 0, f"{type(e).__name__}: {e}"
        ended = time.time()
        with averager.get_tensors() as tensors:
            result = tensors[0].clone()
        return {
            "ok": ok and timing[1] > 0,
            "group_size": group_size,
            "start": timing[0],
            "end": timing[1],
            "step_start": began,
            "step_end": ended,
            "error": error,
            "tensor": result,
        }

    maddrs = [str(maddr) for maddr in dht.get_visible_maddrs() if f"/ip4/{args.address}/" in str(maddr)]
    return run_round, {"maddrs": maddrs}, switch


def make_averager(
    args: argparse.Namespace, variant: dict[str, Any], tensor: Any, dht: Any, timing: Any, key: Any
) -> Any:
    """The averager of the variant, timed: crowdtrain's settings or hivemind's defaults; crowdtrain's signs what it
    gathers with `key`, the one `dht`'s peer ID derives from."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import NoCompression

    from crowdtrain.averaging.partition import PlannedAverager
    from crowdtrain.collaboration.factory import _compression as daemon_compression  # the daemon's own mapping
    from crowdtrain.manifest import demo

    class Timed(DecentralizedAverager):
        async def _run_allreduce_inplace_(self, *a: Any, **kw: Any) -> None:
            started = time.time()
            await super()._run_allreduce_inplace_(*a, **kw)
            timing[0], timing[1] = started, time.time()

    class TimedPlanned(PlannedAverager, Timed):
        pass

    # A prefix per variant: the matchmaking records of the previous averager on this DHT are not this one's.
    common = {"averaged_tensors": [tensor], "dht": dht, "prefix": f"bench-{variant['name']}", "start": True}
    if variant["settings"] == "defaults":
        return Timed(**common)
    spec = demo().averaging
    settings = {
        "target_group_size": spec.group_size,
        # The quick run waits less for peers (args.matchmaking_time): the round time measured is the all-reduce
        # alone, which matchmaking doesn't change; the chunk timeout stays the manifest's in both.
        "min_matchmaking_time": args.matchmaking_time or spec.matchmaking_time_s,
        "next_chunk_timeout": spec.matchmaking_time_s,  # as hivemind.Optimizer sets it from matchmaking_time
        "allreduce_timeout": args.timeout,
        "compression": daemon_compression(spec) if variant["compression"] == "fp16" else NoCompression(),
    }
    if variant["partition"] == "bandwidth":
        return Timed(**common, **settings, bandwidth=args.bandwidth)
    share = args.share if variant["partition"] == "plan" else None
    return TimedPlanned(**common, **settings, share=share, author=key)


# --- The parent: hosts, workers, rounds --------------------------------------------------------------------------


@dataclass(slots=True)
class Worker:
    host: Host
    process: Any
    reader: LineReader
    log_path: Path

    def next_json(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            return json.loads(self.reader.next_line(timeout_s, what))
        except HarnessError as e:
            raise HarnessError(f"{e}; worker log ends:\n{log_tail(self.log_path)}") from None


def start_worker(
    groups: ProcessGroups, host: Host, rank: int, kind: str, options: dict[str, Any], log_path: Path
) -> Worker:
    command = [
        "ip", "netns", "exec", host.namespace, sys.executable, str(Path(__file__).resolve()), "--worker",
        "--kind", kind, "--rank", str(rank), "--address", host.address,
    ]  # fmt: skip
    for name, value in options.items():
        if value is not None:
            command += [f"--{name.replace('_', '-')}", str(value)]
    env = child_env(PYTHONPATH=os.pathsep.join([str(bench.REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log_path, "ab") as log:
        process = groups.start(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    return Worker(host=host, process=process, reader=LineReader(process.stdout), log_path=log_path)


def send(workers: Sequence[Worker], line: str) -> None:
    for worker in workers:
        worker.process.stdin.write(line + "\n")
        worker.process.stdin.flush()


def start_gloo_workers(
    groups: ProcessGroups,
    lab: Lab,
    variant: Variant,
    common: dict[str, Any],
    per_host: dict[str, dict[str, Any]],
    log_dir: Path,
    workers: list[Worker],
) -> None:
    """One gloo rank per host into `workers` (so a failure midway still kills those started), all joined:
    every rank must join the rendezvous before any returns."""
    for rank, host in enumerate(lab.hosts):
        options = {**common, **per_host[host.name]}
        log_path = log_dir / f"{variant.name}-{host.name}.log"
        workers.append(start_worker(groups, host, rank, "gloo", options, log_path))
    for worker in workers:
        worker.next_json(START_TIMEOUT_S, f"gloo worker in {worker.host.name} to join")


def run_variant(
    groups: ProcessGroups,
    lab: Lab,
    variant: Variant,
    size_bytes: int,
    num_rounds: int,
    round_timeout_s: float,
    per_host: dict[str, dict[str, Any]],
    log_dir: Path,
    averagers: list[Worker],
) -> dict[str, Any]:
    """Run `num_rounds` rounds of the variant on every host together; per-round timings.

    gloo starts its own workers and kills them after. The hivemind variants share `averagers`, one worker per
    host, started by the first variant that needs them and kept for the next (each worker swaps its averager
    for the variant's; the DHTs start once per lab); a variant that fails kills them, the next starts anew.
    """
    bench.say(f"averaging: {variant.name} ({variant.description}) on {len(lab.hosts)} hosts")
    common = {"size_bytes": size_bytes, "world_size": len(lab.hosts), "timeout": round_timeout_s}
    common["master"] = lab.hosts[0].address
    workers: list[Worker] = []
    try:
        if variant.kind == "gloo":
            start_gloo_workers(groups, lab, variant, common, per_host, log_dir, workers)
        else:
            if not averagers:
                averagers += start_averagers(groups, lab, common, per_host, log_dir)
            workers = averagers
            send(workers, "averager " + json.dumps(dataclasses.asdict(variant)))
            for worker in workers:
                worker.next_json(START_TIMEOUT_S, f"the {variant.name} averager in {worker.host.name} to start")
        rounds = []
        for number in range(num_rounds):
            send(workers, "go")
            results = [
                worker.next_json(round_timeout_s * 2, f"round {number} in {worker.host.name}") for worker in workers
            ]
            rounds.append(summarize_round(results, len(lab.hosts)))
            bench.say(f"averaging: {variant.name} round {number}: {describe_round(rounds[-1])}")
    except BaseException:
        if workers is averagers:
            averagers.clear()  # in an unknown state: the next variant starts fresh workers
        raise
    finally:
        if workers is not averagers:
            for worker in workers:
                groups.kill(worker.process)
    return summarize_rounds(rounds)


def start_averagers(
    groups: ProcessGroups,
    lab: Lab,
    common: dict[str, Any],
    per_host: dict[str, dict[str, Any]],
    log_dir: Path,
) -> list[Worker]:
    """One hivemind worker per host, its DHT started; the first worker's DHT is the others' initial peer."""

    def start(rank: int, host: Host, initial_peer: str | None = None) -> Worker:
        options = {**common, **per_host[host.name], "initial_peer": initial_peer}
        return start_worker(groups, host, rank, "hivemind", options, log_dir / f"averagers-{host.name}.log")

    first = start(0, lab.hosts[0])
    initial_peer = first.next_json(START_TIMEOUT_S, "the first averaging worker to start")["maddrs"][0]
    others = [start(rank, host, initial_peer) for rank, host in enumerate(lab.hosts[1:], start=1)]
    for worker in others:
        worker.next_json(START_TIMEOUT_S, f"the averaging worker in {worker.host.name} to start")
    return [first, *others]


def summarize_round(results: list[dict[str, Any]], num_peers: int) -> dict[str, Any]:
    complete = all(r["ok"] and r["group_size"] == num_peers for r in results)
    exact = all(r["max_error"] <= EXACT_TOLERANCE for r in results)
    summary: dict[str, Any] = {"complete": complete, "exact": exact, "errors": [r.get("error") for r in results]}
    if complete:
        summary["allreduce_s"] = max(r["end"] for r in results) - min(r["start"] for r in results)
        if "step_start" in results[0]:
            summary["step_s"] = max(r["step_end"] for r in results) - min(r["step_start"] for r in results)
    summary["group_sizes"] = [r["group_size"] for r in results]
    summary["max_error"] = max(r["max_error"] for r in results)
    return summary


def describe_round(summary: dict[str, Any]) -> str:
    if not summary["complete"]:
        return f"incomplete (group sizes {summary['group_sizes']}; {summary['errors']})"
    exact = "exact" if summary["exact"] else f"NOT exact (max error {summary['max_error']:.3g})"
    return f"all-reduce {summary['allreduce_s']:.2f} s, {exact}"


def summarize_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median all-reduce time over the complete, exact rounds (None if there is none)."""
    good = [r for r in rounds if r["complete"] and r["exact"]]
    times = [r["allreduce_s"] for r in good]
    steps = [r["step_s"] for r in good if "step_s" in r]
    return {
        "rounds": rounds,
        "num_rounds": len(rounds),
        "num_good_rounds": len(good),
        "allreduce_s": statistics.median(times) if times else None,
        "allreduce_s_min": min(times) if times else None,
        "step_s": statistics.median(steps) if steps else None,
    }


def bound_s(size_bytes: float, num_peers: int, bandwidth_mbps: float) -> float:
    """The bandwidth-optimal all-reduce time 2(N-1)/N * S/B."""
    return 2 * (num_peers - 1) / num_peers * size_bytes * 8 / (bandwidth_mbps * 1e6)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def measured_or_error(groups: ProcessGroups, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A variant's result, or its error (all-reduce time None) once every worker was killed: shared ones too, as
    run_variant let go of them."""
    try:
        return run()
    except HarnessError as e:
        traceback.print_exc()
        groups.kill_all()
        return {"error": str(e), "allreduce_s": None}


# --- 1. Uniform links -------------------------------------------------------------------------------------------


def bench_uniform(
    groups: ProcessGroups, args: argparse.Namespace, log_dir: Path, variants: Sequence[Variant] = UNIFORM_VARIANTS
) -> dict[str, Any]:
    size_bytes = int(args.size_mb * BYTES_PER_MB)
    bound = bound_s(size_bytes, args.peers, args.mbps)
    timeout_s = max(ROUND_TIMEOUT_FLOOR_S, TIMEOUT_OVER_BOUND * bound)
    scenario = Scenario(
        name="uniform", hosts=(HostSpec(name="peer", count=args.peers, upload_mbps=args.mbps, download_mbps=args.mbps),)
    )
    results: dict[str, Any] = {}
    with Lab(scenario) as lab:
        matchmaking = QUICK_MATCHMAKING_S if args.quick else None
        shares = {host.name: {"share": 1 / args.peers, "matchmaking_time": matchmaking} for host in lab.hosts}
        averagers: list[Worker] = []
        for variant in variants:
            run = functools.partial(run_variant, groups, lab, variant, size_bytes, args.rounds, timeout_s, shares)
            results[variant.name] = measured_or_error(groups, functools.partial(run, log_dir, averagers))
    crowdtrain, fp32 = results["crowdtrain"]["allreduce_s"], results.get("crowdtrain_fp32", {}).get("allreduce_s")
    return {
        "num_peers": args.peers,
        "size_mb": args.size_mb,
        "bandwidth_mbps": args.mbps,
        "num_rounds": args.rounds,
        "crowdtrain_matchmaking_s": matchmaking or "the demo manifest's",
        "bound_s": bound,
        "bound_fp16_wire_s": bound / 2,
        "allreduce_timeout_s": timeout_s,
        "variants": results,
        "time_over_bound": {name: ratio(r["allreduce_s"], bound) for name, r in results.items()},
        "averaging_time_over_bound": ratio(crowdtrain, bound),
        "averaging_time_over_fp16_wire_bound": ratio(crowdtrain, bound / 2),
        "averaging_speedup_vs_hivemind": ratio(results.get("hivemind", {}).get("allreduce_s"), crowdtrain),
        "averaging_speedup_vs_gloo": ratio(results.get("gloo", {}).get("allreduce_s"), crowdtrain),
        "equal_payload": {
            "averaging_time_over_bound": ratio(fp32, bound),
            "averaging_speedup_vs_hivemind": ratio(results.get("hivemind", {}).get("allreduce_s"), fp32),
            "averaging_speedup_vs_gloo": ratio(results.get("gloo", {}).get("allreduce_s"), fp32),
        },
    }


def print_uniform(result: dict[str, Any]) -> None:
    bound = result["bound_s"]
    rows: list[list[Any]] = [["bound 2(N-1)/N·S/B", "—", bound, 1.0, None, None]]
    for variant in UNIFORM_VARIANTS:
        r = result["variants"].get(variant.name)
        if r is None:
            continue
        rounds = f"{r.get('num_good_rounds', 0)}/{r.get('num_rounds', 0)}"
        rows.append(
            [
                variant.name,
                rounds,
                r["allreduce_s"],
                ratio(r["allreduce_s"], bound),
                r.get("step_s"),
                variant.description,
            ]
        )
    bench.print_table(
        f"Averaging: {result['size_mb']:g} MB over {result['num_peers']} peers at {result['bandwidth_mbps']:g} Mbit/s",
        ["", "good rounds", "all-reduce s (median)", "× bound", "with matchmaking s", "what"],
        rows,
    )
    for key in ("averaging_time_over_bound", "averaging_speedup_vs_hivemind", "averaging_speedup_vs_gloo"):
        print(f"{key} = {_fmt(result[key])}   (equal payload, no compression: {_fmt(result['equal_payload'][key])})")
    print(
        "crowdtrain sends fp16 on the wire (its default), half the bytes of the float32 S the other rows move:\n"
        "  against the bound for what it really sends (S/2) it takes "
        f"{_fmt(result['averaging_time_over_fp16_wire_bound'])}×; the equal-payload numbers compare like with like."
    )


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


# --- 2. Heterogeneous links (issue 4) -----------------------------------------------------------------------


def bench_hetero(
    groups: ProcessGroups, args: argparse.Namespace, log_dir: Path, variants: Sequence[Variant] = HETERO_VARIANTS
) -> dict[str, Any]:
    from hivemind.averaging.load_balancing import load_balance_peers

    from crowdtrain.planning.plan import (
        PeerCapabilities,
        PlanProblem,
        allreduce_time_s,
        compute_plan,
        equal_split_time_s,
    )

    scenario = Scenario.load(args.scenario)
    size_bytes = int(args.hetero_size_mb * BYTES_PER_MB)
    wire_bytes = size_bytes // 2  # fp16, crowdtrain's compression, in all three variants
    results: dict[str, Any] = {}
    with Lab(scenario) as lab:
        # Every host computes (a forced trainer): the comparison is about the partition alone.
        peers = [
            PeerCapabilities(
                peer_id=host.name,
                samples_per_second=1.0,
                upload_mbps=host.upload_mbps,
                download_mbps=host.download_mbps,
                reachable=True,
                forced_role="trainer",
            )
            for host in lab.hosts
        ]
        problem = PlanProblem(vector_size_bytes=wire_bytes, target_batch_size=1024)
        plan = compute_plan(peers, problem)
        bandwidths = [min(host.upload_mbps, host.download_mbps) for host in lab.hosts]
        balanced = load_balance_peers(wire_bytes // 2, bandwidths)  # elements of fp16
        balanced_shares = {host.name: part / sum(balanced) for host, part in zip(lab.hosts, balanced, strict=True)}
        computes = {host.name: True for host in lab.hosts}
        predicted = {
            "plan": plan.averaging_time_s,
            "equal_split": equal_split_time_s(peers, problem, computes),
            "hivemind_load_balancing": allreduce_time_s(peers, problem, computes, balanced_shares),
        }
        per_host = {
            host.name: {
                "share": plan.shares[host.name],
                "bandwidth": min(host.upload_mbps, host.download_mbps),
                "matchmaking_time": QUICK_MATCHMAKING_S if args.quick else None,
            }
            for host in lab.hosts
        }
        timeout_s = max(ROUND_TIMEOUT_FLOOR_S, TIMEOUT_OVER_BOUND * max(predicted.values()))
        averagers: list[Worker] = []
        for variant in variants:
            run = functools.partial(run_variant, groups, lab, variant, size_bytes, args.rounds, timeout_s, per_host)
            results[variant.name] = measured_or_error(groups, functools.partial(run, log_dir, averagers))
            results[variant.name]["predicted_s"] = predicted[variant.name]
    plan_s = results["plan"]["allreduce_s"]
    return {
        "scenario": str(
            args.scenario.relative_to(bench.REPO_ROOT)
            if args.scenario.is_relative_to(bench.REPO_ROOT)
            else args.scenario
        ),
        "hosts": [{"name": h.name, "upload_mbps": h.upload_mbps, "download_mbps": h.download_mbps} for h in lab.hosts],
        "size_mb": args.hetero_size_mb,
        "wire_mb": wire_bytes / BYTES_PER_MB,
        "num_rounds": args.rounds,
        "allreduce_timeout_s": timeout_s,
        "plan_shares": plan.shares,
        "hivemind_load_balancing_shares": balanced_shares,
        "variants": results,
        "plan_speedup_vs_equal_split": ratio(results["equal_split"]["allreduce_s"], plan_s),
        "plan_speedup_vs_hivemind_load_balancing": ratio(
            results.get("hivemind_load_balancing", {}).get("allreduce_s"), plan_s
        ),
        "predicted_plan_speedup_vs_equal_split": ratio(predicted["equal_split"], predicted["plan"]),
        "predicted_plan_speedup_vs_hivemind_load_balancing": ratio(
            predicted["hivemind_load_balancing"], predicted["plan"]
        ),
    }


def print_hetero(result: dict[str, Any]) -> None:
    rows = []
    for variant in [variant for variant in HETERO_VARIANTS if variant.name in result["variants"]]:
        r = result["variants"][variant.name]
        rounds = f"{r.get('num_good_rounds', 0)}/{r.get('num_rounds', 0)}"
        rows.append([variant.name, rounds, r["allreduce_s"], r["predicted_s"], r.get("step_s"), variant.description])
    hosts = ", ".join(f"{h['name']} {min(h['upload_mbps'], h['download_mbps']):g}" for h in result["hosts"])
    bench.print_table(
        f"Averaging on {result['scenario']} ({hosts} Mbit/s): {result['size_mb']:g} MB, fp16 on the wire in every row",
        ["", "good rounds", "all-reduce s (median)", "predicted s", "with matchmaking s", "partition"],
        rows,
    )
    shares = ", ".join(f"{name} {share:.3f}" for name, share in result["plan_shares"].items())
    balanced = ", ".join(f"{name} {share:.3f}" for name, share in result["hivemind_load_balancing_shares"].items())
    print(f"plan shares: {shares}\nhivemind load-balancing shares: {balanced}")
    for key in ("plan_speedup_vs_equal_split", "plan_speedup_vs_hivemind_load_balancing"):
        print(f"{key} = {_fmt(result[key])}   (predicted by the plan's cost model: {_fmt(result['predicted_' + key])})")


@bench.plot_to_png(1, 2, figsize=(11, 4.5))
def plot(results: dict[str, Any], axes: Any) -> None:
    left, right = axes
    if "uniform" in results and "error" not in results["uniform"]:
        uniform = results["uniform"]
        names = [v.name for v in UNIFORM_VARIANTS if v.name in uniform["variants"]]
        times = [uniform["variants"][name]["allreduce_s"] or 0.0 for name in names]
        left.bar(["bound", *names], [uniform["bound_s"], *times], color=["grey"] + ["C0"] * len(names))
        title = f"{uniform['size_mb']:g} MB, {uniform['num_peers']} peers, {uniform['bandwidth_mbps']:g} Mbit/s"
        left.set(ylabel="all-reduce time, s (median)", title=title)
        left.tick_params(axis="x", labelrotation=20)
    if "hetero" in results and "error" not in results["hetero"]:
        hetero = results["hetero"]
        names = [v.name for v in HETERO_VARIANTS if v.name in hetero["variants"]]
        measured = [hetero["variants"][name]["allreduce_s"] or 0.0 for name in names]
        predicted = [hetero["variants"][name]["predicted_s"] for name in names]
        positions = range(len(names))
        right.bar([p - 0.2 for p in positions], measured, width=0.4, label="measured")
        right.bar([p + 0.2 for p in positions], predicted, width=0.4, label="predicted (plan's cost model)")
        right.set_xticks(list(positions), names, rotation=15)
        right.set(ylabel="all-reduce time, s", title=f"hetero: {hetero['size_mb']:g} MB (fp16 on the wire)")
        right.legend()


# --- Entry point ----------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench.bench_parser(__doc__, "smaller vectors and fewer rounds")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest run: uniform mode, crowdtrain and gloo, 2 peers, 2 MB, 1 round",
    )
    parser.add_argument("--mode", choices=("uniform", "hetero", "both"), default="both")
    parser.add_argument("--peers", type=int, help="uniform: peers N (default 4)")
    parser.add_argument("--size-mb", type=float, help="uniform: S in MB of float32 (default 100, quick 20)")
    parser.add_argument("--mbps", type=float, help="uniform: link cap B in Mbit/s (default 100)")
    parser.add_argument("--hetero-size-mb", type=float, help="hetero: S in MB (default 40, quick 10)")
    parser.add_argument("--scenario", type=Path, default=HETERO_SCENARIO, help="hetero: the scenario TOML")
    parser.add_argument("--rounds", type=int, help="rounds per variant (default 5, quick 2)")
    worker = parser.add_argument_group("worker (hidden)")
    for name in ("--kind", "--address", "--initial-peer", "--master"):
        worker.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--rank", "--world-size", "--size-bytes"):
        worker.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--share", "--bandwidth", "--timeout", "--matchmaking-time"):
        worker.add_argument(name, type=float, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.mode, args.peers, args.size_mb, args.rounds = "uniform", args.peers or 2, args.size_mb or 2.0, 1
    args.peers = args.peers or 4
    args.size_mb = args.size_mb or (20.0 if args.quick else 100.0)
    args.mbps = args.mbps or 100.0
    args.hetero_size_mb = args.hetero_size_mb or (10.0 if args.quick else 40.0)
    args.rounds = args.rounds or (2 if args.quick else 5)
    return args


def run_modes(args: argparse.Namespace, groups: ProcessGroups, log_dir: Path, results: dict[str, Any]) -> bool:
    """Each mode in turn, results saved after each; a failed mode is recorded and the next one still runs."""
    ok = True
    for mode in ("uniform", "hetero") if args.mode == "both" else (args.mode,):
        try:
            if mode == "uniform":
                smoke = (UNIFORM_VARIANTS[0], UNIFORM_VARIANTS[3])  # crowdtrain and gloo: the fastest to start
                variants = smoke if args.smoke else UNIFORM_VARIANTS
                results[mode] = bench_uniform(groups, args, log_dir, variants)
                print_uniform(results[mode])
            else:
                # The quick run leaves out hivemind's load balancing: it has matched the plan (both give the fast
                # host the whole vector) in every run so far; the full run keeps it.
                variants = HETERO_VARIANTS[:2] if args.quick else HETERO_VARIANTS
                results[mode] = bench_hetero(groups, args, log_dir, variants)
                print_hetero(results[mode])
        except Exception as e:  # record it and go on: the other mode's numbers are still worth having
            bench.record_failure(results, mode, e)
            ok = False
        finally:
            groups.kill_all()
        results["environment"]["load_average_at_end"] = os.getloadavg()
        bench.write_json(args.out / "averaging.json", results)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    if os.geteuid() != 0:
        print("bench_averaging needs root: it creates network namespaces", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"caveat": bench.NOISE_CAVEAT, "environment": bench.environment_json(args.quick)}
    log_dir = args.out / "logs" / "averaging"
    log_dir.mkdir(parents=True, exist_ok=True)
    groups = ProcessGroups()
    try:
        ok = run_modes(args, groups, log_dir, results)
    except KeyboardInterrupt:
        print("interrupted; every worker was killed and the lab torn down", file=sys.stderr)
        return 130
    finally:
        groups.kill_all()
    bench.say_plotted(args.out, "averaging", plot, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
