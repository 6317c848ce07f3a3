"""Benchmark DiLoCo against DeDLOC gradient averaging in the WAN lab: 4 daemons on home links, equal samples.

Issue 15's benchmark. Four `crowdtrain run` daemons, each in its own WAN-lab host (a network namespace whose
upload and download are capped by `tc tbf`), train one run per arm, one arm after the other, until the swarm has
processed `--batches` global batches of 64 or trained `--arm-wall-s` seconds (losses are then compared at the
samples every arm reached):

- `gradients`: DeDLOC as today, an fp16 all-reduce of the gradients every global batch;
- `diloco-fp16`, `diloco-int8`, `diloco-topk`: DiLoCo, H = `--inner-steps` global batches of inner AdamW steps per
  outer round, the pseudo-gradients averaged in the background (`overlap`, the default) in that encoding (top-k
  keeps 2% of each tensor with error feedback); `diloco-int8-stream`: Streaming DiLoCo, int8, the model in 4
  fragments, one averaged every H / 4 global batches in turn (`diloco.fragments`);
- `spes`, `spes-replicas` (issue 16; `--model olmoe-28m` or `olmoe-demo`, a mixture of experts): SPES, the dense
  part's outer rounds as `diloco-int8` but waiting for the round (SPES doesn't overlap), each node training only
  the experts it owns and fetching the others' as int8 changes; `spes-replicas`: two owners per expert;
- `single`: one process (this one, both cores) training the same model on global batches of 64, AdamW as the
  manifest, the gradient clipped as the swarm's.

The daemons wait for each other before their first step (`start_with_peers`: nobody trains alone, nobody downloads
the state at the start). The first daemon scores its replica on the run's 32 held-out windows every 512 samples
(`eval_every`), so every arm gives held-out loss against samples and against wall time (from the moment the swarm
began to train: the founder's wait for the others ended; the single process from its first step). Per arm: compute
utilisation per peer (its log's "computing" share, mean over the epochs after the first), averaging bytes sent per
sample (the daemons' Prometheus counters, read inside each host), partial rounds, time to a target loss (the highest
final held-out loss among the arms, so every arm reaches it) and ratios against `gradients`. Scenarios: `home` (four
20/20 Mbit/s hosts) and `hetero` (one 1000 Mbit/s host and three home ones); `single` runs once whatever the
scenarios. Run as root (namespaces); the lab is torn down however the benchmark ends.

    python scripts/bench_diloco_wan.py [--scenarios home hetero] [--batches 48] [--inner-steps 8] [--arms ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib import (
    bench_parser,
    parse_metrics,
    plot_to_png,
    print_table,
    say,
    say_plotted,
    with_children,
    write_json,
)
from lab.fixtures import LLAMA_20M_CONFIG, bench_run_file
from lab.processes import HarnessError, ProcessGroups, await_condition, child_env
from lab.swarm import START_TIMEOUT_S, Daemon, start_daemon, start_swarm
from lab.wanlab import Host, HostSpec, Lab, Scenario

from crowdtrain.data import WindowSampler, load_token_stream
from crowdtrain.links.relays import reachability
from crowdtrain.manifest import RunManifest, load_run_file, spes_28m, spes_demo
from crowdtrain.models import build_model, load_tokenizer, training_loss
from crowdtrain.optimizer import learning_rate_factor
from crowdtrain.training.held_out import HeldOutScorer
from crowdtrain.training.loop import run_seed

BATCH = 64
MICRO_BATCH = 8
EVAL_SAMPLES = 512
"""The first daemon scores the held-out windows every this many samples (8 global batches)."""
METRICS_PORT = 29500
"""Every daemon's Prometheus port, inside its own host (namespace)."""
ARMS = (
    "single", "gradients", "diloco-fp16", "diloco-int8", "diloco-topk", "diloco-int8-stream", "spes", "spes-replicas",
)  # fmt: skip
SPES_ARMS = ("spes", "spes-replicas")
"""SPES (issue 16), mixture-of-experts models only: the dense part's rounds as `diloco-int8` without overlap (SPES
rounds wait for the exchange), the experts from their owners as int8 changes; `spes-replicas`: two owners each."""
STREAM_FRAGMENTS = 4
"""`diloco-int8-stream`: Streaming DiLoCo, the model in this many fragments, one averaged per H / 4 global batches."""
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-20m": ("LlamaForCausalLM", LLAMA_20M_CONFIG),
    "demo": ("LlamaForCausalLM", LLAMA_20M_CONFIG | {"hidden_size": 256, "intermediate_size": 688,
                                                     "num_hidden_layers": 4, "num_attention_heads": 4,
                                                     "num_key_value_heads": 4}),
    "olmoe-28m": ("OlmoeForCausalLM", dict(spes_28m().model.config)),
    "olmoe-demo": ("OlmoeForCausalLM", dict(spes_demo().model.config)),
}  # fmt: skip
"""Models by name: llama-20m's shape (25.4M parameters with the byte vocabulary), the demo's (3.2M, smoke runs), and
the SPES presets' mixtures of experts (28.4M: 6 layers of 8 experts, top-2; 5.4M)."""
SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
SCENARIOS = {
    "home": (HostSpec(name="home", count=4, upload_mbps=20, download_mbps=20),),
    "hetero": (
        HostSpec(name="fast", upload_mbps=1000, download_mbps=1000),
        HostSpec(name="home", count=3, upload_mbps=20, download_mbps=20),
    ),
    "nat": Scenario.load(SCENARIO_DIR / "home-nat.toml").hosts,
    "open": Scenario.load(SCENARIO_DIR / "home-open.toml").hosts,
}
"""`nat` and `open` (issue 46): one public host at 100 Mbit/s and three home hosts at 20, two of which sit behind
routers of their own in `nat` (nothing forwarded) and are public in `open`. Their bridge is on 11.x, which libp2p
counts as public, so its relays and AutoNAT behave as on the internet; the others keep 10.x."""
RELAY_SCENARIOS = ("nat", "open")
START_S = 600.0
"""Bound on the daemons' start, link probes and wait for each other, before an arm's wall-time cap begins."""
SCORE = re.compile(r"epoch (\d+): held-out loss ([\d.]+) on")
COMPUTING = re.compile(r"epoch (\d+): loss .*computing (\d+)% of the time")
CONTRIBUTED = {
    "gradients": re.compile(r"^(\d\d:\d\d:\d\d) .*epoch \d+: loss", re.M),
    "rounds": re.compile(r"^(\d\d:\d\d:\d\d) .*outer round \d+: averaged with the swarm", re.M),
}
"""A daemon's first contributed step, by its log: a global step it took with the swarm (`gradients`), or an outer
round it averaged with the swarm (DiLoCo, SPES)."""


def run_text(args: argparse.Namespace, arm: str) -> str:
    architecture, config = MODELS[args.model]
    mode = "gradients" if arm in ("gradients", "single") else "spes" if arm in SPES_ARMS else "diloco"
    diloco = spes = ""
    if mode == "diloco":
        compression = arm.removeprefix("diloco-").removesuffix("-stream")
        fragments = STREAM_FRAGMENTS if arm.endswith("-stream") else 1
        diloco = (
            f'\n[diloco]\ninner_steps = {args.inner_steps}\ncompression = "{compression}"\noverlap = true\n'
            f"fragments = {fragments}\n"
        )
    if mode == "spes":
        diloco = f'\n[diloco]\ninner_steps = {args.inner_steps}\ncompression = "int8"\noverlap = false\n'
        spes = f"\n[spes]\nreplicas = {2 if arm == 'spes-replicas' else 1}\n"
    return bench_run_file(
        f"wan-{arm}", batch=BATCH, model_config=config, sequence_length=args.sequence_length, mode=mode,
        averaging_timeout_s=90.0, architecture=architecture, sections=diloco + spes,
    )  # fmt: skip


def samples_per_epoch(args: argparse.Namespace, arm: str) -> int:
    """Samples per epoch: a global batch, an outer round (H global batches), or a streaming round (H / 4)."""
    if not arm.startswith(("diloco", "spes")):
        return BATCH
    return BATCH * args.inner_steps // (STREAM_FRAGMENTS if arm.endswith("-stream") else 1)


# --- the swarm arms ---------------------------------------------------------------------------------------------


class ScoreWatch:
    """The first daemon's held-out scores as they appear in its log, each stamped with the wall time since the swarm
    started training (the founder's log says when its wait for the others ended)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.started: float | None = None
        self.points: dict[int, tuple[float, float]] = {}  # epoch -> (seconds since the start, loss)

    def poll(self) -> int:
        """Read new scores; returns the last epoch scored (0 before any)."""
        log = self.daemon.log()
        if self.started is None and "nodes are ready: starting to train" in log:
            self.started = time.monotonic()
        for epoch, loss in SCORE.findall(log):
            self.points.setdefault(int(epoch), (time.monotonic() - (self.started or 0.0), float(loss)))
        return max(self.points, default=0)


def metrics_in_host(host_namespace: str) -> dict[str, float]:
    """A daemon's unlabelled crowdtrain_* values, read inside its host (its endpoint listens on its loopback)."""
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    text = subprocess.run(
        ["ip", "netns", "exec", host_namespace, "curl", "-s", "--max-time", "10", url],
        capture_output=True, text=True, check=True, timeout=20,
    ).stdout  # fmt: skip
    return parse_metrics(text)


def utilisation(log: str) -> float | None:
    """The mean compute share of the epochs a daemon logged, its first left out (start-up, probes, the joins)."""
    shares = [int(share) / 100 for epoch, share in COMPUTING.findall(log) if int(epoch) > 1]
    return sum(shares) / len(shares) if shares else None


def swarm_arm(args: argparse.Namespace, scenario: str, arm: str, groups: ProcessGroups, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    run_file = root / f"{arm}.toml"
    run_file.write_text(run_text(args, arm))
    per_epoch = samples_per_epoch(args, arm)
    last_epoch = args.batches * BATCH // per_epoch
    octet = 11 if scenario in RELAY_SCENARIOS else 10
    with Lab(Scenario(name=scenario, hosts=SCENARIOS[scenario]), public_octet=octet) as lab:
        placements = [(f"/ip4/{host.address}/tcp/0", ("ip", "netns", "exec", host.namespace)) for host in lab.hosts]
        # Public daemons all train (no aggregate-only role from the plan on 2 shared cores); a NATed one takes
        # the role its plan gives it, as a volunteer's would.
        roles = [() if host.behind_nat else ("--role", "trainer") for host in lab.hosts]
        env = child_env(
            CROWDTRAIN_MICRO_BATCH_SIZE=str(MICRO_BATCH),
            CROWDTRAIN_NUM_THREADS="1",
            CROWDTRAIN_METRICS_PORT=str(METRICS_PORT),
            CROWDTRAIN_CHECKPOINT_INTERVAL_S="100000",
            CROWDTRAIN_EVAL_EVERY=str(max(EVAL_SAMPLES // per_epoch, 1)),  # read by the first daemon only: below
            CROWDTRAIN_START_WITH_PEERS=str(len(lab.hosts)),  # no node trains alone, nobody downloads at the start
        )
        quiet = env | {"CROWDTRAIN_EVAL_EVERY": "0"}
        try:
            spawned = [time.time()]
            nodes = start_swarm(groups, root / arm, 1, ["--run-file", str(run_file), *roles[0]], env, placements)
            started = time.monotonic()
            for index in range(1, len(lab.hosts)):
                spawned.append(time.time())
                nodes.append(_join(groups, root / arm, index, nodes[0], quiet, placements[index], roles[index]))
            for index, node in enumerate(nodes):
                await_condition(node.ready, START_TIMEOUT_S, f"daemon {index} to start")
            say(f"{scenario}/{arm}: {len(nodes)} daemons up; to epoch {last_epoch} ({args.batches * BATCH} samples)")
            watch = ScoreWatch(nodes[0])

            def finished() -> bool:
                for node in nodes:
                    node.check_alive()
                capped = watch.started is not None and time.monotonic() - watch.started > args.arm_wall_s
                return watch.poll() >= last_epoch or capped

            await_condition(
                finished, args.arm_wall_s + START_S, f"{scenario}/{arm} to reach epoch {last_epoch}", poll_s=1
            )
            wall_s = time.monotonic() - (watch.started or started)
            if watch.poll() < last_epoch:
                say(f"{scenario}/{arm}: stopped at its {args.arm_wall_s:g}-s cap, at epoch {watch.poll()}")
            counters = [metrics_in_host(host.namespace) for host in lab.hosts]
            logs = [node.log() for node in nodes]
            hosts = per_host(arm, lab, nodes, spawned, counters, logs, status_in_host(lab.hosts[0], nodes[0]))
        finally:
            groups.kill_all()  # before the lab's namespaces go
    return swarm_result(arm, per_epoch, watch, counters, logs, wall_s) | {"hosts": hosts}


def _join(
    groups: ProcessGroups,
    root: Path,
    index: int,
    founder: Daemon,
    env: dict[str, str],
    where: tuple[str, Any],
    role: tuple[str, ...],
) -> Daemon:
    return start_daemon(
        groups, root / f"node{index}", *role, env=env, initial_peers=[founder.address], listen=where[0],
        launcher=where[1],
    )  # fmt: skip


def status_in_host(host: Host, daemon: Daemon) -> dict[str, Any]:
    """`crowdtrain status --json` of `daemon`, run inside its host; {} if it gave none."""
    shown = subprocess.run(
        ["ip", "netns", "exec", host.namespace, sys.executable, "-m", "crowdtrain", "status", "--json",
         "--state-dir", str(daemon.state_dir)],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )  # fmt: skip
    try:
        return dict(json.loads(shown.stdout))
    except ValueError:
        say(f"status failed: {shown.stderr.strip()[-300:]}")
        return {}


def per_host(
    arm: str,
    lab: Lab,
    nodes: list[Daemon],
    spawned: list[float],
    counters: list[dict[str, float]],
    logs: list[str],
    status: dict[str, Any],
) -> list[dict[str, Any]]:
    """What each host's daemon did: whether it sits behind a NAT, the samples it trained, the seconds from its
    `run` to its first contributed step (by its log), and the part the founder's status shows it holding (roles,
    reachability, aggregation share, SPES experts owned)."""
    peers = {peer["peer_id"]: peer for peer in status.get("peers", [])}
    pattern = CONTRIBUTED["gradients" if arm == "gradients" else "rounds"]
    result = []
    for host, node, started, values, log in zip(lab.hosts, nodes, spawned, counters, logs, strict=True):
        peer = peers.get(node.node_info.get("peer_id", ""), {})
        first = pattern.search(log)
        result.append({
            "host": host.name, "nat": host.behind_nat, "samples_trained": values.get("crowdtrain_samples_trained"),
            "s_to_first_contribution": _seconds_since(started, first.group(1)) if first else None,
            "roles": peer.get("roles"), "reach": _reach(peer), "relays": len(peer.get("relays") or ()),
            "aggregation_share": peer.get("aggregation_share"),
            "experts_owned": (peer.get("training") or {}).get("experts_owned"),
        })  # fmt: skip
    return result


def _reach(peer: dict[str, Any]) -> str | None:
    if not peer:
        return None
    return reachability(peer.get("reachable"), peer.get("reachability_measured"), peer.get("relays") or ())


def _seconds_since(started: float, clock: str) -> float:
    """Seconds from `started` (unix time) to a log line's local HH:MM:SS on the same or the next day."""
    day = datetime.datetime.fromtimestamp(started).replace(hour=0, minute=0, second=0, microsecond=0)
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    at = day.replace(hour=hours, minute=minutes, second=seconds).timestamp()
    return at - started if at >= started - 1 else at + 86_400 - started


def swarm_result(
    arm: str, per_epoch: int, watch: ScoreWatch, counters: list[dict[str, float]], logs: list[str], wall_s: float
) -> dict[str, Any]:
    samples = sum(values.get("crowdtrain_samples_trained", 0.0) for values in counters)
    sent = sum(values.get("crowdtrain_averaging_sent_bytes", 0.0) for values in counters)
    points = sorted(watch.points.items())
    return {
        "arm": arm,
        "samples": [epoch * per_epoch for epoch, _ in points],
        "wall_s": [seconds for _, (seconds, _) in points],
        "held_out_loss": [loss for _, (_, loss) in points],
        "utilisation_per_peer": [utilisation(log) for log in logs],
        "sent_bytes_per_sample": sent / max(samples, 1.0),
        "samples_trained": samples,
        "partial_averages": sum(values.get("crowdtrain_partial_averages", 0.0) for values in counters),
        "wall_s_total": wall_s,
    }


# --- one process --------------------------------------------------------------------------------------------------


def single_arm(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The same model and global batch in this process on both cores, scored every 512 samples like the swarm."""
    run_file = root / "single.toml"
    run_file.write_text(run_text(args, "single"))
    manifest: RunManifest = load_run_file(str(run_file))
    tokenizer = load_tokenizer(manifest.model)
    torch.set_num_threads(2)
    model = build_model(manifest.model, tokenizer.vocab_size, seed=run_seed(manifest))
    sampler = WindowSampler(load_token_stream(manifest.data, tokenizer, root / "cache"), args.sequence_length, 0)
    scorer = HeldOutScorer.for_sampler(model, "causal", sampler, EVAL_SAMPLES // BATCH, "cpu")
    spec = manifest.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=spec.weight_decay)
    result: dict[str, Any] = {"arm": "single", "samples": [], "wall_s": [], "held_out_loss": []}
    started, compute_s = time.monotonic(), 0.0
    for step in range(1, args.batches + 1):
        began = time.monotonic()
        for micro in range(BATCH // MICRO_BATCH):
            (
                training_loss(model, sampler.batch(step, MICRO_BATCH, micro), "causal") / (BATCH // MICRO_BATCH)
            ).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = spec.learning_rate * learning_rate_factor(step - 1, spec)
        optimizer.step()
        optimizer.zero_grad()
        compute_s += time.monotonic() - began
        if scorer.due(step):
            loss = scorer.score_at(step)
            result["samples"].append(step * BATCH)
            result["wall_s"].append(time.monotonic() - started)
            result["held_out_loss"].append(loss)
            say(f"single: {step * BATCH} samples, held-out loss {loss:.4f}")
    wall_s = time.monotonic() - started
    return result | {
        "utilisation_per_peer": [compute_s / wall_s], "sent_bytes_per_sample": 0.0,
        "samples_trained": args.batches * BATCH, "partial_averages": 0, "wall_s_total": wall_s,
    }  # fmt: skip


# --- the report ---------------------------------------------------------------------------------------------------


def time_to(result: dict[str, Any], target: float) -> float | None:
    """Seconds until the first score at or below `target`; None if none reached it."""
    return next((s for s, loss in zip(result["wall_s"], result["held_out_loss"], strict=True) if loss <= target), None)


def loss_at(result: dict[str, Any], samples: int) -> float | None:
    """The held-out loss of the last score at or before `samples`."""
    losses = [loss for seen, loss in zip(result["samples"], result["held_out_loss"], strict=True) if seen <= samples]
    return losses[-1] if losses else None


def add_comparisons(results: dict[str, Any]) -> None:
    """Per scenario: the target loss, each arm's time to it, and its ratios against `gradients`."""
    single = results.get("single")
    for scenario in results["scenarios"].values():
        arms = dict(scenario["arms"])
        if single is not None:
            arms["single"] = single
        finals = [arm["held_out_loss"][-1] for arm in arms.values() if arm.get("held_out_loss")]
        if not finals:
            continue
        target = scenario["target_loss"] = max(finals)
        common = scenario["common_samples"] = min(arm["samples"][-1] for arm in arms.values() if arm.get("samples"))
        for arm in arms.values():
            arm["loss_at_common_samples"] = loss_at(arm, common)
        gradients = arms.get("gradients")
        for arm in scenario["arms"].values():
            arm["time_to_target_s"] = time_to(arm, target)
            if gradients is None or arm is gradients:
                continue
            base_time, own_time = (
                gradients.get("time_to_target_s") or time_to(gradients, target),
                arm["time_to_target_s"],
            )
            arm["speedup_to_target_vs_gradients"] = base_time / own_time if base_time and own_time else None
            own_sent = arm["sent_bytes_per_sample"]
            arm["fewer_bytes_per_sample_vs_gradients"] = (
                gradients["sent_bytes_per_sample"] / own_sent if own_sent else None
            )
            own_loss, base_loss = arm["loss_at_common_samples"], gradients["loss_at_common_samples"]
            arm["loss_vs_gradients"] = own_loss / base_loss - 1 if own_loss and base_loss else None


def print_results(results: dict[str, Any]) -> None:
    single = results.get("single")
    for name, scenario in results["scenarios"].items():
        rows = []
        for arm in ([single] if single else []) + list(scenario["arms"].values()):
            peers = [share for share in arm["utilisation_per_peer"] if share is not None]
            rows.append([
                arm["arm"], arm["samples"][-1] if arm["samples"] else 0, arm.get("loss_at_common_samples"),
                arm.get("loss_vs_gradients"),
                min(peers) if peers else None, arm["sent_bytes_per_sample"] / 1024,
                arm.get("fewer_bytes_per_sample_vs_gradients"), time_to(arm, scenario.get("target_loss", 0.0)),
                arm.get("speedup_to_target_vs_gradients"), arm["wall_s_total"], arm["partial_averages"],
            ])  # fmt: skip
        print_table(
            f"{name}: up to {results['batches'] * BATCH} samples per arm, H = {results['inner_steps']}, losses at "
            f"{scenario.get('common_samples')} samples (every arm's), target loss {scenario.get('target_loss', 0):.4f}",
            ["arm", "samples", "loss at common", "vs gradients", "min computing", "KiB sent/sample", "fewer bytes",
             "s to target", "speed-up", "wall s", "partial"],
            rows,
        )  # fmt: skip
        hosts = [(arm["arm"], host) for arm in scenario["arms"].values() for host in arm.get("hosts", ())]
        if hosts:
            print_table(
                f"{name}: each host's daemon (roles, reach, share and experts from the founder's status at the end)",
                ["arm", "host", "NAT", "samples trained", "s to first contribution", "roles", "reach", "relays",
                 "aggregation share", "experts owned"],
                [[arm, host["host"], host["nat"], host["samples_trained"], host["s_to_first_contribution"],
                  ",".join(host["roles"] or ()), host["reach"], host["relays"], host["aggregation_share"],
                  host["experts_owned"]] for arm, host in hosts],
            )  # fmt: skip


@plot_to_png(1, 2, figsize=(12, 4.5))
def plot_losses(results: dict[str, Any], axes: Any) -> None:
    labelled = [(f"{name}/{arm['arm']}", arm) for name, scenario in results["scenarios"].items()
                for arm in scenario["arms"].values()]  # fmt: skip
    for label, arm in labelled + ([("single", results["single"])] if "single" in results else []):
        if arm["samples"]:
            axes[0].plot(arm["samples"], arm["held_out_loss"], marker=".", label=label)
            axes[1].plot(arm["wall_s"], arm["held_out_loss"], marker=".", label=label)
    axes[0].set_xlabel("samples (all peers)")
    axes[1].set_xlabel("wall time, s")
    for axis in axes:
        axis.set_ylabel("held-out loss")
        axis.legend(fontsize=7)
    axes[0].set_title(f"4 peers, WAN lab, H = {results['inner_steps']}")


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=["home"])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--batches", type=int, default=48, help="global batches of 64 per arm (48)")
    parser.add_argument("--inner-steps", type=int, default=8, help="DiLoCo's H in global batches (8)")
    parser.add_argument("--model", choices=list(MODELS), default="llama-20m")
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument(
        "--arm-wall-s", type=float, default=1200.0, help="stop an arm that trains this long short of --batches (1200)"
    )
    args = parser.parse_args()
    if set(args.arms) & set(SPES_ARMS) and MODELS[args.model][0] != "OlmoeForCausalLM":
        parser.error(
            f"the SPES arms train a mixture of experts: --model {' or '.join(m for m in MODELS if 'olmoe' in m)}"
        )
    eval_batches = EVAL_SAMPLES // BATCH
    if args.batches % math.lcm(eval_batches, args.inner_steps) or max(eval_batches, args.inner_steps) % min(
        eval_batches, args.inner_steps
    ):
        parser.error(
            f"--inner-steps must divide {eval_batches} or be a multiple of it, and --batches a multiple of both"
        )
    results: dict[str, Any] = {"batches": args.batches, "inner_steps": args.inner_steps, "model": args.model,
                               "scenarios": {name: {"arms": {}} for name in args.scenarios}}  # fmt: skip
    out = args.out

    def measure(groups: ProcessGroups, root: Path) -> None:
        if "single" in args.arms:
            results["single"] = single_arm(args, root)
        for name in args.scenarios:
            for arm in (arm for arm in args.arms if arm != "single"):
                try:
                    results["scenarios"][name]["arms"][arm] = swarm_arm(args, name, arm, groups, root / name)
                except (HarnessError, subprocess.SubprocessError) as error:
                    say(f"{name}/{arm} failed: {error}")
                write_json(out / "diloco_wan.json", results)  # what was measured so far survives a later failure

    with_children("crowdtrain-bench-diloco-wan-", out / "logs" / "diloco_wan", measure)
    add_comparisons(results)
    print_results(results)
    write_json(out / "diloco_wan.json", results)
    say_plotted(out, "diloco_wan", plot_losses, results)
    print(json.dumps({"settings": vars(args) | {"out": str(out)}}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
