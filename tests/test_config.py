"""The resolved configuration of a run: the algorithm resolved once into its object, config.yaml
round-trips, help from the fields' own documentation, the simulator's models from flags, and
flags that would have no effect refused."""

from __future__ import annotations

import argparse

import pytest
import torch
import yaml

import gossamer
from gossamer.algorithms import SGP, WAGMA, AllReduce, LocalSGD
from gossamer.cli import main
from gossamer.comm import SimWorld
from gossamer.comm.sim import SimulationError
from gossamer.options import option_help
from gossamer.train.config import (
    GROUPS,
    TrainConfig,
    add_config_arguments,
    config_from_args,
    load_recipe,
)
from gossamer.train.run import run_training


def _round_trip(config: TrainConfig, tmp_path) -> TrainConfig:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.as_dict(), sort_keys=False))
    return TrainConfig(**load_recipe(path))


def test_the_algorithm_is_resolved_into_its_object_and_round_trips(tmp_path):
    config = TrainConfig(algorithm="sgp", options={"tau": "1", "topology": "ring"}, sim=4,
                         bandwidth="100mbit", stragglers=("1:3",), links=("0:1:10mbit:0.002",),
                         jitter=0.1)
    assert config.algorithm == SGP(tau=1, topology="ring")
    assert config.bandwidth == 12.5e6
    assert _round_trip(config, tmp_path) == config
    logged = TrainConfig(run_dir=str(tmp_path / "run"), loggers=("wandb", "mlflow"),
                         checkpoint_every=5, checkpoint_format="dcp")
    assert _round_trip(logged, tmp_path) == logged
    with pytest.raises(ValueError, match="loggers: 'nope' is unknown"):
        TrainConfig(run_dir="d", loggers=("nope",))
    with pytest.raises(ValueError, match="loggers need run_dir"):
        TrainConfig(loggers=("mlflow",))
    compressed = TrainConfig(compressor="dgc:ratio=0.01")
    assert isinstance(compressed.algorithm, AllReduce)
    assert _round_trip(compressed, tmp_path) == compressed
    # replace(options=...) changes options of the algorithm held, keeping the others
    assert config.replace(options={"tau": "2"}).algorithm == SGP(tau=2, topology="ring")


def test_a_recipe_names_the_algorithm_either_way(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("algorithm: localsgd\noptions:\n  period: 4\n")
    nested.write_text("algorithm:\n  name: localsgd\n  options:\n    period: 4\n"
                      "world_size: 8\n")  # world_size: a run directory's record, ignored
    assert TrainConfig(**load_recipe(flat)).algorithm == LocalSGD(period=4)
    assert TrainConfig(**load_recipe(nested)).algorithm == LocalSGD(period=4)
    broken = tmp_path / "broken.yaml"
    broken.write_text("algorithm: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml.*not valid YAML"):
        load_recipe(broken)


def test_another_algorithm_on_the_command_line_does_not_take_the_recipes_options(
        tmp_path, capsys, monkeypatch):
    from gossamer.algorithms import DiLoCo
    from gossamer.cli import build_parser
    from gossamer.train.config import config_from_args

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)  # the note is rank 0's
    recipe = tmp_path / "qsr.yaml"
    recipe.write_text("algorithm: qsr\noptions:\n  period: 2\n  alpha: 0.0045\n")

    def config(*flags: str) -> TrainConfig:
        return config_from_args(build_parser().parse_args(
            ["train", "--config", str(recipe), *flags]))

    # DiLoCo has an alpha too: the QSR recipe's would turn on its QSR period unasked
    diloco = config("--algorithm", "diloco", "--option", "period=8").algorithm
    assert diloco == DiLoCo(period=8) and diloco.alpha == 0
    assert "replaces the recipe's qsr, whose options (alpha, period) are not used" in (
        capsys.readouterr().err)
    # LocalSGD has no alpha: the run starts instead of failing on the recipe's option
    assert config("--algorithm", "localsgd").algorithm == LocalSGD()
    assert "replaces the recipe's qsr" in capsys.readouterr().err
    # the recipe's own algorithm keeps its options, the flags' on top
    qsr = config("--algorithm", "qsr", "--option", "period=3").algorithm
    assert (qsr.name, qsr.period, qsr.alpha) == ("qsr", 3, 0.0045)
    assert capsys.readouterr().err == ""


def test_a_compressor_goes_only_with_a_gradient_level_method():
    with pytest.raises(ValueError, match="compressor.*'sgp'.*allreduce"):
        TrainConfig(algorithm="sgp", compressor="topk")
    with pytest.raises(ValueError, match="ratio"):
        TrainConfig(compressor="topk:ratio=2")


def test_every_flag_has_the_help_of_its_field(capsys):
    helps = option_help(TrainConfig)
    assert all(helps.values()), [name for name, text in helps.items() if not text]
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(helps)  # every field in exactly one group of --help
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for title in GROUPS:
        assert title in out
    assert "seconds of compute per step" in out  # compute_time's help, from its field


@pytest.mark.parametrize("flags, message", [
    (["--min-lr", "0.01"], "min_lr=0.01 has no effect here: it applies to schedule 'cosine'"),
    (["--optimizer", "adamw", "--momentum", "0.5"], "momentum=0.5 has no effect"),
    (["--milestones", "10"], "milestones=(10,) has no effect"),
    (["--dirichlet-alpha", "0.1"], "applies to partition 'dirichlet' only"),
    (["--alpha", "0.1"], "applies to partition 'dirichlet' only"),  # the old name, read
    (["--data-path", "x"], "digits data set is embedded"),
])
def test_a_flag_with_no_effect_is_an_error_that_says_why(flags, message, capsys):
    assert main(["train", "--steps", "5", "--quiet", *flags]) == 2
    assert message in capsys.readouterr().err


def test_simulator_settings_are_refused_on_real_processes():
    real = TrainConfig(bandwidth="10mbit")
    with pytest.raises(ValueError, match="bandwidth sets the simulator's network"):
        real.check_mode(simulated=False)
    real.check_mode(simulated=True)
    with pytest.raises(ValueError, match="bind_all applies to real processes only"):
        TrainConfig(bind_all=True, sim=4).check_mode(simulated=True)
    with pytest.raises(ValueError, match="stragglers '9:2': rank 9 does not exist"):
        TrainConfig(sim=4, stragglers=("9:2",))
    with pytest.raises(ValueError, match="links: '0-1:5' is not SRC:DST:RATE"):
        TrainConfig(sim=4, links=("0-1:5",))


def test_a_straggler_is_written_as_gossamer_plan_takes_it():
    """``--straggler RANK=FACTOR`` is the form that ``gossamer train`` and ``gossamer plan``
    share; the older ``RANK:FACTOR`` still reads the same. A config holds (and config.yaml
    writes) the shared form; an error quotes what was written."""
    from gossamer.cli import build_parser
    from gossamer.plan.cli import parse_stragglers
    from gossamer.train.config import config_from_args

    shared = TrainConfig(sim=8, stragglers=("3=4", "5=2.5"))
    older = TrainConfig(sim=8, stragglers=("3:4", "5:2.5"))
    assert shared.compute_model().stragglers == {3: 4.0, 5: 2.5}
    assert shared.compute_model().stragglers == parse_stragglers(["3=4", "5=2.5"])
    assert older == shared and older.stragglers == ("3=4", "5=2.5")
    args = build_parser().parse_args(["train", "--sim", "8", "--straggler", "3=4"])
    assert config_from_args(args).compute_model().stragglers == {3: 4.0}
    with pytest.raises(ValueError, match=r"stragglers: '3-4' is not RANK=FACTOR \(e\.g\. 3=4"):
        TrainConfig(sim=8, stragglers=("3-4",))
    with pytest.raises(ValueError, match="stragglers '9=2': rank 9 does not exist"):
        TrainConfig(sim=4, stragglers=("9=2",))


def test_stragglers_and_links_reach_the_simulator():
    base = TrainConfig(sim=4, steps=10, eval_every=0, quiet=True, compute_time=0.01)
    plain = run_training(base)["wall_clock"]
    straggling = run_training(base.replace(stragglers=("2:5",)))["wall_clock"]
    slow_link = run_training(base.replace(links=("0:1:1mbit",)))["wall_clock"]
    # a synchronous method waits for its slowest worker and its slowest link
    assert straggling > 4 * plain
    assert slow_link > plain + 10 * 0.2  # ~38 kB a step over the ring at 1 Mbit/s


def test_a_topology_is_built_once_per_run(monkeypatch):
    """Resolved once for the world size, the algorithm's topology is not rebuilt by any
    worker's bind (it was built 2N+1 times for N simulated workers)."""
    import gossamer.algorithms.gossip as gossip

    builds = []
    real_build = gossip.build

    def counting(*args, **kwargs):
        builds.append(args)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(gossip, "build", counting)
    run_training(TrainConfig(algorithm="wagma", sim=8, steps=4, eval_every=0, quiet=True))
    assert len(builds) == 1
    resolved = WAGMA(group_size=2).resolve(4)
    assert resolved.resolve(4) is resolved
    with pytest.raises(ValueError, match="group_size=3 does not divide"):
        WAGMA(group_size=3).resolve(8)


def _started(comm):
    model = torch.nn.Linear(2, 1)
    inputs = lambda k: iter([torch.zeros(1, 2)] * k)  # noqa: E731
    optimizer = gossamer.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    LocalSGD(period=2), comm, total_steps=7,
                                    training_inputs=inputs, nonfinite="skip")
    runtime = optimizer.runtime
    return runtime.total_steps, runtime.training_inputs is inputs, runtime.nonfinite


def test_distribute_tells_the_runtime_what_the_loop_knows():
    assert SimWorld(2).run(_started) == [(7, True, "skip")] * 2
    model = torch.nn.Linear(2, 1)
    with pytest.raises(SimulationError, match="total_steps must be an int >= 1"):
        SimWorld(1).run(lambda comm: gossamer.distribute(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "allreduce", comm,
            total_steps=0))


def test_the_dirichlet_concentration_is_named_apart_and_its_old_name_still_read(tmp_path,
                                                                                capsys):
    """``--dirichlet-alpha`` (a recipe's ``dirichlet_alpha``); the old ``--alpha`` and a
    config.yaml's ``alpha`` still set it, with a note naming the new name; both at once is
    an error."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    new = config_from_args(parser.parse_args(["--partition", "dirichlet",
                                              "--dirichlet-alpha", "0.2"]))
    assert new.dirichlet_alpha == 0.2 and capsys.readouterr().err == ""
    old = config_from_args(parser.parse_args(["--partition", "dirichlet", "--alpha", "0.2"]))
    assert old == new
    assert "--alpha is now --dirichlet-alpha" in capsys.readouterr().err
    with pytest.raises(ValueError, match="give --dirichlet-alpha only"):
        config_from_args(parser.parse_args(["--alpha", "0.2", "--dirichlet-alpha", "0.3"]))
    recipe = tmp_path / "config.yaml"  # as a run directory's config.yaml was written before
    recipe.write_text("partition: dirichlet\nalpha: 0.2\nsteps: 7\n")
    assert load_recipe(recipe) == {"partition": "dirichlet", "dirichlet_alpha": 0.2,
                                   "steps": 7}
    assert "'alpha' is now 'dirichlet_alpha'" in capsys.readouterr().err
    recipe.write_text("alpha: 0.2\ndirichlet_alpha: 0.3\n")
    with pytest.raises(ValueError, match="keep 'dirichlet_alpha'"):
        load_recipe(recipe)
