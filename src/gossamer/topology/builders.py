"""Builders for the standard topologies, and a registry to build them by name.

Unless stated otherwise a sender with ``k`` out-peers in a phase gives ``1 / (k + 1)`` to each
out-peer and to itself, so every builder is column-stochastic (push-sum ready). Every registered
builder is in fact doubly stochastic, because each node also receives from exactly as many
peers as it sends to; the one exception is ``bipartite_exponential`` at an odd n, which is
column-stochastic only (see there).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from gossamer.topology.base import Topology

__all__ = [
    "TOPOLOGIES",
    "bipartite_exponential",
    "build",
    "butterfly_groups",
    "complete",
    "dissemination",
    "exponential",
    "from_matrix",
    "from_networkx",
    "hypercube",
    "random_regular",
    "ring",
]

Phase = list[dict[int, float]]

#: Column/row sums of a user-supplied matrix may be off by this much (they are typed in by hand).
_STOCHASTIC_ATOL = 1e-8


def _check_int(value: object, arg: str, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; bools and floats are rejected (ValueError naming
    ``arg``) because ``n=2.0`` or ``n=True`` is always a caller bug."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{arg} must be an int, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{arg} must be >= {minimum}, got {value}")
    return value


def _check_n(n: object) -> int:
    return _check_int(n, "n", 1)


def _uniform(n: int, out_peers: Iterable[Iterable[int]]) -> Phase:
    """A phase where each sender splits its value evenly between itself and its out-peers."""
    phase: Phase = []
    for i, peers in enumerate(out_peers):
        targets = sorted({int(j) for j in peers if j != i})
        w = 1.0 / (len(targets) + 1)
        col = {i: w}
        col.update({j: w for j in targets})
        phase.append(col)
    assert len(phase) == n
    return phase


def _grouped(n: int, groups: Iterable[Sequence[int]]) -> Phase:
    """A phase where each group averages exactly (every member gives ``1/|group|`` to each)."""
    phase: Phase = [{} for _ in range(n)]
    for group in groups:
        w = 1.0 / len(group)
        for i in group:
            phase[i] = {j: w for j in group}
    return phase


#: The most nodes :func:`complete` builds: it holds n * n weights.
MAX_COMPLETE = 4096


def complete(n: int) -> Topology:
    """Everyone sends to everyone with weight ``1/n``: one step averages exactly. At most
    :data:`MAX_COMPLETE` nodes (n * n weights)."""
    n = _check_n(n)
    if n > MAX_COMPLETE:
        raise ValueError(f"n={n} is too many for the complete topology: it holds n * n = "
                         f"{n * n:,} weights; at most {MAX_COMPLETE} nodes (a sparse topology "
                         "such as exponential scales further)")
    w = 1.0 / n
    return Topology("complete", n, [[{j: w for j in range(n)} for _ in range(n)]])


def ring(n: int) -> Topology:
    """Undirected ring: neighbours ``i - 1`` and ``i + 1`` (the one other node when n == 2)."""
    n = _check_n(n)
    return Topology("ring", n, [_uniform(n, ({(i - 1) % n, (i + 1) % n} for i in range(n)))])


def exponential(n: int, peers_per_step: int = 1) -> Topology:
    """SGP's directed time-varying exponential graph.

    Offsets are the powers of two ``1, 2, ..., 2^(m-1) <= n - 1``; at step ``k`` node ``i``
    sends to ``(i + 2^e) % n`` for ``e`` in ``(k * peers_per_step + j) % m``, ``j <
    peers_per_step``. With n a power of two and one peer per step, one period averages exactly.
    """
    n = _check_n(n)
    if n == 1:
        # A single node has nobody to talk to; peers_per_step is meaningless here.
        return Topology("exponential", 1, [[{0: 1.0}]])
    pps = _check_int(peers_per_step, "peers_per_step", 1)
    if pps >= n:
        raise ValueError(f"peers_per_step={pps} must be < n={n}")
    m = (n - 1).bit_length()
    if pps > m:
        raise ValueError(
            f"peers_per_step={pps} must be <= {m}, the number of power-of-two offsets < n={n}"
        )
    period = m // math.gcd(m, pps)
    phases = []
    for k in range(period):
        offsets = [1 << ((k * pps + j) % m) for j in range(pps)]
        phases.append(_uniform(n, ([(i + d) % n for d in offsets] for i in range(n))))
    return Topology("exponential", n, phases)


def bipartite_exponential(n: int) -> Topology:
    """SGP's dynamic bipartite exponential graph: even ranks only ever talk to odd ranks.

    The offsets are ``d_0 = 1`` and ``d_i = 2^i + 1`` for ``1 <= i <= floor(log2(n - 1))``
    (1, 3, 5, 9, 17, ...). Phase ``2 i`` sends ``r -> r + d_i``, phase ``2 i + 1`` sends
    ``r -> r - d_i`` (mod n); each sender keeps 1/2 and gives 1/2, so the period is
    ``2 (floor(log2(n - 1)) + 1)``. Every offset is odd and n is even, so every edge joins an
    even and an odd rank (AD-PSGD's active/passive split); every phase is ``(I + P) / 2`` for a
    shift ``P``: doubly stochastic, directed (not symmetric), one out- and one in-peer per node.

    This is ``DynamicBipartiteExponentialGraph`` of the code of Assran, Loizou, Ballas and
    Rabbat, "Stochastic Gradient Push for Distributed Deep Learning" (ICML 2019), with one peer
    per step and uniform mixing: rank ``r``'s peer list is ``r + d_0, r - d_0, r + d_1, ...``,
    visited in order, one per step. Offsets past ``n / 2`` repeat earlier peers (n = 8:
    ``+5 = -3``), as there.

    Odd n (AD-PSGD's survivors of a failure, say 3 of 4): the graph of ``n + 1`` ranks without
    its last rank ``n`` (an odd one): the same offsets and period, taken mod ``n + 1``, and the
    rank whose peer in a phase would be ``n`` keeps its whole value in that phase. Every edge
    still joins an even and an odd rank (a shift mod an odd n would join two even ones), the
    union of the phases stays symmetric and connected (the offsets +-1 make a path), and each
    rank has at most one out- and one in-peer per phase. Such a phase is column-stochastic
    (push-sum and AD-PSGD, which uses only its edges) but not doubly stochastic: the
    numbers of even and odd ranks differ, so no phase can be a shift. n = 3: ranks 0 and 2
    each talk to rank 1 only.
    """
    n = _check_n(n)
    if n == 1:
        return Topology("bipartite_exponential", 1, [[{0: 1.0}]])
    m = n + n % 2  # the even graph this one is cut from (n itself when n is even)
    offsets = [1] + [(1 << i) + 1 for i in range(1, (m - 1).bit_length())]
    phases = [
        _uniform(n, ([(r + sign * d) % m] if (r + sign * d) % m < n else [] for r in range(n)))
        for d in offsets
        for sign in (1, -1)
    ]
    return Topology("bipartite_exponential", n, phases)


def hypercube(n: int) -> Topology:
    """Phase ``k`` pairs ``i`` with ``i XOR 2^k`` (weights 1/2): exact average in log2(n) steps."""
    n = _check_n(n)
    if n & (n - 1):
        raise ValueError(f"n={n} must be a power of two for a hypercube")
    if n == 1:
        return Topology("hypercube", 1, [[{0: 1.0}]])
    phases = [
        _grouped(n, [(i, i ^ (1 << k)) for i in range(n) if i < i ^ (1 << k)])
        for k in range(n.bit_length() - 1)
    ]
    return Topology("hypercube", n, phases)


def dissemination(n: int) -> Topology:
    """Phase ``k < ceil(log2 n)``: ``i`` sends to ``i + 2^k`` (weights 1/2), for any n."""
    n = _check_n(n)
    if n == 1:
        return Topology("dissemination", 1, [[{0: 1.0}]])
    phases = [
        _uniform(n, ([(i + (1 << k)) % n] for i in range(n))) for k in range((n - 1).bit_length())
    ]
    return Topology("dissemination", n, phases)


def _butterfly_strides(n: int, g: int) -> list[int]:
    strides = [1]
    while n % (g * strides[-1] * g) == 0:
        strides.append(strides[-1] * g)
    if strides[-1] * g < n:
        # n is not a power of g: one last phase mixes across the blocks averaged so far.
        strides.append(n // g)
    return strides


def butterfly_groups(n: int, group_size: int = 4) -> Topology:
    """Groups of ``group_size`` that average exactly and change every phase (butterfly strides).

    With ``n = group_size^m`` one period of ``m`` phases averages all n nodes exactly.
    ``group_size == 1`` gives isolated nodes (allowed; not connected unless n == 1).
    """
    n = _check_n(n)
    g = _check_int(group_size, "group_size", 1)
    if n % g:
        raise ValueError(f"group_size={g} does not divide n={n}")
    if g == 1:
        return Topology("butterfly_groups", n, [[{i: 1.0} for i in range(n)]])
    phases = []
    for s in _butterfly_strides(n, g):
        block = g * s
        groups = [
            [base + off + j * s for j in range(g)]
            for base in range(0, n, block)
            for off in range(s)
        ]
        phases.append(_grouped(n, groups))
    return Topology("butterfly_groups", n, phases)


def _random_regular_edges(
    n: int, degree: int, rng: np.random.Generator
) -> list[set[int]] | None:
    """One attempt at a simple ``degree``-regular graph by random stub pairing; None on a
    dead end (a stub can only pair with itself or an existing neighbour)."""
    stubs = [i for i in range(n) for _ in range(degree)]
    adj: list[set[int]] = [set() for _ in range(n)]
    misses = 0
    while stubs:
        a, b = (int(x) for x in rng.integers(len(stubs), size=2))
        u, v = stubs[a], stubs[b]
        if a == b or u == v or v in adj[u]:
            misses += 1
            if misses > 20 * len(stubs) + 100:
                return None
            continue
        misses = 0
        adj[u].add(v)
        adj[v].add(u)
        # Remove both stubs by swapping with the end (larger index first keeps a valid).
        for idx in sorted((a, b), reverse=True):
            stubs[idx] = stubs[-1]
            stubs.pop()
    return adj


def _connected(adj: Sequence[set[int]]) -> bool:
    seen = {0}
    stack = [0]
    while stack:
        for j in adj[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return len(seen) == len(adj)


def random_regular(n: int, degree: int, seed: int = 0) -> Topology:
    """A connected simple random ``degree``-regular undirected graph (weights 1/(degree+1)).

    Deterministic given ``seed`` (numpy's ``default_rng``). Low-degree expanders mix far better
    than rings at the same per-step cost.
    """
    n = _check_n(n)
    degree = _check_int(degree, "degree", 0 if n == 1 else 1)
    if n > 1 and degree >= n:
        raise ValueError(f"degree={degree} must be < n={n}")
    if n == 1:
        if degree != 0:
            raise ValueError(f"degree={degree} must be 0 when n=1")
        return Topology("random_regular", 1, [[{0: 1.0}]])
    if (n * degree) % 2:
        raise ValueError(f"n * degree must be even, got n={n}, degree={degree}")
    if degree == 1 and n > 2:
        raise ValueError(f"degree=1 cannot give a connected graph on n={n} > 2 nodes")
    rng = np.random.default_rng(seed)
    adj: list[set[int]] | None = None
    attempts = 200
    if degree == 2:
        # The connected 2-regular graphs are exactly the Hamiltonian cycles.
        order = [int(x) for x in rng.permutation(n)]
        adj = [set() for _ in range(n)]
        for a, b in zip(order, order[1:] + order[:1], strict=True):
            adj[a].add(b)
            adj[b].add(a)
    elif 2 * degree > n - 1:
        # Stub pairing dead-ends on dense graphs, so draw the sparse complement instead; a graph
        # with minimum degree >= (n - 1) / 2 is always connected.
        for _ in range(attempts):
            comp = _random_regular_edges(n, n - 1 - degree, rng)
            if comp is not None:
                adj = [set(range(n)) - comp[i] - {i} for i in range(n)]
                break
    else:
        for _ in range(attempts):
            cand = _random_regular_edges(n, degree, rng)
            if cand is not None and _connected(cand):
                adj = cand
                break
    if adj is None:
        raise ValueError(
            f"degree={degree}: could not draw a connected simple {degree}-regular graph "
            f"on n={n} nodes in {attempts} attempts (seed={seed})"
        )
    return Topology("random_regular", n, [_uniform(n, adj)])


def _validate_matrices(W: Any) -> list[np.ndarray]:
    """``W`` as a non-empty list of equal-size square finite non-negative float64 matrices."""
    try:
        arr = np.asarray(W, dtype=np.float64)
    except (ValueError, TypeError):
        arr = None  # ragged: matrices of different sizes, checked one by one below
    if arr is not None and arr.ndim == 2:
        mats = [arr]
    elif arr is not None and arr.ndim == 3:
        mats = list(arr)
    elif arr is None and isinstance(W, Sequence):
        mats = []
        for p, m in enumerate(W):
            try:
                mats.append(np.asarray(m, dtype=np.float64))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"W[{p}] is not a numeric matrix: {exc}") from None
    else:
        shape = None if arr is None else arr.shape
        raise ValueError(
            f"W must be a square matrix or a sequence of square matrices, got shape {shape}"
        )
    if not mats:
        raise ValueError("W must hold at least one matrix, got none")
    n = mats[0].shape[0] if mats[0].ndim == 2 else -1
    for p, m in enumerate(mats):
        if m.ndim != 2 or m.shape[0] != m.shape[1]:
            raise ValueError(f"W[{p}] must be a square 2-D matrix, got shape {m.shape}")
        if m.shape[0] != n:
            raise ValueError(f"W[{p}] has shape {m.shape} but W[0] has shape {mats[0].shape}")
        if n == 0:
            raise ValueError("W must be at least 1 x 1, got 0 x 0")
        if not np.all(np.isfinite(m)):
            raise ValueError(f"W[{p}] has non-finite entries")
        if np.any(m < 0):
            j, i = (int(x) for x in np.argwhere(m < 0)[0])
            raise ValueError(f"W[{p}] has a negative weight: W[{j}, {i}] = {m[j, i]:g}")
    return mats


def from_matrix(W: Any, name: str = "matrix") -> Topology:
    """A topology from one mixing matrix, or a sequence of them (one per phase).

    ``W[j, i]`` is the weight of ``i``'s value at ``j``. Each phase must be column-stochastic
    (push-sum) or row-stochastic (pull averaging).
    """
    mats = _validate_matrices(W)
    n = mats[0].shape[0]
    for p, m in enumerate(mats):
        cols, rows = m.sum(axis=0), m.sum(axis=1)
        ci, ri = int(np.argmax(np.abs(cols - 1))), int(np.argmax(np.abs(rows - 1)))
        if abs(cols[ci] - 1) > _STOCHASTIC_ATOL and abs(rows[ri] - 1) > _STOCHASTIC_ATOL:
            raise ValueError(
                f"W is not stochastic: in phase {p} column {ci} sums to {cols[ci]:.12g} and "
                f"row {ri} sums to {rows[ri]:.12g}; every column or every row must sum to 1"
            )
    phases = [
        [{int(j): float(m[j, i]) for j in np.flatnonzero(m[:, i])} for i in range(n)]
        for m in mats
    ]
    return Topology(name, n, phases)


def from_networkx(G: Any, weights: str = "uniform") -> Topology:
    """A static topology from a networkx graph (directed: successors are out-peers).

    Nodes other than exactly ``0 .. n-1`` are relabelled in sorted order. ``weights`` is
    ``"uniform"`` (push weight ``1/(out_degree + 1)``) or ``"metropolis"`` (undirected only:
    ``1 / (1 + max(d_i, d_j))``, doubly stochastic for irregular graphs too). Self-loops are
    ignored. The graph must be strongly connected.
    """
    try:
        import networkx as nx
    except ImportError as exc:  # pragma: no cover - networkx is a dev dependency
        raise ImportError(
            "from_networkx needs networkx: pip install networkx (or gossamer[networkx])"
        ) from exc
    if weights not in ("uniform", "metropolis"):
        raise ValueError(f"weights must be 'uniform' or 'metropolis', got {weights!r}")
    if not isinstance(G, nx.Graph):
        raise ValueError(f"G must be a networkx graph, got {type(G).__name__}")
    n = G.number_of_nodes()
    if n == 0:
        raise ValueError("G has no nodes")
    directed = G.is_directed()
    if weights == "metropolis" and directed:
        raise ValueError("weights='metropolis' needs an undirected graph; G is directed")
    nodes = list(G.nodes)
    if set(nodes) != set(range(n)):
        try:
            order = sorted(nodes)
        except TypeError as exc:
            raise ValueError(f"G's nodes are not 0..n-1 and cannot be sorted: {exc}") from None
        G = nx.relabel_nodes(G, {v: k for k, v in enumerate(order)})
    nbrs = [
        sorted({int(j) for j in (G.successors(i) if directed else G.neighbors(i)) if j != i})
        for i in range(n)
    ]
    if weights == "uniform":
        phase = _uniform(n, nbrs)
    else:
        deg = [len(p) for p in nbrs]
        phase = []
        for i in range(n):
            col = {j: 1.0 / (1 + max(deg[i], deg[j])) for j in nbrs[i]}
            col[i] = max(0.0, 1.0 - sum(col.values()))
            phase.append(col)
    name = str(G.name) if getattr(G, "name", "") else "networkx"
    topo = Topology(name, n, [phase])
    if not topo.is_strongly_connected():
        kind = "strongly connected" if directed else "connected"
        raise ValueError(f"G must be {kind}; gossip on it can never reach consensus")
    return topo


#: The named builders, for configs and the command line (read-only).
TOPOLOGIES: Mapping[str, Callable[..., Topology]] = MappingProxyType(
    {
        "complete": complete,
        "ring": ring,
        "exponential": exponential,
        "bipartite_exponential": bipartite_exponential,
        "hypercube": hypercube,
        "dissemination": dissemination,
        "butterfly_groups": butterfly_groups,
        "random_regular": random_regular,
    }
)


def build(name: str, n: int, **options: Any) -> Topology:
    """Build the registered topology ``name`` on ``n`` nodes, e.g. ``build("exponential", 16,
    peers_per_step=2)``; unknown names and options raise ValueError naming them."""
    builder = TOPOLOGIES.get(name) if isinstance(name, str) else None
    if builder is None:
        raise ValueError(f"name={name!r} is not a known topology; known: {', '.join(TOPOLOGIES)}")
    params = dict(inspect.signature(builder).parameters)
    params.pop("n")
    for opt in options:
        if opt not in params:
            accepted = ", ".join(params) or "none"
            raise ValueError(
                f"{opt} is not an option of the {name!r} topology (its options: {accepted})"
            )
    for pname, param in params.items():
        if param.default is inspect.Parameter.empty and pname not in options:
            raise ValueError(f"{pname} is required by the {name!r} topology")
    return builder(n, **options)
