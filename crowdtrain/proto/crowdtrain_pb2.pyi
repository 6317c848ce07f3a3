from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
BOUND_FIELD_NUMBER: _ClassVar[int]
bound: _descriptor.FieldDescriptor

class FieldBound(_message.Message):
    __slots__ = ("min", "max", "max_count")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    min: float
    max: float
    max_count: int
    def __init__(self, min: _Optional[float] = ..., max: _Optional[float] = ..., max_count: _Optional[int] = ...) -> None: ...

class RunManifest(_message.Message):
    __slots__ = ("run_id", "protocol_version", "created_at", "model", "data", "optimizer", "target_batch_size", "averaging", "moe", "diloco", "admission", "spes", "skippipe", "training")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TARGET_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_FIELD_NUMBER: _ClassVar[int]
    MOE_FIELD_NUMBER: _ClassVar[int]
    DILOCO_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    SPES_FIELD_NUMBER: _ClassVar[int]
    SKIPPIPE_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    protocol_version: int
    created_at: float
    model: ModelSpec
    data: DataSpec
    optimizer: OptimizerSpec
    target_batch_size: int
    averaging: AveragingSpec
    moe: MoESpec
    diloco: DiLoCoSpec
    admission: str
    spes: SpesSpec
    skippipe: SkipPipeSpec
    training: TrainingSpec
    def __init__(self, run_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., created_at: _Optional[float] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., data: _Optional[_Union[DataSpec, _Mapping]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., target_batch_size: _Optional[int] = ..., averaging: _Optional[_Union[AveragingSpec, _Mapping]] = ..., moe: _Optional[_Union[MoESpec, _Mapping]] = ..., diloco: _Optional[_Union[DiLoCoSpec, _Mapping]] = ..., admission: _Optional[str] = ..., spes: _Optional[_Union[SpesSpec, _Mapping]] = ..., skippipe: _Optional[_Union[SkipPipeSpec, _Mapping]] = ..., training: _Optional[_Union[TrainingSpec, _Mapping]] = ...) -> None: ...

class TrainingSpec(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class SkipPipeSpec(_message.Message):
    __slots__ = ("stages", "skip_ratio", "reorder", "microbatches", "wire_dtype", "gradient_dtype", "overlap_exchange")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    SKIP_RATIO_FIELD_NUMBER: _ClassVar[int]
    REORDER_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_EXCHANGE_FIELD_NUMBER: _ClassVar[int]
    stages: int
    skip_ratio: float
    reorder: bool
    microbatches: int
    wire_dtype: str
    gradient_dtype: str
    overlap_exchange: bool
    def __init__(self, stages: _Optional[int] = ..., skip_ratio: _Optional[float] = ..., reorder: _Optional[bool] = ..., microbatches: _Optional[int] = ..., wire_dtype: _Optional[str] = ..., gradient_dtype: _Optional[str] = ..., overlap_exchange: _Optional[bool] = ...) -> None: ...

class SpesSpec(_message.Message):
    __slots__ = ("merge_every", "merge_neighbours", "merge_alpha", "merge_warmup_steps", "replicas")
    MERGE_EVERY_FIELD_NUMBER: _ClassVar[int]
    MERGE_NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    MERGE_ALPHA_FIELD_NUMBER: _ClassVar[int]
    MERGE_WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    merge_every: int
    merge_neighbours: int
    merge_alpha: float
    merge_warmup_steps: int
    replicas: int
    def __init__(self, merge_every: _Optional[int] = ..., merge_neighbours: _Optional[int] = ..., merge_alpha: _Optional[float] = ..., merge_warmup_steps: _Optional[int] = ..., replicas: _Optional[int] = ...) -> None: ...

class DiLoCoSpec(_message.Message):
    __slots__ = ("inner_steps", "outer_learning_rate", "outer_momentum", "compression", "topk_fraction", "overlap", "min_inner_steps", "max_inner_steps", "fragments")
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    OUTER_LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    TOPK_FRACTION_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MIN_INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    inner_steps: int
    outer_learning_rate: float
    outer_momentum: float
    compression: str
    topk_fraction: float
    overlap: bool
    min_inner_steps: int
    max_inner_steps: int
    fragments: int
    def __init__(self, inner_steps: _Optional[int] = ..., outer_learning_rate: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., compression: _Optional[str] = ..., topk_fraction: _Optional[float] = ..., overlap: _Optional[bool] = ..., min_inner_steps: _Optional[int] = ..., max_inner_steps: _Optional[int] = ..., fragments: _Optional[int] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("architecture", "config_json", "tokenizer", "precision")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    config_json: str
    tokenizer: str
    precision: str
    def __init__(self, architecture: _Optional[str] = ..., config_json: _Optional[str] = ..., tokenizer: _Optional[str] = ..., precision: _Optional[str] = ...) -> None: ...

class DataSpec(_message.Message):
    __slots__ = ("source", "path", "text_field", "sequence_length")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    source: str
    path: str
    text_field: str
    sequence_length: int
    def __init__(self, source: _Optional[str] = ..., path: _Optional[str] = ..., text_field: _Optional[str] = ..., sequence_length: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "learning_rate", "weight_decay", "warmup_steps", "total_steps", "max_grad_norm")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    name: str
    learning_rate: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    max_grad_norm: float
    def __init__(self, name: _Optional[str] = ..., learning_rate: _Optional[float] = ..., weight_decay: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., total_steps: _Optional[int] = ..., max_grad_norm: _Optional[float] = ...) -> None: ...

class AveragingSpec(_message.Message):
    __slots__ = ("group_size", "grid_dims", "compression", "timeout_s", "matchmaking_time_s", "aggregation")
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GRID_DIMS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MATCHMAKING_TIME_S_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    group_size: int
    grid_dims: int
    compression: str
    timeout_s: float
    matchmaking_time_s: float
    aggregation: str
    def __init__(self, group_size: _Optional[int] = ..., grid_dims: _Optional[int] = ..., compression: _Optional[str] = ..., timeout_s: _Optional[float] = ..., matchmaking_time_s: _Optional[float] = ..., aggregation: _Optional[str] = ...) -> None: ...

class MoESpec(_message.Message):
    __slots__ = ("grid", "layers", "expert", "expert_hidden_size", "k", "k_min", "forward_timeout_s", "backward_timeout_s", "timeout_after_k_min_s", "uid_prefix")
    GRID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    K_MIN_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_AFTER_K_MIN_S_FIELD_NUMBER: _ClassVar[int]
    UID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    grid: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    expert: str
    expert_hidden_size: int
    k: int
    k_min: int
    forward_timeout_s: float
    backward_timeout_s: float
    timeout_after_k_min_s: float
    uid_prefix: str
    def __init__(self, grid: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[int]] = ..., expert: _Optional[str] = ..., expert_hidden_size: _Optional[int] = ..., k: _Optional[int] = ..., k_min: _Optional[int] = ..., forward_timeout_s: _Optional[float] = ..., backward_timeout_s: _Optional[float] = ..., timeout_after_k_min_s: _Optional[float] = ..., uid_prefix: _Optional[str] = ...) -> None: ...

class SignedManifest(_message.Message):
    __slots__ = ("manifest", "founder_public_key", "signature")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    FOUNDER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    manifest: bytes
    founder_public_key: bytes
    signature: bytes
    def __init__(self, manifest: _Optional[bytes] = ..., founder_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("peer_id", "version", "state", "roles", "device", "samples_per_second", "epoch", "loss", "upload_mbps", "download_mbps", "reachable", "experts", "multiaddrs", "last_seen", "samples_accumulated", "run_id", "partial_averages", "local_steps", "measured_samples_per_second", "aggregation_share", "role_override", "reachability_measured", "plan_digest", "phase_times", "training", "excluded_peers", "observed_uploads", "relays")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ONLINE: _ClassVar[PeerStatus.State]
        OFFLINE: _ClassVar[PeerStatus.State]
    ONLINE: PeerStatus.State
    OFFLINE: PeerStatus.State
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBPS_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MBPS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MULTIADDRS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_AVERAGES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_SHARE_FIELD_NUMBER: _ClassVar[int]
    ROLE_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_MEASURED_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMES_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_PEERS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    RELAYS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    version: str
    state: PeerStatus.State
    roles: _containers.RepeatedScalarFieldContainer[str]
    device: str
    samples_per_second: float
    epoch: int
    loss: float
    upload_mbps: float
    download_mbps: float
    reachable: bool
    experts: _containers.RepeatedScalarFieldContainer[str]
    multiaddrs: _containers.RepeatedScalarFieldContainer[str]
    last_seen: float
    samples_accumulated: int
    run_id: str
    partial_averages: int
    local_steps: int
    measured_samples_per_second: float
    aggregation_share: float
    role_override: str
    reachability_measured: bool
    plan_digest: str
    phase_times: PhaseTimes
    training: TrainingStatus
    excluded_peers: _containers.RepeatedCompositeFieldContainer[ExcludedPeer]
    observed_uploads: _containers.RepeatedCompositeFieldContainer[ObservedUpload]
    relays: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, peer_id: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[_Union[PeerStatus.State, str]] = ..., roles: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ..., samples_per_second: _Optional[float] = ..., epoch: _Optional[int] = ..., loss: _Optional[float] = ..., upload_mbps: _Optional[float] = ..., download_mbps: _Optional[float] = ..., reachable: _Optional[bool] = ..., experts: _Optional[_Iterable[str]] = ..., multiaddrs: _Optional[_Iterable[str]] = ..., last_seen: _Optional[float] = ..., samples_accumulated: _Optional[int] = ..., run_id: _Optional[str] = ..., partial_averages: _Optional[int] = ..., local_steps: _Optional[int] = ..., measured_samples_per_second: _Optional[float] = ..., aggregation_share: _Optional[float] = ..., role_override: _Optional[str] = ..., reachability_measured: _Optional[bool] = ..., plan_digest: _Optional[str] = ..., phase_times: _Optional[_Union[PhaseTimes, _Mapping]] = ..., training: _Optional[_Union[TrainingStatus, _Mapping]] = ..., excluded_peers: _Optional[_Iterable[_Union[ExcludedPeer, _Mapping]]] = ..., observed_uploads: _Optional[_Iterable[_Union[ObservedUpload, _Mapping]]] = ..., relays: _Optional[_Iterable[str]] = ...) -> None: ...

class ExcludedPeer(_message.Message):
    __slots__ = ("peer_id", "reason", "remaining_s")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    reason: str
    remaining_s: float
    def __init__(self, peer_id: _Optional[str] = ..., reason: _Optional[str] = ..., remaining_s: _Optional[float] = ...) -> None: ...

class ObservedUpload(_message.Message):
    __slots__ = ("peer_id", "upload_mbps")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBPS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    upload_mbps: float
    def __init__(self, peer_id: _Optional[str] = ..., upload_mbps: _Optional[float] = ...) -> None: ...

class TrainingStatus(_message.Message):
    __slots__ = ("mode", "compression", "inner_step", "inner_steps", "round_bytes_sent", "compute_utilisation", "experts_owned", "experts_total", "skippipe_stage", "skippipe_iteration", "experts_capacity")
    MODE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROUND_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_OWNED_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SKIPPIPE_STAGE_FIELD_NUMBER: _ClassVar[int]
    SKIPPIPE_ITERATION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    mode: str
    compression: str
    inner_step: int
    inner_steps: int
    round_bytes_sent: int
    compute_utilisation: float
    experts_owned: int
    experts_total: int
    skippipe_stage: int
    skippipe_iteration: int
    experts_capacity: int
    def __init__(self, mode: _Optional[str] = ..., compression: _Optional[str] = ..., inner_step: _Optional[int] = ..., inner_steps: _Optional[int] = ..., round_bytes_sent: _Optional[int] = ..., compute_utilisation: _Optional[float] = ..., experts_owned: _Optional[int] = ..., experts_total: _Optional[int] = ..., skippipe_stage: _Optional[int] = ..., skippipe_iteration: _Optional[int] = ..., experts_capacity: _Optional[int] = ...) -> None: ...

class PhaseTimes(_message.Message):
    __slots__ = ("compute_s", "wait_s", "matchmaking_s", "allreduce_s", "state_averaging_s", "optimizer_step_s", "state_download_s")
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MATCHMAKING_S_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_S_FIELD_NUMBER: _ClassVar[int]
    STATE_AVERAGING_S_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_S_FIELD_NUMBER: _ClassVar[int]
    STATE_DOWNLOAD_S_FIELD_NUMBER: _ClassVar[int]
    compute_s: float
    wait_s: float
    matchmaking_s: float
    allreduce_s: float
    state_averaging_s: float
    optimizer_step_s: float
    state_download_s: float
    def __init__(self, compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., matchmaking_s: _Optional[float] = ..., allreduce_s: _Optional[float] = ..., state_averaging_s: _Optional[float] = ..., optimizer_step_s: _Optional[float] = ..., state_download_s: _Optional[float] = ...) -> None: ...

class ProbeRefusal(_message.Message):
    __slots__ = ("reason", "retry_after_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    retry_after_s: float
    def __init__(self, reason: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("total_bytes", "payload")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    payload: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class UploadResult(_message.Message):
    __slots__ = ("refusal", "received_bytes", "measured_bytes", "duration_s", "truncated")
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    refusal: ProbeRefusal
    received_bytes: int
    measured_bytes: int
    duration_s: float
    truncated: bool
    def __init__(self, refusal: _Optional[_Union[ProbeRefusal, _Mapping]] = ..., received_bytes: _Optional[int] = ..., measured_bytes: _Optional[int] = ..., duration_s: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("refusal", "payload")
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    refusal: ProbeRefusal
    payload: bytes
    def __init__(self, refusal: _Optional[_Union[ProbeRefusal, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("multiaddrs",)
    MULTIADDRS_FIELD_NUMBER: _ClassVar[int]
    multiaddrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, multiaddrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DialAttempt(_message.Message):
    __slots__ = ("multiaddr", "verdict", "detail")
    class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DIALED: _ClassVar[DialAttempt.Verdict]
        REFUSED: _ClassVar[DialAttempt.Verdict]
        TIMEOUT: _ClassVar[DialAttempt.Verdict]
        IP_MISMATCH: _ClassVar[DialAttempt.Verdict]
        UNSUPPORTED: _ClassVar[DialAttempt.Verdict]
        UNREACHABLE: _ClassVar[DialAttempt.Verdict]
        NOT_TRIED: _ClassVar[DialAttempt.Verdict]
    DIALED: DialAttempt.Verdict
    REFUSED: DialAttempt.Verdict
    TIMEOUT: DialAttempt.Verdict
    IP_MISMATCH: DialAttempt.Verdict
    UNSUPPORTED: DialAttempt.Verdict
    UNREACHABLE: DialAttempt.Verdict
    NOT_TRIED: DialAttempt.Verdict
    MULTIADDR_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    multiaddr: str
    verdict: DialAttempt.Verdict
    detail: str
    def __init__(self, multiaddr: _Optional[str] = ..., verdict: _Optional[_Union[DialAttempt.Verdict, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class DialBackResult(_message.Message):
    __slots__ = ("refusal", "attempts", "observed_ip")
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_IP_FIELD_NUMBER: _ClassVar[int]
    refusal: ProbeRefusal
    attempts: _containers.RepeatedCompositeFieldContainer[DialAttempt]
    observed_ip: str
    def __init__(self, refusal: _Optional[_Union[ProbeRefusal, _Mapping]] = ..., attempts: _Optional[_Iterable[_Union[DialAttempt, _Mapping]]] = ..., observed_ip: _Optional[str] = ...) -> None: ...

class ExpertParametersRequest(_message.Message):
    __slots__ = ("uid",)
    UID_FIELD_NUMBER: _ClassVar[int]
    uid: str
    def __init__(self, uid: _Optional[str] = ...) -> None: ...

class ExpertParametersChunk(_message.Message):
    __slots__ = ("found", "num_values", "payload", "busy")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    found: bool
    num_values: int
    payload: bytes
    busy: bool
    def __init__(self, found: _Optional[bool] = ..., num_values: _Optional[int] = ..., payload: _Optional[bytes] = ..., busy: _Optional[bool] = ...) -> None: ...

class SpesExpertRequest(_message.Message):
    __slots__ = ("unit", "round", "base_digest")
    UNIT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    unit: int
    round: int
    base_digest: bytes
    def __init__(self, unit: _Optional[int] = ..., round: _Optional[int] = ..., base_digest: _Optional[bytes] = ...) -> None: ...

class SpesExpertChunk(_message.Message):
    __slots__ = ("found", "num_values", "payload", "change", "digest", "not_owner", "busy")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NOT_OWNER_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    found: bool
    num_values: int
    payload: bytes
    change: bool
    digest: bytes
    not_owner: bool
    busy: bool
    def __init__(self, found: _Optional[bool] = ..., num_values: _Optional[int] = ..., payload: _Optional[bytes] = ..., change: _Optional[bool] = ..., digest: _Optional[bytes] = ..., not_owner: _Optional[bool] = ..., busy: _Optional[bool] = ...) -> None: ...

class SparsePart(_message.Message):
    __slots__ = ("version", "dense", "index_gaps", "values")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    INDEX_GAPS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    version: int
    dense: bool
    index_gaps: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    def __init__(self, version: _Optional[int] = ..., dense: _Optional[bool] = ..., index_gaps: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ...) -> None: ...

class InviteCertificate(_message.Message):
    __slots__ = ("run_id", "founder_public_key", "invite_public_key", "expires_at", "label", "signature", "max_identities")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FOUNDER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    INVITE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_IDENTITIES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    founder_public_key: bytes
    invite_public_key: bytes
    expires_at: float
    label: str
    signature: bytes
    max_identities: int
    def __init__(self, run_id: _Optional[str] = ..., founder_public_key: _Optional[bytes] = ..., invite_public_key: _Optional[bytes] = ..., expires_at: _Optional[float] = ..., label: _Optional[str] = ..., signature: _Optional[bytes] = ..., max_identities: _Optional[int] = ...) -> None: ...

class JoinToken(_message.Message):
    __slots__ = ("certificate", "invite_private_key")
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    INVITE_PRIVATE_KEY_FIELD_NUMBER: _ClassVar[int]
    certificate: InviteCertificate
    invite_private_key: bytes
    def __init__(self, certificate: _Optional[_Union[InviteCertificate, _Mapping]] = ..., invite_private_key: _Optional[bytes] = ...) -> None: ...

class AdmissionRecord(_message.Message):
    __slots__ = ("username", "public_key", "expiration_time", "signature", "since", "since_signature")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_TIME_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    SINCE_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    username: str
    public_key: bytes
    expiration_time: str
    signature: bytes
    since: float
    since_signature: bytes
    def __init__(self, username: _Optional[str] = ..., public_key: _Optional[bytes] = ..., expiration_time: _Optional[str] = ..., signature: _Optional[bytes] = ..., since: _Optional[float] = ..., since_signature: _Optional[bytes] = ...) -> None: ...

class RevokedInvite(_message.Message):
    __slots__ = ("invite_public_key", "expires_at")
    INVITE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    invite_public_key: bytes
    expires_at: float
    def __init__(self, invite_public_key: _Optional[bytes] = ..., expires_at: _Optional[float] = ...) -> None: ...

class InviteRevocations(_message.Message):
    __slots__ = ("run_id", "founder_public_key", "revoked", "issued_at", "signature")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FOUNDER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    founder_public_key: bytes
    revoked: _containers.RepeatedCompositeFieldContainer[RevokedInvite]
    issued_at: float
    signature: bytes
    def __init__(self, run_id: _Optional[str] = ..., founder_public_key: _Optional[bytes] = ..., revoked: _Optional[_Iterable[_Union[RevokedInvite, _Mapping]]] = ..., issued_at: _Optional[float] = ..., signature: _Optional[bytes] = ...) -> None: ...

class StateDigestRequest(_message.Message):
    __slots__ = ("seed",)
    SEED_FIELD_NUMBER: _ClassVar[int]
    seed: int
    def __init__(self, seed: _Optional[int] = ...) -> None: ...

class TensorSketch(_message.Message):
    __slots__ = ("sum", "norm", "samples")
    SUM_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    sum: float
    norm: float
    samples: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sum: _Optional[float] = ..., norm: _Optional[float] = ..., samples: _Optional[_Iterable[float]] = ...) -> None: ...

class StateDigest(_message.Message):
    __slots__ = ("served", "epoch", "tensors")
    SERVED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    served: bool
    epoch: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSketch]
    def __init__(self, served: _Optional[bool] = ..., epoch: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSketch, _Mapping]]] = ...) -> None: ...

class StageHop(_message.Message):
    __slots__ = ("iteration", "microbatch", "stage", "shape", "dtype", "payload", "optimizer_steps", "loss", "microbatches", "fingerprint", "max_bytes_per_s")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    microbatch: int
    stage: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    payload: bytes
    optimizer_steps: int
    loss: float
    microbatches: int
    fingerprint: _containers.RepeatedScalarFieldContainer[float]
    max_bytes_per_s: float
    def __init__(self, iteration: _Optional[int] = ..., microbatch: _Optional[int] = ..., stage: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., payload: _Optional[bytes] = ..., optimizer_steps: _Optional[int] = ..., loss: _Optional[float] = ..., microbatches: _Optional[int] = ..., fingerprint: _Optional[_Iterable[float]] = ..., max_bytes_per_s: _Optional[float] = ...) -> None: ...

class SkipPipeMember(_message.Message):
    __slots__ = ("peer_id", "stage", "seconds_per_microbatch", "memory_microbatches", "serving", "seconds_per_hop")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_HOP_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    stage: int
    seconds_per_microbatch: float
    memory_microbatches: int
    serving: bool
    seconds_per_hop: float
    def __init__(self, peer_id: _Optional[str] = ..., stage: _Optional[int] = ..., seconds_per_microbatch: _Optional[float] = ..., memory_microbatches: _Optional[int] = ..., serving: _Optional[bool] = ..., seconds_per_hop: _Optional[float] = ...) -> None: ...

class SkipPipeMembership(_message.Message):
    __slots__ = ("from_iteration", "members")
    FROM_ITERATION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    from_iteration: int
    members: _containers.RepeatedCompositeFieldContainer[SkipPipeMember]
    def __init__(self, from_iteration: _Optional[int] = ..., members: _Optional[_Iterable[_Union[SkipPipeMember, _Mapping]]] = ...) -> None: ...

class SkipPipeRoster(_message.Message):
    __slots__ = ("history",)
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    history: _containers.RepeatedCompositeFieldContainer[SkipPipeMembership]
    def __init__(self, history: _Optional[_Iterable[_Union[SkipPipeMembership, _Mapping]]] = ...) -> None: ...
