"""Expert placement and grid coverage: pure functions of the hosts' published expert lists."""

from __future__ import annotations

from crowdtrain.moe.placement import choose_experts, grid_coverage

GRID = [f"run-ffn0.{i}.{j}" for i in range(4) for j in range(4)]


def test_a_host_on_an_empty_grid_takes_its_capacity_in_grid_order() -> None:
    chosen = choose_experts(GRID, {}, "peer-a", 4)
    assert len(chosen) == 4 and len(set(chosen)) == 4
    assert list(chosen) == sorted(chosen, key=GRID.index)
    assert choose_experts(GRID, {}, "peer-a", 4) == chosen, "deterministic"


def test_hosts_choosing_at_once_spread_by_their_peer_id() -> None:
    choices = {peer: set(choose_experts(GRID, {}, peer, 8)) for peer in ("peer-a", "peer-b", "peer-c")}
    assert len({frozenset(chosen) for chosen in choices.values()}) == 3


def test_a_host_takes_the_same_cells_in_every_layer_so_losing_it_empties_no_layer() -> None:
    layers = [[f"run-ffn{layer}.{i}.{j}" for i in range(2) for j in range(2)] for layer in range(3)]
    grid = [uid for layer in layers for uid in layer]
    for peer in ("peer-a", "peer-b", "peer-c"):
        chosen = choose_experts(grid, {}, peer, 6)
        cells = [{uid.split(".", 1)[1] for uid in chosen if uid in layer} for layer in layers]
        assert cells[0] == cells[1] == cells[2] and len(cells[0]) == 2
        rest = choose_experts(grid, {peer: chosen}, "peer-z", 6)
        assert all(set(layer) - set(chosen) - set(rest) == set() for layer in layers)


def test_uncovered_experts_come_first() -> None:
    others = {"peer-a": GRID[:10]}
    assert set(choose_experts(GRID, others, "peer-b", 6)) == set(GRID[10:])
    assert set(choose_experts(GRID, others, "peer-b", 3)) < set(GRID[10:])


def test_with_the_grid_covered_the_fewest_replicas_come_next() -> None:
    others = {"peer-a": GRID, "peer-b": GRID[:12]}
    assert set(choose_experts(GRID, others, "peer-c", 4)) == set(GRID[12:])
    assert set(choose_experts(GRID, others, "peer-c", 20)) == set(GRID), "capacity beyond the grid takes it all"


def test_a_host_keeps_what_it_serves_when_nothing_is_better() -> None:
    others = {"peer-a": GRID[:8]}
    current = GRID[8:12]
    assert choose_experts(GRID, others, "peer-b", 4, current=current) == tuple(current)


def test_a_host_takes_over_experts_whose_host_vanished() -> None:
    mine, theirs = GRID[:8], GRID[8:]
    assert choose_experts(GRID, {"peer-a": theirs}, "peer-b", 16, current=mine) == tuple(GRID)
    # peer-a's record expired: a host with room picks its experts up; a full one keeps its own
    assert set(choose_experts(GRID, {}, "peer-b", 16, current=mine)) == set(GRID)
    assert choose_experts(GRID, {}, "peer-b", 8, current=mine) == tuple(mine)


def test_of_two_hosts_serving_the_same_experts_one_keeps_each_and_the_other_moves_on() -> None:
    doubled, uncovered = GRID[:4], GRID[4:8]
    others = {"peer-z": GRID[8:]}
    a = choose_experts(GRID, {**others, "peer-b": doubled}, "peer-a", 4, current=doubled)
    b = choose_experts(GRID, {**others, "peer-a": doubled}, "peer-b", 4, current=doubled)
    assert set(a) ^ set(b) >= set(doubled), "every doubled expert keeps exactly one host"
    assert set(a) | set(b) <= set(doubled) | set(uncovered)
    assert len(set(a) | set(b)) > len(doubled), "the one that lets go takes uncovered experts"


def test_hosts_starting_together_cover_the_grid_after_a_few_rechecks() -> None:
    peers = [f"peer-{n}" for n in range(4)]
    served: dict[str, tuple[str, ...]] = {peer: () for peer in peers}
    for _ in range(6):  # every host re-places at once from the same snapshot: the worst case
        snapshot = dict(served)
        served = {
            peer: choose_experts(
                GRID, {other: snapshot[other] for other in peers if other != peer}, peer, 4, current=snapshot[peer]
            )
            for peer in peers
        }
    assert grid_coverage(GRID, list(served.values())).num_live == len(GRID)


def test_local_checkpoints_break_ties_among_uncovered_experts() -> None:
    checkpoints = GRID[13:15]
    assert set(choose_experts(GRID, {}, "peer-a", 2, checkpoints=checkpoints)) == set(checkpoints)


def test_zero_capacity_and_uids_outside_the_grid() -> None:
    assert choose_experts(GRID, {}, "peer-a", 0) == ()
    others = {"peer-a": ["other-run-ffn0.0.0", *GRID[:15]]}
    assert choose_experts(GRID, others, "peer-b", 1) == (GRID[15],)


def test_coverage_counts_live_experts_and_replicas() -> None:
    coverage = grid_coverage(GRID, [GRID[:10], GRID[5:10], ["foreign.1.1"]])
    assert (coverage.num_live, coverage.num_total) == (10, 16)
    assert coverage.replicas[GRID[0]] == 1 and coverage.replicas[GRID[7]] == 2
    summary = coverage.to_json()
    assert (summary["live"], summary["total"], summary["min_replicas"], summary["max_replicas"]) == (10, 16, 0, 2)
    full = grid_coverage(GRID, [GRID, GRID[:3]]).to_json()
    assert (full["live"], full["min_replicas"], full["max_replicas"]) == (16, 1, 2)
    empty = grid_coverage(GRID, []).to_json()
    assert (empty["live"], empty["min_replicas"], empty["max_replicas"]) == (0, 0, 0)
