"""The :class:`Topology` class: who sends to whom at each step, and with which weights.

Convention: the mixing matrix of step ``k`` is ``W = topo.matrix(k)`` with ``W[j, i]`` the weight
with which node ``j`` receives node ``i``'s value (``i`` sends to ``j``), so one round of mixing is
``x_next = W @ x``. Column ``i`` holds ``i``'s *push* weights (what push-sum splits its mass by);
row ``j`` holds the weights ``j`` combines its in-peers with (pull averaging, as in D-PSGD).

Phases are stored sparsely (per rank, a dict of receivers) because world sizes reach the
thousands; dense matrices are only built on demand.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Topology", "Weights"]


@dataclass(frozen=True)
class Weights:
    """The weight a node gives its own value and the weight of each peer (by rank)."""

    self_weight: float
    peers: dict[int, float]


def _as_rank(value: object, what: str) -> int:
    """Coerce an int-like (int or numpy integer, not bool) to int, or raise ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r}") from None


class Topology:
    """A possibly time-varying communication graph with mixing weights.

    ``phases[p][i]`` maps each receiver ``j`` (``j == i`` for the self weight) to the weight of
    ``i``'s value at ``j`` in phase ``p``; step ``k`` uses phase ``k % period``. Zero weights are
    dropped, so a zero-weight receiver is not a peer.
    """

    def __init__(
        self,
        name: str,
        world_size: int,
        phases: Sequence[Sequence[Mapping[int, float]]],
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
            raise ValueError(f"world_size must be an int, got {world_size!r}")
        world_size = int(world_size)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if len(phases) < 1:
            raise ValueError("phases must hold at least one phase, got none")

        self._name = str(name)
        self._n = world_size
        out: list[tuple[dict[int, float], ...]] = []
        for p, phase in enumerate(phases):
            if len(phase) != world_size:
                raise ValueError(
                    f"phases[{p}] must have one entry per rank ({world_size}), got {len(phase)}"
                )
            cols: list[dict[int, float]] = []
            for i, column in enumerate(phase):
                col: dict[int, float] = {}
                for j_raw, w_raw in column.items():
                    j = _as_rank(j_raw, f"phases[{p}][{i}] receiver")
                    if not 0 <= j < world_size:
                        raise ValueError(
                            f"phases[{p}][{i}]: receiver {j} is not a rank in [0, {world_size})"
                        )
                    w = float(w_raw)
                    if not math.isfinite(w) or w < 0:
                        raise ValueError(
                            f"weights must be finite and non-negative: phase {p}, "
                            f"sender {i} -> receiver {j} has weight {w_raw!r}"
                        )
                    if w > 0:
                        col[j] = w
                cols.append(dict(sorted(col.items())))
            out.append(tuple(cols))
        self._cols: tuple[tuple[dict[int, float], ...], ...] = tuple(out)

        # Rows (what each rank receives) are precomputed so in_peers/in_weights are O(1).
        rows_all: list[tuple[dict[int, float], ...]] = []
        for cols in self._cols:
            rows: list[dict[int, float]] = [{} for _ in range(world_size)]
            for i, col in enumerate(cols):
                for j, w in col.items():
                    rows[j][i] = w
            rows_all.append(tuple(rows))
        self._rows: tuple[tuple[dict[int, float], ...], ...] = tuple(rows_all)
        self._out = tuple(
            tuple([j for j in col if j != i] for i, col in enumerate(cols)) for cols in self._cols
        )
        self._in = tuple(
            tuple([j for j in row if j != i] for i, row in enumerate(rows)) for rows in self._rows
        )
        #: phase -> its components and each rank's (see _components)
        self._component_cache: dict[int, tuple[list[tuple[int, ...]], list[int]]] = {}

    # -- basic properties -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """A short human-readable name, e.g. ``'ring'``."""
        return self._name

    @property
    def world_size(self) -> int:
        """The number of nodes (ranks ``0 .. world_size - 1``)."""
        return self._n

    @property
    def period(self) -> int:
        """The number of phases; step ``k`` uses phase ``k % period``."""
        return len(self._cols)

    def __repr__(self) -> str:
        return f"Topology({self._name!r}, world_size={self._n}, period={self.period})"

    def _phase(self, step: int) -> int:
        step = _as_rank(step, "step")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return step % self.period

    def _rank(self, rank: int) -> int:
        rank = _as_rank(rank, "rank")
        if not 0 <= rank < self._n:
            raise ValueError(f"rank must be in [0, {self._n}), got {rank}")
        return rank

    # -- per-node queries --------------------------------------------------------------------

    def out_peers(self, rank: int, step: int) -> list[int]:
        """The ranks ``rank`` sends to at ``step`` (sorted, excluding itself)."""
        r, p = self._rank(rank), self._phase(step)
        return list(self._out[p][r])

    def mirrored(self, by_offset: bool = False) -> bool:
        """Whether every node's sends mirror node 0's at every step: each node sends to one
        peer and receives from one, or each sends to node 0's out-peers shifted by its rank
        (a circulant graph) in the same order: :meth:`out_peers`' order, or with
        ``by_offset`` the order of the offsets ``(peer - rank) % n`` (a method that sends in
        that order). Every node's messages then leave and arrive at the same times when the
        links are alike (:mod:`gossamer.comm.mirror`)."""
        n = self._n

        def order(r: int, peers: list[int]) -> list[int]:
            return sorted(peers, key=lambda q: (q - r) % n) if by_offset else peers

        for p in range(self.period):
            zero = order(0, list(self._out[p][0]))
            for r in range(n):
                out = order(r, list(self._out[p][r]))
                if len(out) == 1 and len(self._in[p][r]) == 1 and len(zero) == 1:
                    continue
                if out != [(q + r) % n for q in zero]:
                    return False
        return True

    def in_peers(self, rank: int, step: int) -> list[int]:
        """The ranks ``rank`` receives from at ``step`` (sorted, excluding itself)."""
        r, p = self._rank(rank), self._phase(step)
        return list(self._in[p][r])

    def weights(self, rank: int, step: int) -> Weights:
        """``rank``'s push weights at ``step``: column ``rank`` of the mixing matrix."""
        r, p = self._rank(rank), self._phase(step)
        col = self._cols[p][r]
        return Weights(col.get(r, 0.0), {j: w for j, w in col.items() if j != r})

    def in_weights(self, rank: int, step: int) -> Weights:
        """``rank``'s combine weights at ``step``: row ``rank`` of the mixing matrix.

        Pull-style averaging (D-PSGD) sets ``x_rank = self_weight * x_rank + sum(w * x_peer)``.
        """
        r, p = self._rank(rank), self._phase(step)
        row = self._rows[p][r]
        return Weights(row.get(r, 0.0), {j: w for j, w in row.items() if j != r})

    def matrix(self, step: int) -> np.ndarray:
        """The dense ``n x n`` mixing matrix of ``step`` (float64), ``W[j, i]`` = i -> j."""
        p = self._phase(step)
        return self._dense(p)

    def _dense(self, p: int) -> np.ndarray:
        w = np.zeros((self._n, self._n), dtype=np.float64)
        for i, col in enumerate(self._cols[p]):
            if col:
                w[list(col.keys()), i] = list(col.values())
        return w

    def groups(self, step: int) -> list[list[int]]:
        """The connected components (ignoring direction) of ``step``'s graph, each sorted.

        Group-averaging algorithms all-reduce within each component.
        """
        return [list(g) for g in self._components(self._phase(step))[0]]

    def group_of(self, rank: int, step: int) -> list[int]:
        """The component of :meth:`groups` that holds ``rank`` at ``step`` (sorted): found
        once per phase for every rank, where a search of :meth:`groups` costs a pass over
        all ranks (10,000 workers of a group method ask for their group every round)."""
        groups, index = self._components(self._phase(step))
        return list(groups[index[self._rank(rank)]])

    def _components(self, p: int) -> tuple[list[tuple[int, ...]], list[int]]:
        """Phase ``p``'s components, sorted by their first rank, and each rank's component
        (its index in that list); worked out at the first call (the phases never change)."""
        cache = self._component_cache
        found = cache.get(p)
        if found is None:
            groups = [tuple(g) for g in self._find_components(p)]
            index = [0] * self._n
            for i, group in enumerate(groups):
                for r in group:
                    index[r] = i
            found = cache[p] = (groups, index)
        return found

    def _find_components(self, p: int) -> list[list[int]]:
        parent = list(range(self._n))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for i, peers in enumerate(self._out[p]):
            for j in peers:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
        comps: dict[int, list[int]] = {}
        for i in range(self._n):
            comps.setdefault(find(i), []).append(i)
        return sorted(comps.values(), key=lambda g: g[0])

    # -- checks ------------------------------------------------------------------------------

    def _column_sums(self, p: int) -> np.ndarray:
        return np.array([sum(col.values()) for col in self._cols[p]], dtype=np.float64)

    def _row_sums(self, p: int) -> np.ndarray:
        return np.array([sum(row.values()) for row in self._rows[p]], dtype=np.float64)

    def _worst(self, rows: bool) -> tuple[float, int, int, float]:
        """(deviation from 1, phase, index, sum) of the worst column (or row) sum."""
        best = (-1.0, 0, 0, 1.0)
        for p in range(self.period):
            sums = self._row_sums(p) if rows else self._column_sums(p)
            dev = np.abs(sums - 1.0)
            k = int(np.argmax(dev))
            if float(dev[k]) > best[0]:
                best = (float(dev[k]), p, k, float(sums[k]))
        return best

    def is_nonnegative(self) -> bool:
        """Whether every weight is >= 0 (always true: the constructor enforces it)."""
        return all(w >= 0 for cols in self._cols for col in cols for w in col.values())

    def is_column_stochastic(self, atol: float = 1e-9) -> bool:
        """Whether every sender's push weights sum to 1 in every phase (push-sum needs this)."""
        return self._worst(rows=False)[0] <= atol

    def is_row_stochastic(self, atol: float = 1e-9) -> bool:
        """Whether every receiver's combine weights sum to 1 in every phase."""
        return self._worst(rows=True)[0] <= atol

    def is_doubly_stochastic(self, atol: float = 1e-9) -> bool:
        """Whether every phase is both column- and row-stochastic (plain averaging needs this)."""
        return self.is_column_stochastic(atol) and self.is_row_stochastic(atol)

    def _reach(self, forward: bool) -> int:
        """How many nodes node 0 reaches in the union graph of one period (BFS)."""
        adj = self._out if forward else self._in
        seen = bytearray(self._n)
        seen[0] = 1
        stack = [0]
        count = 1
        while stack:
            i = stack.pop()
            for per_phase in adj:
                for j in per_phase[i]:
                    if not seen[j]:
                        seen[j] = 1
                        count += 1
                        stack.append(j)
        return count

    def is_strongly_connected(self) -> bool:
        """Whether the union of one period's graphs is strongly connected (needed to reach
        consensus); a single node counts as connected."""
        return self._reach(True) == self._n and self._reach(False) == self._n

    def _require_stochastic(self, arg: str, rows: bool, atol: float) -> None:
        dev, p, k, s = self._worst(rows)
        if dev > atol:
            kind = "row" if rows else "column"
            raise ValueError(
                f"{arg}: {self._name!r} is not {kind}-stochastic: worst is phase {p}, "
                f"{kind} {k}, which sums to {s:.12g} (must be 1 within {atol:g})"
            )

    def require_column_stochastic(self, arg: str = "topology", atol: float = 1e-9) -> None:
        """Raise ValueError (message starting with ``arg``) unless column-stochastic."""
        self._require_stochastic(arg, rows=False, atol=atol)

    def require_doubly_stochastic(self, arg: str = "topology", atol: float = 1e-9) -> None:
        """Raise ValueError (message starting with ``arg``) unless doubly stochastic."""
        self._require_stochastic(arg, rows=False, atol=atol)
        self._require_stochastic(arg, rows=True, atol=atol)

    def require_strongly_connected(self, arg: str = "topology") -> None:
        """Raise ValueError (message starting with ``arg``) unless strongly connected."""
        fwd, bwd = self._reach(True), self._reach(False)
        if fwd != self._n or bwd != self._n:
            raise ValueError(
                f"{arg}: {self._name!r} is not strongly connected over its period of "
                f"{self.period} phase(s): node 0 reaches {fwd} of {self._n} nodes and is "
                f"reached by {bwd}, so the workers cannot reach consensus"
            )

    def require_world_size(self, world_size: int, arg: str = "topology") -> None:
        """Raise ValueError (message starting with ``arg``) unless built for ``world_size``."""
        if world_size != self._n:
            raise ValueError(
                f"{arg}: {self._name!r} was built for world_size={self._n}, "
                f"but world_size is {world_size}"
            )

    # -- spectral properties -----------------------------------------------------------------

    def spectral_gap(self) -> float:
        """``1 - |lambda_2|`` of the product of one period's matrices ``W_{p-1} ... W_0``.

        It bounds how fast one period contracts disagreement; 1 means exact averaging, 0 means
        no consensus (e.g. a disconnected graph).
        """
        if self._n == 1:
            return 1.0
        prod = self._dense(0)
        for p in range(1, self.period):
            prod = self._dense(p) @ prod
        moduli = np.sort(np.abs(np.linalg.eigvals(prod)))[::-1]
        return max(0.0, float(1.0 - moduli[1]))
