"""The training loop's parts, each alone: the accounting of what the algorithm spent, and the
Trainer's step, end of step, checkpoint and resume."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gossamer.comm import ComputeModel, NetworkModel, SimWorld
from gossamer.train.accounting import Accounting, raw_counts
from gossamer.train.config import TrainConfig
from gossamer.train.loop import Trainer
from gossamer.train.run import prepare

# ---- Accounting


def _counted(comm, time: bool):
    """(counters before, after a counted all-reduce, after one run by ``excluding``)."""
    accounting = Accounting(comm)
    comm.compute_step()
    start = accounting.counters()
    comm.all_reduce(torch.ones(1000))
    counted = accounting.counters()
    accounting.excluding(comm.all_reduce, torch.ones(1000), time=time)
    return start, counted, accounting.counters(), raw_counts(comm)


def test_excluding_takes_a_collectives_bytes_messages_and_time_out_of_the_counters():
    for start, counted, after, raw in SimWorld(2).run(_counted, True):
        assert start == (0, 0, 0.01, 0)  # the step's compute is the run's time
        sent, messages, seconds, _ = counted
        assert sent > 0 and messages > 0 and seconds > 0.01  # a counted one is counted
        assert after == counted  # the excluded one: nothing more
        assert raw["bytes"] == 2 * sent and raw["messages"] == 2 * messages  # (it did talk)
        assert raw["time"] > seconds


def test_excluding_without_time_takes_out_only_bytes_and_messages():
    for _, counted, after, _ in SimWorld(2).run(_counted, False):
        assert after[:2] == counted[:2]
        assert after[2] == pytest.approx(counted[2] + (counted[2] - 0.01))  # as long again


def test_excluding_returns_what_the_collective_returns():
    def worker(comm):
        return Accounting(comm).excluding(comm.all_reduce, torch.full((2,), comm.rank + 1.0))

    assert [t.tolist() for t in SimWorld(2).run(worker)] == [[3.0, 3.0]] * 2


def _catch_up(comm):
    accounting = Accounting(comm)
    comm.compute_step()  # rank 1 (3 times slower) arrives 20 ms after rank 0
    arrived = comm.clock()
    accounting.catch_up()
    return arrived, comm.clock(), accounting.counters()


def test_catch_up_counts_the_wait_for_the_last_worker_but_not_the_barriers():
    world = SimWorld(2, network=NetworkModel(latency=1e-3),
                     compute=ComputeModel(step_time=0.01, stragglers={1: 3.0}))
    (arrived_0, clock_0, counters_0), (arrived_1, clock_1, counters_1) = world.run(_catch_up)
    assert (arrived_0, arrived_1) == pytest.approx((0.01, 0.03))
    # the barriers cost time, which the clocks show...
    assert clock_0 == clock_1 and clock_0 > 0.03 + 1e-3
    # ...and the counters do not: both workers count up to the last one's arrival, rank 0's
    # wait for it included; no barrier traffic
    assert counters_0 == pytest.approx((0, 0, 0.03, 0))
    assert counters_1 == pytest.approx((0, 0, 0.03, 0))


class _Counting:
    """A communicator as Accounting sees it: its stats and its clock, set by hand."""

    def __init__(self, sent: int = 0, messages: int = 0, now: float = 0.0) -> None:
        self.stats = SimpleNamespace(total_bytes_sent=sent, total_messages_sent=messages)
        self.now = now

    def clock(self) -> float:
        return self.now


def test_switch_carries_the_algorithms_counts_over_to_the_next_communicator():
    old = _Counting(100, 4, 2.0)
    accounting = Accounting(old)
    accounting.excluding(lambda: setattr(old.stats, "total_bytes_sent", 130))  # 30 not counted
    new = _Counting(7, 1, 5.0)  # what the new one counted before is not the algorithm's
    accounting.switch(new)
    assert accounting.counters() == (100, 4, 2.0, 0)
    new.stats.total_bytes_sent, new.now = 17, 6.0
    assert accounting.counters() == (110, 4, 3.0, 0)


def test_go_on_from_counts_on_from_carried_over_counts():
    comm = _Counting(50, 5, 1.5)
    accounting = Accounting(comm)
    accounting.go_on_from({"bytes": 1000, "messages": 10, "time": 9.0, "examples": 64})
    assert accounting.counters() == (1000, 10, 9.0, 64)
    assert accounting.totals() == {"bytes": 1000, "messages": 10, "time": 9.0, "examples": 64}
    comm.stats.total_bytes_sent = 80
    assert accounting.counters()[0] == 1030


def test_count_until_counts_only_the_steps_not_counted_yet():
    accounting = Accounting(_Counting())
    accounting.count_step(1, 32)
    accounting.count_step(2, 32)
    accounting.count_until(5, 16)  # steps 3 to 5, at a smaller world
    assert (accounting.offsets["examples"], accounting.counted) == (2 * 32 + 3 * 16, 5)
    accounting.count_until(4, 16)  # behind what was counted: nothing
    assert (accounting.offsets["examples"], accounting.counted) == (112, 5)


# ---- Trainer


@pytest.fixture(scope="module")
def digits():
    return prepare(TrainConfig(quiet=True))


def _config(**changes) -> TrainConfig:
    return TrainConfig(**{"sim": 2, "steps": 10, "quiet": True, **changes})


def test_due_evaluates_every_eval_every_steps_and_at_the_last_and_saves_likewise(
        digits, tmp_path):
    def worker(comm, config):
        trainer = Trainer(comm, config, digits)
        return [trainer.due(done) for done in range(1, config.steps + 1)]

    config = _config(eval_every=3, checkpoint_every=4, run_dir=str(tmp_path))
    due = SimWorld(2).run(worker, config)[0]
    assert [d for d, (evaluate, _) in enumerate(due, 1) if evaluate] == [3, 6, 9, 10]
    assert [d for d, (_, save) in enumerate(due, 1) if save] == [4, 8, 10]
    due = SimWorld(2).run(worker, _config(eval_every=0, checkpoint_every=0))[0]
    assert [d for d, (evaluate, _) in enumerate(due, 1) if evaluate] == [10]
    assert not any(save for _, save in due)


def test_end_of_step_evaluates_and_saves_as_due(digits, tmp_path):
    def worker(comm, config):
        trainer = Trainer(comm, config, digits)
        calls: list[tuple[str, int]] = []
        trainer.evaluate = lambda done: calls.append(("evaluate", done))
        trainer.save = lambda done: calls.append(("save", done))
        for done in range(1, config.steps + 1):
            trainer.end_of_step(done)
        return calls

    config = _config(eval_every=5, checkpoint_every=4, run_dir=str(tmp_path))
    calls = SimWorld(2).run(worker, config)
    assert calls[0] == calls[1] == [("save", 4), ("evaluate", 5), ("save", 8),
                                    ("evaluate", 10), ("save", 10)]


def test_one_step_changes_the_parameters_and_counts_the_examples(digits):
    def worker(comm, config):
        trainer = Trainer(comm, config, digits)
        before = [p.detach().clone() for p in trainer.model.parameters()]
        loss = trainer.step(1)
        after = [p.detach().clone() for p in trainer.model.parameters()]
        return before, after, loss, trainer.accounting.counters(), trainer.window_count

    config = _config(batch_size=16, accumulation=2)
    results = SimWorld(2).run(worker, config)
    for before, after, loss, (sent, _, _, examples), window in results:
        assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
        assert loss > 0 and window == 1
        assert examples == 16 * 2 * 2  # both workers' two minibatches
        assert sent > 0  # the gradients' all-reduce is the algorithm's
    for a, b in zip(results[0][1], results[1][1], strict=True):  # the replicas stay equal
        assert torch.equal(a, b)


def test_evaluate_writes_the_record_and_starts_a_new_window(digits):
    def worker(comm, config):
        trainer = Trainer(comm, config, digits)
        losses = [trainer.step(done) for done in (1, 2)]
        counted = trainer.accounting.counters()
        record = trainer.evaluate(2)
        return losses, record, trainer.window_count, counted, trainer.accounting.counters()

    results = SimWorld(2).run(worker, _config())
    losses, record, window, counted, after = results[0]
    # the training loss since the last evaluation, the mean over the workers
    mean = sum(sum(r[0]) / 2 for r in results) / 2
    assert record["step"] == 2 and record["train_loss"] == pytest.approx(mean)
    # the mean over the workers of the algorithm's bytes so far
    assert record["bytes_sent"] == pytest.approx(sum(r[3][0] for r in results) / 2)
    for *_, counted, after in results:  # the evaluation's traffic is not the algorithm's
        assert after[:2] == counted[:2]
    assert window == 0


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same_sampler(a: dict, b: dict) -> bool:
    return (a["rng"], a["epoch"], a["position"]) == (b["rng"], b["epoch"], b["position"]) \
        and torch.equal(a["order"], b["order"])


def test_a_saved_trainer_resumes_to_the_same_state_and_the_same_next_step(digits, tmp_path):
    config = _config(run_dir=str(tmp_path), algorithm="dpsgd", momentum=0.9)

    def straight(comm):
        trainer = Trainer(comm, config, digits)
        for done in (1, 2, 3):
            trainer.step(done)
        trainer.save(3)
        saved = (_params(trainer.model), trainer.sampler.state_dict(),
                 trainer.accounting.totals())
        trainer.step(4)
        return saved, _params(trainer.model)

    def resumed(comm):
        trainer = Trainer(comm, config.replace(resume=True), digits)
        state = (trainer.start, _params(trainer.model), trainer.sampler.state_dict(),
                 trainer.accounting.totals())
        trainer.step(4)
        return state, _params(trainer.model)

    world = SimWorld(2)
    first = world.run(straight)
    assert (Path(tmp_path) / "checkpoints").is_dir()
    second = SimWorld(2).run(resumed)
    for rank in (0, 1):
        (params, sampler, totals), stepped = first[rank]
        (start, params_again, sampler_again, totals_again), stepped_again = second[rank]
        assert start == 3
        assert all(torch.equal(a, b) for a, b in zip(params, params_again, strict=True))
        assert _same_sampler(sampler_again, sampler)
        assert totals_again["examples"] == totals["examples"] == 3 * 32 * 2
        assert totals_again["bytes"] == totals["bytes"] > 0
        # the optimizer's momentum, the algorithm's and the sampler's state came back too
        assert all(torch.equal(a, b) for a, b in zip(stepped, stepped_again, strict=True))
    # (D-PSGD's replicas differ: each worker's own state was saved and resumed)
    assert not all(torch.equal(a, b) for a, b in zip(first[0][1], first[1][1], strict=True))
