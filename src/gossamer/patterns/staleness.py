"""The models partners published for rounds, kept while a later round may still use them: the
store behind a bounded-staleness average (WAGMA's group average takes, for each member, its
model of the round, or the newest older one while it is at most ``tau`` rounds old).

A model is published for one round, or, when its owner skips rounds to catch up, for each round
it skipped: it is kept under the first round (its stamp) with the last round it stands for.

Example::

    store = PublishedModels([1, 2], initial=x0)   # round 0's model of every partner: x0
    store.keep(1, stamp=3, until=3, x=x1)
    age, stamp, model = store.model_for(1, 4)     # (1, 3, x1): one round old
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["PublishedModels"]


class PublishedModels:
    """Per partner, the models it published that may still be used: ``by_peer[peer]`` maps a
    model's first round to ``(the last round it is the partner's model for, the model)``."""

    def __init__(self, partners: Iterable[int], initial: torch.Tensor, stamp: int = 0) -> None:
        self.by_peer: dict[int, dict[int, tuple[int, torch.Tensor]]] = {}
        self.reset(partners, stamp, initial)

    def reset(self, partners: Iterable[int], stamp: int, x: torch.Tensor) -> None:
        """Every partner's model is ``x``, for round ``stamp`` (an exact average made them
        all equal)."""
        self.by_peer = {m: {stamp: (stamp, x)} for m in partners}

    def keep(self, peer: int, stamp: int, until: int, x: torch.Tensor) -> None:
        """``peer``'s model ``x`` for rounds ``stamp`` to ``until``, unless a model for more
        rounds from the same stamp is kept already (a message overtaken by a later one)."""
        known = self.by_peer[peer]
        if stamp not in known or until >= known[stamp][0]:
            known[stamp] = (until, x)

    def newest(self, peer: int) -> tuple[int, torch.Tensor]:
        """The model ``peer`` published last (the largest stamp): the last round it is the
        partner's model for, and the model."""
        known = self.by_peer[peer]
        return known[max(known)]

    def model_for(self, peer: int, q: int) -> tuple[int, int, torch.Tensor] | None:
        """``peer``'s model for round ``q``: its age in rounds (0: its model of that round),
        its stamp and the model; None while it has published nothing for round ``q`` or
        earlier. A model published for later rounds only is never used for ``q``: it
        already holds this worker's contribution to them."""
        known = self.by_peer[peer]
        current = [stamp for stamp, (until, _) in known.items() if stamp <= q <= until]
        if current:
            stamp = max(current)
            return 0, stamp, known[stamp][1]
        older = [stamp for stamp, (until, _) in known.items() if until < q]
        if not older:
            return None
        stamp = max(older, key=lambda k: known[k][0])
        return q - known[stamp][0], stamp, known[stamp][1]

    def forget(self, oldest: int) -> None:
        """Drop the models that stand only for rounds before ``oldest`` (the oldest round a
        later average may use); the newest of each partner is kept."""
        for known in self.by_peer.values():
            newest = max(known)
            for stamp in [k for k, (until, _) in known.items() if until < oldest and k != newest]:
                del known[stamp]

    def state_dict(self) -> dict[str, Any]:
        return {str(m): {str(k): v for k, v in known.items()}
                for m, known in self.by_peer.items()}

    def load_state_dict(self, state: dict[str, Any], dtype: torch.dtype) -> None:
        self.by_peer = {int(m): {int(k): (int(until), x.to(dtype))
                                 for k, (until, x) in known.items()}
                        for m, known in state.items()}
