"""SkipPipe stage nodes in one process, for the pipeline and hostile-peer tests: a tiny LLaMA built the same at every
call, and StageServices on loopback DHTs of their own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import hivemind
import torch
from lab.diloco import loopback_dht
from transformers import LlamaConfig, LlamaForCausalLM

from crowdtrain.modes.skippipe.hops import HopLimits, StageService


def tiny_llama(limits: HopLimits, num_layers: int) -> torch.nn.Module:
    """A LLaMA of `num_layers` layers as wide as `limits`' hidden states (its vocabulary and MLP twice as wide), with
    as long a context as their sequences, from seed 0: every call the same weights, as every node of a test has."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2 * limits.hidden_size,
        hidden_size=limits.hidden_size,
        intermediate_size=2 * limits.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=limits.max_sequence,
    )
    return LlamaForCausalLM(config)


@contextlib.contextmanager
def stage_services(
    num_nodes: int, build: Callable[[int, hivemind.DHT], StageService]
) -> Iterator[tuple[list[hivemind.DHT], list[StageService]]]:
    """`num_nodes` started StageServices, node i's made by `build(i, its DHT)`, each DHT bootstrapped from the first;
    (the DHTs, the services), all closed after."""
    dhts: list[hivemind.DHT] = []
    services: list[StageService] = []
    try:
        for node in range(num_nodes):
            dhts.append(loopback_dht(dhts[0].get_visible_maddrs() if dhts else []))
            services.append(build(node, dhts[-1]))
            services[-1].start()
        yield dhts, services
    finally:
        for service in services:
            service.close()
        for dht in dhts:
            dht.shutdown()
