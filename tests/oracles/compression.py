"""Oracles: compressed AllReduce-SGD, Deep Gradient Compression and error feedback.

n workers hold their parameters as dicts of float64 tensors (name -> tensor) and step in one
loop. Every step each worker computes its gradient at its own parameters; what it sends is
formed from it as the papers say; every worker decodes everyone's message and averages; each
then takes the optimizer step. The averages are the same on every worker, so the replicas stay
equal, but each worker's memory (residual, momentum, velocity) is its own.

**Error feedback** (:func:`ef_sgd`). The library adds the residual to the gradient, before the
learning rate, and hands the average to ``torch.optim.SGD`` (with its momentum and weight
decay): Vogels, Karimireddy & Jaggi, "PowerSGD" (NeurIPS 2019), Algorithm 2 ("distributed
error-feedback SGD with momentum"), its compression and aggregation steps::

    p_w = g_w + e_w;   C(p_w) sent;   e_w = p_w - decompress(C(p_w));   avg = (1/n) sum_w C(p_w)

then ``torch.optim.SGD`` on ``avg`` (``d = avg + wd x; b = mu b + d; x -= lr b``; Nesterov:
``x -= lr (d + mu b)``). This is Seide et al. (2014)'s form of error feedback; with a constant
learning rate ``lr``, no momentum and a compressor that commutes with scaling (top-k, random-k,
PowerSGD) it is EF-SGD, Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes" (ICML 2019), Algorithm 2 (``p = lr g + e; delta = C(p); x -= delta;
e = p - delta``), whose ``e`` is ``lr`` times this one. Without error feedback ``e`` stays 0.

The compressors, for one tensor ``p`` (flattened) of one worker:

- top-k (Aji & Heafield 2017): the ``k = ceil(ratio * numel)`` entries of largest magnitude;
- random-k (Stich et al., "Sparsified SGD with Memory", NeurIPS 2018, ``rand_k``): the entries
  at ``k`` distinct positions, a uniform random k-subset (drawn without replacement), the same
  on every worker, from a generator seeded by ``(seed, name, step)`` (the seed and the draws
  are replayed here, see :func:`seeded_generator` and :func:`random_subset`);
- QSGD (Alistarh et al., NeurIPS 2017, Section 3.1, the stochastic quantizer
  ``Q_s(v_i) = ||v||_2 sgn(v_i) xi_i(v, s)`` with ``xi_i = (l + 1) / s`` with probability
  ``s |v_i| / ||v|| - l`` and ``l / s`` otherwise, ``l = floor(s |v_i| / ||v||)``), over buckets
  of ``bucket_size`` entries (the paper's bucketing), one norm per bucket; the
  uniform draws replayed from a generator seeded by ``(seed, name, step, worker)``;
- PowerSGD (Vogels et al. 2019, Algorithm 1, rank-r compression) on each tensor viewed as an
  ``n0 x m`` matrix: ``P = (1/n) sum_w M_w Q``, ``P^ = orthogonalize(P)`` (Gram-Schmidt),
  ``Q_w = M_w^T P^``, ``Q = (1/n) sum_w Q_w``; the average is ``P^ Q^T`` and what worker w
  sent, for its error feedback, ``P^ Q_w^T``. ``Q`` starts from a standard normal draw seeded
  by ``(seed, name, step)`` and, with warm start, the next step starts from this step's ``Q``.
  Vectors, and matrices whose factors would not be smaller (``(n0 + m) r >= n0 m``), are
  averaged dense;
- fp16 / bf16, in the order of DDP's ``fp16_compress_hook`` (``buffer.to(dtype).div_(n)``,
  then an all-reduce): every entry cast to the narrow type (clamped to its range), divided by
  n in that type, clamped to :func:`share_limit` so that the sum cannot overflow, and the
  workers' shares summed in that type in rank order (as an all-reduce of the narrow tensors
  does): the sum is the average. What a worker sent, for its error feedback, is n times its
  share.

Values travel in the model's precision (float64 here) unless a compressor narrows them (fp16
values, the fp16 and bf16 compressors): :func:`wire` rounds them so. Tensors a compressor does
not take are averaged dense.

**DGC** (:func:`dgc_sgd`): Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression" (ICLR
2018). Algorithm 1 (gradient sparsification with local accumulation on node k) with the
momentum correction of Section 3.2 (``u = m u + g; v = v + u``; Nesterov ``u = m (u + g); v =
v + u + g``, as the authors' code), local gradient clipping of Section 3.2 (Algorithm 1
accumulates node k's share ``G_k = g_k / n`` of the averaged gradient, and Section 3.2 clips
it at the global threshold times ``n ** -0.5``, the norm of one of n i.i.d. shares: each
tensor's share is clipped so before it is accumulated, and ``g_k = n G_k``), momentum factor
masking of Section 3.3 (``u`` cleared where ``v`` was sent) and the warm-up of Section 3.3 (the
density falling exponentially from 25% to ``ratio``: ``0.25 (ratio / 0.25) ** (s / stages)``
in stage ``s`` of ``stages``, stage ``s = step * stages // warmup_steps``). The selection is the
top-k of ``|v|`` (zeros never sent) for tensors below 2048 entries or where the threshold
sample would be a quarter of the tensor, which is what the library does there; otherwise the
library's documented threshold rule, written out plainly in :func:`dgc_threshold_select`.
Tensors of fewer than 2 dimensions are averaged dense (``v`` is sent whole). The optimizer has
no momentum of its own (DGC took it over) and steps ``x -= lr avg``. Weight decay: by default
each worker adds ``b = m b + wd x`` (Nesterov ``wd x + m b``) to the average after the
exchange, as the authors' optimizer (``DGCSGD``) does; with ``decay_in_gradient`` it is added
to the gradient before clipping and momentum correction instead, and so is sparsified.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import torch

Params = dict[str, torch.Tensor]
#: ``grad(worker, step, params)``: worker ``worker``'s gradient at ``params``, by name.
GradFn = Callable[[int, int, Params], Params]
#: What one step of a compressor does with one tensor of every worker: from the compensated
#: tensors ``p_w`` (same shape), each worker's decompressed message and the average.
Exchange = Callable[[str, int, list[torch.Tensor]], tuple[list[torch.Tensor], torch.Tensor]]

_TINY = 2.0**-149  # the smallest positive float32: DGC never sends a zero


def seeded_generator(seed: int, *parts: object) -> torch.Generator:
    """A CPU generator seeded as the library seeds its draws: an 8-byte BLAKE2b digest of
    ``"seed/part/part..."``, little-endian, shifted right by one bit."""
    text = "/".join(str(p) for p in (seed, *parts)).encode()
    value = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
    return torch.Generator().manual_seed(value)


def selected_count(ratio: float, numel: int) -> int:
    """``k = ceil(ratio * numel)``, at least 1, at most ``numel`` (the product rounded down by
    1e-12 first, so that 0.05 * 120 is 6 and not 7)."""
    return min(numel, max(1, math.ceil(ratio * numel * (1 - 1e-12))))


def wire(t: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``t`` as it travels in ``dtype``, back in float64 (clamped to the range of ``dtype``)."""
    limit = torch.finfo(dtype).max
    return t.clamp(-limit, limit).to(dtype).to(torch.float64)


def sgd_step(x: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor, *, lr: float,
             momentum: float, nesterov: bool, weight_decay: float
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``torch.optim.SGD`` written out (dampening 0): ``d = g + wd x``, ``b = mu b + d`` (the
    first ``b`` is ``d``), ``x -= lr b`` (Nesterov: ``x -= lr (d + mu b)``)."""
    d = g + weight_decay * x
    if momentum:
        b = d.clone() if b is None else momentum * b + d
        d = d + momentum * b if nesterov else b
    return x - lr * d, b


def mean_of(messages: Sequence[torch.Tensor]) -> torch.Tensor:
    """The workers' messages summed in rank order, over n."""
    total = messages[0].clone()
    for m in messages[1:]:
        total = total + m
    return total / len(messages)


# -- the compressors with error feedback ------------------------------------------------------


def dense() -> Exchange:
    """No compression: every entry as it is."""
    def exchange(name: str, step: int, ps: list[torch.Tensor]):
        sent = [wire(p) for p in ps]
        return sent, mean_of(sent)
    return exchange


def top_k(ratio: float, fp16_values: bool = False) -> Exchange:
    """The ``ceil(ratio * numel)`` entries of largest magnitude of each worker's tensor."""
    dtype = torch.float16 if fp16_values else torch.float64

    def exchange(name: str, step: int, ps: list[torch.Tensor]):
        sent = []
        for p in ps:
            flat = p.reshape(-1)
            chosen = torch.topk(flat.abs(), selected_count(ratio, flat.numel())).indices
            s = torch.zeros_like(flat)
            s[chosen] = wire(flat[chosen], dtype)
            sent.append(s.view_as(p))
        return sent, mean_of(sent)
    return exchange


def random_subset(numel: int, k: int, generator: torch.Generator) -> list[int]:
    """``k`` distinct positions of ``range(numel)``, a uniform random subset, with the
    library's draws replayed: the smaller of the subset and its complement (``m`` positions)
    is drawn, and the complement's complement taken.

    - ``m <= numel / 4``: uniform draws with replacement, in batches of ``torch.randint`` of
      ``need + need * (have + need) // (numel - have - need) + 16`` (``have`` distinct so far,
      ``need`` more wanted), until at least ``m`` distinct ones; then a uniform random ``m`` of
      them: the first ``distinct - m`` places of a ``torch.randperm`` over the distinct values,
      in ascending order, are dropped;
    - else the first ``m`` of ``torch.randperm(numel)``.
    """
    m = min(k, numel - k)
    if m == 0:
        return list(range(k))
    if 4 * m <= numel:
        distinct: set[int] = set()
        while len(distinct) < m:
            have, need = len(distinct), m - len(distinct)
            batch = need + need * (have + need) // max(1, numel - have - need) + 16
            distinct.update(torch.randint(numel, (batch,), generator=generator).tolist())
        picked = sorted(distinct)
        if len(picked) > m:
            dropped = set(torch.randperm(len(picked), generator=generator)[:len(picked) - m]
                          .tolist())
            picked = [v for i, v in enumerate(picked) if i not in dropped]
    else:
        picked = torch.randperm(numel, generator=generator)[:m].tolist()
    if m == k:
        return sorted(picked)
    left_out = set(picked)
    return [i for i in range(numel) if i not in left_out]


def random_k(ratio: float, seed: int) -> Exchange:
    """The entries at ``k`` distinct positions every worker draws alike, from
    ``(seed, name, step)``."""
    def exchange(name: str, step: int, ps: list[torch.Tensor]):
        numel = ps[0].numel()
        k = selected_count(ratio, numel)
        chosen = torch.tensor(random_subset(numel, k, seeded_generator(seed, name, step)),
                              dtype=torch.int64)
        assert chosen.numel() == k
        sent = []
        for p in ps:
            s = torch.zeros(numel, dtype=p.dtype)
            s[chosen] = wire(p.reshape(-1)[chosen])
            sent.append(s.view_as(p))
        return sent, mean_of(sent)
    return exchange


def qsgd(levels: int, bucket_size: int, seed: int) -> Exchange:
    """QSGD's stochastic quantizer ``Q_s`` (Alistarh et al. 2017, eq. 2) on buckets of
    ``bucket_size`` entries: ``Q_s(v_i) = ||v|| sgn(v_i) xi_i / s`` with
    ``xi_i = l + 1`` with probability ``r - l`` (``r = s |v_i| / ||v||``, ``l = floor(r)``), else
    ``l``. Written signed: ``sgn(v_i) xi_i = floor(s v_i / ||v|| + u_i)`` for ``u_i`` uniform on
    [0, 1) (for ``v_i >= 0`` it exceeds ``l`` when ``u_i >= 1 - (r - l)``, for ``v_i < 0`` when
    ``u_i < r - l``: probability ``r - l`` either way). Worker w's ``u_i`` from
    ``(seed, name, step, w)``: a random permutation ``pi`` of ``0..p-1`` and a shift ``v``, in that
    order, ``u_i = (pi(i mod p) + v) / p`` with ``p = min(entries, 2^16)``."""
    s = levels

    def quantize(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        flat = p.reshape(-1)
        n = flat.numel()
        period = max(1, min(n, 2**16))
        perm = torch.randperm(period, generator=generator, dtype=torch.float64)
        shift = torch.rand((), generator=generator, dtype=torch.float64)
        u = ((perm + shift) / period).repeat(math.ceil(n / period))[:n]
        values = torch.zeros(n, dtype=torch.float64)
        for first in range(0, n, bucket_size):
            v = flat[first:first + bucket_size].to(torch.float64)
            norm = torch.linalg.vector_norm(v)
            if norm == 0:
                continue
            signed = torch.floor(s * v / norm + u[first:first + bucket_size]).clamp(-s, s)
            values[first:first + bucket_size] = norm * signed / s
        return values.to(p.dtype).view_as(p)

    def exchange(name: str, step: int, ps: list[torch.Tensor]):
        sent = [quantize(p, seeded_generator(seed, name, step, w)) for w, p in enumerate(ps)]
        return sent, mean_of(sent)
    return exchange


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning those of ``p``, by Gram-Schmidt (PowerSGD's choice)."""
    q = p.clone()
    for j in range(q.shape[1]):
        for i in range(j):
            q[:, j] -= (q[:, i] @ q[:, j]) * q[:, i]
        q[:, j] /= torch.linalg.vector_norm(q[:, j])
    return q


def power_sgd(rank: int, seed: int, warm_start: bool = True) -> Exchange:
    """PowerSGD's Algorithm 1, one power iteration per step, with ``Q`` kept for warm start."""
    memory: dict[str, torch.Tensor] = {}  # Q of each tensor, shared by every worker

    def exchange(name: str, step: int, ps: list[torch.Tensor]):
        n0 = ps[0].shape[0] if ps[0].dim() else 1
        m = ps[0].numel() // max(n0, 1)
        r = min(rank, n0, m)
        if ps[0].dim() < 2 or (n0 + m) * r >= n0 * m:
            return dense()(name, step, ps)
        mats = [p.reshape(n0, m) for p in ps]
        q = memory.get(name) if warm_start else None
        if q is None:
            q = torch.randn(m, r, generator=seeded_generator(seed, name, step)).double()
        p_hat = orthogonalize(mean_of([mat @ q for mat in mats]))
        q_own = [mat.T @ p_hat for mat in mats]
        q = memory[name] = mean_of(q_own)
        sent = [(p_hat @ qw.T).view_as(p) for qw, p in zip(q_own, ps, strict=True)]
        return sent, (p_hat @ q.T).view_as(ps[0])
    return exchange


def share_limit(dtype: torch.dtype, n: int) -> float:
    """The largest value of ``dtype`` at most ``max / (n (1 + eps / 2) ** (n - 1))``: n shares
    of at most this magnitude add up, rounding after each addition, to at most ``max``."""
    info = torch.finfo(dtype)
    bound = info.max / (n * (1 + info.eps / 2) ** (n - 1))
    limit = torch.tensor(bound, dtype=torch.float64).to(dtype)
    while float(limit) > bound:
        limit = torch.nextafter(limit, torch.zeros_like(limit))
    return float(limit)


def half_precision(dtype: torch.dtype) -> Exchange:
    """DDP's ``fp16_compress_hook`` (``bf16_compress_hook``): every entry cast to ``dtype``,
    then divided by n in ``dtype`` (and clamped to :func:`share_limit`); the shares summed in
    ``dtype`` in rank order (an all-reduce of the narrow tensors) are the average."""
    def exchange(name: str, step: int, ps: list[torch.Tensor]):
        n = len(ps)
        limit = share_limit(dtype, n)
        shares = [(wire(p, dtype).to(dtype) / n).clamp(-limit, limit) for p in ps]
        total = shares[0].clone()
        for t in shares[1:]:
            total = total + t
        return [n * t.double() for t in shares], total.double()
    return exchange


def ef_sgd(x0: Params, grad: GradFn, exchange: Exchange, *, workers: int, steps: int,
           lr: float, momentum: float = 0.0, nesterov: bool = False,
           weight_decay: float = 0.0, error_feedback: bool = True) -> list[list[Params]]:
    """Compressed AllReduce-SGD with error feedback (or without: ``error_feedback=False``).

    Returns ``trajectory[k][w]``: worker w's parameters after step ``k + 1``.
    """
    x = [{k: v.clone() for k, v in x0.items()} for _ in range(workers)]
    e = [{k: torch.zeros_like(v) for k, v in x0.items()} for _ in range(workers)]
    b: list[dict[str, torch.Tensor | None]] = [dict.fromkeys(x0) for _ in range(workers)]
    trajectory = []
    for step in range(steps):
        grads = [grad(w, step, x[w]) for w in range(workers)]
        averages = {}
        for name in sorted(x0):
            p = [grads[w][name] + e[w][name] for w in range(workers)]
            sent, averages[name] = exchange(name, step, p)
            if error_feedback:
                for w in range(workers):
                    e[w][name] = p[w] - sent[w]
        for w in range(workers):
            for name, avg in averages.items():
                x[w][name], b[w][name] = sgd_step(
                    x[w][name], b[w][name], avg, lr=lr, momentum=momentum, nesterov=nesterov,
                    weight_decay=weight_decay)
        trajectory.append([{k: v.clone() for k, v in xw.items()} for xw in x])
    return trajectory


# -- Deep Gradient Compression ---------------------------------------------------------------


def warmup_density(ratio: float, step: int, warmup_steps: int, stages: int) -> float:
    """Section 3.3's warm-up: from 25% down to ``ratio``, exponentially, in ``stages`` stages."""
    if warmup_steps <= 0 or step >= warmup_steps or ratio >= 0.25:
        return ratio
    stage = step * stages // warmup_steps
    return max(ratio, 0.25 * (ratio / 0.25) ** (stage / stages))


def fitted_warmup_steps(total_steps: int) -> int:
    """The warm-up's length when it is not given: the paper's 4 epochs of a 90-164 epoch run
    do not fit a run of a few epochs, so the library spreads the same schedule over the run's
    first quarter (rounded, at least one step)."""
    return max(1, round(total_steps / 4))


def dgc_threshold_select(magnitude: torch.Tensor, k: int, density: float, samples: int, *,
                         max_adaptations: int, generator: torch.Generator) -> torch.Tensor:
    """The library's threshold rule for a large tensor, written out (positions, flat).

    1. The sample: runs of 8 consecutive entries, every ``stride`` runs from a random start;
       the threshold is its ``ceil(density * size)``-th largest magnitude.
    2. Every entry whose magnitude reaches the threshold is selected.
    3. While fewer than 0.8 k are selected (at most ``max_adaptations`` times) the sample rank
       grows by ``k / max(selected, k / 8)`` and the threshold falls to that rank of the
       sample's top ``8 ceil(density * size)``; still short, it falls to the k-th largest of
       the maxima of blocks of 64 entries.
    4. More than 1.3 k selected: the k largest of them.
    """
    numel = magnitude.numel()
    runs = magnitude[: numel // 8 * 8].view(-1, 8)
    stride = max(1, runs.shape[0] * 8 // samples)
    start = int(torch.randint(stride, (1,), generator=generator)) if stride > 1 else 0
    sample = runs[start::stride].reshape(-1)
    sample_k = min(sample.numel(), max(1, math.ceil(density * sample.numel())))
    order = torch.sort(sample, descending=True).values
    top = order[: min(sample.numel(), 8 * sample_k)]
    rank = sample_k
    threshold = max(float(order[rank - 1]), _TINY)
    chosen = (magnitude >= threshold).nonzero().view(-1)
    adaptations = 0
    while chosen.numel() < 0.8 * k and adaptations < max_adaptations and threshold > _TINY:
        adaptations += 1
        rank = math.ceil(rank * k / max(chosen.numel(), k / 8))
        if rank <= top.numel():
            threshold = max(float(top[rank - 1]), _TINY)
        elif top.numel() == sample.numel():
            threshold = _TINY
        else:
            threshold = max(float(top[-1]), _TINY)
        chosen = (magnitude >= threshold).nonzero().view(-1)
    if chosen.numel() < 0.8 * k and threshold > _TINY:
        peaks = magnitude[: numel // 64 * 64].view(-1, 64).amax(dim=1)
        threshold = max(float(torch.sort(peaks, descending=True).values[min(k, peaks.numel())
                                                                        - 1]), _TINY)
        chosen = (magnitude >= threshold).nonzero().view(-1)
    if chosen.numel() > 1.3 * k:
        chosen = chosen[torch.topk(magnitude[chosen], k).indices]
    return chosen


def dgc_select(v: torch.Tensor, density: float, *, sample_ratio: float, max_adaptations: int,
               generator: torch.Generator) -> torch.Tensor:
    """The flat positions of ``v`` that DGC sends at ``density``."""
    flat = v.reshape(-1)
    numel = flat.numel()
    k = selected_count(density, numel)
    samples = max(math.ceil(sample_ratio * numel), math.ceil(16 / density))
    if 4 * samples >= numel or numel < 2048:
        chosen = torch.topk(flat.abs(), k).indices
        return chosen[flat[chosen] != 0]  # zeros are never sent
    return dgc_threshold_select(flat.abs(), k, density, samples,
                                max_adaptations=max_adaptations, generator=generator)


def dgc_sgd(x0: Params, grad: GradFn, *, workers: int, steps: int, lr: float, ratio: float,
            momentum: float, nesterov: bool = False, weight_decay: float = 0.0,
            decay_in_gradient: bool = False, masking: bool = True,
            clip_norm: float | None = None, warmup_steps: int = 0, warmup_stages: int = 4,
            sample_ratio: float = 0.01, max_adaptations: int = 3, fp16_values: bool = True,
            seed: int = 0) -> list[list[Params]]:
    """DGC with momentum SGD on n workers (see the module docs); ``clip_norm`` is the global
    threshold (of the averaged gradient), each worker clips its share ``g / n`` at
    ``clip_norm / sqrt(n)`` (Algorithm 1 and Section 3.2).

    Returns ``trajectory[k][w]``: worker w's parameters after step ``k + 1``.
    """
    x = [{k: t.clone() for k, t in x0.items()} for _ in range(workers)]
    u = [{k: torch.zeros_like(t) for k, t in x0.items()} for _ in range(workers)]
    v = [{k: torch.zeros_like(t) for k, t in x0.items()} for _ in range(workers)]
    decay = [{k: torch.zeros_like(t) for k, t in x0.items()} for _ in range(workers)]
    share_clip = None if clip_norm is None else clip_norm / math.sqrt(workers)
    values = torch.float16 if fp16_values else torch.float64
    trajectory = []
    for step in range(steps):
        density = warmup_density(ratio, step, warmup_steps, warmup_stages)
        sent: dict[str, list[torch.Tensor]] = {name: [] for name in x0}
        for w in range(workers):
            g = grad(w, step, x[w])
            for name in sorted(x0):
                gw = g[name] + weight_decay * x[w][name] if decay_in_gradient else g[name]
                if share_clip is not None:  # the share G_k = g / n, clipped, times n
                    share = gw / workers
                    norm = float(torch.linalg.vector_norm(share))
                    if norm > share_clip:
                        gw = share * (share_clip / norm) * workers
                uw, vw = u[w][name], v[w][name]
                if nesterov:
                    uw = momentum * (uw + gw)
                    vw = vw + uw + gw
                else:
                    uw = momentum * uw + gw
                    vw = vw + uw
                if vw.dim() < 2:  # dense: v is sent whole
                    s = wire(vw)
                    vw = vw - s
                else:
                    chosen = dgc_select(vw, density, sample_ratio=sample_ratio,
                                        max_adaptations=max_adaptations,
                                        generator=seeded_generator(seed, name, step))
                    s = torch.zeros(vw.numel(), dtype=vw.dtype)
                    s[chosen] = wire(vw.reshape(-1)[chosen], values)
                    s = s.view_as(vw)
                    vw = vw - s  # what was sent leaves v; its rounding (fp16) stays
                    if masking:
                        uw = uw.clone()
                        uw.view(-1)[chosen] = 0
                u[w][name], v[w][name] = uw, vw
                sent[name].append(s)
        averages = {name: mean_of(messages) for name, messages in sent.items()}
        for w in range(workers):
            for name, avg in averages.items():
                if weight_decay and not decay_in_gradient:  # the worker's own, after
                    d = weight_decay * x[w][name]
                    decay[w][name] = momentum * decay[w][name] + d
                    avg = avg + (d + momentum * decay[w][name] if nesterov else decay[w][name])
                x[w][name] = x[w][name] - lr * avg
        trajectory.append([{k: t.clone() for k, t in xw.items()} for xw in x])
    return trajectory
