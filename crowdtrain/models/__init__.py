"""Model builders from a run manifest: tokenizers, transformers models, the training loss.

tokenizer  the built-in byte tokenizer, or a saved tokenizer directory, behind one interface
build      build a transformers model from a ModelSpec with identical initial weights on every peer;
           its parameter count, its kind (causal or masked) and its training loss
dmoe       the DMoE variant: chosen FFNs replaced by hivemind's RemoteMixtureOfExperts over the run's grid
precision  the manifest's compute precision resolved for a device (autocast, loss scaling, TF32), and the
           micro-step's backward and optimizer step in it
"""

from crowdtrain.models.build import (
    build_model,
    check_model_spec,
    count_parameters,
    model_kind,
    spec_parameter_count,
    training_loss,
)
from crowdtrain.models.dmoe import DMoEFeedForward, ExpertsUnavailableError, build_dmoe_model
from crowdtrain.models.precision import (
    MicroStep,
    Precision,
    apply_tf32,
    autocast,
    precision_for_device,
    resolve_precision,
)
from crowdtrain.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DMoEFeedForward",
    "ExpertsUnavailableError",
    "HFTokenizer",
    "MicroStep",
    "Precision",
    "Tokenizer",
    "apply_tf32",
    "autocast",
    "build_dmoe_model",
    "build_model",
    "check_model_spec",
    "count_parameters",
    "load_tokenizer",
    "model_kind",
    "precision_for_device",
    "resolve_precision",
    "spec_parameter_count",
    "training_loss",
]
