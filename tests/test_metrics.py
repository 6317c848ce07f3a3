"""The local Prometheus endpoint: names, values, loopback only, a busy port as one sentence."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest

from crowdtrain.averaging.phases import PhaseTimes
from crowdtrain.errors import BadInputError
from crowdtrain.modes.progress import Progress
from crowdtrain.node.metrics import MetricsEndpoint, start_metrics_endpoint


@pytest.fixture
def endpoint() -> Iterator[tuple[MetricsEndpoint, Progress]]:
    progress = Progress(epoch=7, samples_per_second=12.5, loss=2.25, num_partial_averages=1, num_peers=3)
    progress.phase_times = PhaseTimes(compute_s=3.0, allreduce_s=1.5)
    progress.averaging_bytes_sent, progress.averaging_bytes_received = 4096, 2048
    progress.samples_trained = 16
    metrics = start_metrics_endpoint(progress, 0)
    try:
        yield metrics, progress
    finally:
        metrics.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_the_endpoint_serves_the_nodes_metrics_on_loopback(endpoint: tuple[MetricsEndpoint, Progress]) -> None:
    metrics, progress = endpoint
    assert metrics.server.server_address[0] == "127.0.0.1"
    lines = scrape(metrics.port).splitlines()
    for line in (
        "crowdtrain_epoch 7.0",
        "crowdtrain_samples_per_second 12.5",
        "crowdtrain_samples_trained_total 16.0",
        "crowdtrain_loss 2.25",
        'crowdtrain_step_phase_seconds{phase="compute"} 3.0',
        'crowdtrain_step_phase_seconds{phase="allreduce"} 1.5',
        'crowdtrain_step_phase_seconds{phase="state_download"} 0.0',
        "crowdtrain_partial_averages_total 1.0",
        "crowdtrain_local_steps_total 0.0",
        "crowdtrain_peers_online 3.0",
        "crowdtrain_averaging_sent_bytes_total 4096.0",
        "crowdtrain_averaging_received_bytes_total 2048.0",
    ):
        assert line in lines
    assert any(line.startswith("# HELP crowdtrain_averaging_sent_bytes_total ") for line in lines)
    assert not any(line.startswith("crowdtrain_held_out") for line in lines), "no score yet: no gauge"
    progress.epoch = 8  # read at every scrape: nothing pushed from the training path
    progress.held_out_loss, progress.held_out_epoch = 3.5, 8
    lines = scrape(metrics.port).splitlines()
    assert "crowdtrain_epoch 8.0" in lines
    assert "crowdtrain_held_out_loss 3.5" in lines and "crowdtrain_held_out_epoch 8.0" in lines
    assert not any(line.startswith("crowdtrain_reachability") for line in lines), "before the first beat: none"
    progress.reachability = "relay"
    lines = scrape(metrics.port).splitlines()
    assert 'crowdtrain_reachability{state="relay"} 1.0' in lines and 'crowdtrain_reachability{state="yes"} 0.0' in lines


def test_a_port_in_use_is_one_plain_sentence() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BadInputError, match=f"Cannot serve metrics on 127.0.0.1:{port} .*metrics_port"):
            start_metrics_endpoint(Progress(), port)


def test_every_micro_batch_adds_its_samples_to_the_nodes_total() -> None:
    progress = Progress()
    for _ in range(3):
        progress.observe(2.0, num_samples=8, elapsed_s=0.5)
    assert progress.samples_trained == 24 and progress.samples_per_second == 16.0
