"""MuLoCo as one sequential program over every worker, written from the paper.

Therien, Huang, Rish, Belilovsky, "MuLoCo: Muon is a practical inner optimizer for DiLoCo"
(arXiv 2505.23725): Algorithm 1 (DiLoCo's, Douillard et al. 2023) with the compression and
error feedback of its Section 3. The inner optimizer is torch's Muon on the hidden matrices and
torch's AdamW on the rest, built here on each worker's own parameter lists (not through
gossamer's combined optimizer); the quantiser, the accumulator, the average and the outer
Nesterov SGD are written out below, element by element where the paper defines them so.

``authors_code=True`` follows instead the arithmetic of the authors' code
(github.com/facebookresearch/MuLoCo at 15ee278b6018c5fbdb6f779b71d22fabf6984b67,
``torchtitan/torchtitan/components/quantized_outer_sgd.py``: ``QuantizedOuterSGD._save_grads``
adds ``lr * Delta`` to the error buffer, and ``step`` runs ``torch.optim.SGD`` with ``lr`` on the
averaged reconstruction).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from oracles.statistical import quantise


def muloco(make_model: Callable[[], nn.Module], batch: Callable[[int, int], tuple],
           loss_fn: Callable, *, workers: int, steps: int, period: int, inner_lr: float,
           bits: int, beta: float, outer_lr: float, momentum: float = 0.9,
           sigmas: float = 6.0, authors_code: bool = False) -> list[list[torch.Tensor]]:
    """Every worker's flat parameters after every step."""
    models = [make_model() for _ in range(workers)]
    inner = []
    for m in models:  # Muon for the hidden matrices, AdamW for the rest (the paper, Sec. 4)
        linears = [x for x in m.modules() if isinstance(x, nn.Linear)]
        hidden = [x.weight for x in linears[:-1]]
        rest = [p for p in m.parameters() if all(p is not h for h in hidden)]
        inner.append([torch.optim.Muon(hidden, lr=inner_lr, weight_decay=0.01,
                                       adjust_lr_fn="match_rms_adamw"),
                      torch.optim.AdamW(rest, lr=inner_lr, weight_decay=0.01)])
    theta = [p.detach().clone() for p in models[0].parameters()]  # theta^(0)
    errors = [[torch.zeros_like(t) for t in theta] for _ in range(workers)]
    buffers = [None] * len(theta)  # the outer SGD's momentum
    trajectory = []
    for step in range(steps):
        for r, m in enumerate(models):  # one inner step on each worker's data
            for opt in inner[r]:
                opt.zero_grad()
            x, y = batch(r, step)
            loss_fn(m(x), y).backward()
            for opt in inner[r]:
                opt.step()
        if (step + 1) % period == 0:  # the round's end
            sent = []
            for r, m in enumerate(models):
                mine = []
                for i, p in enumerate(m.parameters()):
                    delta = theta[i] - p.detach()                 # Delta_r
                    if authors_code:
                        e = beta * errors[r][i] + outer_lr * delta
                    else:
                        e = beta * errors[r][i] + delta           # e_r = beta e_r + Delta_r
                    d = e if bits == 32 else quantise(e, bits, sigmas)  # D_r = Q(e_r)
                    errors[r][i] = e - d                          # e_r = e_r - D_r
                    mine.append(d)
                sent.append(mine)
            for i in range(len(theta)):
                g = sum(s[i] for s in sent) / workers            # Delta = mean_r D_r
                # OuterOpt: SGD with Nesterov momentum (torch's SGD, dampening 0)
                buffers[i] = g.clone() if buffers[i] is None else momentum * buffers[i] + g
                theta[i] = theta[i] - outer_lr * (g + momentum * buffers[i])
            for m in models:  # every worker continues from theta^(t)
                with torch.no_grad():
                    for p, t in zip(m.parameters(), theta, strict=True):
                        p.copy_(t)
        trajectory.append([torch.cat([p.detach().flatten() for p in m.parameters()])
                           for m in models])
    return trajectory
