"""hivemind.Optimizer configured from the run manifest: global batches, Moshpit keys, fp16 on the wire.

`gradients` mode (DeDLOC): peers accumulate gradients until the swarm reaches the target batch,
average them, and step together. `parameters` mode (Moshpit SGD): peers step locally and average
parameters once per global epoch. The hivemind classes it builds are in collaboration/hivemind_optimizer.py;
the Moshpit group keys and matchmaking timeouts in averaging/groups.py.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Iterable, Iterator
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import hivemind
import torch
from hivemind.compression import CompressionBase, NoCompression
from hivemind.utils.crypto import RSAPrivateKey

from crowdtrain.averaging.groups import chunk_timeout_s, join_request_timeout_s
from crowdtrain.averaging.partition import PlanSharesMixin
from crowdtrain.averaging.phases import PhaseAccumulator
from crowdtrain.averaging.quarantine import Verdict
from crowdtrain.averaging.traffic import AggregationSettings, AveragingTraffic, TrafficCountingAverager
from crowdtrain.codecs.compression import compression_for
from crowdtrain.collaboration.hivemind_optimizer import CountingGradientAverager, CrowdtrainOptimizer
from crowdtrain.manifest import AveragingSpec, RunManifest
from crowdtrain.optimizer import build_optimizer, build_scheduler

LOAD_STATE_TIMEOUT_S = 120.0
STATE_AVERAGING_EVERY_EPOCHS = 5


def make_optimizer(
    *,
    dht: hivemind.DHT,
    manifest: RunManifest,
    parameters: Iterable[torch.nn.Parameter],
    micro_batch_size: int,
    client_mode: bool,
    auxiliary: bool = False,
    group_bits: str,
    private_key: RSAPrivateKey,
    partial_counter: Synchronized,
    phases: PhaseAccumulator | None = None,
    traffic: AveragingTraffic | None = None,
    reuse_grad_buffers: bool = False,
    use_local_updates: bool = False,
    stop: threading.Event | None = None,
) -> hivemind.Optimizer:
    """The collaborative optimizer of this node for the run described by `manifest`.

    `private_key` must be the key the DHT's peer ID derives from (the averagers sign what they gather with it,
    averaging/authored.py) and the key of the DHT's signature validator: hivemind merges every
    RSASignatureValidator added to a DHT into the first one, so progress records signed with any
    other key (hivemind's default, a process-wide random key) go out unsigned and every peer
    rejects them: peers then never see each other's epoch and never resynchronise.
    `auxiliary` (gradients mode only): this peer computes nothing and only aggregates its plan share.
    `phases` receives the time of each phase of a global step; `traffic` counts the bytes of averaging rounds.
    `reuse_grad_buffers` (gradients mode, no loss scaler): the parameters' `.grad` is the accumulator of the
    global batch, which saves a copy of every gradient per micro-batch and one model-sized buffer; the caller
    must then never zero gradients itself (see `discard_local_gradients`, `clear_micro_batch_gradients`).
    `use_local_updates` (Moshpit SGD): every peer steps its own replica and the swarm averages parameters; else
    the swarm averages gradients and every peer takes the same step (DeDLOC).
    `stop`: the node's stop event; once set, a step waiting for its gradient round raises NodeStopping.
    """
    traffic = AveragingTraffic.new() if traffic is None else traffic
    if auxiliary and (client_mode or use_local_updates):
        raise ValueError("only a reachable peer that averages gradients can be an auxiliary aggregator")
    averaging = manifest.averaging
    compression = _compression(averaging)
    request_timeout = join_request_timeout_s(averaging)
    averager_opts = {
        "target_group_size": averaging.group_size,
        "initial_group_bits": group_bits,
        "request_timeout": request_timeout,
        "author": private_key,
    }
    # No peer's claimed weight (its samples) counts for more than the global batch (averaging/robust.py).
    aggregation = AggregationSettings(rule=averaging.aggregation, max_weight=float(manifest.target_batch_size))
    extra: dict[str, Any] = {}
    if not use_local_updates:
        extra["grad_averager_factory"] = functools.partial(
            CountingGradientAverager,
            partial_counter=partial_counter,
            traffic=traffic,
            aggregation=aggregation,
            **averager_opts,
        )
        extra["grad_compression"] = compression
        extra["reuse_grad_buffers"] = reuse_grad_buffers
    elif reuse_grad_buffers:
        raise ValueError("only a gradients-mode run accumulates gradients: parameters mode steps every micro-batch")
    with keep_sigint_handler():
        return CrowdtrainOptimizer(
            dht=dht,
            run_id=f"crowdtrain-{manifest.run_id}",
            target_batch_size=manifest.target_batch_size,
            # An auxiliary peer (the plan's aggregator that computes nothing) only helps average.
            batch_size_per_step=None if auxiliary else micro_batch_size,
            auxiliary=auxiliary,
            params=list(parameters),
            optimizer=functools.partial(build_optimizer, spec=manifest.optimizer),
            scheduler=functools.partial(build_scheduler, spec=manifest.optimizer),
            matchmaking_time=averaging.matchmaking_time_s,
            averaging_timeout=averaging.timeout_s,
            # hivemind's default (the matchmaking time, 5 s) bans a group member as a sender when its first part comes
            # later than that: a peer still finishing a micro-batch of a large model, and both peers' rounds came
            # back half un-averaged. A dead peer is still dropped well within the round's timeout.
            next_chunk_timeout=chunk_timeout_s(averaging),
            load_state_timeout=LOAD_STATE_TIMEOUT_S,
            use_local_updates=use_local_updates,
            # Gradient mode: every peer applies the same averaged gradient, so parameters only drift when a
            # peer misses a round; average them every few epochs, in step, never in the background (hivemind's
            # default), where a late result overwrites parameters that moved on and training diverges.
            delay_state_averaging=use_local_updates,
            average_state_every=1 if use_local_updates else STATE_AVERAGING_EVERY_EPOCHS,
            offload_optimizer=False,
            client_mode=client_mode,
            phases=phases,
            traffic=traffic,
            aggregation=aggregation,
            run_created_at=manifest.created_at,
            stop=stop,
            # Parameters averaged every few epochs in gradient mode travel uncompressed, so rounding never
            # erases small updates; a downloaded state always does: fp16 flushes Adam's tiny second moments
            # to zero, and the next step divides by ~eps and blows the weights up.
            state_averaging_compression=compression if use_local_updates else NoCompression(),
            load_state_compression=NoCompression(),
            averager_opts=averager_opts
            if use_local_updates
            else {"target_group_size": averaging.group_size, "request_timeout": request_timeout, "author": private_key},
            tracker_opts={"private_key": private_key},
            verbose=False,
            **extra,
        )


@contextlib.contextmanager
def keep_sigint_handler() -> Iterator[None]:
    """Start hivemind averagers inside: the SIGINT handler is as before when the block ends.

    Symptom worked around: hivemind's averagers set SIGINT to SIG_IGN in the *calling* process when they start
    (DecentralizedAverager.run_in_background), so Ctrl-C would no longer stop the daemon.
    """
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def reuses_grad_buffers(optimizer: hivemind.Optimizer) -> bool:
    """Whether the parameters' `.grad` accumulates the global batch (see make_optimizer)."""
    averager = getattr(optimizer, "grad_averager", None)
    return averager is not None and bool(averager.reuse_grad_buffers)


def clear_micro_batch_gradients(optimizer: hivemind.Optimizer) -> None:
    """After a micro-batch's `optimizer.step()`: zero `.grad` for the next one, unless `.grad` is the accumulator.

    Zeroed in place: freeing and re-allocating a model-sized buffer every micro-batch costs page faults on a CPU.
    """
    if not reuses_grad_buffers(optimizer):
        optimizer.zero_grad(set_to_none=False)


def discard_local_gradients(optimizer: hivemind.Optimizer) -> None:
    """A micro-batch's gradients are unusable (a non-finite loss) and must not reach the swarm's average.

    When `.grad` accumulates the global batch, the bad gradients are already summed into it and can't be taken
    out alone: this node's whole contribution since the last global step is dropped, and its reported samples
    go back to zero, as hivemind does on an fp16 overflow.
    """
    if reuses_grad_buffers(optimizer):
        optimizer.grad_averager.reset_accumulated_grads_()
        optimizer.tracker.report_local_progress(optimizer.local_epoch, 0)
    else:
        optimizer.zero_grad(set_to_none=False)


def excluded_peers(optimizer: hivemind.Optimizer) -> dict[str, Verdict]:
    """The peers this node's gradient and state averagers keep out of their groups (averaging/quarantine.py)."""
    excluded: dict[str, Verdict] = {}
    for averager in (getattr(optimizer, "grad_averager", None), optimizer.state_averager):
        if isinstance(averager, TrafficCountingAverager):
            excluded.update(averager.excluded_peers())
    return excluded


def set_plan_share(optimizer: hivemind.Optimizer, share: float | None) -> None:
    """Aggregate `share` of every later averaging round (gradients and state); None: no plan, equal split."""
    for averager in (getattr(optimizer, "grad_averager", None), optimizer.state_averager):
        if isinstance(averager, PlanSharesMixin):
            averager.set_share(share)


def _compression(averaging: AveragingSpec) -> CompressionBase:
    return compression_for(averaging.compression)
