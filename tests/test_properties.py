"""Property: every configuration either trains a few steps in the simulator or is refused.

Hypothesis draws an algorithm, values for its options (plausible ones and bad ones: zero,
negative, NaN, infinite, unknown names), a number of simulated workers and the run's settings.
Each draw must either train to the end with finite results or raise a ``ValueError`` (which
the command line prints as a clear error). Anything else, an unexpected exception type, a
non-finite result or a run that does not finish within its real-time budget, is a bug.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import types
import typing

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossamer.algorithms import AllReduce, CompressionPreset
from gossamer.algorithms.registry import available, lookup
from gossamer.topology.builders import TOPOLOGIES
from gossamer.train.config import TrainConfig
from gossamer.train.run import run_training

REAL_SECONDS = 60  # one draw may take this long before it counts as hung

NUMBERS = [-1.0, 0.0, 1e-4, 0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 3.0, 25.0, 1e12,
           float("nan"), float("inf")]
INTS = [-1, 0, 1, 2, 3, 4, 8, 10**9]
STRINGS = {
    "topology": [*TOPOLOGIES, "", "no-such-graph"],
    "dtype": ["float16", "bfloat16", "float32", "int8"],
    "aggregation": ["allreduce", "allgather", "sum"],
    "compression": ["", "unknown", "topk:ratio=0.1", "qsgd:levels=3", "powersgd", "fp16",
                    "randomk:ratio=2", "dgc:ratio=0.01"],
}
NOT_DRAWN = {"compressor", "memory"}  # Python objects, not settings a recipe can hold


def _candidates(tp: typing.Any) -> list[typing.Any]:
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) \
        else (tp,)
    return [a for a in args if a is not type(None)]


def _value(field: str, tp: typing.Any) -> st.SearchStrategy:
    kinds = _candidates(tp)
    choices: list[st.SearchStrategy] = []
    if bool in kinds:
        choices.append(st.booleans())
    if int in kinds and bool not in kinds:
        choices.append(st.sampled_from(INTS))
    if float in kinds:
        choices.append(st.sampled_from(NUMBERS))
    if str in kinds:
        choices.append(st.sampled_from(STRINGS.get(field, ["", "unknown"])))
    if type(None) in typing.get_args(tp):
        choices.append(st.none())
    return st.one_of(choices) if choices else st.nothing()


@st.composite
def algorithm_options(draw: st.DrawFn) -> tuple[str, dict[str, typing.Any]]:
    name = draw(st.sampled_from(available()))
    cls = lookup(name)
    # a preset (dgc, topk, ...): its compressor's options and AllReduce's it offers
    parts = [(cls.compression, None), (AllReduce, cls.allreduce_options)] if isinstance(
        cls, CompressionPreset) else [(cls, None)]
    hints = {k: v for part, _ in parts for k, v in typing.get_type_hints(part).items()}
    fields = [f for part, only in parts for f in dataclasses.fields(part)
              if f.init and f.name not in NOT_DRAWN and (only is None or f.name in only)]
    chosen = draw(st.lists(st.sampled_from(fields), unique_by=lambda f: f.name, max_size=3)) \
        if fields else []
    options = {f.name: draw(_value(f.name, hints[f.name])) for f in chosen}
    return name, options


# The run's settings: a valid value for each, and bad ones of which a draw uses at most one,
# so that most draws train and the refusals are each exercised.
VALID = {
    "sim": [1, 2, 3, 4, 8],
    "steps": [1, 2, 4],
    "batch_size": [1, 8, 32],
    "accumulation": [1, 2],
    "optimizer": ["sgd", "adamw"],
    "lr": [0.01, 0.1],
    "momentum": [0.0, 0.9],
    "schedule": ["constant", "cosine", "step"],
    "partition": ["iid", "dirichlet"],
    "latency": [0.0, 50e-6],
    "bandwidth": [125e6, 1.25e9],
    "compute_time": [0.0, 0.01],
}
BAD = {
    "steps": [0, -1],
    "batch_size": [0, 10**6],
    "accumulation": [0],
    "optimizer": ["lamb"],
    "lr": [0.0, -0.1, float("nan"), float("inf")],
    "momentum": [1.0, -0.5],
    "schedule": ["linear"],
    "partition": ["shards"],
    "latency": [-1.0, float("nan")],
    "bandwidth": [0.0, float("nan")],
    "compute_time": [-0.01],
}


@st.composite
def configs(draw: st.DrawFn) -> dict[str, typing.Any]:
    name, options = draw(algorithm_options())
    settings_ = {key: draw(st.sampled_from(values)) for key, values in VALID.items()}
    corrupt = draw(st.sampled_from([None, None, None, *BAD]))
    if corrupt is not None:
        settings_[corrupt] = draw(st.sampled_from(BAD[corrupt]))
    return {"algorithm": name, "options": options, **settings_}


class _Hung(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise _Hung(f"the run did not finish within {REAL_SECONDS} s of real time")


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.slow
@given(settings_=configs())
def test_every_config_trains_or_is_refused(settings_):
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(REAL_SECONDS)
    try:
        try:
            config = TrainConfig(**settings_, eval_every=0, eval_workers=False, quiet=True,
                                 timeout=30.0)
            result = run_training(config)
        except ValueError as exc:
            assert str(exc), "a refusal must say why"
            hypothesis.event("refused")
            return
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    hypothesis.event("trained")
    assert result["world_size"] == settings_["sim"]
    assert math.isfinite(result["eval_loss"]), result
    assert 0.0 <= result["eval_accuracy"] <= 1.0
    assert result["bytes_sent"] >= 0


@pytest.mark.parametrize("key, value", [(k, v) for k, values in BAD.items() for v in values])
def test_each_bad_setting_is_refused_naming_it(key, value):
    settings_ = {k: values[0] for k, values in VALID.items()}
    settings_[key] = value
    with pytest.raises(ValueError, match=key):
        run_training(TrainConfig(**settings_, quiet=True, eval_every=0))
