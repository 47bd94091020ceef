"""Every method keeps its per-step tensors and random draws on the model's device.

On a CPU-only machine every tensor is on the CPU, so where a tensor *would* land on a GPU is
read from how it is made. :class:`DeviceRecorder` is a ``TorchFunctionMode`` (and a stand-in
for ``torch.Generator``) active while the workers take their steps; once a worker has taken
``WARMUP`` steps (its set-up: buffers, memories, PowerSGD's first factors), it records, with the
gossamer source line that made the call:

- a host transfer: ``Tensor.cpu``, ``.numpy``, ``.to(...)`` of a device written ``"cpu"`` in the
  line, a tensor made by ``torch.from_numpy``;
- a host read, which waits for the device: ``.item``, ``.tolist``, ``bool``/``float``/``int``
  /``index`` of a tensor (what calls ``aten._local_scalar_dense`` from Python), and the
  operations whose result's size is the data's (``nonzero``, ``unique``, ``masked_select``,
  ``bincount``, indexing by a mask), which a CUDA device must copy back to size it. (A
  tensor that torch itself reads as a number inside an operation is not seen: an aten-level
  ``TorchDispatchMode`` would see it, at ten times the cost; none is known in gossamer.)
- a tensor factory (``torch.zeros``, ``empty``, ``full``, ``arange``, ``rand*``, ``randperm``,
  ``tensor``...) or a ``torch.Generator`` made without an explicit device: the CPU on a GPU
  run, or with a device written ``"cpu"`` in the line.

A call is the caller's when the innermost frame outside torch's own dispatch plumbing is a
gossamer module; calls made inside torch (the user's optimizer) and the simulator's
bookkeeping are not the method's. Every method of ``gossamer.algorithms.available()`` (the
compressed presets among them) and every registered compressor with AllReduce takes a few steps
in :class:`~gossamer.comm.SimWorld`, and each site found must be in :data:`ALLOWED`, whose
entries say why the host must decide there. ``test_the_recorder_catches_a_planted_cpu`` shows
that the check can fail.

The compressors' and SPARTA's draws have a path for accelerators (counter-based,
:mod:`gossamer.compress.draws`) that the CPU does not take (it keeps its generator's draws, so
that a CPU run computes what it always has); the recorded runs force it, as on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import linecache
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from greenlet import getcurrent
from torch import nn
from torch.overrides import TorchFunctionMode

import gossamer
from gossamer.algorithms import AllReduce, available
from gossamer.algorithms.registry import create
from gossamer.comm import SimWorld
from gossamer.compress import draws
from gossamer.compress.registry import available_compressors, parse_compression

WORKERS, WARMUP, STEPS = 4, 2, 4
SOURCE = Path(gossamer.__file__).resolve().parent
# the simulator's own bookkeeping (its clocks, its copies of messages) is not a method's
IGNORED = ("comm/sim.py", "comm/mirror.py", "comm/timing.py", "testing.py")
# where torch passes a call on (its Python wrappers, its override and dispatch machinery)
PLUMBING = tuple(str(Path(torch.__file__).parent / name) for name in (
    "overrides.py", "_tensor.py", "functional.py", "_jit_internal.py", "utils/_device.py"))
FACTORIES = {getattr(torch, name) for name in (
    "zeros", "ones", "empty", "full", "arange", "range", "linspace", "logspace", "eye", "rand",
    "randn", "randint", "randperm", "tensor", "as_tensor", "scalar_tensor", "empty_strided",
    "normal", "tril_indices", "triu_indices")}  # (the *_like and new_* follow their tensor)
HOST_READS = {
    torch.Tensor.item: "item()", torch.Tensor.tolist: "tolist()", torch.Tensor.numpy: "numpy()",
    torch.Tensor.cpu: "cpu()", torch.Tensor.__bool__: "bool()", torch.Tensor.__float__:
    "float()", torch.Tensor.__int__: "int()", torch.Tensor.__index__: "index()",
    torch.from_numpy: "from_numpy()",
}
# operations whose result is sized by the data: a CUDA device copies the size back first
SIZED_BY_DATA = {
    torch.nonzero, torch.Tensor.nonzero, torch.unique, torch.Tensor.unique,
    torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.masked_select,
    torch.Tensor.masked_select, torch.bincount, torch.Tensor.bincount, torch.argwhere,
    torch.Tensor.argwhere,
}

#: (module, function, what) -> why the host must decide there; docs/design.md ("Device
#: residency") lists the same.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("patterns/nonfinite.py", "all_finite", "item()"):
        "whether the step is taken: a non-finite gradient skips it or raises (one read)",
    ("patterns/nonfinite.py", "all_finite.<locals>.<genexpr>", "item()"):
        "the same, on the CPU only (one Python float per tensor; a device stacks the sums)",
    ("patterns/nonfinite.py", "ranks_from_flags", "tolist()"):
        "which workers flagged a non-finite gradient: the step is dropped or the run stops",
    ("patterns/overlap.py", "GradientBuckets._write_averages", "tolist()"):
        "whether the averages are written or the step dropped (the non-finite flags)",
    ("compress/payloads.py", "unpack_bytes", "tolist()"):
        "the lengths of another worker's gathered payloads (DGC's count is its own): the "
        "host cuts the bytes",
    ("algorithms/adpsgd.py", "ADPSGDRuntime.settle.<locals>.<dictcomp>", "int()"):
        "how many requests a passive worker still answers, at a periodic average: a loop",
    ("algorithms/sparta.py", "counter_select.<locals>.<listcomp>", "nonzero (sized by the data)"):
        "the random selector's count is drawn: it sizes the all-reduce",
    ("algorithms/demo.py", "DeMoRuntime.after_backward.<locals>.<listcomp>", "float()"):
        "which workers sent a non-finite flag: the step is dropped or the run stops",
    ("algorithms/wagma_channels.py", "WAGMAChannels._global_average", "bool()"):
        "whether the group average is a global one: which messages follow",
    ("patterns/mailbox.py", "StampedMailbox.take", "tolist()"):
        "a message's stamps (acknowledgement, kind, step), read at once: the protocol's next "
        "move",
    ("compress/sparse_allreduce.py", "_byte_counts", "item()"):
        "how many bytes each peer sends here: the receive buffers' sizes",
}
# sparse payloads are sized by the data: DGC's threshold search and the sparse all-reduce's
# re-selection pick how many elements to send, and a buffer of that size
SIZED = "a sparse payload's size is the data's: the host sizes the selection"
ALLOWED.update({(path, function, what): SIZED for path, function, what in (
    ("compress/dgc.py", "DGCCompressor._exact", "indexing by a mask (sized by the data)"),
    ("compress/dgc.py", "DGCCompressor._threshold", "float()"),
    ("compress/dgc.py", "DGCCompressor._threshold.<locals>.select", "nonzero (sized by the data)"),
    ("compress/sparse_allreduce.py", "keep_largest", "nonzero (sized by the data)"),
    ("compress/sparse_allreduce.py", "owner_selection", "int()"),
    ("compress/sparse_allreduce.py", "next_threshold", "float()"),
    ("compress/sparse_allreduce.py", "sparse_allreduce", "bincount (sized by the data)"),
    ("compress/sparse_allreduce.py", "sparse_allreduce", "tolist()"),
    ("compress/sparse_allreduce.py", "sparse_allreduce", "indexing by a mask (sized by the data)"),
    ("compress/sparse_allreduce.py", "sparse_allreduce", "nonzero (sized by the data)"),
)})
# DGC's sample starts at a host integer drawn from its seeded CPU generator: nothing on the
# device is read, and it slices the gradient
ALLOWED.update({("compress/dgc.py", "DGCCompressor._threshold", what): (
    "the sample's offset, a host integer from the seeded CPU generator (no device read)")
    for what in ("int()", "randint() without a device")})


@dataclasses.dataclass(frozen=True)
class Site:
    """A gossamer source line that made a recorded call."""

    path: str  # relative to the package, e.g. "compress/qsgd.py"
    line: int
    function: str
    what: str

    def __str__(self) -> str:
        text = linecache.getline(str(SOURCE / self.path), self.line).strip()
        return f"{self.path}:{self.line} in {self.function}: {self.what}: {text}"


def _caller() -> tuple[str, int, str] | None:
    """(path in the package, line, function) of the gossamer line that made this call, or
    None when torch or the simulator made it."""
    frame = sys._getframe(2)
    here = os.path.abspath(__file__)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name == here or name.startswith(PLUMBING):
            frame = frame.f_back
            continue
        if not name.startswith(str(SOURCE) + os.sep):
            return None  # torch (the user's optimizer), or the test itself
        path = os.path.relpath(name, SOURCE).replace(os.sep, "/")
        if path in IGNORED:
            return None
        return path, frame.f_lineno, frame.f_code.co_qualname
    return None


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, (str, int, torch.device)):
        return torch.device(value)
    return None


class DeviceRecorder:
    """Records the sites of the module docstring made by the armed greenlets (the workers past
    their set-up); :meth:`arm` and :meth:`disarm` are called by the worker itself."""

    def __init__(self) -> None:
        self.sites: set[Site] = set()
        self.armed: set[int] = set()
        self.calls = 0  # recorded calls, sites or not (the recorder saw the steps)

    def arm(self) -> None:
        self.armed.add(id(getcurrent()))

    def disarm(self) -> None:
        self.armed.discard(id(getcurrent()))

    def active(self) -> bool:
        return id(getcurrent()) in self.armed

    def note(self, what: str) -> None:
        where = _caller()
        if where is not None:
            self.sites.add(Site(where[0], where[1], where[2], what))

    def on_function(self, func: Callable, args: tuple, kwargs: dict) -> None:
        self.calls += 1
        self.on_sized(func, args, kwargs)
        if func in HOST_READS:
            self.note(HOST_READS[func])
        elif func is torch.Tensor.to:
            targets = [_device_of(a) for a in args[1:]] + [_device_of(kwargs.get("device"))]
            if any(t is not None and t.type == "cpu" for t in targets) and self._says_cpu():
                self.note("to(cpu)")
        elif func in FACTORIES and kwargs.get("out") is None and not (
                func in (torch.tensor, torch.as_tensor) and isinstance(args[0], torch.Tensor)):
            device = kwargs.get("device")
            if device is None:
                self.note(f"{func.__name__}() without a device")
            elif torch.device(device).type == "cpu" and self._says_cpu():
                self.note(f"{func.__name__}() on the CPU")

    def on_generator(self, device: Any) -> None:
        if not self.active():
            return
        if device is None:
            self.note("Generator() without a device")
        elif torch.device(device).type == "cpu" and self._says_cpu():
            self.note("Generator() on the CPU")

    def on_sized(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """Operations whose result is sized by the data: a CUDA device copies that size back
        before it can go on."""
        name = getattr(func, "__name__", str(func))
        if func in SIZED_BY_DATA:
            self.note(f"{name} (sized by the data)")
        elif func in (torch.where, torch.Tensor.where) and len(args) + len(kwargs) == 1:
            self.note("where(condition) (sized by the data)")
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) \
                and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                               torch.Tensor) and kwargs.get("output_size") is None:
            self.note("repeat_interleave (sized by the data)")
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in index):
                self.note("indexing by a mask (sized by the data)")

    @staticmethod
    def _says_cpu() -> bool:
        """Whether the calling gossamer line names the CPU (on a CPU-only machine the only way
        to tell ``device="cpu"`` from ``device=tensor.device``)."""
        where = _caller()
        if where is None:
            return False
        return "cpu" in linecache.getline(str(SOURCE / where[0]), where[1]).lower()

    @contextmanager
    def recording(self) -> Iterator[DeviceRecorder]:
        recorder = self
        real_generator = torch.Generator

        class FunctionMode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if recorder.active():
                    recorder.on_function(func, args, kwargs)
                return func(*args, **kwargs)

        class Made(type(real_generator)):  # a generator made through the recorder
            def __instancecheck__(cls, obj: object) -> bool:
                return isinstance(obj, real_generator)

            def __call__(cls, device: Any = None) -> torch.Generator:
                recorder.on_generator(device)
                return real_generator() if device is None else real_generator(device)

        class Generator(real_generator, metaclass=Made):
            pass

        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(torch, "Generator", Generator))
            stack.enter_context(FunctionMode())
            yield self


def _model() -> nn.Module:
    torch.manual_seed(0)
    # the middle layer is large enough for DGC's sampled threshold and PowerSGD's factors
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


# options that make every method communicate within the recorded steps
OPTIONS: dict[str, dict[str, Any]] = {
    "adpsgd": {"allreduce_every": 2}, "dpsgd": {"allreduce_every": 2},
    "gossipgrad": {"allreduce_every": 2}, "sgp": {"allreduce_every": 2},
    "osgp": {"allreduce_every": 2}, "wagma": {"allreduce_every": 2},
    "diloco": {"period": 2}, "localsgd": {"period": 2}, "qsr": {"period": 2},
    "noloco": {"period": 2},
    "streaming-diloco": {"period": 4, "fragments": 2},
    "sparta": {"fraction": 0.1},
}


# what the presets' defaults leave out: the other aggregations, PowerSGD drawing its start at
# every step, the hierarchical reducer, a reducer that does not overlap backward
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dgc+sparse_allreduce": ("dgc", {"ratio": 0.05, "aggregation": "sparse_allreduce"}),
    "dgc+ratio=0.05": ("dgc", {"ratio": 0.05}),
    "topk+sparse_allreduce": ("topk", {"aggregation": "sparse_allreduce"}),
    "powersgd+cold_start": ("powersgd", {"warm_start": False}),
    "randomk+no_overlap": ("randomk", {"overlap": False}),
    "topk+node_size=2": ("allreduce", {"compression": "topk", "node_size": 2}),
}


def cases() -> dict[str, Callable[[], Any]]:
    """Every registered method (with :data:`OPTIONS`), every compressor with AllReduce (its
    preset is the same configuration), and :data:`VARIANTS`."""
    out: dict[str, Callable[[], Any]] = {
        name: functools.partial(create, name, OPTIONS.get(name, {})) for name in available()}
    for name in available_compressors():
        if create(name) != AllReduce(compression=parse_compression(name)):
            out[f"allreduce+{name}"] = functools.partial(
                lambda n: AllReduce(compression=parse_compression(n)), name)
    for case, (name, options) in VARIANTS.items():
        out[case] = functools.partial(create, name, options)
    return out


CASES = cases()


def train(comm, algorithm, recorder: DeviceRecorder) -> int:
    model = _model()
    optimizer = gossamer.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), algorithm, comm)
    g = torch.Generator().manual_seed(100 + comm.rank)
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            recorder.arm()
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    recorder.disarm()
    optimizer.finish()
    return comm.stats.total_bytes_sent


def record(case: str) -> DeviceRecorder:
    """The sites of ``case``'s steps after the set-up, with the draws an accelerator makes
    (on the CPU, the compressors draw from a CPU generator as they always have)."""
    recorder = DeviceRecorder()
    algorithm = CASES[case]()
    with recorder.recording(), mock.patch.object(draws, "on_host", lambda device: False):
        sent = SimWorld(WORKERS).run(train, algorithm, recorder)
    assert all(sent), f"{case}: a worker sent nothing"
    assert recorder.calls, f"{case}: nothing was recorded"
    return recorder


def unexplained(recorder: DeviceRecorder) -> list[str]:
    return sorted(str(s) for s in recorder.sites
                  if (s.path, s.function, s.what) not in ALLOWED)


@pytest.mark.parametrize("case", sorted(CASES))
def test_per_step_tensors_stay_on_the_models_device(case):
    problems = unexplained(record(case))
    assert not problems, f"{case}: per-step calls that would leave the model's device:\n" + \
        "\n".join(problems)


def test_the_recorder_catches_a_planted_cpu():
    """A ``.cpu()`` planted in the compressed reducer's step (compiled under the reducer's
    file name, as if it were written there) is found, with its line."""
    from gossamer.compress import reducer

    source = textwrap.dedent(inspect.getsource(reducer.CompressedReducer._update))
    head, body = source.split(":\n", 1)  # the signature, then the body
    planted = f"{head}:\n    [t.cpu() for _, t in run]\n{body}"
    namespace: dict[str, Any] = {}
    exec(compile(planted, reducer.__file__, "exec"), vars(reducer), namespace)
    with mock.patch.object(reducer.CompressedReducer, "_update", namespace["_update"]):
        problems = unexplained(record("topk"))
    assert any("compress/reducer.py" in p and "cpu()" in p for p in problems), problems


# -- the counter-based draws: exact integers, so the same values on every device ---------------

CPU = torch.device("cpu")
GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available")])


def _lowbias32_keys(seed: int, n: int, stream: int = 0) -> list[int]:
    """:func:`draws.keys` in plain Python integers: what every device must compute."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = x * 0x7FEB352D & draws.MASK
        x ^= x >> 15
        x = x * 0x846CA68B & draws.MASK
        return x ^ x >> 16

    out = []
    for i in range(n):
        for r in range(draws.ROUNDS):
            i = mix(i ^ draws.seed_value(seed, stream, r) & draws.MASK)
        out.append(i)
    return out


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_counter_draws_are_python_integer_arithmetic(device):
    """The keys are the Python integers' (no overflow, no rounding): on every device."""
    assert draws.keys(7, 50, torch.device(device), stream=2).tolist() == \
        _lowbias32_keys(7, 50, stream=2)
    assert draws.keys(7, 6, torch.device(device)).tolist() == [
        1899069337, 1670852883, 1892465698, 2386127218, 3664217580, 4218107658]


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_counter_draws_on_a_device_match_the_cpus(device):
    device = torch.device(device)
    for make in (lambda d: draws.subset(5, 10_000, 300, d),
                 lambda d: draws.permutation(5, 4096, d),
                 lambda d: draws.uniform(5, 4096, d, stream=1),
                 lambda d: draws.normal(5, (64, 4), d)):
        assert torch.equal(make(device).cpu(), make(CPU))


def test_counter_draws_have_their_distributions():
    keys = draws.keys(3, 1 << 16, CPU)
    assert keys.unique().numel() == 1 << 16 and 0 <= int(keys.min()) <= int(keys.max()) < 2**32
    chosen = draws.subset(3, 1000, 100, CPU)
    assert chosen.numel() == 100 and torch.equal(chosen, chosen.unique())  # distinct, sorted
    assert torch.equal(draws.subset(3, 7, 7, CPU), torch.arange(7))
    assert torch.equal(draws.permutation(3, 500, CPU).sort().values, torch.arange(500))
    # every position about as often: 2000 subsets of 10 of 100 -> 200 each, sd ~13
    counts = torch.zeros(100)
    for step in range(2000):
        counts[draws.subset(step, 100, 10, CPU)] += 1
    assert 140 < float(counts.min()) and float(counts.max()) < 260
    u = draws.uniform(3, 100_000, CPU)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    z = draws.normal(3, (100_000,), CPU)
    assert abs(float(z.mean())) < 0.02 and abs(float(z.var()) - 1) < 0.02


def test_accelerator_paths_keep_the_compressors_contracts():
    """With the accelerators' draws (forced on the CPU): random-k's positions are the same on
    every worker and new at every step, QSGD stays unbiased, SPARTA's partitions cover every
    position once per cycle."""
    from gossamer.algorithms.sparta import SPARTA, counter_select
    from gossamer.compress import QSGD, RandomK

    with mock.patch.object(draws, "on_host", lambda device: False):
        x = torch.randn(1000)
        a, b = RandomK(ratio=0.05).for_worker(0), RandomK(ratio=0.05).for_worker(1)
        first = a.compress(x, "w").indices
        assert torch.equal(first, b.compress(x, "w").indices) and first.numel() == 50
        a.set_step(1)
        assert not torch.equal(first, a.compress(x, "w").indices)
        q = QSGD(levels=3, bucket_size=100).for_worker(0)
        mean = torch.zeros(1000)
        for step in range(400):
            q.set_step(step)
            mean += q.decompress(q.compress(x, "w"), "w") / 400
        # the rounding's mean is x: each element's draw has sd < |bucket| / (2 s) ~ 1.7, its
        # mean over 400 steps ~0.08
        error = (mean - x).abs()
        assert float(error.mean()) < 0.1 and float(error.max()) < 0.5
    config = SPARTA(fraction=0.25, selector="partitioned")
    seen = torch.cat([counter_select(config, step, [10], CPU)[0] for step in range(4)])
    assert torch.equal(seen.sort().values, torch.arange(10))
