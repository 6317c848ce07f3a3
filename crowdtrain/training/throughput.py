"""The throughput probe: training samples/s of the run's model on this device, cached per model and device."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from crowdtrain.data import WindowSampler, load_token_stream
from crowdtrain.manifest import RunManifest
from crowdtrain.models import (
    MicroStep,
    Precision,
    apply_tf32,
    autocast,
    build_model,
    load_tokenizer,
    model_kind,
    precision_for_device,
    training_loss,
)
from crowdtrain.models.device import describe_device

logger = logging.getLogger(__name__)

MEASURE_DURATION_S = 3.0
"""Forward/backward steps are timed for about this long after the warm-up step."""
MAX_MEASURED_STEPS = 50
"""Timing stops after this many steps even if MEASURE_DURATION_S has not passed (fast GPUs)."""
CACHE_VERSION = 1
CACHE_FILE = "throughput.json"
"""Name of the cache in a state dir; `check` and the daemon share it, so a check spares the daemon a measurement."""
PROBE_SEED = 0


def measure_throughput(
    manifest: RunManifest,
    device: str,
    micro_batch_size: int,
    num_threads: int,
    cache_path: Path,
    *,
    duration_s: float = MEASURE_DURATION_S,
    data_cache_dir: Path | None = None,
) -> float:
    """Samples/s of forward+backward passes of the run's model on `device` (cpu or cuda:N).

    The passes run in the run's compute precision on this device, as training does. The result is cached
    in the JSON file `cache_path`, keyed by the model spec, precision, sequence length, micro-batch size,
    device, thread count and torch version. `data_cache_dir` (default: the `data-cache` folder beside
    `cache_path`, as the daemon's) holds the tokenised corpus.
    """
    precision = precision_for_device(manifest.model.precision, device)
    key = cache_key(manifest, device, micro_batch_size, num_threads, precision)
    cached = _read_cache(cache_path).get(key)
    if isinstance(cached, dict) and _is_rate(cached.get("samples_per_second")):
        return float(cached["samples_per_second"])
    cache_dir = data_cache_dir or cache_path.parent / "data-cache"
    samples_per_second = _measure(manifest, device, precision, micro_batch_size, num_threads, cache_dir, duration_s)
    entries = _read_cache(cache_path)  # again: another process may have added entries meanwhile
    entries[key] = {
        "samples_per_second": samples_per_second,
        "measured_at": time.time(),
        "device": device,
        "precision": precision.name,
    }
    _write_cache(cache_path, entries)
    return samples_per_second


def cache_key(manifest: RunManifest, device: str, micro_batch_size: int, num_threads: int, precision: Precision) -> str:
    """A hash of everything the throughput depends on."""
    description = {
        "precision": [precision.name, precision.allows_tf32],
        "architecture": manifest.model.architecture,
        "config": manifest.model.config,
        "tokenizer": manifest.model.tokenizer,
        "sequence_length": manifest.data.sequence_length,
        "micro_batch_size": micro_batch_size,
        "device": describe_device(device),  # names the GPU model, or the number of CPU cores
        "num_threads": num_threads,
        "torch": torch.__version__,
    }
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _measure(
    manifest: RunManifest,
    device: str,
    precision: Precision,
    micro_batch_size: int,
    num_threads: int,
    cache_dir: Path,
    duration_s: float,
) -> float:
    previous_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        tokenizer = load_tokenizer(manifest.model)
        model = build_model(manifest.model, tokenizer.vocab_size, seed=PROBE_SEED).to(device)
        kind = model_kind(manifest.model)
        tokens = load_token_stream(manifest.data, tokenizer, cache_dir)
        sampler = WindowSampler(tokens, manifest.data.sequence_length, PROBE_SEED)
        generator = torch.Generator(device=device).manual_seed(PROBE_SEED)
        apply_tf32(precision)
        micro_step = MicroStep(precision, device)  # the same forward and (scaled) backward as training

        def step(index: int) -> None:
            batch = sampler.batch(0, micro_batch_size, index).to(device)
            with autocast(precision, device):
                loss = training_loss(model, batch, kind, generator=generator)  # type: ignore[arg-type]
            micro_step.backward(loss)
            model.zero_grad(set_to_none=True)

        step(0)  # warm-up: allocations, kernel selection, lazy initialisation
        _synchronize(device)
        num_steps, started = 0, time.perf_counter()
        while num_steps < MAX_MEASURED_STEPS and (num_steps == 0 or time.perf_counter() - started < duration_s):
            num_steps += 1
            step(num_steps)
        _synchronize(device)
        elapsed_s = time.perf_counter() - started
    finally:
        torch.set_num_threads(previous_threads)
    samples_per_second = num_steps * micro_batch_size / elapsed_s
    logger.info(
        f"throughput probe: {samples_per_second:.1f} samples/s of {manifest.model.architecture} on {device} "
        f"in {precision.name} "
        f"({num_steps} steps of {micro_batch_size} samples in {elapsed_s:.1f} s)"
    )
    return samples_per_second


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _is_rate(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; an unreadable or corrupt file counts as empty (it is rewritten on the next store)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return dict(data["entries"])


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Replace the cache file atomically (temp file, fsync, rename); a failure only costs a re-measure."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump({"version": CACHE_VERSION, "entries": entries}, file, indent=2)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as e:
        logger.warning(f"could not cache the throughput measurement in {path}: {e.strerror or e}")
        temporary.unlink(missing_ok=True)
