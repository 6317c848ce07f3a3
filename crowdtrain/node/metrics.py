"""A local Prometheus endpoint: this node's training progress, step phases and averaging traffic.

Served on 127.0.0.1 only (a volunteer's metrics are not for the internet) when `metrics_port` is set.
Every scrape reads the `Progress` the trainer writes, so nothing is pushed from the training path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from crowdtrain.errors import BadInputError
from crowdtrain.links.relays import REACHABILITY

if TYPE_CHECKING:
    from crowdtrain.modes.progress import Progress

METRICS_ADDRESS = "127.0.0.1"
SHUTDOWN_TIMEOUT_S = 5.0


class ProgressCollector(Collector):
    """Turns the trainer's `Progress` into `crowdtrain_*` metrics at every scrape."""

    def __init__(self, progress: Progress):
        self.progress = progress

    def collect(self) -> Iterator[Metric]:
        progress = self.progress
        yield GaugeMetricFamily("crowdtrain_epoch", "The last global epoch this node completed.", value=progress.epoch)
        yield GaugeMetricFamily(
            "crowdtrain_samples_per_second",
            "This node's recent training throughput (moving average), samples/s.",
            value=progress.samples_per_second,
        )
        phases = GaugeMetricFamily(
            "crowdtrain_step_phase_seconds",
            "Seconds the training process spent blocked in each phase of its last completed global step.",
            labels=["phase"],
        )
        if progress.phase_times is not None:
            for phase, seconds in progress.phase_times.by_phase().items():
                phases.add_metric([phase.value], seconds)
        yield phases
        yield CounterMetricFamily(
            "crowdtrain_samples_trained",
            "Samples this node computed forward and backward since it started (skipped micro-batches not counted).",
            value=progress.samples_trained,
        )
        yield CounterMetricFamily(
            "crowdtrain_partial_averages",
            "Averaging rounds this node rejected because some parts came back un-averaged.",
            value=progress.num_partial_averages,
        )
        yield CounterMetricFamily(
            "crowdtrain_local_steps",
            "Global steps this node took with its own gradients alone (averaging failed or found no peer).",
            value=progress.num_local_steps,
        )
        yield GaugeMetricFamily(
            "crowdtrain_peers_online",
            "Peers training in this run as hivemind's progress tracker last saw them, this node included.",
            value=progress.num_peers,
        )
        yield CounterMetricFamily(
            "crowdtrain_averaging_sent_bytes",
            "Serialized tensor-part bytes this node sent in all-reduce rounds (payload, without framing); in SkipPipe "
            "runs its pipeline hops, gradients and stage states.",
            value=progress.averaging_bytes_sent,
        )
        yield CounterMetricFamily(
            "crowdtrain_averaging_received_bytes",
            "Serialized tensor-part bytes this node received in all-reduce rounds (payload, without framing); in "
            "SkipPipe runs its pipeline hops, gradients and stage states.",
            value=progress.averaging_bytes_received,
        )
        if progress.reachability:
            reach = GaugeMetricFamily(
                "crowdtrain_reachability",
                "1 for how peers reach this node: dialed back (yes), untried (assumed), through a relay, or no.",
                labels=["state"],
            )
            for state in REACHABILITY:
                reach.add_metric([state], float(state == progress.reachability))
            yield reach
        # Gauges of values that are not known yet, or mean nothing in this run's mode, are left out.
        known_later = (
            ("crowdtrain_loss", "This node's recent training loss (moving average).", progress.loss),
            (
                "crowdtrain_compute_utilisation",
                "Share of the last completed round's wall time this node spent computing (forward and backward).",
                progress.compute_utilisation,
            ),
            (
                "crowdtrain_held_out_loss",
                "The loss of this node's replica on the run's held-out windows, at its last score (eval_every).",
                progress.held_out_loss,
            ),
            (
                "crowdtrain_held_out_epoch",
                "The epoch of the last held-out score.",
                progress.held_out_epoch if progress.held_out_loss is not None else None,
            ),
            (
                "crowdtrain_inner_step",
                "diloco: global batches the swarm completed in the current outer round (of H inner steps).",
                progress.inner_step if progress.inner_steps else None,
            ),
        )
        for name, documentation, value in known_later:
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=value)


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricsEndpoint:
    """The running HTTP endpoint; `close()` stops it."""

    server: WSGIServer
    """The HTTP server answering scrapes."""
    thread: threading.Thread
    """The thread serving it."""

    @property
    def port(self) -> int:
        """The TCP port it listens on (the chosen one when started on port 0)."""
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=SHUTDOWN_TIMEOUT_S)


def start_metrics_endpoint(progress: Progress, port: int) -> MetricsEndpoint:
    """Serve `progress` as Prometheus metrics on 127.0.0.1:`port` (0: any free port); a port in use is bad input."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProgressCollector(progress))
    try:
        server, thread = start_http_server(port, addr=METRICS_ADDRESS, registry=registry)
    except OSError as e:
        raise BadInputError(
            f"Cannot serve metrics on {METRICS_ADDRESS}:{port} ({e.strerror or e}); set metrics_port to a free port, "
            "or to 0 to turn the endpoint off."
        ) from None
    return MetricsEndpoint(server=server, thread=thread)
