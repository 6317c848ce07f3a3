"""The run manifest: what a run trains, on what data, with which optimizer and averaging, and how its sections fit.

It travels through the DHT as a signed protobuf (`proto.RunManifest` inside `proto.SignedManifest`), so joiners
need only an address.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from crowdtrain import proto
from crowdtrain.manifest.specs import AveragingSpec, DataSpec, ModelSpec, MoESpec, OptimizerSpec, TrainingSpec
from crowdtrain.modes.diloco.settings import DiLoCoSpec
from crowdtrain.modes.settings import check_mode_sections
from crowdtrain.modes.skippipe.settings import SkipPipeSpec
from crowdtrain.modes.spes.settings import SPESSpec
from crowdtrain.structured import FieldError, from_message, to_message

PROTOCOL_VERSION = 9
"""Bumped when nodes of different versions can no longer train together. 2: a reducer sends back the encoded
average, not a delta (averaging/traffic.py). 3: a sender ends its all-reduce stream only after every average
came back, and a reducer holds a zero-share sender's averages until all are ready, not until that end. 4: every
step's gradient is clipped to `optimizer.max_grad_norm` (replicas that clip differently would drift apart). 5: a run
may be invite-only (`admission`): its nodes then sign every DHT request with an access token (dht/admission.py). 6:
SkipPipe's schedule weighs each node's published link (`SkipPipeMember.seconds_per_hop`,
modes/skippipe/roster/schedule.py), and
with `overlap_exchange` a replica computes on a look-ahead and serves and fingerprints its true state. 7: DiLoCo
groups are keyed by outer round (modes/diloco/pseudo_gradients.py), and with `overlap_exchange` SkipPipe's schedule
costs hops at the link the background exchange leaves (`SkipPipeProblem.background_share`). 8: the training mode
is `training.mode` (RunManifest.training), no longer `averaging.mode`. 9: every averaging group member signs what it
gathers (averaging/authored.py), and a group with an unsigned entry is not averaged."""

RUN_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
MAX_CREATED_AT = 1e10
"""Cap on `created_at`: the year 2286 (a time far beyond it overflowed the state download's epoch bound)."""
ADMISSIONS = ("open", "invite")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunManifest:
    """Everything a joiner needs to train with the run; published by the founder, signed."""

    run_id: str
    """The run's name: lowercase letters, digits, '.', '_' and '-', at most 63 characters."""
    protocol_version: int = PROTOCOL_VERSION
    """The wire protocol the run speaks."""
    created_at: float = 0.0
    """Unix seconds when the founder started the run (set on publication)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    target_batch_size: int = 256
    """Samples the whole swarm accumulates per global step."""
    training: TrainingSpec = field(default_factory=TrainingSpec)
    averaging: AveragingSpec = field(default_factory=AveragingSpec)
    moe: MoESpec | None = None
    """DMoE runs only: the expert grid that replaces the model's FFNs; None for a dense run."""
    diloco: DiLoCoSpec | None = None
    """DiLoCo runs, and SPES runs for their dense part; None there means DiLoCoSpec's defaults."""
    spes: SPESSpec | None = None
    """SPES runs only; None there means SPESSpec's defaults. Which mode reads which section: modes/settings.py."""
    skippipe: SkipPipeSpec | None = None
    """SkipPipe runs only; None there means SkipPipeSpec's defaults."""
    admission: str = "open"
    """`open`: anyone who reaches the swarm may join; `invite`: only nodes holding a join token the founder issued
    (`crowdtrain invite`), checked on every DHT request and every RPC (crowdtrain/dht/admission.py, dht/gate.py)."""

    def __post_init__(self) -> None:
        if not RUN_ID_PATTERN.fullmatch(self.run_id):
            raise ValueError(f"run_id must be 1-63 lowercase letters, digits, '.', '_' or '-', got {self.run_id!r}")
        if self.protocol_version != PROTOCOL_VERSION:
            remedy = (
                "run the crowdtrain release the run was started with"
                if self.protocol_version < PROTOCOL_VERSION
                else "upgrade crowdtrain"
            )
            raise ValueError(
                f"protocol_version {self.protocol_version} is not spoken by this crowdtrain "
                f"(it speaks {PROTOCOL_VERSION}); {remedy}"
            )
        if self.target_batch_size < 1:
            raise ValueError(f"target_batch_size must be positive, got {self.target_batch_size}")
        if not 0.0 <= self.created_at <= MAX_CREATED_AT:
            raise ValueError(f"created_at must be Unix seconds from 0 to {MAX_CREATED_AT:.0e}, got {self.created_at}")
        if self.moe is not None:
            _check_moe_layers(self.moe, self.model)
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {', '.join(ADMISSIONS)}, got {self.admission!r}")
        check_mode_sections(self)

    def to_bytes(self) -> bytes:
        """Serialize as a `proto.RunManifest` message."""
        return to_message(self, proto.RunManifest()).SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> RunManifest:
        """Parse a serialized `proto.RunManifest`; raises ValueError when malformed or invalid."""
        try:
            message = proto.RunManifest.FromString(data)
        except DecodeError as e:
            raise FieldError(f"not a RunManifest message: {e}") from None
        return from_message(cls, message)


def _check_moe_layers(moe: MoESpec, model: ModelSpec) -> None:
    for name in ("num_hidden_layers", "hidden_size"):
        value = model.config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"a DMoE run needs a positive model.config.{name}, to lay out its experts")
    num_layers = model.config["num_hidden_layers"]
    beyond = [layer for layer in moe.layers if layer >= num_layers]
    if beyond:
        raise ValueError(f"moe.layers names layer {beyond[0]}, but the model has {num_layers} layers")


def moe_layers(manifest: RunManifest) -> tuple[int, ...]:
    """The decoder layers of a DMoE run whose FFN is a DMoE layer; () for a dense run."""
    if manifest.moe is None:
        return ()
    return tuple(sorted(manifest.moe.layers)) or tuple(range(int(manifest.model.config["num_hidden_layers"])))


def expert_uid_prefix(manifest: RunManifest, layer: int) -> str:
    """The uid prefix of one layer's grid, ending in '.': hivemind's uids allow no '.' before the grid indices."""
    assert manifest.moe is not None
    return f"{manifest.run_id.replace('.', '_')}-{manifest.moe.uid_prefix}{layer}."


def expert_uids(manifest: RunManifest) -> list[str]:
    """Every expert uid of a DMoE run, layer by layer in grid order; [] for a dense run."""
    if manifest.moe is None:
        return []
    cells = itertools.product(*(range(size) for size in manifest.moe.grid))
    suffixes = [".".join(map(str, cell)) for cell in cells]
    return [expert_uid_prefix(manifest, layer) + suffix for layer in moe_layers(manifest) for suffix in suffixes]
