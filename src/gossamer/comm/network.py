"""Cost models of the simulator: how long messages take, and how long a worker computes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gossamer.checks import check_positive
from gossamer.comm.rate import parse_rate


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """The alpha-beta model of a network: a message of b bytes from i to j takes
    ``latency(i, j) + b / bandwidth(i, j)`` seconds, and each worker has one NIC that sends one
    message at a time (sends queue behind each other; receives do not).

    Args:
        latency: seconds per message, alpha (default 50e-6, a switched Ethernet hop).
        bandwidth: every link's rate, 1 / beta: bytes per second, or a rate such as
            ``"1gbit"`` or ``"125MB/s"`` (:func:`gossamer.comm.rate.parse_rate`); kept in
            bytes per second (default 125e6: 1 Gbit/s).
        link_latency: per-(sender, receiver) overrides of ``latency``.
        link_bandwidth: per-(sender, receiver) overrides of ``bandwidth`` (rates too), e.g. a
            slow link.
        size_scale: every message counts this many times its real size when its time is
            computed (default 1): simulates a model ``size_scale`` times larger than the one
            computed, e.g. ResNet-50's 25.6M parameters with a 0.1M-parameter stand-in. Byte
            counters keep counting real bytes.
        node_size: workers per node (default 1: every link is a network link): ranks
            ``[k G, (k + 1) G)`` share node k, and a message between two of them takes
            ``node_latency`` and ``node_bandwidth`` (e.g. NVLink) instead; each worker still
            has one NIC. The per-link overrides win over both.
        node_latency: seconds per message inside a node (default None: ``latency``).
        node_bandwidth: the rate inside a node (default None: ``bandwidth``).

    Example::

        net = NetworkModel(latency=5e-6, bandwidth="100gbit")  # bandwidth == 12.5e9 bytes/s
        slow = NetworkModel(bandwidth=125e6, link_bandwidth={(0, 1): "100mbit"})
        nodes = NetworkModel(bandwidth="10gbit", node_size=8, node_bandwidth="1000gbit")
    """

    latency: float = 50e-6  # lower: small messages (gossip, barriers) get cheaper
    bandwidth: float = 125e6  # higher: large messages (dense gradients) get cheaper
    link_latency: Mapping[tuple[int, int], float] = field(default_factory=dict)
    link_bandwidth: Mapping[tuple[int, int], float] = field(default_factory=dict)
    size_scale: float = 1.0  # higher: messages cost as if the model were that much larger
    node_size: int = 1  # higher: more workers share a node's fast links
    node_latency: float | None = None  # lower: messages inside a node get cheaper
    node_bandwidth: float | None = None  # higher: large messages inside a node get cheaper

    def __post_init__(self) -> None:
        check_positive("size_scale", self.size_scale, allow_zero=False)
        check_positive("latency", self.latency, allow_zero=True)
        # rates in, bytes per second kept: frozen, so set through object.__setattr__
        object.__setattr__(self, "bandwidth", parse_rate(self.bandwidth, arg="bandwidth"))
        if isinstance(self.node_size, bool) or not isinstance(self.node_size, int) \
                or self.node_size < 1:
            raise ValueError(f"node_size must be an int >= 1, got {self.node_size!r}")
        if self.node_latency is not None:
            check_positive("node_latency", self.node_latency, allow_zero=True)
        if self.node_bandwidth is not None:
            object.__setattr__(self, "node_bandwidth",
                               parse_rate(self.node_bandwidth, arg="node_bandwidth"))
        for (i, j), value in self.link_latency.items():
            check_positive(f"link_latency[({i}, {j})]", value, allow_zero=True)
        object.__setattr__(self, "link_bandwidth", {
            (i, j): parse_rate(value, arg=f"link_bandwidth[({i}, {j})]")
            for (i, j), value in self.link_bandwidth.items()})

    def _inside(self, src: int, dst: int) -> bool:
        return self.node_size > 1 and src // self.node_size == dst // self.node_size

    def transfer_time(self, src: int, dst: int, nbytes: int) -> float:
        """Seconds the sender's NIC is busy with a message (no latency)."""
        rate = self.bandwidth
        if self.node_bandwidth is not None and self._inside(src, dst):
            rate = self.node_bandwidth
        return nbytes * self.size_scale / self.link_bandwidth.get((src, dst), rate)

    def message_time(self, src: int, dst: int, nbytes: int) -> float:
        """Seconds from the start of sending to arrival: alpha + b * beta."""
        latency = self.latency
        if self.node_latency is not None and self._inside(src, dst):
            latency = self.node_latency
        return self.link_latency.get((src, dst), latency) + self.transfer_time(
            src, dst, nbytes
        )


@dataclass(frozen=True, kw_only=True)
class ComputeModel:
    """How long one training step's computation takes on each simulated worker.

    ``duration = step_time * stragglers.get(rank, 1) * jitter_factor``, where the jitter factor
    is drawn from a log-normal of standard deviation ``jitter`` by a generator seeded from the
    world's seed and the rank, so it is reproducible. A rank in ``trace`` replays its step
    times instead: its k-th step takes ``trace[rank][k % len(trace[rank])] *
    stragglers.get(rank, 1)``, no jitter (the times measured on a real run, to predict that
    run's communication with exactly its compute). A step of a trace may also be a sequence of
    seconds, the step's local work between its communicator calls (as a real run measures it:
    before the first call, between each call and the next, after the last): the first part is
    charged when the step's computation is, the second when the worker enters the step's
    second communicator call (a collective, an exchange, or the wait for one), and so on, so
    that a collective late in the step waits for the slowest worker's work before it, as on
    the real run. What a step's calls leave over (its part after the last call, or more where
    the simulated step makes fewer calls) is charged at the next step's start.
    With ``measured=True`` the real time the worker's code took since its previous step is
    used instead (not reproducible).

    Args:
        step_time: seconds per step (default 0.01).
        stragglers: rank -> slowdown factor, e.g. ``{3: 4.0}`` makes rank 3 four times slower.
        jitter: relative spread of step times (default 0, none).
        measured: use measured time instead of ``step_time`` (default False).
        trace: rank -> the seconds of its successive steps (each a number, or a sequence of
            the step's parts between its communicator calls), replayed in turn and from the
            first again after the last (default: none).

    Example::

        ComputeModel(step_time=0.1, trace={0: [0.08, 0.12, 0.3]})  # rank 0: its own times
        ComputeModel(trace={0: [[0.05, 0.02, 0.01]]})  # 50 ms, a call, 20 ms, a call, 10 ms
    """

    step_time: float = 0.01  # higher: communication matters less relative to compute
    stragglers: Mapping[int, float] = field(default_factory=dict)
    jitter: float = 0.0  # higher: more variable step times, more waiting in synchronous methods
    measured: bool = False
    trace: Mapping[int, Sequence[float | Sequence[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_positive("step_time", self.step_time, allow_zero=True)
        check_positive("jitter", self.jitter, allow_zero=True)
        for rank, factor in self.stragglers.items():
            check_positive(f"stragglers[{rank}]", factor, allow_zero=False)
        if self.trace and self.measured:
            raise ValueError("trace: a measured compute model takes no trace")
        for rank, times in self.trace.items():
            if isinstance(times, (str, bytes)) or not isinstance(times, Sequence) or not times:
                raise ValueError(f"trace[{rank}] must be a non-empty sequence of seconds, got "
                                 f"{times!r}")
            for k, t in enumerate(times):
                if isinstance(t, (str, bytes)) or not isinstance(t, Sequence):
                    check_positive(f"trace[{rank}][{k}]", t, allow_zero=True)
                    continue
                if not t:
                    raise ValueError(f"trace[{rank}][{k}] must be a number of seconds or a "
                                     f"non-empty sequence of them, got {t!r}")
                for j, part in enumerate(t):
                    check_positive(f"trace[{rank}][{k}][{j}]", part, allow_zero=True)

    def step_parts(self, rank: int, step: int) -> tuple[float, ...] | None:
        """The seconds of ``rank``'s ``step``-th step between its communicator calls (see the
        class docs), stragglers applied; None where the step is one number or not traced."""
        times = self.trace.get(rank)
        if times is None:
            return None
        entry = times[step % len(times)]
        if not isinstance(entry, Sequence):
            return None
        factor = self.stragglers.get(rank, 1.0)
        return tuple(part * factor for part in entry)

    def step_duration(self, rank: int, rng: np.random.Generator, step: int = 0) -> float:
        """Seconds of ``rank``'s ``step``-th step (counted from 0, all its parts); ``rng``
        draws its jitter."""
        times = self.trace.get(rank)
        if times is not None:
            entry = times[step % len(times)]
            total = sum(entry) if isinstance(entry, Sequence) else entry
            return total * self.stragglers.get(rank, 1.0)
        duration = self.step_time * self.stragglers.get(rank, 1.0)
        if self.jitter > 0:
            duration *= float(rng.lognormal(mean=0.0, sigma=self.jitter))
        return duration
