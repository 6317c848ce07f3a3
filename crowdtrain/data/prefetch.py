"""Micro-batches built ahead on a background thread, so the training thread never waits for data.

The trainer asks for the batch of (epoch, step); the thread has already cut the windows of the next
steps from the token stream (a memory-mapped file: cold pages cost disk reads) and, for a CUDA device,
pinned them, so the copy to the device is asynchronous. When the epoch changes, batches built for the
old one are dropped: every batch is still the one `WindowSampler.batch(epoch, size, step)` gives.
"""

from __future__ import annotations

import queue
import threading

import torch

from crowdtrain.data.sampler import WindowSampler

PREFETCH_DEPTH = 2
"""Batches built ahead of the one being trained on."""
WAIT_SLICE_S = 0.5
"""How often a blocked producer looks whether it was closed."""
GET_TIMEOUT_S = 60.0
"""A batch that takes longer than this to build means the producer died: raise rather than hang."""

_Key = tuple[int, int]


class BatchPrefetcher:
    """`get(epoch, step)` returns `sampler.batch(epoch, batch_size, step)` on `device`, built in the background."""

    def __init__(self, sampler: WindowSampler, batch_size: int, device: str, depth: int = PREFETCH_DEPTH):
        self.sampler, self.batch_size, self.device = sampler, batch_size, torch.device(device)
        self._pin = self.device.type == "cuda"
        self._ready: queue.Queue[tuple[int, _Key, torch.Tensor]] = queue.Queue(maxsize=depth)
        self._lock = threading.Lock()
        self._generation = 0
        self._next: _Key | None = None
        """What the producer builds next; None until the first get()."""
        self._expected: _Key | None = None
        """What the consumer will most likely ask for next."""
        self._wanted = threading.Event()
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, name="batch-prefetch", daemon=True)
        self._thread.start()

    def get(self, epoch: int, step: int) -> torch.Tensor:
        """The batch of (`epoch`, `step`) on the device; the batches of the next steps are built meanwhile."""
        key = (epoch, step)
        with self._lock:
            if key != self._expected:
                # A new epoch (or the first call): what was built ahead is for other steps.
                self._generation += 1
                self._next = key
                self._drain()
            generation = self._generation
            self._expected = (epoch, step + 1)
        self._wanted.set()
        while True:
            if self._error is not None:
                raise RuntimeError(f"the batch prefetcher failed: {self._error}") from self._error
            try:
                built_generation, built_key, batch = self._ready.get(timeout=GET_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"no batch was built within {GET_TIMEOUT_S:g} s") from None
            if self._error is not None:
                raise RuntimeError(f"the batch prefetcher failed: {self._error}") from self._error
            if built_generation == generation and built_key == key:
                return batch.to(self.device, non_blocking=self._pin)

    def close(self) -> None:
        """Stop the producer thread."""
        self._closed.set()
        self._wanted.set()
        self._drain()
        self._thread.join(timeout=5)

    def _drain(self) -> None:
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                return

    def _produce(self) -> None:
        try:
            self._wanted.wait()
            while not self._closed.is_set():
                with self._lock:
                    generation, key = self._generation, self._next
                    assert key is not None, "set by the first get() before it wakes this thread"
                    self._next = (key[0], key[1] + 1)
                batch = self.sampler.batch(key[0], self.batch_size, key[1])
                if self._pin:
                    batch = batch.pin_memory()
                self._put((generation, key, batch))
        except BaseException as e:  # surfaced to the training thread by get(), woken by an empty batch
            self._error = e
            self._drain()
            self._ready.put_nowait((-1, (-1, -1), torch.empty(0)))

    def _put(self, item: tuple[int, _Key, torch.Tensor]) -> None:
        while not self._closed.is_set():
            with self._lock:
                if item[0] != self._generation:
                    return  # built for an epoch the trainer left; the next loop builds for the new one
            try:
                self._ready.put(item, timeout=WAIT_SLICE_S)
                return
            except queue.Full:
                continue
