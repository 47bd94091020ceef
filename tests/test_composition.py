"""Configurations composed of objects, not of other methods: the period rule, the warm-up and
the outer step are objects a method's configuration holds; no method inherits an option it
refuses; the compression aliases are presets of AllReduce, not classes."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gossamer.algorithms import (
    QSR,
    AllReduce,
    CompressionPreset,
    DiLoCo,
    LocalSGD,
    StreamingDiLoCo,
    available,
    lookup,
)
from gossamer.algorithms.outer import OuterStep
from gossamer.algorithms.rounds import ConstantPeriod, QuadraticRule, RoundSchedule


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def test_a_method_configuration_derives_only_from_the_method_it_extends():
    classes = {name: lookup(name) for name in available()}
    methods = {name: cls for name, cls in classes.items() if isinstance(cls, type)}
    derived = sorted((name, base.name) for name, cls in methods.items()
                     for base in cls.__mro__[1:] if base in methods.values())
    # QSR is local SGD with another rule, Overlap SGP is SGP with a delay: each takes every
    # option of the method it extends, and refuses none
    assert derived == [("osgp", "sgp"), ("qsr", "localsgd")]
    for name, base in derived:
        assert _fields(lookup(base)) <= _fields(lookup(name))
        assert not lookup(name).retired_options
    # the compression aliases are presets of AllReduce, not classes
    presets = sorted(name for name, cls in classes.items() if isinstance(cls, CompressionPreset))
    assert presets == ["dgc", "fp16", "powersgd", "qsgd", "randomk", "topk"]
    assert all(type(lookup(name)()) is AllReduce for name in presets)


def test_streaming_diloco_has_no_option_it_refuses():
    # it had alpha, power, warmup, warmup_period and compression from DiLoCo, refused
    assert not _fields(StreamingDiLoCo) & {"alpha", "power", "warmup", "warmup_period",
                                           "compression"}
    # what it shares with DiLoCo is declared the same: default and help
    shared = _fields(StreamingDiLoCo) & _fields(DiLoCo)
    assert {"outer", "outer_lr", "outer_momentum", "outer_nesterov", "outer_optimizer",
            "replica_size", "bucket_mb", "average_buffers"} <= shared
    helps = {cls: {f.name: (f.default, f.metadata["help"]) for f in dataclasses.fields(cls)}
             for cls in (DiLoCo, StreamingDiLoCo)}
    for name in shared - {"period", "warmup_steps"}:  # (each says what its period is)
        assert helps[DiLoCo][name] == helps[StreamingDiLoCo][name], name


@pytest.mark.parametrize("config, rule, cap", [
    (LocalSGD(period=3, warmup_steps=5, warmup_period=2), ConstantPeriod(3), False),
    (QSR(period=2, alpha=0.2, power=1.5, warmup="rising_lr", warmup_steps=5, warmup_period=2),
     QuadraticRule(2, 0.2, 1.5, rising_lr=True), True),
    (DiLoCo(period=3, warmup_steps=5, warmup_period=2), ConstantPeriod(3), True),
    (DiLoCo(period=2, alpha=0.2, power=1.5, warmup="rising_lr", warmup_steps=5,
            warmup_period=2), QuadraticRule(2, 0.2, 1.5, rising_lr=True), True),
])
def test_each_configuration_holds_its_period_rule_and_warm_up(config, rule, cap):
    assert config.schedule == RoundSchedule(rule, 5, 2, cap_to_end=cap)


def test_streaming_diloco_holds_a_constant_period_and_the_outer_step():
    config = StreamingDiLoCo(period=8, fragments=2, warmup_steps=3, outer="adam", outer_lr=0.1)
    assert config.schedule == RoundSchedule(ConstantPeriod(8), 3, 1, cap_to_end=True)
    assert config.outer_step == OuterStep(outer="adam", outer_lr=0.1)
    assert DiLoCo(outer_momentum=0.5).outer_step == OuterStep(outer_momentum=0.5)


def test_the_schedule_gives_the_warm_up_the_rule_and_the_cap():
    qsr = RoundSchedule(QuadraticRule(2, 0.1), warmup_steps=4, warmup_period=1, cap_to_end=True)
    assert qsr.period(3, 0.001, None, None) == 1  # the warm-up
    assert qsr.period(4, 0.01, 0.02, None) == math.floor((0.1 / 0.01) ** 2) == 100
    assert qsr.period(4, 0.01, 0.02, steps_left=7) == 7  # capped: the last step averages
    assert qsr.period(4, 1.0, 0.02, None) == 2  # H_base
    rising = RoundSchedule(QuadraticRule(2, 0.1, rising_lr=True))
    assert rising.period(0, 0.001, None, None) == 2  # the first round
    assert rising.period(9, 0.002, 0.001, None) == 2  # the rate still rises
    assert rising.period(9, 0.001, 0.002, None) == 10_000
    constant = RoundSchedule(ConstantPeriod(5))
    assert constant.period(0, 0.1, None, steps_left=2) == 5  # not capped
    with pytest.raises(ValueError, match="positive learning rate"):
        qsr.period(4, 0.0, 0.01, None)


@pytest.mark.parametrize("make, name", [
    (lambda: ConstantPeriod(0), "period"),
    (lambda: QuadraticRule(2, -1.0), "alpha"),
    (lambda: QuadraticRule(2, 0.1, power=0), "power"),
    (lambda: RoundSchedule(ConstantPeriod(2), warmup_steps=-1), "warmup_steps"),
    (lambda: RoundSchedule(ConstantPeriod(2), warmup_period=0), "warmup_period"),
    (lambda: OuterStep(outer="nosuch"), "outer"),
    (lambda: OuterStep(outer_lr=-1.0), "outer_lr"),
    (lambda: OuterStep(outer="adam", outer_momentum=0.5), "outer_momentum"),
])
def test_the_parts_name_the_option_they_refuse(make, name):
    with pytest.raises(ValueError, match=name):
        make()
