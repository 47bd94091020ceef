"""Tests for gossamer.topology: builders' invariants, exact mixing properties, validation, CLI."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import reduce

import networkx as nx
import numpy as np
import pytest

from gossamer.topology import (
    TOPOLOGIES,
    Topology,
    Weights,
    bipartite_exponential,
    build,
    butterfly_groups,
    complete,
    dissemination,
    exponential,
    from_matrix,
    from_networkx,
    hypercube,
    random_regular,
    ring,
)
from gossamer.topology import cli as topo_cli

NS = (1, 2, 3, 4, 8, 16, 17)


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _random_column_stochastic(n: int) -> Topology:
    rng = np.random.default_rng(n)
    w = rng.random((n, n)) + 0.1
    return from_matrix(w / w.sum(axis=0, keepdims=True), name="random_column")


# (id, factory, allowed(n), doubly stochastic, strongly connected)
Case = tuple[str, Callable[[int], Topology], Callable[[int], bool], bool, bool]
CASES: list[Case] = [
    ("complete", complete, lambda n: True, True, True),
    ("ring", ring, lambda n: True, True, True),
    ("exponential", exponential, lambda n: True, True, True),
    ("exponential_pps2", lambda n: exponential(n, 2), lambda n: n >= 3, True, True),
    ("bipartite_exponential", bipartite_exponential, lambda n: n == 1 or n % 2 == 0, True, True),
    ("hypercube", hypercube, _pow2, True, True),
    ("dissemination", dissemination, lambda n: True, True, True),
    ("butterfly_g1", lambda n: butterfly_groups(n, 1), lambda n: True, True, False),
    ("butterfly_g2", lambda n: butterfly_groups(n, 2), lambda n: n % 2 == 0, True, True),
    ("butterfly_g4", butterfly_groups, lambda n: n % 4 == 0, True, True),
    ("random_regular_2", lambda n: random_regular(n, 2, seed=1), lambda n: n >= 3, True, True),
    ("random_regular_3", lambda n: random_regular(n, 3, seed=2), lambda n: n >= 4 and n % 2 == 0,
     True, True),
    ("networkx_path_metropolis", lambda n: from_networkx(nx.path_graph(n), "metropolis"),
     lambda n: True, True, True),
    ("networkx_dicycle_uniform", lambda n: from_networkx(nx.cycle_graph(n, nx.DiGraph)),
     lambda n: True, True, True),
    ("from_matrix_column", _random_column_stochastic, lambda n: True, False, True),
]
PARAMS = [
    pytest.param(factory, n, doubly, connected, id=f"{name}-{n}")
    for name, factory, allowed, doubly, connected in CASES
    for n in NS
    if allowed(n)
]


@pytest.mark.parametrize("factory, n, doubly, connected", PARAMS)
def test_builder_invariants(
    factory: Callable[[int], Topology], n: int, doubly: bool, connected: bool
) -> None:
    topo = factory(n)
    assert topo.world_size == n
    assert topo.is_nonnegative()
    assert topo.is_column_stochastic()
    # One node's only weight is its self weight, so any stochastic 1 x 1 is doubly stochastic.
    assert topo.is_row_stochastic() == (doubly or n == 1)
    assert topo.is_doubly_stochastic() == (doubly or n == 1)
    assert topo.is_strongly_connected() == (connected or n == 1)
    for k in range(2 * topo.period):
        w = topo.matrix(k)
        assert w.shape == (n, n)
        np.testing.assert_array_equal(w, topo.matrix(k % topo.period))
        outs = [set(topo.out_peers(i, k)) for i in range(n)]
        ins = [set(topo.in_peers(i, k)) for i in range(n)]
        for i in range(n):
            for j in range(n):
                assert (j in outs[i]) == (i in ins[j])
            assert i not in outs[i] and i not in ins[i]
            pw = topo.weights(i, k)
            assert sorted(pw.peers) == topo.out_peers(i, k)
            col = np.zeros(n)
            col[i] = pw.self_weight
            for j, x in pw.peers.items():
                col[j] = x
            np.testing.assert_allclose(w[:, i], col, atol=0)
            iw = topo.in_weights(i, k)
            assert sorted(iw.peers) == topo.in_peers(i, k)
            assert iw.self_weight == pytest.approx(w[i, i])
            for j, x in iw.peers.items():
                assert w[i, j] == x


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_exponential_power_of_two_averages_exactly(n: int) -> None:
    topo = exponential(n)
    prod = reduce(lambda acc, k: topo.matrix(k) @ acc, range(topo.period), np.eye(n))
    np.testing.assert_allclose(prod, np.full((n, n), 1.0 / n), rtol=0, atol=1e-12)
    assert topo.spectral_gap() == pytest.approx(1.0, abs=1e-9)


def test_exponential_exact_peers() -> None:
    topo = exponential(8)
    assert topo.period == 3
    for k in range(7):
        for i in range(8):
            assert topo.out_peers(i, k) == [(i + 2 ** (k % 3)) % 8]
            assert topo.in_peers(i, k) == [(i - 2 ** (k % 3)) % 8]
    two = exponential(8, peers_per_step=2)
    assert two.period == 3
    assert two.out_peers(0, 0) == [1, 2] and two.out_peers(0, 1) == [1, 4]
    assert two.weights(0, 0) == Weights(1 / 3, {1: 1 / 3, 2: 1 / 3})


@pytest.mark.parametrize(
    "n, shifts",
    [
        # floor(log2 7) = 2: offsets 1, 2^1 + 1 = 3, 2^2 + 1 = 5, each +d then -d (mod 8);
        # rank r's peer list in SGP's graph is [r+1, r-1, r+3, r-3, r+5, r-5].
        (8, [1, 7, 3, 5, 5, 3]),
        # floor(log2 31) = 4: offsets 1, 3, 5, 9, 17.
        (32, [1, 31, 3, 29, 5, 27, 9, 23, 17, 15]),
    ],
)
def test_bipartite_exponential_is_sgp_graph(n: int, shifts: list[int]) -> None:
    topo = bipartite_exponential(n)
    assert topo.period == len(shifts)
    assert [topo.out_peers(0, k) for k in range(len(shifts))] == [[s] for s in shifts]
    for k in range(2 * topo.period):
        s = shifts[k % len(shifts)]
        w = np.eye(n) / 2  # uniform mixing: keep 1/2, send 1/2 to the one out-peer
        for r in range(n):
            assert topo.out_peers(r, k) == [(r + s) % n]
            assert topo.in_peers(r, k) == [(r - s) % n]
            assert topo.weights(r, k) == Weights(0.5, {(r + s) % n: 0.5})
            assert (r + s) % 2 != r % 2  # even ranks only ever talk to odd ranks
            w[(r + s) % n, r] = 0.5
        np.testing.assert_array_equal(topo.matrix(k), w)


def test_bipartite_exponential_matrix_literal() -> None:
    # n = 8, phase 2: r -> r + 3, so row j mixes j and j - 3 (mod 8) half and half.
    h = 0.5
    expected = np.array([
        [h, 0, 0, 0, 0, h, 0, 0],
        [0, h, 0, 0, 0, 0, h, 0],
        [0, 0, h, 0, 0, 0, 0, h],
        [h, 0, 0, h, 0, 0, 0, 0],
        [0, h, 0, 0, h, 0, 0, 0],
        [0, 0, h, 0, 0, h, 0, 0],
        [0, 0, 0, h, 0, 0, h, 0],
        [0, 0, 0, 0, h, 0, 0, h],
    ])
    np.testing.assert_array_equal(bipartite_exponential(8).matrix(2), expected)
    # n = 2 and 4: offsets past n/2 repeat the same peers, as in SGP's graph.
    assert [bipartite_exponential(2).out_peers(0, k) for k in range(2)] == [[1], [1]]
    assert [bipartite_exponential(4).out_peers(1, k) for k in range(4)] == [[2], [0], [0], [2]]


def _assert_partition(groups: list[list[int]], n: int) -> None:
    assert sorted(r for g in groups for r in g) == list(range(n))
    assert all(g == sorted(g) for g in groups)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)


@pytest.mark.parametrize(
    "topo, size, phases",
    [
        (hypercube(16), 2, 4),
        (butterfly_groups(16, 2), 2, 4),
        (butterfly_groups(16, 4), 4, 2),
        (butterfly_groups(64, 4), 4, 3),
        (butterfly_groups(27, 3), 3, 3),
        (butterfly_groups(8, 8), 8, 1),
    ],
    ids=repr,
)
def test_group_topologies_partition_and_average_exactly(
    topo: Topology, size: int, phases: int
) -> None:
    n = topo.world_size
    assert topo.period == phases
    prod = np.eye(n)
    for k in range(phases):
        groups = topo.groups(k)
        _assert_partition(groups, n)
        assert all(len(g) == size for g in groups)
        w = topo.matrix(k)
        for g in groups:  # everyone in a group gives 1/size to every member
            np.testing.assert_allclose(w[np.ix_(g, g)], 1.0 / size)
        prod = w @ prod
    assert np.all(prod > 0)
    np.testing.assert_allclose(prod, 1.0 / n, atol=1e-12)


def test_butterfly_not_a_power_still_mixes() -> None:
    topo = butterfly_groups(8, 4)  # strides 1 and then the extra n / group_size = 2
    assert topo.groups(0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.groups(1) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    prod = topo.matrix(1) @ topo.matrix(0)
    assert np.all(prod > 0)


def test_groups_of_ring_and_isolated() -> None:
    assert ring(5).groups(0) == [[0, 1, 2, 3, 4]]
    assert butterfly_groups(3, 1).groups(0) == [[0], [1], [2]]
    assert not butterfly_groups(3, 1).is_strongly_connected()


def test_random_regular_deterministic_regular_connected() -> None:
    a = random_regular(64, 4, seed=7)
    b = random_regular(64, 4, seed=7)
    c = random_regular(64, 4, seed=8)
    np.testing.assert_array_equal(a.matrix(0), b.matrix(0))
    assert not np.array_equal(a.matrix(0), c.matrix(0))
    for i in range(64):
        assert len(a.out_peers(i, 0)) == 4
        assert a.out_peers(i, 0) == a.in_peers(i, 0)
    assert a.is_strongly_connected()
    np.testing.assert_array_equal(a.matrix(0), a.matrix(0).T)
    dense = random_regular(20, 15, seed=3)  # dense: drawn through the complement
    assert all(len(dense.out_peers(i, 0)) == 15 for i in range(20))


def test_spectral_gaps() -> None:
    for n in (1, 2, 5, 16):
        assert complete(n).spectral_gap() == pytest.approx(1.0, abs=1e-9)
    gap = ring(8).spectral_gap()
    assert 0.0 < gap < 1.0
    # ring(8): eigenvalues (1 + 2 cos(2 pi k / 8)) / 3, so |lambda_2| = (1 + sqrt 2) / 3.
    assert gap == pytest.approx(1 - (1 + np.sqrt(2)) / 3)
    assert from_matrix(np.eye(4)).spectral_gap() == 0.0
    assert not from_matrix(np.eye(4)).is_strongly_connected()


def test_from_matrix_time_varying_and_row_stochastic() -> None:
    a = np.array([[0.5, 0.5], [0.5, 0.5]])
    b = np.array([[1.0, 0.0], [0.5, 0.5]])  # row-stochastic only
    topo = from_matrix([a, b], name="two")
    assert topo.period == 2 and topo.name == "two"
    assert topo.is_row_stochastic() and not topo.is_column_stochastic()
    assert topo.out_peers(0, 1) == [1] and topo.out_peers(1, 1) == []
    assert topo.in_weights(1, 1) == Weights(0.5, {0: 0.5})
    with pytest.raises(ValueError, match="topology.*column-stochastic.*phase 1.*column 0.*1.5"):
        topo.require_column_stochastic()
    topo.require_strongly_connected()


def test_from_networkx_relabels_and_metropolis() -> None:
    g = nx.Graph([("a", "b"), ("b", "c"), ("b", "d")])  # a star centred on b
    topo = from_networkx(g, weights="metropolis")
    assert topo.out_peers(1, 0) == [0, 2, 3]
    assert topo.weights(0, 0) == Weights(0.75, {1: 0.25})
    assert topo.is_doubly_stochastic()
    uniform = from_networkx(g)
    assert uniform.is_column_stochastic() and not uniform.is_row_stochastic()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: hypercube(6), r"\bn\b.*power of two"),
        (lambda: complete(0), r"^n must be >= 1, got 0"),
        (lambda: ring(2.0), r"^n must be an int"),
        (lambda: ring(True), r"^n must be an int"),
        (lambda: exponential(4, peers_per_step=4), r"peers_per_step=4 must be < n=4"),
        (lambda: exponential(8, peers_per_step=4), r"peers_per_step=4 must be <= 3"),
        (lambda: exponential(8, peers_per_step=0), r"peers_per_step must be >= 1"),
        (lambda: butterfly_groups(8, 3), r"group_size=3 does not divide n=8"),
        (lambda: random_regular(5, 3), r"n \* degree must be even"),
        (lambda: random_regular(5, 5), r"degree=5 must be < n=5"),
        (lambda: random_regular(6, 1), r"degree=1"),
        (lambda: from_matrix([[0.5, 0.2], [0.1, 0.3]]), r"^W is not stochastic"),
        (lambda: from_matrix([[1.5, -0.5], [-0.5, 1.5]]), r"^W\[0\] has a negative weight"),
        (lambda: from_matrix([[1.0, np.nan], [0.0, 1.0]]), r"^W\[0\] has non-finite"),
        (lambda: from_matrix([[1.0, 0.0]]), r"^W\[0\] must be a square"),
        (lambda: from_matrix([np.eye(2), np.eye(3)]), r"^W\[1\] has shape"),
        (lambda: from_networkx(nx.Graph([(0, 1), (2, 3)])), r"^G must be connected"),
        (lambda: from_networkx(nx.DiGraph([(0, 1)])), r"^G must be strongly connected"),
        (lambda: from_networkx(nx.path_graph(3), "max"), r"^weights must be"),
        (lambda: from_networkx(nx.cycle_graph(3, nx.DiGraph), "metropolis"), r"metropolis"),
        (lambda: Topology("t", 0, [[]]), r"^world_size must be >= 1, got 0"),
        (lambda: Topology("t", 2, []), r"^phases"),
        (lambda: Topology("t", 2, [[{0: 1.0}]]), r"^phases\[0\] must have one entry per rank"),
        (lambda: Topology("t", 2, [[{0: 1.0}, {2: 1.0}]]), r"receiver 2 is not a rank"),
        (lambda: Topology("t", 2, [[{0: 1.0}, {0: -1.0}]]),
         r"^weights .*phase 0, sender 1 -> receiver 0"),
        (lambda: Topology("t", 1, [[{0: float("inf")}]]), r"^weights"),
        (lambda: ring(4).out_peers(4, 0), r"^rank"),
        (lambda: ring(4).in_peers(0, -1), r"^step"),
        (lambda: ring(4).require_world_size(8, arg="gossip.topology"),
         r"^gossip\.topology: .*world_size=4.*8"),
        (lambda: from_matrix(np.eye(3)).require_strongly_connected("topo"),
         r"^topo: .*not strongly connected"),
        (lambda: from_networkx(nx.DiGraph([(0, 1), (1, 2), (2, 0)]))
         .require_doubly_stochastic(), None),
        (lambda: build("torus", 4), r"^name='torus'.*complete.*random_regular"),
        (lambda: build("ring", 4, degree=2), r"^degree is not an option"),
        (lambda: build("random_regular", 4), r"^degree is required"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(
    call: Callable[[], object], match: str | None
) -> None:
    if match is None:  # the directed 3-cycle with uniform weights is doubly stochastic
        call()
        return
    with pytest.raises(ValueError, match=match):
        call()


def test_require_checks_messages() -> None:
    topo = from_networkx(nx.star_graph(3))  # uniform push weights: rows do not sum to 1
    topo.require_column_stochastic()
    with pytest.raises(ValueError, match=r"^mixing: 'networkx' is not row-stochastic.*row 0"):
        topo.require_doubly_stochastic(arg="mixing")
    ring(4).require_world_size(4)


def test_build_registry() -> None:
    assert set(TOPOLOGIES) == {
        "complete", "ring", "exponential", "bipartite_exponential", "hypercube",
        "dissemination", "butterfly_groups", "random_regular",
    }
    topo = build("exponential", 16, peers_per_step=2)
    assert topo.name == "exponential" and topo.out_peers(0, 0) == [1, 2]
    np.testing.assert_array_equal(
        build("random_regular", 10, degree=3, seed=5).matrix(0),
        random_regular(10, 3, seed=5).matrix(0),
    )
    assert repr(build("ring", 8)) == "Topology('ring', world_size=8, period=1)"


def test_large_topology_is_cheap_to_query() -> None:
    topo = exponential(2048)
    assert topo.period == 11
    assert topo.out_peers(5, 3) == [13] and topo.in_peers(5, 3) == [2045]
    assert topo.is_strongly_connected() and topo.is_column_stochastic()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    topo_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_prints_matrix_checks_and_gap(capsys: pytest.CaptureFixture[str]) -> None:
    assert topo_cli.run(_parse(["ring", "--workers", "4"])) == 0
    out = capsys.readouterr().out
    assert "Topology('ring', world_size=4, period=1)" in out
    assert "0.333" in out and "0.000" in out  # the matrix, 3 decimals
    assert "0 -> 1: 0.333, 3: 0.333" in out
    assert "doubly stochastic:" in out and "yes" in out
    expected_gap = 1 - 1 / 3  # ring(4): eigenvalues 1, 1/3, 1/3, -1/3
    assert f"spectral gap (one period): {expected_gap:.6f}" in out


def test_cli_options_and_large_n(capsys: pytest.CaptureFixture[str]) -> None:
    topo_cli.run(_parse(["random_regular", "--workers", "40", "--degree", "3", "--seed", "1"]))
    out = capsys.readouterr().out
    assert "..." in out and "matrix" not in out
    assert "spectral gap" in out
    with pytest.raises(ValueError, match="group_size"):
        topo_cli.run(_parse(["butterfly_groups", "--workers", "8", "--group-size", "3"]))
