"""Who sends how many bytes to whom in each collective, and how long it takes (alpha-beta model).

Both communicators count collectives with these formulas, so byte counters agree between the
simulator and real runs: an all-reduce is counted as a ring reduce-scatter plus a ring
all-gather, an all-gather as a ring, a broadcast as a binomial tree, a barrier as a
dissemination barrier. The simulator also takes its virtual durations from here: a collective
starts when its last member arrives and lasts as long as its slowest step on the slowest link.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gossamer.comm.network import NetworkModel

#: One entry per destination: (peer, bytes, messages), in the ranks of the communicator.
Traffic = list[tuple[int, int, int]]


def chunk_sizes(numel: int, parts: int) -> list[int]:
    """Split ``numel`` elements into ``parts`` chunks as evenly as possible (first ones larger)."""
    return [chunk_size(numel, parts, i) for i in range(parts)]


def chunk_size(numel: int, parts: int, index: int) -> int:
    """The size of chunk ``index`` of :func:`chunk_sizes`."""
    base, extra = divmod(numel, parts)
    return base + (1 if index < extra else 0)


def ring_all_reduce_traffic(rank: int, n: int, numel: int, element_size: int) -> Traffic:
    """Bytes ``rank`` sends to its ring successor: reduce-scatter then all-gather."""
    if n == 1:
        return []
    # Reduce-scatter sends every chunk but the successor's; all-gather every chunk but the
    # one two places ahead.
    elements = 2 * numel - chunk_size(numel, n, (rank + 1) % n) - chunk_size(
        numel, n, (rank + 2) % n
    )
    return [((rank + 1) % n, elements * element_size, 2 * (n - 1))]


def ring_all_reduce_time(
    n: int, numel: int, element_size: int, network: NetworkModel, members: Sequence[int]
) -> float:
    """Duration of a ring all-reduce: 2 (n - 1) steps, each as slow as its slowest link."""
    if n == 1:
        return 0.0
    chunk_bytes = -(-numel // n) * element_size
    step = max(
        network.message_time(members[i], members[(i + 1) % n], chunk_bytes) for i in range(n)
    )
    return 2 * (n - 1) * step


def ring_all_gather_traffic(rank: int, n: int, nbytes_per_rank: Sequence[int]) -> Traffic:
    """Bytes ``rank`` sends to its successor in a ring all-gather of per-rank sizes."""
    if n == 1:
        return []
    return [((rank + 1) % n, sum(nbytes_per_rank) - nbytes_per_rank[(rank + 1) % n], n - 1)]


def ring_all_gather_time(
    nbytes_per_rank: Sequence[int], network: NetworkModel, members: Sequence[int]
) -> float:
    """Duration of a ring all-gather: at step s rank i forwards the block of rank i - s.

    Blocks of one size (a header of shapes, equal payloads) make every step as long as the
    first: it is found once, in O(n) rather than O(n^2) (the same sum, step by step).
    """
    n = len(nbytes_per_rank)
    total = 0.0
    if n > 1 and min(nbytes_per_rank) == max(nbytes_per_rank):
        size = nbytes_per_rank[0]
        step = max(network.message_time(members[i], members[(i + 1) % n], size)
                   for i in range(n))
        for _ in range(n - 1):
            total += step
        return total
    for s in range(n - 1):
        total += max(
            network.message_time(members[i], members[(i + 1) % n], nbytes_per_rank[(i - s) % n])
            for i in range(n)
        )
    return total


def broadcast_edges(n: int, src: int) -> list[list[tuple[int, int]]]:
    """Binomial-tree broadcast edges per round, as (sender, receiver) ranks: the messages of
    a broadcast from ``src`` among ``n`` ranks, as the cost model counts them and
    :class:`~gossamer.comm.p2p_group.P2PGroup` sends them."""
    rounds = []
    r = 0
    while (1 << r) < n:
        edges = []
        for v in range(1 << r):
            w = v + (1 << r)
            if w < n:
                edges.append(((v + src) % n, (w + src) % n))
        rounds.append(edges)
        r += 1
    return rounds


def broadcast_traffic(rank: int, n: int, src: int, nbytes: int) -> Traffic:
    """Bytes ``rank`` sends in a binomial-tree broadcast from ``src``."""
    return [(dst, nbytes, 1) for edges in broadcast_edges(n, src) for s, dst in edges if s == rank]


def broadcast_sources(rank: int, n: int, src: int) -> list[int]:
    """The rank that ``rank`` receives from in a binomial-tree broadcast (empty for ``src``)."""
    return [s for edges in broadcast_edges(n, src) for s, dst in edges if dst == rank]


def broadcast_time(
    n: int, src: int, nbytes: int, network: NetworkModel, members: Sequence[int]
) -> float:
    return sum(
        max(network.message_time(members[s], members[d], nbytes) for s, d in edges)
        for edges in broadcast_edges(n, src)
    )


def barrier_rounds(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def barrier_traffic(rank: int, n: int) -> Traffic:
    """A dissemination barrier: in round r, rank i signals i + 2^r (zero-byte messages)."""
    return [((rank + (1 << r)) % n, 0, 1) for r in range(barrier_rounds(n))]


def barrier_time(n: int, network: NetworkModel, members: Sequence[int]) -> float:
    return sum(
        max(network.message_time(members[i], members[(i + (1 << r)) % n], 0) for i in range(n))
        for r in range(barrier_rounds(n))
    )


def fit_ring_all_reduce(
    samples: Sequence[tuple[int, int, float]], element_size: int = 4,
    max_bandwidth: float | None = None,
) -> NetworkModel:
    """The alpha-beta :class:`NetworkModel` that best explains measured all-reduce times.

    Each sample is ``(workers, nbytes, seconds)``: one all-reduce of ``nbytes`` over
    ``workers`` ranks took ``seconds``. The model of :func:`ring_all_reduce_time`,
    ``2 (n - 1) (alpha + chunk * beta)`` with ``chunk`` the bytes of one ring chunk, is fitted
    by least squares on the relative error, so that small and large messages weigh alike. A
    negative latency is not physical: the fit is then redone with ``alpha = 0``; nor is a
    bandwidth above the links' rate, when it is known (``max_bandwidth``): the bandwidth is
    then that rate and only the latency is fitted.

    Args:
        samples: at least two, with at least two different chunk sizes; ``workers >= 2``.
        element_size: bytes per element (default 4, float32), for the chunk rounding.
        max_bandwidth: the links' rate in bytes per second, an upper bound of the fitted
            bandwidth (default None: no bound). A shaped link's burst, or an algorithm other
            than the ring for small messages, can otherwise fit a rate the link never gives.

    Returns a :class:`NetworkModel` with the fitted ``latency`` (alpha) and ``bandwidth``
    (1 / beta). Raises ValueError when the samples cannot determine both.

    Example::

        net = fit_ring_all_reduce([(4, 10**6, 0.0125), (4, 10**8, 1.21)])
        net.latency, net.bandwidth   # seconds per message, bytes per second
    """
    import numpy as np

    if max_bandwidth is not None and not max_bandwidth > 0:
        raise ValueError(f"max_bandwidth must be > 0 bytes per second, got {max_bandwidth!r}")
    rows, chunks = [], set()
    for n, nbytes, seconds in samples:
        if n < 2:
            raise ValueError(f"samples: an all-reduce of {n} worker(s) moves nothing, got {n}")
        if not seconds > 0:
            raise ValueError(f"samples: times must be > 0 seconds, got {seconds!r}")
        numel = -(-int(nbytes) // element_size)
        chunk = -(-numel // n) * element_size
        chunks.add(chunk)
        steps = 2 * (n - 1)
        rows.append((steps / seconds, steps * chunk / seconds))
    if len(chunks) < 2:
        raise ValueError("samples: need at least two different message sizes to separate "
                         "latency from bandwidth")
    a = np.array(rows, dtype=np.float64)
    ones = np.ones(len(rows))
    (alpha, beta), *_ = np.linalg.lstsq(a, ones, rcond=None)
    bandwidth = None
    if alpha < 0:
        alpha = 0.0
        beta = float(a[:, 1] @ ones / (a[:, 1] @ a[:, 1]))
    if max_bandwidth is not None and beta > 0 and 1 / beta > max_bandwidth:
        beta = 1 / max_bandwidth
        bandwidth = float(max_bandwidth)  # exactly (1 / beta may round)
        # the alpha that minimises the relative errors, sum((a0 alpha + a1 beta - 1)^2), alone
        alpha = max(0.0, float((ones - a[:, 1] * beta) @ a[:, 0] / (a[:, 0] @ a[:, 0])))
    if not beta > 0:
        raise ValueError("samples: the times do not grow with the message size; no "
                         "bandwidth fits them")
    return NetworkModel(latency=float(alpha), bandwidth=bandwidth or float(1 / beta))
