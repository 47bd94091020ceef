"""Topologies: who sends to whom at each step, with which mixing weights (pure data).

- :class:`Topology`: a possibly time-varying graph, stored sparsely, with per-node queries
  (``out_peers``, ``in_peers``, ``weights``, ``in_weights``), dense ``matrix(step)``, checks
  (stochasticity, strong connectivity) and the ``spectral_gap``.
- Builders: :func:`complete`, :func:`ring`, :func:`exponential`, :func:`bipartite_exponential`,
  :func:`hypercube`, :func:`dissemination`, :func:`butterfly_groups`, :func:`random_regular`,
  :func:`from_matrix`, :func:`from_networkx`, and :func:`build` / :data:`TOPOLOGIES` by name.
- :class:`GossipGradSchedule` (GossipGraD's partners) and :class:`RandomPairs` (NoLoCo's
  random groups of two): step-indexed schedules.
"""

from gossamer.topology.base import Topology, Weights
from gossamer.topology.builders import (
    TOPOLOGIES,
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
from gossamer.topology.gossipgrad import GossipGradSchedule
from gossamer.topology.pairing import RandomPairs

__all__ = [
    "TOPOLOGIES",
    "GossipGradSchedule",
    "RandomPairs",
    "Topology",
    "Weights",
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
