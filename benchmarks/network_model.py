"""The alpha-beta model of the network suite's emulated links: nominal (the link's rate) and
fitted to part (a)'s all-reduces. Used by the suite (:mod:`benchmarks.network`) and by its
report (:mod:`benchmarks.network_report`)."""

from __future__ import annotations

from typing import Any


def nominal_network(gbits: float):
    """The alpha-beta model of a link of ``gbits``: its rate, NetworkModel's default latency."""
    from gossamer.comm import NetworkModel

    return NetworkModel(bandwidth=gbits * 1e9 / 8)


def all_reduce_model(n: int, nbytes: int, network) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` of float32 over ``n`` workers."""
    from gossamer.comm.cost import ring_all_reduce_time

    return ring_all_reduce_time(n, nbytes // 4, 4, network, list(range(n)))


def fitted_network(a: dict[str, Any], n: int, gbits: float):
    """The NetworkModel fitted in (a) to ``n`` workers' all-reduces at ``gbits``."""
    from gossamer.comm import NetworkModel

    for fit in a["fits"]:
        if fit["gbits"] == gbits and fit["workers"] == [n]:
            return NetworkModel(latency=fit["latency"], bandwidth=fit["bandwidth"])
    raise ValueError(f"(a) has no fit for {n} workers at {gbits:g} Gbit/s: run part a first")
