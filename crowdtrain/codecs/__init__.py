"""Tensor encodings on the wire, shared by every mode that sends tensors.

compression     wire encodings by the manifest's names (fp16, int8, topk, none); hivemind's 8-bit decoder fixed and
                bounded; blockwise int8 (SkipPipe's gradient exchange, SPES's expert changes)
error_feedback  DiLoCo's top-k: each tensor's largest values sent, the rest kept back for later rounds

May import: `proto`, `errors`.
"""
