"""Model builders from a run manifest: tokenizers, transformers models, the training loss.

tokenizer  the built-in byte tokenizer, or a saved tokenizer directory, behind one interface
build      build a transformers model from a ModelSpec with identical initial weights on every peer;
           its parameter count, its kind (causal or masked) and its training loss
"""

from crowdtrain.models.build import (
    build_model,
    check_model_spec,
    count_parameters,
    model_kind,
    spec_parameter_count,
    training_loss,
)
from crowdtrain.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "build_model",
    "check_model_spec",
    "count_parameters",
    "load_tokenizer",
    "model_kind",
    "spec_parameter_count",
    "training_loss",
]
