"""The run manifest: what a run trains, on what data, with which optimizer and averaging; the founder builds it
from a preset or a run file, and it travels through the DHT as a signed protobuf.

specs      the sections: model, data, optimizer, averaging, DMoE's settings; each mode's own section is its
           sub-package's `settings.py` (crowdtrain/modes/settings.py), re-exported here
run        RunManifest: how its sections fit, its protobuf form, what it implies (expert uids)
presets    the named presets, plain functions returning a manifest
loading    run files: TOML that extends a preset, and a preset printed as one
"""

from crowdtrain.manifest.loading import load_run_file, manifest_from_overrides, preset_run_file
from crowdtrain.manifest.presets import (
    PRESETS,
    demo,
    demo_moe,
    llama_20m,
    llama_85m,
    llama_350m,
    preset_manifest,
    preset_summaries,
    skippipe_demo,
    spes_28m,
    spes_250m,
    spes_demo,
)
from crowdtrain.manifest.run import (
    ADMISSIONS,
    MAX_CREATED_AT,
    PROTOCOL_VERSION,
    RUN_ID_PATTERN,
    RunManifest,
    expert_uid_prefix,
    expert_uids,
    moe_layers,
)
from crowdtrain.manifest.specs import (
    AGGREGATION_RULES,
    DATA_SOURCES,
    EXPERT_ARCHITECTURES,
    MAX_EXPERTS_PER_LAYER,
    MAX_MODEL_CONFIG_BYTES,
    PRECISIONS,
    UID_PREFIX_PATTERN,
    AveragingSpec,
    DataSpec,
    ModelSpec,
    MoESpec,
    OptimizerSpec,
    TrainingSpec,
)
from crowdtrain.modes.diloco.settings import DILOCO_COMPRESSIONS, MAX_FRAGMENTS, DiLoCoSpec
from crowdtrain.modes.settings import TRAINING_MODES
from crowdtrain.modes.skippipe.settings import (
    MAX_SKIPPIPE_STAGES,
    SKIPPIPE_ARCHITECTURES,
    SKIPPIPE_GRADIENT_DTYPES,
    SKIPPIPE_WIRE_DTYPES,
    SkipPipeSpec,
)
from crowdtrain.modes.spes.settings import MAX_SPES_REPLICAS, SPESSpec

__all__ = [
    "ADMISSIONS",
    "AGGREGATION_RULES",
    "DATA_SOURCES",
    "DILOCO_COMPRESSIONS",
    "EXPERT_ARCHITECTURES",
    "MAX_CREATED_AT",
    "MAX_EXPERTS_PER_LAYER",
    "MAX_FRAGMENTS",
    "MAX_MODEL_CONFIG_BYTES",
    "MAX_SKIPPIPE_STAGES",
    "MAX_SPES_REPLICAS",
    "PRECISIONS",
    "PRESETS",
    "PROTOCOL_VERSION",
    "RUN_ID_PATTERN",
    "SKIPPIPE_ARCHITECTURES",
    "SKIPPIPE_GRADIENT_DTYPES",
    "SKIPPIPE_WIRE_DTYPES",
    "TRAINING_MODES",
    "UID_PREFIX_PATTERN",
    "AveragingSpec",
    "DataSpec",
    "DiLoCoSpec",
    "ModelSpec",
    "MoESpec",
    "OptimizerSpec",
    "RunManifest",
    "SPESSpec",
    "SkipPipeSpec",
    "TrainingSpec",
    "demo",
    "demo_moe",
    "expert_uid_prefix",
    "expert_uids",
    "llama_20m",
    "llama_85m",
    "llama_350m",
    "load_run_file",
    "manifest_from_overrides",
    "moe_layers",
    "preset_manifest",
    "preset_run_file",
    "preset_summaries",
    "skippipe_demo",
    "spes_28m",
    "spes_250m",
    "spes_demo",
]
