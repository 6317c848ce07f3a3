"""Benchmark the run's DHT: store/get latency and success with 32+ nodes on loopback, then after 25% are SIGKILLed.

Nodes are crowdtrain's own: `crowdtrain.dht.swarm.join_swarm` with crowdtrain's validators (signatures and
the record schema), each a hivemind DHT process with its p2pd, all started from this process and
bootstrapped through the first one. Then:
1. K keys are stored, each through a random node, and read back through another random node;
2. 25% of the nodes are SIGKILLed (their process group: the DHT process and its p2pd), and every key is
   read again through a random survivor, at once, before the swarm had any time to repair itself.
Prints a table; writes <out>/dht.json and <out>/dht.png (latency distributions).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import benchlib as bench
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from lab.processes import KILL_TIMEOUT_S, await_condition, raise_keyboard_interrupt
from lab.procfs import group_alive
from lab.swarm import START_TIMEOUT_S

from crowdtrain.dht.swarm import SupervisedDHT, SwarmOptions, join_swarm
from crowdtrain.dht.validator import make_validators

OPERATION_TIMEOUT_S = 30.0
"""One store or get that has not finished after this long counts as failed."""
NUM_THREADS = 4
"""Operations in flight at once; each thread drives its own nodes, so no node's pipe is shared between threads."""
KILL_FRACTION = 0.25
STARTING_AT_ONCE = 4
RECORD_TTL_S = 600.0
SEED = 0


def start_nodes(num_nodes: int, started: list[SupervisedDHT], release: threading.Event) -> float:
    """Start `num_nodes` DHT nodes into `started` (so a failure still kills those up), a few at a time; seconds.

    The first node is every other node's initial peer. Start-up is mostly waiting for p2pd and the bootstrap,
    so STARTING_AT_ONCE threads start nodes in parallel (32 one by one took minutes on 2 busy cores). Each
    thread then waits for `release`: a node dies with the *thread* that forked it (SupervisedDHT sets
    PR_SET_PDEATHSIG, which fires when the forking thread exits), so those threads outlive the benchmark.
    """
    began = time.monotonic()
    started.append(join_swarm(SwarmOptions(), make_validators(RSAPrivateKey())))
    options = SwarmOptions(initial_peers=(str(started[0].get_visible_maddrs()[0]),))
    errors: list[BaseException] = []

    def start_some(count: int) -> None:
        try:
            for _ in range(count):
                started.append(join_swarm(options, make_validators(RSAPrivateKey())))
                if len(started) % 8 == 0:
                    bench.say(f"dht: {len(started)}/{num_nodes} nodes up")
        except BaseException as e:  # reported by the main thread, which stops waiting
            errors.append(e)
        release.wait()

    counts = [len(range(i, num_nodes - 1, STARTING_AT_ONCE)) for i in range(STARTING_AT_ONCE)]
    for count in counts:
        threading.Thread(target=start_some, args=(count,), name="dht-starter", daemon=True).start()

    def all_started() -> bool:
        if errors:
            raise errors[0]
        return len(started) == num_nodes

    await_condition(all_started, START_TIMEOUT_S * 2, f"{num_nodes} DHT nodes to start")
    return time.monotonic() - began


def kill_node(node: SupervisedDHT) -> None:
    """SIGKILL the node's process group: its DHT process and the p2pd it started (SupervisedDHT leads a group)."""
    try:
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node.join(KILL_TIMEOUT_S)
    await_condition(lambda: not group_alive(node.pid), KILL_TIMEOUT_S, f"DHT node {node.pid} to die")


def timed(operation: Callable[[], Any], check: Callable[[Any], bool]) -> tuple[float, bool]:
    """(milliseconds, success) of one blocking DHT operation; an exception or a timeout is a failure."""
    began = time.perf_counter()
    try:
        ok = check(operation())
    except Exception:
        ok = False
    return (time.perf_counter() - began) * 1000, ok


def run_operations(
    nodes: Sequence[SupervisedDHT], jobs: Sequence[tuple[int, Callable[[SupervisedDHT], tuple[float, bool]]]]
) -> list[tuple[float, bool]]:
    """Run each (node index, operation) job; thread t serves the nodes with index % NUM_THREADS == t."""
    results: list[tuple[float, bool] | None] = [None] * len(jobs)

    def serve(thread: int) -> None:
        for position, (index, job) in enumerate(jobs):
            if index % NUM_THREADS == thread:
                results[position] = job(nodes[index])

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        list(pool.map(serve, range(NUM_THREADS)))
    assert all(result is not None for result in results)
    return [result for result in results if result is not None]


def store_job(key: str, value: str) -> Callable[[SupervisedDHT], tuple[float, bool]]:
    def job(node: SupervisedDHT) -> tuple[float, bool]:
        def store() -> Any:
            future = node.store(key, value, expiration_time=get_dht_time() + RECORD_TTL_S, return_future=True)
            return future.result(timeout=OPERATION_TIMEOUT_S)

        return timed(store, bool)

    return job


def get_job(key: str, value: str) -> Callable[[SupervisedDHT], tuple[float, bool]]:
    def job(node: SupervisedDHT) -> tuple[float, bool]:
        def get() -> Any:
            return node.get(key, latest=True, return_future=True).result(timeout=OPERATION_TIMEOUT_S)

        return timed(get, lambda found: found is not None and found.value == value)

    return job


def latency_stats(results: Sequence[tuple[float, bool]]) -> dict[str, Any]:
    """p50/p99 of the successful operations' latencies, and the success rate over all of them."""
    latencies = sorted(ms for ms, ok in results if ok)
    return {
        "num_operations": len(results),
        "success_rate": sum(ok for _, ok in results) / len(results) if results else None,
        "p50_ms": statistics.median(latencies) if latencies else None,
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "max_ms": latencies[-1] if latencies else None,
        "latencies_ms": [round(ms, 3) for ms, _ in results],
    }


def bench_dht(num_nodes: int, num_keys: int) -> dict[str, Any]:
    rng = random.Random(SEED)
    nodes: list[SupervisedDHT] = []
    release = threading.Event()
    memory = bench.MemoryPeaks([])
    try:
        bench.say(f"dht: starting {num_nodes} nodes (join_swarm, crowdtrain's validators) on loopback")
        startup_s = start_nodes(num_nodes, nodes, release)
        memory = bench.MemoryPeaks([node.pid for node in nodes], by="pgrp")  # each node leads a group of its own
        memory.poll()
        keys = [(f"bench-dht-{index}", f"value-{index}-{rng.getrandbits(64):x}") for index in range(num_keys)]
        writers = [rng.randrange(num_nodes) for _ in keys]
        readers = [rng.choice([i for i in range(num_nodes) if i != writer]) for writer in writers]
        bench.say(f"dht: {num_nodes} nodes up in {startup_s:.0f} s; {num_keys} stores, then {num_keys} gets")
        stores = run_operations(nodes, [(w, store_job(k, v)) for w, (k, v) in zip(writers, keys, strict=True)])
        gets = run_operations(nodes, [(r, get_job(k, v)) for r, (k, v) in zip(readers, keys, strict=True)])
        killed = sorted(rng.sample(range(num_nodes), round(num_nodes * KILL_FRACTION)))
        bench.say(f"dht: SIGKILL {len(killed)} nodes, then {num_keys} gets through the survivors")
        for index in killed:
            kill_node(nodes[index])
        survivors = [i for i in range(num_nodes) if i not in killed]
        after = run_operations(nodes, [(rng.choice(survivors), get_job(k, v)) for k, v in keys])
        memory.poll()
    finally:
        killers = [threading.Thread(target=kill_node, args=(node,)) for node in nodes if node.is_alive()]
        for killer in killers:
            killer.start()
        for killer in killers:
            killer.join()
        release.set()
    per_node = [bench.memory_json(memory.groups[node.pid]) for node in nodes]
    return {
        "num_nodes": num_nodes,
        "num_keys": num_keys,
        "nodes": "crowdtrain.dht.swarm.join_swarm with crowdtrain's validators (hivemind DHT + p2pd), loopback",
        "startup_s": startup_s,
        "num_killed": len(killed),
        "store": latency_stats(stores),
        "get": latency_stats(gets),
        "get_after_kill": latency_stats(after),
        "peak_rss_mib_per_node_mean": statistics.mean(n["peak_rss_mib"] for n in per_node),
        "pss_mib_per_node_mean": statistics.mean(n["pss_at_peak_mib"] for n in per_node),
        "dht_get_p50_ms": latency_stats(gets)["p50_ms"],
        "dht_get_success_after_kill": latency_stats(after)["success_rate"],
    }


def print_dht(result: dict[str, Any]) -> None:
    rows = [
        [name, stats["num_operations"], stats["success_rate"], stats["p50_ms"], stats["p99_ms"], stats["max_ms"]]
        for name, stats in (
            ("store", result["store"]),
            ("get", result["get"]),
            (f"get after SIGKILL of {result['num_killed']}", result["get_after_kill"]),
        )
    ]
    bench.print_table(
        f"DHT: {result['num_nodes']} nodes on loopback ({result['num_nodes']} started in {result['startup_s']:.0f} s)",
        ["", "operations", "success", "p50 ms", "p99 ms", "max ms"],
        rows,
    )
    print(f"dht_get_p50_ms = {result['dht_get_p50_ms']:.2f}")
    print(f"dht_get_success_after_kill = {result['dht_get_success_after_kill']:.3f}")
    print(
        f"memory per node (DHT process + p2pd): peak RSS {result['peak_rss_mib_per_node_mean']:.0f} MiB, "
        f"PSS {result['pss_mib_per_node_mean']:.0f} MiB (forked from this process, so RSS counts shared pages)"
    )


@bench.plot_to_png(figsize=(7, 4.5))
def plot(result: dict[str, Any], axes: Any) -> None:
    for name, label in (("store", "store"), ("get", "get"), ("get_after_kill", "get after 25% SIGKILLed")):
        latencies = sorted(result[name]["latencies_ms"])
        axes.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))], label=label)
    axes.set(xscale="log", xlabel="latency, ms (failures at their timeout)", ylabel="fraction of operations")
    axes.set_title(f"DHT, {result['num_nodes']} nodes on loopback")
    axes.grid(alpha=0.3)
    axes.legend()


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench.bench_parser(__doc__, "fewer keys")
    parser.add_argument("--nodes", type=int, help="DHT nodes (default 32)")
    parser.add_argument("--keys", type=int, help="keys stored and read (default 400, quick 64)")
    args = parser.parse_args(argv)
    num_nodes, num_keys = args.nodes or 32, args.keys or (64 if args.quick else 400)
    if num_nodes < 4:
        parser.error("--nodes must be at least 4, so that 25% of them is at least one")
    report = bench.Report("dht", print_dht, plot, "every DHT node was killed")
    return bench.run_benchmark(report, args.out, args.quick, lambda: bench_dht(num_nodes, num_keys))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    sys.exit(main())
