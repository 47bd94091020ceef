"""`gossamer train --model pkg.module:factory --dataset pkg.module:factory`: the example of
docs/training.md trains as printed there, and every bad factory stops with a clear error."""

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gossamer.cli import main
from gossamer.train.data import load_dataset
from gossamer.train.models import build_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
COMMAND = ("gossamer train --model mydata:make_model --dataset mydata:make_dataset --steps 40 "
           "--quiet")


@pytest.fixture
def in_examples(monkeypatch):
    """Run from docs/examples, as the docs do, and forget the imported example afterwards."""
    monkeypatch.chdir(EXAMPLES)
    monkeypatch.delitem(sys.modules, "mydata", raising=False)
    yield
    sys.modules.pop("mydata", None)


def _documented_output() -> str:
    """The lines docs/training.md prints under COMMAND, up to the end of its block."""
    lines = (ROOT / "docs" / "training.md").read_text().splitlines()
    start = lines.index(f"$ {COMMAND}") + 1
    end = lines.index("```", start)
    return "\n".join(lines[start:end]) + "\n"


def test_the_documented_example_trains_and_prints_what_the_docs_show(in_examples, tmp_path,
                                                                    capsys):
    out = tmp_path / "result.json"
    assert main([*COMMAND.split()[1:], "--json", str(out)]) == 0
    assert capsys.readouterr().out == _documented_output()
    result = json.loads(out.read_text())["result"]
    assert result["eval_accuracy"] > 0.9  # four classes: chance is 0.25


def test_a_single_data_set_is_split_80_20_the_same_way_every_time(in_examples):
    first = load_dataset("mydata:make_dataset", seed=0)
    again = load_dataset("mydata:make_dataset", seed=0)
    assert (len(first.y_train), len(first.y_test)) == (800, 200)
    assert torch.equal(first.x_test, again.x_test) and torch.equal(first.y_train, again.y_train)
    import mydata

    everything = mydata.make_dataset().x
    held_out = {tuple(row.tolist()) for row in first.x_test}
    assert held_out.isdisjoint(tuple(row.tolist()) for row in first.x_train)
    assert len(held_out | {tuple(row.tolist()) for row in first.x_train}) == len(everything)
    assert first.num_classes == 4 and first.input_shape == (8,)  # from Blobs.classes
    assert first.y_train.dtype == torch.int64


def test_a_pair_is_kept_as_train_and_test(in_examples):
    data = load_dataset("mydata:make_split")
    assert (len(data.y_train), len(data.y_test)) == (800, 200)
    assert data.name == "mydata:make_split"


def test_the_model_factory_gets_input_shape_and_num_classes_and_may_be_a_class(in_examples):
    model = build_model("mydata:make_model", (8,), 4)
    assert model(torch.zeros(2, 8)).shape == (2, 4)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `userfactories` in a fresh current directory, made from the given source."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "userfactories", raising=False)

    def write(source: str) -> None:
        (tmp_path / "userfactories.py").write_text(HEADER + textwrap.dedent(source))

    yield write
    sys.modules.pop("userfactories", None)


HEADER = """\
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset


class Items(Dataset):
    def __init__(self, items, **attributes):
        self.items = items
        self.__dict__.update(attributes)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def points(n=20):
    x = torch.arange(2.0 * n).view(n, 2)
    return TensorDataset(x, torch.arange(n) % 2)


def model(input_shape, num_classes):
    return nn.Linear(input_shape[0], num_classes)
"""

BAD = """
NOT_CALLABLE = 3
def not_a_module(): return "linear"
def positional(shape, depth): return nn.Linear(2, 2)
def a_list(): return [(torch.zeros(2), 0)]
def empty(): return TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
def one(): return TensorDataset(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long))
def empty_test(): return points(), TensorDataset(torch.zeros(0, 2), torch.zeros(0).long())
def triples(): return Items([(torch.zeros(2), 0, 1)])
def not_tensor(): return Items([([0.0, 1.0], 0), ([1.0, 0.0], 1)])
def float_label(): return Items([(torch.zeros(2), 0.5), (torch.ones(2), 1.0)])
def ragged(): return Items([(torch.zeros(2), 0), (torch.zeros(3), 1)])
def negative(): return Items([(torch.zeros(2), -1), (torch.ones(2), 1)])
def too_few(): return Items([(torch.zeros(2), 0), (torch.ones(2), 5)], num_classes=3)
def unlike(): return points(), Items([(torch.zeros(3), 0)])
def needs_arg(size): return points(size)
"""


@pytest.mark.parametrize("argv, message", [
    (["--model", "nosuchmodule:make"],
     "model 'nosuchmodule:make': no module named 'nosuchmodule' (looked in the current directory"),
    (["--model", "userfactories:missing"],
     "model 'userfactories:missing': 'userfactories' has no attribute 'missing'"),
    (["--model", "userfactories:NOT_CALLABLE"],
     "model 'userfactories:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not callable"),
    (["--model", "userfactories:not_a_module"],
     "model 'userfactories:not_a_module': the factory returned a str, not a torch.nn.Module"),
    (["--model", "userfactories:positional"],
     "model 'userfactories:positional': the factory cannot be called with no arguments"),
    (["--model", "userfactories:a:b"], "model 'userfactories:a:b' is not MODULE:FACTORY"),
    (["--dataset", "nosuchmodule:make"], "dataset 'nosuchmodule:make': no module named"),
    (["--dataset", "userfactories:a_list"],
     "dataset 'userfactories:a_list': the factory returned a list, not a "
     "torch.utils.data.Dataset or a pair (train, test) of them"),
    (["--dataset", "userfactories:empty"], "dataset 'userfactories:empty': the data set is empty"),
    (["--dataset", "userfactories:one"], "holds 1 example: at least 2 are needed"),
    (["--dataset", "userfactories:empty_test"],
     "dataset 'userfactories:empty_test': the test set is empty"),
    (["--dataset", "userfactories:triples"],
     "dataset 'userfactories:triples': data item 0 is a tuple, not a pair (x, y)"),
    (["--dataset", "userfactories:not_tensor"], "data item 0's x is a list, not a tensor"),
    (["--dataset", "userfactories:float_label"],
     "data item 0's y is 0.5, not an integer class label"),
    (["--dataset", "userfactories:ragged"],
     "data item 1's x is torch.float32 of shape (3,), item 0's torch.float32 of shape (2,)"),
    (["--dataset", "userfactories:negative"], "label -1 is negative"),
    (["--dataset", "userfactories:too_few"], "label 5 is out of range for its num_classes=3"),
    (["--dataset", "userfactories:unlike"], "train items are x (2,), y (); test items x (3,)"),
    (["--dataset", "userfactories:needs_arg"],
     "dataset 'userfactories:needs_arg': the factory cannot be called with no arguments"),
    (["--dataset", "userfactories:points", "--data-path", "data"],
     "dataset 'userfactories:points' takes no data path (its factory has no `path` argument)"),
])
def test_each_bad_factory_stops_with_exit_2_and_says_what_is_wrong(argv, message, user_module,
                                                                    capsys):
    user_module(BAD)
    assert main(["train", "--steps", "1", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gossamer train: error: ") and message in err, err


def test_a_missing_module_that_the_users_module_imports_is_not_reported_as_the_users(
        user_module, capsys):
    user_module("import notinstalledanywhere\n")
    with pytest.raises(ModuleNotFoundError, match="notinstalledanywhere"):
        main(["train", "--steps", "1", "--quiet", "--model", "userfactories:model"])


def test_a_factory_with_a_path_argument_gets_data_path(user_module, tmp_path, capsys):
    user_module("""
        def from_file(path):
            n = int(open(path).read())
            return points(n)
    """)
    (tmp_path / "n.txt").write_text("30")
    data = load_dataset("userfactories:from_file", path=tmp_path / "n.txt")
    assert (len(data.y_train), len(data.y_test), data.num_classes) == (24, 6, 2)
    assert main(["train", "--steps", "1", "--quiet", "--dataset", "userfactories:from_file"]) == 2
    assert "cannot be called with no arguments" in capsys.readouterr().err


def test_sequence_items_and_an_iterable_data_set_train(user_module, capsys):
    # next-token prediction on a cycle 0, 1, ..., 4: y is x shifted by one, a class per position
    user_module("""
        class Cycles(IterableDataset):
            def __iter__(self):
                for start in range(100):
                    tokens = (torch.arange(9) + start) % 5
                    yield tokens[:-1], tokens[1:]

        def cycles():
            return Cycles()

        class TokenModel(nn.Module):
            def __init__(self, num_classes):
                super().__init__()
                self.embed = nn.Embedding(num_classes, 16)
                self.head = nn.Linear(16, num_classes)

            def forward(self, x):
                return self.head(self.embed(x))
    """)
    data = load_dataset("userfactories:cycles")
    assert data.y_train.shape == (80, 8) and data.num_classes == 5
    assert main(["train", "--model", "userfactories:TokenModel", "--dataset",
                 "userfactories:cycles", "--steps", "30", "--batch-size", "8", "--lr", "0.5",
                 "--quiet"]) == 0
    accuracy = float(capsys.readouterr().out.split("eval accuracy")[1].split("%")[0])
    assert accuracy > 90  # chance is 20%


@pytest.mark.slow
@pytest.mark.gloo
def test_two_gloo_processes_train_the_example():
    done = subprocess.run(
        [sys.executable, "-m", "gossamer", "launch", "--nproc", "2", "--", "--model",
         "mydata:make_model", "--dataset", "mydata:make_dataset", "--steps", "40", "--quiet"],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^(\[rank 0\] )?workers +2 \(torch.distributed\)$", done.stdout,
                     re.MULTILINE)
    accuracy = float(done.stdout.split("eval accuracy")[1].split("%")[0])
    assert accuracy > 90
