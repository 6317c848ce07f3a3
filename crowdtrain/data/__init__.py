"""Training data: text sources tokenised once into a cached stream, and per-peer sampling from it.

corpus   text from the embedded corpus (Python's own docs and stdlib), local files or HF datasets,
         tokenised into one cached token stream
sampler  random training windows that differ per peer and repeat per (peer, epoch, step);
         a held-out tail for evaluation
prefetch the next micro-batches built on a background thread (pinned for CUDA)
"""

from crowdtrain.data.corpus import TextEncoder, load_token_stream, read_documents
from crowdtrain.data.prefetch import BatchPrefetcher
from crowdtrain.data.sampler import WindowSampler, peer_seed_from_peer_id

__all__ = [
    "BatchPrefetcher",
    "TextEncoder",
    "WindowSampler",
    "load_token_stream",
    "peer_seed_from_peer_id",
    "read_documents",
]
