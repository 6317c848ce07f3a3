"""SPES on real peers: each trains only its experts, the round hands every node the owners' copies, an owner's
death costs at most one round of its experts' training, and a joiner takes the swarm's dense state and experts.

Every peer is a real SPESMode (a real model, real forward and backward passes, its DiLoCo averager process, its
progress tracker, a DHT on loopback, the expert exchange's RPCs). The rounds are driven as the DiLoCo outer-step
tests drive them: inner steps on each peer's own micro-batches, then every peer's outer round at once.
"""

from __future__ import annotations

import dataclasses
import tracemalloc
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from lab.diloco import loopback_dht, loopback_dhts, spes_peer, spes_peers
from lab.processes import await_condition

from crowdtrain import proto
from crowdtrain.manifest import DiLoCoSpec, RunManifest, SPESSpec, spes_demo
from crowdtrain.modes.base import SwarmView
from crowdtrain.modes.diloco.joining import _tiebreak
from crowdtrain.modes.progress import Progress
from crowdtrain.modes.spes.expert_exchange import (
    ANSWER_LIMITS,
    NAMESPACE,
    ExpertExchange,
    ExpertFetchError,
    Published,
    change_bytes,
    copy_digest,
    encode_change,
)
from crowdtrain.modes.spes.gathered import read_member, spes_gathered
from crowdtrain.modes.spes.mode import SPESMode
from crowdtrain.modes.spes.owned_experts import unit_experts

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def manifest(name: str) -> RunManifest:
    base = spes_demo()
    small = dict(base.model.config, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return dataclasses.replace(
        base,
        run_id=f"spes-{name}",
        model=dataclasses.replace(base.model, config={**small, "num_key_value_heads": 2}),
        target_batch_size=1_000_000,  # rounds end when the test says, not when the swarm's samples reach a target
        # a group closes once every known peer is in: the matchmaking time only gives a late peer slack
        averaging=dataclasses.replace(base.averaging, group_size=4, matchmaking_time_s=5.0, timeout_s=10.0),
        diloco=DiLoCoSpec(inner_steps=1, overlap=False),
        spes=SPESSpec(),
    )


def flat(mode: SPESMode, unit: int) -> torch.Tensor:
    return torch.cat([tensor.detach().reshape(-1) for tensor in unit_experts(mode.layers, unit)]).clone()


def train(modes: Sequence[SPESMode], steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for mode in modes:
            assert mode.train_micro_batch(torch.randint(0, 256, (4, 32), generator=generator)) is not None


def outer_round(modes: Sequence[SPESMode]) -> None:
    # at least: a vanished peer's progress record outlives it (hivemind's metadata expiration)
    await_condition(
        lambda: all(mode.tracker.global_progress.num_peers >= len(modes) for mode in modes),
        60,
        "every peer's tracker to see the others",
    )
    with ThreadPoolExecutor(len(modes)) as pool:
        list(pool.map(lambda mode: mode._outer_round(), modes))


def a_round_without(modes: list[SPESMode], dead: SPESMode, seed: int) -> None:
    """`dead` stops answering (its exchange, its averager and its DHT go; no hand-over is attempted); the others,
    left in `modes`, train two inner steps and run a round."""
    modes.remove(dead)
    dead.close()
    dead.context.dht.shutdown()
    train(modes, steps=2, seed=seed)
    for mode in modes:
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses_of(modes)))
    outer_round(modes)


def assert_every_node_holds_the_owners_copies(modes: Sequence[SPESMode]) -> None:
    for unit in range(modes[0].num_units):
        owner = next(mode for mode in modes if unit in mode.owned)
        for mode in modes:
            if mode is not owner:
                assert torch.equal(flat(mode, unit), owner.bases[unit]), f"expert {unit}: the owner's copy, bit for bit"
        # the owner trains on from its own weights; its copy is them up to the int8 change's rounding
        torch.testing.assert_close(flat(owner, unit), owner.bases[unit], rtol=0, atol=1e-4)


def test_each_node_trains_its_own_experts_and_a_round_hands_out_the_owners_copies() -> None:
    with spes_peers(manifest("round"), 3) as modes:
        # the first node's memory holds the gradients and moments of two experts (as it measured them)
        modes[0]._unit_capacity = lambda: 2  # type: ignore[method-assign]
        owned = [set(mode.owned) for mode in modes]
        assert set().union(*owned) == set(range(modes[0].num_units)) and sum(map(len, owned)) == modes[0].num_units
        before = [[flat(mode, unit) for unit in range(mode.num_units)] for mode in modes]
        train(modes, steps=3, seed=1)
        for mode, start in zip(modes, before, strict=True):
            changed = {unit for unit in range(mode.num_units) if not torch.equal(start[unit], flat(mode, unit))}
            assert changed == set(mode.owned), "inner steps move the owned experts and no other"
        sent_before = [mode.exchange.bytes_served for mode in modes]
        owned_in_round = [len(mode.owned) for mode in modes]  # the next round's owners follow the gathered rates
        outer_round(modes)
        assert [(mode.round, mode.num_local_rounds, mode.fetch_failures) for mode in modes] == [(1, 0, 0)] * 3
        for mode in modes[1:]:  # the dense parameters: one outer step on the average, the same everywhere
            for mine, first in zip(mode.parameters, modes[0].parameters, strict=True):
                assert torch.equal(mine, first)
        assert_every_node_holds_the_owners_copies(modes)
        # the next round's owners: the first node takes no more than it said fits, the others the rest; every entry,
        # relayed by the round's leader, reads as a well-formed one of the round
        assert all(claims.well_formed for mode in modes for claims in mode.round_claims.values())
        assert owned_in_round[0] > 2 and len(modes[0].owned) == 2
        assert sorted(unit for mode in modes for unit in mode.owned) == list(range(modes[0].num_units))
        per_expert = change_bytes(flat(modes[0], 0).numel())
        # an answer cut short in transport is asked again (about 1 fetch in 10,000 on loopback) and may cost a copy
        repeated = sum(mode.exchange.asks_repeated for mode in modes)
        for mode, sent, owned_count in zip(modes, sent_before, owned_in_round, strict=True):
            # each expert it owned went to each other node once, as an int8 change from the initial weights
            once_each = per_expert * owned_count * (len(modes) - 1)
            assert once_each <= mode.exchange.bytes_served - sent <= once_each + per_expert * repeated
        progress = Progress()
        modes[0].report(progress)
        assert (progress.experts_owned, progress.experts_total) == (len(modes[0].owned), modes[0].num_units)
        assert progress.experts_capacity == 2, "what it gathered is what its status record says"


def test_an_owner_that_goes_costs_its_experts_one_round_and_they_are_re_owned() -> None:
    with spes_peers(manifest("death"), 3) as modes:
        train(modes, steps=2, seed=2)
        outer_round(modes)
        survivors, dead = modes[:2], modes[2]
        orphans = list(dead.owned)
        copies = {unit: dead.bases[unit].clone() for unit in orphans}
        a_round_without(modes, dead, seed=3)
        for mode in survivors:
            # the round could not fetch the dead owner's experts: said and counted, the last copies kept
            assert mode.fetch_failures == mode.stale_experts == len(orphans)
            for unit in orphans:
                assert torch.equal(flat(mode, unit), copies[unit]) or unit in mode.owned
        assert sorted(survivors[0].owned + survivors[1].owned) == list(range(survivors[0].num_units))
        assert set(orphans) <= set(survivors[0].owned) | set(survivors[1].owned)
        train(survivors, steps=2, seed=4)  # the orphans train again, from the freshest copy
        outer_round(survivors)
        assert all(mode.fetch_failures == len(orphans) for mode in survivors), "no failure in the next round"
        assert_every_node_holds_the_owners_copies(survivors)


def the_mean_of(owners: Sequence[SPESMode], round_: int, unit: int) -> torch.Tensor:
    """What every node must hold of `unit` after round `round_`: its owners' published copies summed in the order of
    their peer IDs, divided by their number."""
    ordered = sorted(owners, key=lambda mode: mode.context.peer_id)
    copies = [published.values for mode in ordered if (published := mode.exchange.published(round_, unit))]
    assert len(copies) == len(ordered), f"expert {unit}: each owner published its copy"
    total = copies[0].clone()
    for copy in copies[1:]:
        total += copy
    return total / len(copies)


def held(mode: SPESMode, unit: int) -> torch.Tensor:
    """The copy of `unit` a node holds between rounds: an owner's base (it trains on from the same copy plus what
    the int8 change left out), the model's weights elsewhere."""
    return mode.bases[unit] if unit in mode.owned else flat(mode, unit)


def test_experts_with_two_owners_become_their_mean_and_outlive_an_owner_that_goes() -> None:
    run = dataclasses.replace(manifest("replicas"), spes=SPESSpec(replicas=2))
    with spes_peers(run, 3) as modes:
        units = range(modes[0].num_units)
        round_owners = modes[0].owners
        assert all(mode.owners == round_owners for mode in modes) and all(len(owners) == 2 for owners in round_owners)
        start = [flat(modes[0], unit) for unit in units]
        train(modes, steps=2, seed=8)
        outer_round(modes)
        assert [mode.fetch_failures for mode in modes] == [0, 0, 0]
        for unit in units:
            owners = [mode for mode in modes if mode.context.peer_id in round_owners[unit]]
            mean = the_mean_of(owners, 1, unit)
            assert all(torch.equal(held(mode, unit), mean) for mode in modes), f"expert {unit}: the mean, bit for bit"
            copies = [owner.exchange.published(1, unit).values for owner in owners]  # type: ignore[union-attr]
            assert not torch.equal(copies[0], copies[1]) and not torch.equal(mean, start[unit]), "both trained it"
            for mode in modes:
                if unit in mode.owned:  # the mean, plus what its own int8 change left out
                    torch.testing.assert_close(flat(mode, unit), mean, rtol=0, atol=1e-3)
        # one owner goes: each of its experts keeps the round's training of the other owner
        round_owners = modes[0].owners
        survivors, dead = modes[:2], modes[2]
        orphans = [unit for unit in units if dead.context.peer_id in round_owners[unit]]
        before = {unit: held(survivors[0], unit).clone() for unit in orphans}
        a_round_without(modes, dead, seed=9)
        for mode in survivors:
            assert mode.fetch_failures == len(orphans), "each missing copy said and counted"
            assert mode.stale_experts == 0, "every expert of the dead owner had another owner's copy"
        for unit in orphans:
            (other,) = [mode for mode in survivors if mode.context.peer_id in round_owners[unit]]
            copy = other.exchange.published(2, unit)
            assert copy is not None and not torch.equal(copy.values, before[unit]), "trained in the round"
            assert all(torch.equal(held(mode, unit), copy.values) for mode in survivors), f"expert {unit}"
        assert all(mode.owners == [tuple(sorted(m.context.peer_id for m in survivors))] * len(units) for mode in modes)
        train(survivors, steps=2, seed=10)
        outer_round(survivors)
        assert all(mode.fetch_failures == len(orphans) for mode in survivors), "no failure in the next round"
        for unit in units:
            mean = the_mean_of(survivors, 3, unit)
            assert all(torch.equal(held(mode, unit), mean) for mode in survivors), f"expert {unit}, round 3"


def test_a_round_whose_group_held_part_of_the_swarm_leaves_ownership_to_the_status_records() -> None:
    with spes_peers(manifest("partial"), 3) as modes:
        mode, ids = modes[0], [m.context.peer_id for m in modes]
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses_of(modes)))
        train(modes, steps=1, seed=11)  # the trackers see the peers that train
        await_condition(lambda: mode.tracker.global_progress.num_peers >= 3, 60, "the tracker to see the others")
        mode.round = 1
        statuses = [proto.PeerStatus(peer_id=peer, epoch=1) for peer in ids]  # each completed the first round
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses))
        mode._note_round(gathered_round(modes, 1), 0.0)
        assert {owner for owners in mode._next_owners() for owner in owners} == set(ids), "the whole swarm's group"
        # two groups met in this round (peers too far apart): this one's members must not share every expert
        mode._note_round(gathered_round(modes[:2], 1), 0.0)
        assert mode._next_owners() == mode._assign_from_statuses(sorted(ids))
        assert {owner for owners in mode._next_owners() for owner in owners} == set(ids)
        # the third completed no round yet: a joiner still waiting for the swarm's state owns no expert (every node
        # would wait out the exchange's timeout for its copies each round), and the group holds the rest of the swarm
        statuses[2] = proto.PeerStatus(peer_id=ids[2], epoch=0)
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses))
        assert {owner for owners in mode._next_owners() for owner in owners} == set(ids[:2])


def test_a_peer_others_cant_dial_owns_no_expert_by_its_round_or_its_status_record() -> None:
    with spes_peers(manifest("undialable"), 2) as modes:
        mode, (public, home) = modes[0], [m.context.peer_id for m in modes]
        mode.round = 1
        statuses = [proto.PeerStatus(peer_id=peer, epoch=1, reachable=True) for peer in (public, home)]
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses))
        mode._note_round(gathered_round(modes, 1, undialable={home}), 0.0)
        assert set(mode._next_owners()) == {(public,)}, "the round said it can't be dialed"
        # from status records: measured unreachable, or a declared client
        statuses[1] = proto.PeerStatus(peer_id=home, epoch=1, reachable=False, reachability_measured=True)
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses))
        assert set(mode._assign_from_statuses([public, home])) == {(public,)}
        statuses[1] = proto.PeerStatus(peer_id=home, epoch=1, role_override="client")
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses))
        assert set(mode._assign_from_statuses([public, home])) == {(public,)}
        statuses[1] = proto.PeerStatus(peer_id=home, epoch=1)  # says nothing of its reachability: as before
        mode.apply_swarm_view(SwarmView(plan_share=None, statuses=statuses))
        assert set(mode._assign_from_statuses([public, home])) == {(public,), (home,)}
        # this node itself a client: it gives itself none, and all of them when it is alone
        mode.context = dataclasses.replace(mode.context, client_mode=True)
        assert set(mode._assign_from_statuses([public, home])) == {(home,)}
        assert set(mode._assign_from_statuses([public])) == {(public,)}
        gathered = mode._gather()
        claims = read_member(gathered, 1, mode.num_units)
        assert claims.well_formed and claims.dialable is False, "and its round says so"


def gathered_round(modes: Sequence[SPESMode], round_: int, undialable: Collection[str] = ()) -> dict[str, list]:
    """What each of `modes` gathers in round `round_` (1 sample/s, no memory cap), as its `_gather` makes it."""
    digest = modes[0]._start_digest()  # the peers start from the same weights
    return {
        mode.context.peer_id: spes_gathered([round_, None, digest], 1.0, None, mode.context.peer_id not in undialable)
        for mode in modes
    }


def test_nodes_that_disagreed_about_owners_hold_the_owners_copies_after_the_next_round() -> None:
    with spes_peers(manifest("disagree"), 2) as modes:
        first, second = modes
        second._take_ownership(peers=[second.context.peer_id])  # it believes it owns every expert (a stale view)
        assert set(first.owned) < set(second.owned)
        train(modes, steps=2, seed=6)
        outer_round(modes)  # both trained the first one's experts; the round's group makes them agree again
        assert sorted(first.owned + second.owned) == list(range(first.num_units))
        train(modes, steps=2, seed=7)
        outer_round(modes)
        # a copy made from another base is never patched with a change: the whole copy came, checked by digest
        assert_every_node_holds_the_owners_copies(modes)


def test_nodes_whose_dense_parameters_differ_after_an_averaged_round_resync_to_the_higher_ranked() -> None:
    """Two nodes that each stepped a round alone (neither saw the other yet) apply the same averaged Δ to different
    θ₀ ever after, and a joiner can corroborate neither's state: a CI log of test_spes_swarm, a joiner refused for four
    minutes. SPES's rounds gather the dense θ₀'s digest as DiLoCo's do; the lower-ranked node takes a state."""
    with spes_peers(manifest("lineage"), 2) as modes:
        train(modes, steps=1, seed=12)
        outer_round(modes)
        assert not any(mode._resync for mode in modes), "nodes in step hold the same bits"
        lower, higher = sorted(modes, key=lambda mode: _tiebreak(mode.context.peer_id))
        with torch.no_grad():
            lower.global_parameters[0].add_(0.25)  # a round it stepped apart
        train(modes, steps=1, seed=13)
        outer_round(modes)
        assert all(mode.round == 2 and mode.num_local_rounds == 0 for mode in modes), "the round was averaged"
        assert lower._resync and not higher._resync
        await_condition(lambda: lower._behind_the_swarm() and lower._load_state_from_peers(), 60, "the state above")
        for mine, theirs in zip(lower.global_parameters, higher.global_parameters, strict=True):
            assert torch.equal(mine, theirs), "the higher-ranked node's θ₀"
        train(modes, steps=1, seed=14)
        outer_round(modes)
        assert not any(mode._resync for mode in modes), "in step again"
        assert_every_node_holds_the_owners_copies(modes)


def test_a_joiner_takes_the_dense_state_and_every_expert_from_the_swarm() -> None:
    run = manifest("join")
    with spes_peers(run, 2) as modes:
        train(modes, steps=2, seed=5)
        outer_round(modes)
        dht = loopback_dht(modes[0].context.dht.get_visible_maddrs())
        joiner = spes_peer(run, dht, statuses_of(modes))
        try:
            assert joiner._load_state_from_peers()
            assert joiner.round == 1 and joiner.fetch_failures == 0
            for mine, theirs in zip(joiner.parameters, modes[0].parameters, strict=True):
                assert torch.equal(mine, theirs)
            for unit in range(joiner.num_units):
                owner = next(mode for mode in modes if unit in mode.owned)
                if unit not in joiner.owned:
                    assert torch.equal(flat(joiner, unit), owner.bases[unit])
                else:  # taken over by the joiner: it trains on from the owner's copy
                    assert torch.equal(joiner.bases[unit], owner.bases[unit])
        finally:
            joiner.close()
            dht.shutdown()


def test_a_rounds_experts_are_fetched_from_owners_that_publish_after_the_fetches_began() -> None:
    # Owners publish a round when their own outer step is done; the fetcher's concurrent fetches wait for each.
    dhts = loopback_dhts(3)
    owners, fetcher = [ExpertExchange(dht) for dht in dhts[:2]], ExpertExchange(dhts[2])
    for owner in owners:
        owner.start()
    fetcher.start(serve=False)
    try:
        held = torch.zeros(1000)
        copies = {unit: encode_change(held, torch.full((1000,), float(unit)))[1] for unit in range(8)}
        owned = {unit: owners[unit % 2] for unit in range(8)}
        peers = {unit: [owner.dht.peer_id.to_base58()] for unit, owner in owned.items()}
        taken: dict[int, torch.Tensor] = {}

        def take(unit: int, copies: dict[str, torch.Tensor]) -> None:
            assert list(copies) == peers[unit]
            taken[unit] = copies[peers[unit][0]]

        with ThreadPoolExecutor(1) as pool:
            fetching = pool.submit(fetcher.fetch_all, peers, 7, 20.0, lambda unit: held, take)
            await_condition(fetching.running, 10, "the fetches to start")
            for owner in owners:
                copy_of = {unit: copies[unit] for unit in range(8) if owned[unit] is owner}
                change = {unit: encode_change(held, values)[0] for unit, values in copy_of.items()}
                owner.publish(7, {
                    unit: Published(values=values, base_digest=copy_digest(held), change=change[unit])
                    for unit, values in copy_of.items()
                })  # fmt: skip
            failures = fetching.result(timeout=30)
        assert failures == {} and sorted(taken) == list(range(8))
        assert all(torch.equal(taken[unit], copies[unit]) for unit in range(8))
    finally:
        fetcher.close()
        for owner in owners:
            owner.close()
        for dht in dhts:
            dht.shutdown()


def test_an_owner_answers_few_requests_at_once_and_never_builds_a_whole_copy() -> None:
    # Requests for a 32 MiB expert take a grant before any of its bytes are encoded: past the limits each is answered
    # busy at once, and an answer holds one chunk of the copy at a time, not a copy.
    first, second, third = loopback_dhts(3)
    owner, asker, fetcher = ExpertExchange(first), ExpertExchange(second), ExpertExchange(third)
    owner.start()
    asker.start(serve=False)
    fetcher.start(serve=False)
    try:
        values = torch.randn(8 << 20)
        owner.publish(1, {0: Published(values=values, base_digest=b"", change=b"")})
        request = proto.SpesExpertRequest(unit=0, round=1, base_digest=b"")
        streams: list = []

        async def ask_many(count: int) -> list[proto.SpesExpertChunk]:
            stub = asker.get_stub(asker.require_p2p(), first.peer_id, namespace=NAMESPACE)
            for _ in range(count):
                streams.append(await stub.rpc_spes_expert(request))
            return [await anext(stream) for stream in streams]

        async def close_all() -> None:
            for stream in streams:
                await stream.aclose()

        tracemalloc.start()
        try:
            headers = asker.run(ask_many(16), 30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert sum(header.found for header in headers) == ANSWER_LIMITS.max_answers_per_peer
        assert all(header.busy for header in headers if not header.found)
        assert peak < 16 << 20, f"{peak} bytes allocated while 16 requests for a 32 MiB copy were answered"
        assert owner.gate.num_answers == ANSWER_LIMITS.max_answers_per_peer, "the asker's streams are still open"
        # another peer is served in full while they stay open, the asker's requests each cost it one chunk at most
        held = torch.zeros(8 << 20)
        assert torch.equal(fetcher.fetch(first.peer_id.to_base58(), 0, 1, held, 30.0), values)
        asker.run(close_all(), 30)
        await_condition(lambda: owner.gate.num_answers == 0, 30, "the answers to end with their streams")
    finally:
        for exchange in (fetcher, asker, owner):
            exchange.close()
        for dht in (first, second, third):
            dht.shutdown()


def statuses_of(modes: Sequence[SPESMode]) -> list[proto.PeerStatus]:
    """What each node's status record says: its peer ID and the last round it completed."""
    return [proto.PeerStatus(peer_id=mode.context.peer_id, epoch=mode.round) for mode in modes]


def test_a_fetcher_refuses_non_finite_mis_sized_forged_and_unowned_copies() -> None:
    first, second = loopback_dhts(2)
    owner, fetcher = ExpertExchange(first), ExpertExchange(second)
    owner.start()
    fetcher.start(serve=False)
    try:
        base, other = torch.zeros(1000), torch.ones(1000)
        change, copy = encode_change(base, torch.full((1000,), 0.5))
        forged = encode_change(base, torch.full((1000,), -0.5))[0]
        owner.publish(3, {
            0: Published(values=copy, base_digest=copy_digest(base), change=change),
            1: Published(values=torch.full((1000,), float("nan")), base_digest=b"", change=b""),
            2: Published(values=torch.zeros(999), base_digest=b"", change=b""),
            3: Published(values=copy, base_digest=copy_digest(base), change=change[:-1]),  # a change cut short
            4: Published(values=copy, base_digest=copy_digest(base), change=forged),  # not the copy it names
        })  # fmt: skip
        peer = first.peer_id.to_base58()
        for held, what, size in [(base, "the change from the copy held", change_bytes(1000)),
                                  (other, "whole, to a node holding another copy", 4000)]:  # fmt: skip
            sent, repeated = owner.bytes_served, fetcher.asks_repeated
            assert torch.equal(fetcher.fetch(peer, 0, 3, held, 5.0), copy), what
            # once, or once more for each answer cut short in transport and asked again (rare; see above)
            assert size <= owner.bytes_served - sent <= size * (1 + fetcher.asks_repeated - repeated), what
        for unit, round_, held, reason in [
            (1, 3, base, "non-finite"),
            (2, 3, base, "999 values"),
            (3, 3, base, "bytes"),
            (4, 3, base, "not the copy its digest names"),
            (0, 3, torch.zeros(10), "1000 values"),
            (5, 3, base, "did not own expert 5"),  # at once, not after the deadline
            (0, 4, base, "no expert 0 of round 4"),  # not published (yet): asked until the deadline
        ]:
            with pytest.raises(ExpertFetchError, match=reason):
                fetcher.fetch(peer, unit, round_, held, 1.0)
        # all at once, as a round's end fetches them: each copy is taken as it comes, each failure has its sentence
        taken: dict[int, dict[str, torch.Tensor]] = {}
        wanted = {unit: [peer] for unit in (0, 1, 4, 5)}
        failures = fetcher.fetch_all(wanted, 3, 5.0, lambda unit: base, taken.__setitem__)
        assert list(taken) == [0] and list(taken[0]) == [peer] and torch.equal(taken[0][peer], copy)
        assert sorted(failures) == [1, 4, 5] and all(list(why) == [peer] for why in failures.values())
        assert "non-finite" in failures[1][peer] and "did not own" in failures[5][peer]
        assert "not the copy its digest names" in failures[4][peer]
        assert fetcher.unreachable == set(), "the owner answered every fetch, refusals included"
        owner.close()
        first.shutdown()  # the owner is gone: its copies can't be asked for
        failures = fetcher.fetch_all({0: [peer]}, 3, 5.0, lambda unit: base, taken.__setitem__)
        assert list(failures) == [0] and fetcher.unreachable == {peer}
    finally:
        fetcher.close()
        owner.close()
        first.shutdown()
        second.shutdown()
