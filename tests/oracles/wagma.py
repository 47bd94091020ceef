"""WAGMA-SGD as a sequential program that replays a recorded order of rounds.

Li, Ben-Nun, Nadiradze, Di Girolamo, Dryden, Alistarh, Hoefler, "Breaking (Global) Barriers in
Parallel Stochastic Optimization with Wait-Avoiding Group Averaging" (IEEE TPDS 2021),
Algorithm 1: in iteration t worker i computes its gradient at its model x_t, its group G_t
averages models in a (wait-avoiding) group allreduce, and the gradient is applied to the
average::

    x_{t+1} = (1 / |G_t|) sum_{j in G_t} x_j^{(t, i)} - lr * grad F_i(x_t)

where x_j^{(t, i)} is j's model for round t when j has arrived, else the newest model j
published (at most tau rounds older: the staleness bound); every K-th round is an exact
average of all workers (a global allreduce). A worker publishes its model for a round as soon
as it has it: the model it starts that round with.

Which stale model a member contributes depends on timing; the oracle takes it from the
library's record: ``events[i]`` lists ``(step, round, kind, {member: stamp}, ...)`` per
step, with kind ``"group"`` (the stamps of the models averaged) or ``"global"``. A worker's
model for round ``r`` is the one its step of round ``r - 1`` ends with (a worker that skips
from round ``r`` to ``q > r`` publishes that same model for the rounds it skipped, under the
stamp ``r``); a global round's all-reduce sets everyone's model for that round.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def run(x0: list[torch.Tensor], grad: Callable[[int, torch.Tensor], torch.Tensor], lr: float,
        steps: int, events: list[list[tuple]]
        ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Returns every worker's model after each step, and at the end: a worker done with its
    steps pauses, and takes part in the global rounds of those still stepping (as the
    library's workers do until every one has paused)."""
    n = len(x0)
    x = [t.clone() for t in x0]
    models: list[dict[int, torch.Tensor]] = [{0: x0[i].clone()} for i in range(n)]
    arrived: dict[int, dict[int, torch.Tensor]] = {}  # global round -> worker -> model
    results: dict[int, torch.Tensor] = {}  # global round -> the average
    trajectory: list[list[torch.Tensor | None]] = [[None] * n for _ in range(steps)]
    step = [0] * n
    next_round = [0] * n
    while min(step) < steps:
        progressed = False
        for i in range(n):
            if step[i] == steps:
                continue
            t = step[i]
            recorded_step, q, kind, stamps = events[i][t][:4]
            assert recorded_step == t, (i, t, recorded_step)
            if kind == "global":
                arrived.setdefault(q, {})[i] = x[i]
                if q not in results:
                    # an all-reduce: everyone must be there; a worker done with its steps
                    # is paused and takes part with its current model
                    if any(j not in arrived[q] and step[j] < steps for j in range(n)):
                        continue
                    results[q] = torch.stack([arrived[q].get(j, x[j]) for j in range(n)]
                                             ).mean(0)
                    for j in range(n):
                        models[j][q] = results[q]
                        if step[j] == steps:
                            x[j] = results[q]
                average = results[q]
            else:
                if any(stamp not in models[m] for m, stamp in stamps.items()):
                    continue  # a member's model is not made yet
                total = x[i] + sum(models[m][stamp] for m, stamp in stamps.items())
                average = total / (len(stamps) + 1)
            x[i] = average - lr * grad(i, x[i])
            models[i][q + 1] = x[i]  # published for the next round as soon as it exists
            trajectory[t][i] = x[i]
            next_round[i] = q + 1
            step[i] += 1
            progressed = True
        if not progressed:
            raise ValueError("the recorded rounds wait for each other: no order exists")
    return trajectory, x  # type: ignore[return-value]
