"""Which device this node trains on, and how it describes it to the swarm."""

from __future__ import annotations

import os
from pathlib import Path

from crowdtrain.errors import BadInputError

MEMINFO = Path("/proc/meminfo")


def resolve_device(requested: str) -> str:
    """`auto` picks the first GPU if there is one; an explicit GPU must exist."""
    import torch

    if requested == "cpu":
        return "cpu"
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "cuda:0" if num_gpus else "cpu"
    index = int(requested.partition(":")[2] or 0)
    if index >= num_gpus:
        raise BadInputError(
            f"--device {requested} asks for a GPU this machine doesn't have ({num_gpus} CUDA devices visible); "
            "pass --device cpu or auto."
        )
    return f"cuda:{index}"


def available_memory_bytes(device: str = "cpu") -> int | None:
    """Free memory where `device` keeps tensors: MemAvailable from /proc/meminfo for the CPU, the GPU's free
    memory for cuda:N; None where it can't be read."""
    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def describe_device(device: str) -> str:
    """A short description for status: `cpu (8 cores)` or `cuda:0 (NVIDIA A100, 80 GiB)`."""
    import torch

    if device == "cpu":
        return f"cpu ({len(os.sched_getaffinity(0))} cores)"
    properties = torch.cuda.get_device_properties(device)
    return f"{device} ({properties.name}, {properties.total_memory / 2**30:.0f} GiB)"
