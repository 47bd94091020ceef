"""Oracle: top-k SGD with error feedback, reduced by a partitioned sparse all-reduce.

Written from the papers, as one sequential loop over the workers (float64):

- Ok-Topk, Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning" (PPoPP
  2022), section 3.1 (Algorithm 1): the index space is split into one region per worker;
  "split and reduce": every worker's sparse entries of region ``j`` go to worker ``j``, which
  sums them; "balance and allgatherv": the entries each owner selects from its reduced region
  are all-gathered, so that every worker holds the same sparse sum; section 4 (Algorithm 2):
  the residual keeps what a worker accumulated minus its local values that were selected
  globally.
- gTop-k, Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k
  Sparsification for Low Bandwidth Networks" (ICDCS 2019): the selection keeps the ``k``
  largest magnitudes of the sum of the workers' top-k vectors, and the local top-k entries
  that are not in the global selection go back to the residual.

The selection, per owner, is the one :mod:`gossamer.compress.sparse_allreduce` documents:
among the non-zero sums of its region, the region's share of the per-worker target,
``q_j = ceil(K |R_j| / N)``, of largest magnitude (ties: the lower position), and every sum
of magnitude at least the global threshold ``theta`` (Ok-Topk's selection with the threshold
of the previous iteration), at most ``max(q_j, K)`` in all, the largest; ``K = sum_t ceil(ratio
numel_t)``, and ``theta`` is the ``K``-th largest magnitude kept at the previous step (none at
the first step: the quotas alone; when ``C < K`` were kept, the smallest kept magnitude times
``C / K``). The tensors of one step are laid end to end in the order of their names (one
bucket), regions ``R_j = [j N // n, (j + 1) N // n)``. Sums are taken in rank order. The
optimizer is ``torch.optim.SGD`` (:func:`oracles.compression.sgd_step`).

Hierarchy (``node_size``): the members of a node first average their gradients exactly, then
the node averages take part in the loop above as one worker per node (each member holds the
same memory, so one residual per node stands for all).
"""

from __future__ import annotations

import math

import torch

from oracles.compression import GradFn, Params, selected_count, sgd_step


def owner_selection(total: torch.Tensor, target: int, workers: int,
                    threshold: float | None = None) -> list[int]:
    """The positions every owner keeps of the summed vector ``total`` (length N)."""
    numel = total.numel()
    kept: list[int] = []
    for j in range(workers):
        start, end = j * numel // workers, (j + 1) * numel // workers
        quota = math.ceil(target * (end - start) / numel) if end > start else 0
        candidates = [i for i in range(start, end) if total[i] != 0]
        candidates.sort(key=lambda i: (-abs(float(total[i])), i))  # stable: lower position
        take = quota
        if threshold is not None:
            above = [i for i in candidates if abs(float(total[i])) >= threshold]
            take = min(max(quota, len(above)), max(quota, target))
        kept += candidates[:take]
    return sorted(kept)


def next_threshold(total: torch.Tensor, kept: list[int], target: int) -> float | None:
    """The ``target``-th largest magnitude among the kept sums; if fewer were kept, the
    smallest times ``len(kept) / target``; None if none was."""
    magnitudes = sorted((abs(float(total[i])) for i in kept), reverse=True)
    if not magnitudes or target < 1:
        return None
    if len(magnitudes) >= target:
        return magnitudes[target - 1]
    return magnitudes[-1] * len(magnitudes) / target


def topk_sparse_allreduce_sgd(
    x0: Params, grad: GradFn, *, workers: int, steps: int, lr: float, ratio: float,
    momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
    node_size: int = 1,
) -> list[list[Params]]:
    """``trajectory[k][w]``: worker w's parameters after step ``k + 1``."""
    names = sorted(x0)
    numels = [x0[name].numel() for name in names]
    offsets = [sum(numels[:t]) for t in range(len(names))]
    target = sum(selected_count(ratio, k) for k in numels)
    nodes = workers // node_size
    x = [{k: v.clone() for k, v in x0.items()} for _ in range(workers)]
    b: list[dict[str, torch.Tensor | None]] = [dict.fromkeys(x0) for _ in range(workers)]
    residual = [torch.zeros(sum(numels), dtype=torch.float64) for _ in range(nodes)]
    trajectory = []
    threshold: float | None = None
    for step in range(steps):
        grads = [grad(w, step, x[w]) for w in range(workers)]
        # exact average inside each node (node_size 1: the worker's own gradient)
        node_grads = []
        for node in range(nodes):
            members = [grads[node * node_size + m] for m in range(node_size)]
            flat = []
            for name in names:
                total = members[0][name].reshape(-1).clone()
                for g in members[1:]:
                    total = total + g[name].reshape(-1)
                flat.append(total / node_size)
            node_grads.append(torch.cat(flat))
        # compensate; each node's top-k per tensor
        compensated = [node_grads[i] + residual[i] for i in range(nodes)]
        selected = []
        for c in compensated:
            positions = []
            for offset, numel in zip(offsets, numels, strict=True):
                part = c[offset:offset + numel]
                order = sorted(range(numel), key=lambda i, p=part: -abs(float(p[i])))
                positions += [offset + i for i in order[:selected_count(ratio, numel)]]
            selected.append(positions)
        # split and reduce: owners sum the entries of their region, in rank order
        total = torch.zeros(sum(numels), dtype=torch.float64)
        for i in range(nodes):
            for position in selected[i]:
                total[position] = total[position] + compensated[i][position]
        kept_list = owner_selection(total, target, nodes, threshold)
        threshold = next_threshold(total, kept_list, target)
        kept = set(kept_list)
        average = torch.zeros_like(total)
        for position in kept:
            average[position] = total[position] / nodes
        # error feedback: only the entries an owner kept leave a node's residual
        for i in range(nodes):
            residual[i] = compensated[i].clone()
            for position in selected[i]:
                if position in kept:
                    residual[i][position] = 0.0
        for w in range(workers):
            for name, offset, numel in zip(names, offsets, numels, strict=True):
                avg = average[offset:offset + numel].view_as(x0[name])
                x[w][name], b[w][name] = sgd_step(
                    x[w][name], b[w][name], avg, lr=lr, momentum=momentum,
                    nesterov=nesterov, weight_decay=weight_decay)
        trajectory.append([{k: v.clone() for k, v in xw.items()} for xw in x])
    return trajectory
