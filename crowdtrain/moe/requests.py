"""What an expert host accepts from a caller: every forward and backward request is checked before it runs.

hivemind's ConnectionHandler deserializes whatever a caller sends and hands it to the expert's task pool: a
stream of any length, any number of tensors of any shape or dtype, NaN. Here a request is refused, with a
sentence to the caller, unless it carries exactly the tensors the expert's schema names (the forward's inputs;
for a backward, those and the gradients of the outputs), uncompressed, of the schema's dtype and shape with a
batch of 1 to `max_batch_size` sequences shared by all, every value finite, and, for a stream, at most the
bytes and frames such a request needs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.p2p.p2p_daemon import DEFAULT_MAX_MSG_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils import nested_flatten
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from crowdtrain.errors import CrowdtrainError

STREAM_CHUNK_BYTES = DEFAULT_MAX_MSG_SIZE
"""Tensor bytes per frame of hivemind's streaming client (it splits each tensor into chunks of this size)."""
MAX_FRAME_BYTES = STREAM_CHUNK_BYTES + 64 * 1024
"""Cap on one frame of an expert stream on the wire: a chunk and its message's fields (uid, shape, dtype)."""
MAX_EXTRA_FRAMES = 64
"""Frames a stream may carry beyond those of hivemind's chunking: a client that splits finer, or sends empty ones."""
_NONE = runtime_pb2.CompressionType.NONE


class RefusedRequestError(CrowdtrainError):
    """An expert request that this host does not run: its sentence goes back to the caller."""


@dataclass(frozen=True, slots=True)
class RequestShape:
    """The tensors one expert call carries, in order, and the largest batch it may hold."""

    schemas: tuple[BatchTensorDescriptor, ...]
    """Each tensor's descriptor: its size starts with None, the batch dimension."""
    max_batch_size: int
    """The most sequences one request may carry (the expert's task pool runs no more at once)."""

    @property
    def max_frames(self) -> int:
        """Frames of the largest request as hivemind's client streams it (each tensor in chunks), and some more."""
        return MAX_EXTRA_FRAMES + sum(
            math.ceil(self.max_batch_size * _sample_bytes(schema) / STREAM_CHUNK_BYTES) for schema in self.schemas
        )


def request_shapes(backend: ModuleBackend, max_batch_size: int) -> tuple[RequestShape, RequestShape]:
    """The forward and backward requests `backend` accepts; raises ValueError for a schema this module can't check."""
    forward = tuple(nested_flatten(backend.forward_schema))
    backward = tuple(nested_flatten(backend.backward_schema))
    for schema in backward:
        if schema.compression != _NONE or schema.size[0] is not None or None in schema.size[1:]:
            raise ValueError(f"expert {backend.name}: only uncompressed batch-first schemas are checked, got {schema}")
    return RequestShape(forward, max_batch_size), RequestShape(backward, max_batch_size)


def check_tensors(tensors: Sequence[runtime_pb2.Tensor], shape: RequestShape) -> list[torch.Tensor]:
    """The request's tensors, deserialized, when they fit `shape` (see the module); else RefusedRequestError."""
    if len(tensors) != len(shape.schemas):
        raise RefusedRequestError(f"the request carries {len(tensors)} tensors; this expert takes {len(shape.schemas)}")
    batch_sizes = set()
    for index, (tensor, schema) in enumerate(zip(tensors, shape.schemas, strict=True)):
        batch_size = _check_header(index, tensor, schema, shape)
        if len(tensor.buffer) != batch_size * _sample_bytes(schema):
            raise RefusedRequestError(f"tensor {index} has {len(tensor.buffer)} bytes, not those of its shape")
        batch_sizes.add(batch_size)
    if len(batch_sizes) > 1:
        raise RefusedRequestError(f"the request's tensors have different batch sizes: {sorted(batch_sizes)}")
    inputs = []
    for index, tensor in enumerate(tensors):
        value = deserialize_torch_tensor(tensor)
        if not bool(torch.isfinite(value).all()):
            raise RefusedRequestError(f"tensor {index} of the request holds NaN or infinite values")
        inputs.append(value)
    return inputs


def _check_header(index: int, tensor: runtime_pb2.Tensor, schema: BatchTensorDescriptor, shape: RequestShape) -> int:
    """The batch size of tensor `index` when its header fits `schema`: everything but its buffer's length."""
    expected = [None, *schema.size[1:]]
    size, dtype = tuple(tensor.size), _dtype_name(schema.dtype)
    if tensor.compression != _NONE or tensor.dtype != dtype:
        raise RefusedRequestError(f"tensor {index} is not uncompressed {dtype}")
    if len(size) != len(expected) or list(size[1:]) != expected[1:]:
        raise RefusedRequestError(f"tensor {index} has shape {list(size)}; this expert takes {expected} (batch first)")
    if tensor.requires_grad and not schema.dtype.is_floating_point:
        # hivemind's deserializer would call requires_grad_() and raise a RuntimeError of its own
        raise RefusedRequestError(f"tensor {index} of {dtype} asks for gradients, which only float tensors have")
    if not 1 <= size[0] <= shape.max_batch_size:
        raise RefusedRequestError(
            f"tensor {index} has a batch of {size[0]}; this host takes 1 to {shape.max_batch_size}"
        )
    return size[0]


class StreamedRequest:
    """The frames of one streamed request, bounded as they arrive: each tensor's first part (hivemind's chunking
    names the dtype there) is checked as soon as it comes, and no tensor carries more bytes than its shape."""

    def __init__(self, shape: RequestShape):
        self.shape = shape
        self._parts: list[list[runtime_pb2.Tensor]] = []
        self._num_frames = self._room_bytes = 0

    def add(self, tensors: Iterable[runtime_pb2.Tensor]) -> None:
        """Take one frame's tensor parts; raises RefusedRequestError once the request is over its bounds."""
        self._num_frames += 1
        if self._num_frames > self.shape.max_frames:
            raise RefusedRequestError(f"the stream has more than the {self.shape.max_frames} frames a request needs")
        for part in tensors:
            index = len(self._parts) - 1
            if part.dtype:
                index += 1
                if index == len(self.shape.schemas):
                    raise RefusedRequestError(f"the stream carries more than {len(self.shape.schemas)} tensors")
                schema = self.shape.schemas[index]
                self._room_bytes = _check_header(index, part, schema, self.shape) * _sample_bytes(schema)
                self._parts.append([])
            elif index < 0:
                raise RefusedRequestError("the stream's first part names no dtype")
            self._room_bytes -= len(part.buffer)
            if self._room_bytes < 0:
                raise RefusedRequestError(f"tensor {index} carries more bytes than its shape {list(part.size)} holds")
            self._parts[-1].append(part)

    def tensors(self) -> list[torch.Tensor]:
        """The whole request's tensors, checked as a unary request's are."""
        return check_tensors([combine_from_streaming(parts) for parts in self._parts], self.shape)


def _sample_bytes(schema: BatchTensorDescriptor) -> int:
    return math.prod(schema.size[1:]) * schema.dtype.itemsize


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")  # as hivemind's serializer names it
