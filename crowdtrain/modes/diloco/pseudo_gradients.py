"""The averager of DiLoCo's outer rounds: pseudo-gradients averaged in Moshpit groups, the outer state served.

Each round the training mode writes this peer's pseudo-gradient (global parameters at the round's start minus
its parameters after the inner steps) into the averager's tensors, and one all-reduce averages them: exact
(a partial round raises), partitioned by the plan's shares, chunks checked and aggregated robustly. Between
rounds the averager serves the outer state a joiner needs (the global parameters, the outer optimizer's
momentum, the round) and downloads it verified (state/download.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKey, GroupKeyManager
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.compression import CompressionInfo

from crowdtrain.averaging.authored import AuthoredAverager, UnauthoredEntryError, own_gathered
from crowdtrain.averaging.exact import ExactRoundsMixin
from crowdtrain.averaging.grid import GroupSizeMixin
from crowdtrain.averaging.partition import PlanSharesMixin
from crowdtrain.averaging.traffic import TrafficCountingAverager
from crowdtrain.dht.gate import AdmissionGated
from crowdtrain.state.download import VerifiedStateDownloadMixin
from crowdtrain.state.serving import StateServingMixin
from crowdtrain.state.template import StateTemplate

OuterState = tuple[dict[str, Any], list[torch.Tensor]]
"""(metadata with at least `epoch`, tensors) as a peer serves it and a joiner loads it."""


class PseudoGradientAverager(
    AdmissionGated,
    StateServingMixin,
    ExactRoundsMixin,
    PlanSharesMixin,
    GroupSizeMixin,
    VerifiedStateDownloadMixin,
    TrafficCountingAverager,
    AuthoredAverager,
):
    """Averages pseudo-gradients; `outer_state` gives what joiners download, `template` what a download must match."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        *,
        partial_counter: Synchronized,
        outer_state: Callable[[], OuterState],
        template: Callable[[], StateTemplate],
        **kwargs: Any,
    ):
        self.partial_counter = partial_counter
        self._outer_state, self._template = outer_state, template
        super().__init__(averaged_tensors, **kwargs)

    async def _step(self, *, step: StepControl, **kwargs: Any) -> Any:
        # Runs in the averager's process: each look for a group happens under a key of its own step's round.
        matchmaking = self._matchmaking
        if not isinstance(matchmaking.group_key_manager, RoundKeyManager):
            keys = matchmaking.group_key_manager = RoundKeyManager.replacing(matchmaking.group_key_manager)
            looking = _LookingByRound(matchmaking.look_for_group, keys, self.serializer)
            matchmaking.look_for_group, self._looking = looking, looking
        return await super()._step(step=step, **kwargs)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        # A group whose members are at different outer rounds is never applied (DiLoCoMode._round_gathered), so
        # its all-reduce is skipped: no bytes for nothing, and no honest member dropped and quarantined by the
        # reducers' norm check for a pseudo-gradient of another round's length. Every member holds the same
        # gathered data (the leader sends it to all), so every member skips the same all-reduce. Honest peers
        # never meet another round's (RoundKeyManager): a member that gathers another round than the key's lied in
        # one of them, so this node keeps it out of its groups for a while (`disputers`), and the lie costs the
        # swarm one round, not every round.
        try:
            entries = self.authored_entries(group_info)  # a forged entry is nobody's lie: the round is just lost
        except UnauthoredEntryError as e:
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e
        gathered = {peer: entry.value for peer, entry in zip(group_info.peer_ids, entries, strict=True)}
        looking: _LookingByRound | None = self.__dict__.get("_looking")
        round_ = None if looking is None else looking.key_rounds.pop(group_info.group_id, None)
        if len({gathered_round(value) for value in gathered.values()}) > 1:
            for peer, claimed in disputers(gathered, round_):
                self._quarantine_sender(str(peer), f"gathered round {claimed} in a group of round {round_}")
            return gathered
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], list[CompressionInfo]]:
        # hivemind's DecentralizedAverager.get_current_state (run in this, the host process, when a peer asks).
        metadata, tensors = self._outer_state()
        return (
            metadata,
            tensors,
            [CompressionInfo.from_tensor(tensor, key=index) for index, tensor in enumerate(tensors)],
        )

    def state_template(self) -> StateTemplate:
        return self._template()


MAX_GATHERED = 8
"""The most items of a peer's gathered list ([round, proposed H, ...]) read: later versions may add some."""


def gathered_round(value: Any) -> int | None:
    """The round in a peer's gathered data: an int, or the first of [round, proposed H, ...] (adaptive H, SPES)."""
    if isinstance(value, list | tuple) and 2 <= len(value) <= MAX_GATHERED:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def disputers(gathered: dict[Any, Any], round_: int | None) -> list[tuple[Any, int | None]]:
    """The members of a group of round `round_` (its key's) that gathered another round, with the round each
    gathered; [] when this node's round is not known."""
    if round_ is None:
        return []
    return [(peer, gathered_round(value)) for peer, value in gathered.items() if gathered_round(value) != round_]


class RoundKeyManager(GroupKeyManager):
    """hivemind's group keys with the outer round in them: `{prefix}_r{round}.0b{bits}`.

    Under one key for every round, peers one round apart met whenever they ended a round at the same moment (the
    swarm's progress ends everyone's round at once), their group mixed rounds and nobody applied it; both went on
    alone and one round apart, round after round.
    Keyed by round, such peers find no group, each ends its round alone, and the one behind takes the other's
    state; the peers of one round never wait for a peer of another. Donors are still found under the prefix."""

    round: int | None = None

    @classmethod
    def replacing(cls, keys: GroupKeyManager) -> RoundKeyManager:
        """A round-keyed manager with `keys`' DHT, prefix, Moshpit bits and group size."""
        return cls(keys.dht, keys.prefix, keys.group_bits, keys.target_group_size)

    @property
    def current_key(self) -> GroupKey:
        tag = "" if self.round is None else f"_r{self.round}"
        return f"{self.prefix}{tag}.0b{self.group_bits}"


class _LookingByRound:
    """hivemind's `Matchmaking.look_for_group`, keyed by the round of the step that looks, one look at a time.

    Steps of one averager overlap: a round given up (the swarm moved on) is cancelled while the next round's step
    starts. With the key's round set as each step starts, the older step looked on under the newer round's key with
    its older round's data, met that round's group, and every member kept this honest node out as a liar
    (`disputers`). Here the key's round is set when a step's look begins and held until it ends; the round whose
    key formed each group is kept for its all-reduce (`key_rounds`)."""

    def __init__(self, look_for_group: Callable[..., Awaitable[Any]], keys: RoundKeyManager, serializer: Any):
        self._look, self._keys, self._serializer = look_for_group, keys, serializer
        self._lock = asyncio.Lock()
        self.key_rounds: dict[bytes, int | None] = {}
        """The key's round of each group found, by group ID, until its all-reduce reads it (at most a few held)."""

    async def __call__(self, step: StepControl, *args: Any, **kwargs: Any) -> Any:
        async with self._lock:
            self._keys.round = _step_round(self._serializer, step)
            group_info = await self._look(step, *args, **kwargs)
            if group_info is not None:
                while len(self.key_rounds) >= 8:  # groups whose all-reduce never ran
                    self.key_rounds.pop(next(iter(self.key_rounds)))
                self.key_rounds[group_info.group_id] = self._keys.round
            return group_info


def _step_round(serializer: Any, step: StepControl) -> int | None:
    """The round a step gathers (`gathered_round` of its user data, as hivemind's `step` packed it), or None."""
    try:
        return gathered_round(own_gathered(serializer, step.data_for_gather))
    except Exception:
        return None
