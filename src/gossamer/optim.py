"""Muon for the hidden matrices, AdamW for every other parameter: one ``torch.optim``
optimizer, the inner optimizer of MuLoCo and of any local method.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks";
``torch.optim.Muon``) orthogonalises the momentum of a 2-D matrix with Newton-Schulz
iterations, so it takes only matrices; its authors, torch's documentation and MuLoCo
(Therien et al. 2025, arXiv 2505.23725, Section 4: "the embeddings, output head, biases and
norms are optimised with AdamW") send the input embeddings, the output head and every 1-D
parameter to AdamW. :func:`muon` makes that split from a module: the weights of its
``nn.Linear`` layers go to Muon, except the last one (the output head); the rest (embeddings,
biases, norms, convolutions) to AdamW.

:class:`MuonWithAdamW` is a real ``torch.optim.Optimizer``: its ``param_groups`` are the Muon
group then the AdamW group (each marked ``"muon": True / False``), so that a learning-rate
schedule, :func:`gossamer.distribute`, checkpoints (``state_dict`` / ``load_state_dict``, both
optimizers' state in one) and ``zero_grad`` see one optimizer. The two groups share the
learning rate a schedule sets: by default Muon scales it per matrix by ``0.2 sqrt(max(A, B))``
(``adjust_lr_fn="match_rms_adamw"``, Liu et al. 2025, "Muon is Scalable for LLM Training"), so
that an AdamW learning rate serves both, as the MuLoCo authors' runs give one learning rate to
both.

Example::

    inner = gossamer.muon(model, lr=3e-3, weight_decay=0.01)
    optimizer = gossamer.distribute(model, inner, gossamer.MuLoCo(period=16))
    # command line: gossamer train --optimizer muon --lr 0.003 --algorithm muloco
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["MuonWithAdamW", "muon", "muon_parameters"]


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters of ``model``: the weights of its ``nn.Linear``
    layers but the last (the output head), and everything else."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    hidden = {id(m.weight) for m in linears[:-1] if m.weight.requires_grad}
    # a weight tied to a parameter AdamW takes (an embedding) stays with AdamW
    others = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    hidden -= others
    trained = [p for p in model.parameters() if p.requires_grad]
    return ([p for p in trained if id(p) in hidden],
            [p for p in trained if id(p) not in hidden])


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``muon_params`` and ``torch.optim.AdamW`` over
    ``adamw_params``, as one optimizer.

    Args:
        muon_params: 2-D matrices (any other shape is a ValueError naming it).
        adamw_params: every other parameter.
        lr: the learning rate of both (default 1e-3); Muon adjusts it per matrix by
            ``adjust_lr_fn``.
        weight_decay: decoupled weight decay of both (default 0.01, AdamW's).
        momentum, nesterov, ns_steps, adjust_lr_fn: Muon's (defaults 0.95, True, 5,
            ``"match_rms_adamw"``: an AdamW learning rate; ``"original"``: Keller Jordan's
            ``sqrt(max(1, A / B))``, for learning rates near 0.02).
        betas, eps: AdamW's (defaults (0.9, 0.999), 1e-8).
    """

    def __init__(self, muon_params: Iterable[nn.Parameter],
                 adamw_params: Iterable[nn.Parameter], *, lr: float = 1e-3,
                 weight_decay: float = 0.01, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, adjust_lr_fn: str | None = "match_rms_adamw",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        matrices, rest = list(muon_params), list(adamw_params)
        for p in matrices:
            if p.ndim != 2:
                raise ValueError(f"muon_params: Muon takes 2-D matrices only, got a parameter "
                                 f"of shape {tuple(p.shape)}; give it to adamw_params")
        if not matrices and not rest:
            raise ValueError("muon_params and adamw_params: no parameters to optimise")
        inners: list[torch.optim.Optimizer] = []
        if matrices:
            inners.append(torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay,
                                           momentum=momentum, nesterov=nesterov,
                                           ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn))
            inners[-1].param_groups[0]["muon"] = True
        if rest:
            inners.append(torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps,
                                            weight_decay=weight_decay))
            inners[-1].param_groups[0]["muon"] = False
        # the inner optimizers' groups are this optimizer's (a schedule's lr reaches them)
        super().__init__([inner.param_groups[0] for inner in inners], {"lr": lr})
        self._inners = inners
        self._link()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_inners", None) is not None:  # after construction
            raise ValueError("param_group: MuonWithAdamW's two groups are fixed when it is "
                             "built; make a new one over every parameter instead")
        super().add_param_group(param_group)

    def _link(self) -> None:
        """Each inner optimizer's group and state are this optimizer's own objects."""
        for inner, group in zip(self._inners, self.param_groups, strict=True):
            inner.param_groups = [group]
            inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inners:
            inner.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()  # loading made new group dicts and a new state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_inners" in state:
            self._link()


def muon(model: nn.Module, **options: Any) -> MuonWithAdamW:
    """A :class:`MuonWithAdamW` over ``model``'s trainable parameters, split by
    :func:`muon_parameters`; ``options`` are its keywords (``lr``, ``weight_decay``...).

    Example::

        optimizer = gossamer.muon(model, lr=3e-3)
    """
    matrices, rest = muon_parameters(model)
    return MuonWithAdamW(matrices, rest, **options)
