"""A joiner's state download from peers, verified before anything is loaded (issue 14, "verified state").

hivemind downloads from the donor with the highest *self-declared* priority, keeps every streamed byte,
and loads what came: a NaN tensor, a one-element tensor that `copy_` broadcasts over a whole parameter, a
negative Adam second moment, optimizer hyperparameters of the donor's choosing, or an epoch of 2**62 that
makes the learning-rate scheduler step forever. Here the download is checked against a template of this
node's own state: the number of tensors, every shape and dtype, finiteness, the sign of quantities that
can't be negative, the total bytes (bounded while streaming), and an epoch no higher than the run could
have reached since its manifest was created (`epoch_ceiling`); the optimizer's hyperparameters are always
this node's own. A donor whose state is malformed is remembered and not asked again; the download goes on
with the next donor. Not done yet: comparing digests of two donors' states before loading.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.optim.state_averager import dump_optimizer_state
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

logger = logging.getLogger(__name__)

MAX_GLOBAL_STEPS_PER_S = 20.0
"""No run makes global steps faster than this (the demo model on one CPU makes about 3 per second)."""
EPOCH_SLACK = 100_000
"""Epochs allowed beyond the time bound, for clocks that disagree (an hour at the maximum rate)."""
NON_NEGATIVE_STATE = frozenset({"step", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer_norm"})
"""Optimizer state entries that are never negative (a negative second moment makes Adam's step NaN)."""
STREAM_OVERHEAD_BYTES = 1 << 20
"""Serialization overhead allowed beyond the template's own bytes."""


class UnacceptableStateError(ValueError):
    """A downloaded state that does not fit this node's own: never loaded, and its donor is not asked again."""


class EpochTooHighError(UnacceptableStateError):
    """A state claiming an epoch beyond the bound: not loaded; the donor may be asked again later."""


class StaleStateError(UnacceptableStateError):
    """A state older than this node's own: not loaded; nothing wrong with the donor."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What one tensor of a state must look like."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    non_negative: bool = False


@dataclass(frozen=True, slots=True)
class StateTemplate:
    """This node's own state as a download must match it, and the highest epoch it may claim."""

    tensors: tuple[TensorSpec, ...]
    epoch_ceiling: int
    epoch_floor: int = 0
    """A state older than this is of no use to this node (it is not held against the donor)."""

    @property
    def max_bytes(self) -> int:
        """Bytes the whole download may take on the wire."""
        return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in self.tensors) + STREAM_OVERHEAD_BYTES


def epoch_ceiling(created_at: float, now: float) -> int:
    """The highest epoch a donor may claim: the global steps a run created at `created_at` (the signed manifest's
    time) can have made by `now`, at the fastest plausible rate, plus slack for clocks."""
    return int(max(0.0, now - created_at) * MAX_GLOBAL_STEPS_PER_S) + EPOCH_SLACK


def check_state(metadata: Any, tensors: Sequence[Any], template: StateTemplate) -> int:
    """The state's epoch when `metadata` and `tensors` fit `template`; else UnacceptableStateError."""
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if type(epoch) is not int or epoch < 0:
        raise UnacceptableStateError(f"epoch {epoch!r} is not a non-negative integer")
    if epoch > template.epoch_ceiling:
        raise EpochTooHighError(f"epoch {epoch} is beyond the {template.epoch_ceiling} this run can have reached")
    if epoch < template.epoch_floor:
        raise StaleStateError(f"epoch {epoch} is older than this node's {template.epoch_floor}")
    if len(tensors) != len(template.tensors):
        raise UnacceptableStateError(f"{len(tensors)} tensors where this node's state has {len(template.tensors)}")
    for index, (tensor, spec) in enumerate(zip(tensors, template.tensors, strict=True)):
        _check_tensor(index, tensor, spec)
    return epoch


def _check_tensor(index: int, tensor: Any, spec: TensorSpec) -> None:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        found = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise UnacceptableStateError(f"tensor {index} is {found}, expected {spec.shape} {spec.dtype}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise UnacceptableStateError(f"tensor {index} holds NaN or infinite values")
    if spec.non_negative and tensor.numel() and bool((tensor < 0).any()):
        raise UnacceptableStateError(f"tensor {index} holds negative values where none can be")


def optimizer_tensor_specs(optimizer: torch.optim.Optimizer) -> list[TensorSpec]:
    """Specs of the optimizer's state tensors in the order hivemind streams them (`dump_optimizer_state`)."""
    names = [name for name, value in _flatten_named(optimizer.state_dict()) if isinstance(value, torch.Tensor)]
    _, tensors = dump_optimizer_state(optimizer)
    pairs = zip(names, tensors, strict=True)  # fails loudly if hivemind's flattening order ever changes
    return [TensorSpec(tuple(tensor.shape), tensor.dtype, name in NON_NEGATIVE_STATE) for name, tensor in pairs]


def _flatten_named(value: Any, name: str = "") -> Iterator[tuple[str, Any]]:
    # The order of hivemind.utils.nested.nested_flatten (lists in order, dicts by sorted key), with each leaf's
    # innermost dict key, so a tensor's role (exp_avg_sq, step, ...) is known.
    if isinstance(value, list | tuple):
        for item in value:
            yield from _flatten_named(item, name)
    elif isinstance(value, dict):
        for key, item in sorted(value.items()):
            yield from _flatten_named(item, str(key))
    else:
        yield name, value


class VerifiedStateDownloadMixin:
    """Mixed into a hivemind DecentralizedAverager subclass, ahead of DecentralizedAverager in the MRO.

    The host process builds the template (`state_template`) and sends it with the request; the averager
    process downloads, bounded and checked, trying donors by priority and skipping those that failed before.
    """

    _outer_pipe: Any
    peer_id: PeerID
    prefix: str
    next_chunk_timeout: float | None
    request_timeout: float
    serializer: Any
    last_loaded_epoch: int | None = None
    """The epoch of the state the last download loaded; None when no donor gave an acceptable one."""

    def state_template(self) -> StateTemplate:
        """This node's own state as a download must match it; subclasses list their tensors."""
        raise NotImplementedError

    def trusted_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """The downloaded metadata with whatever this node must not take from a peer replaced by its own."""
        return metadata

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None, above_priority: float | None = None
    ) -> Any:
        """hivemind's DecentralizedAverager.load_state_from_peers, verified; returns (metadata, tensors) or None.
        `above_priority`: ask only donors that declared a higher priority than this."""
        future: MPFuture = MPFuture()
        template = self.state_template()
        request = dict(timeout=timeout, future=future, template=template, above_priority=above_priority)
        self._outer_pipe.send(("_load_verified_state", [], request))
        if not wait:
            return future
        loaded = future.result(timeout=timeout)
        self.last_loaded_epoch = None if loaded is None else int(loaded[0]["epoch"])
        return None if loaded is None else (self.trusted_metadata(loaded[0]), loaded[1])

    async def _load_verified_state(
        self, future: MPFuture, timeout: float | None, template: StateTemplate, above_priority: float | None = None
    ) -> None:
        # Runs in the averager process. hivemind's own _load_state_from_peers, with the checks of this module.
        bad_donors: set[PeerID] = self.__dict__.setdefault("_bad_donors", set())
        chunk_timeout = self.next_chunk_timeout if self.next_chunk_timeout is not None else self.request_timeout
        try:
            for donor in await self._donors(bad_donors, above_priority):
                started = time.monotonic()
                try:
                    metadata, tensors = await self._download(donor, template, chunk_timeout)
                    epoch = check_state(metadata, tensors, template)
                except StaleStateError as e:
                    logger.debug(f"skipped the state of peer {donor}: {e}")
                    continue
                except UnacceptableStateError as e:
                    if not isinstance(e, EpochTooHighError):
                        bad_donors.add(donor)
                    again = "" if isinstance(e, EpochTooHighError) else "; it will not be asked again"
                    logger.warning(f"refused the state of peer {donor}: {e}{again}")
                    continue
                except Exception as e:
                    logger.warning(f"could not download the state of peer {donor}: {e!r}")
                    continue
                logger.info(f"downloaded and verified the state of epoch {epoch} from {donor} "
                            f"in {time.monotonic() - started:.1f} s")  # fmt: skip
                future.set_result((metadata, tensors))
                return
        finally:
            if not future.done():
                future.set_result(None)

    async def _donors(self, bad_donors: set[PeerID], above_priority: float | None = None) -> list[PeerID]:
        averager: Any = self
        key_manager = averager._matchmaking.group_key_manager
        found = await averager.dht.get(f"{key_manager.prefix}.all_averagers", latest=True, return_future=True)
        priorities, _ = found or ({}, None)
        if not isinstance(priorities, dict):
            return []
        ranked = {
            PeerID(peer_id): (float(info.value), random.random())
            for peer_id, info in priorities.items()
            if isinstance(info, ValueWithExpiration) and isinstance(info.value, float | int)
        }
        donors = sorted(ranked, key=ranked.__getitem__, reverse=True)
        if above_priority is not None:
            donors = [donor for donor in donors if ranked[donor][0] > above_priority]
        return [donor for donor in donors if donor != self.peer_id and donor not in bad_donors]

    async def _download(
        self, donor: PeerID, template: StateTemplate, chunk_timeout: float
    ) -> tuple[Any, list[torch.Tensor]]:
        averager: Any = self
        stub = averager.get_stub(averager._p2p, donor, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata: Any = None
        parts: list[Any] = []
        tensors: list[torch.Tensor] = []
        received = 0
        async for message in aiter_with_timeout(stream, timeout=chunk_timeout):
            received += len(message.metadata) + len(message.tensor_part.buffer)
            if received > template.max_bytes:
                raise UnacceptableStateError(f"sent more than the {template.max_bytes} bytes its state can take")
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
                if len(tensors) > len(template.tensors):
                    raise UnacceptableStateError(f"sent more than the {len(template.tensors)} tensors of a state")
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        if not metadata:
            raise UnacceptableStateError("sent no metadata")
        return metadata, tensors


def parameter_specs(tensors: Sequence[torch.Tensor]) -> list[TensorSpec]:
    """Specs of parameters or other plain tensors: shape and dtype, any sign."""
    return [TensorSpec(tuple(tensor.shape), tensor.dtype) for tensor in tensors]
