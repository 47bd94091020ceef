"""Size-only tensors: run the real algorithm runtimes on a model that has shapes but no data.

The timing-only mode of :class:`~gossamer.comm.SimWorld` (``SimWorld(..., timing_only=True)``)
runs every worker's code with its model on torch's ``meta`` device: a meta tensor has a shape,
a dtype and strides but no storage, so a 1B-parameter replica costs nothing, every operation
on it is a shape computation, and the communicator sees exactly the sizes the full simulator
sees. The virtual clocks, the event order and the bytes are those of the full simulator; only
the values of the model are missing, and the algorithms' time and bytes do not depend on them.

What the algorithms do read from their tensors is of two kinds, and :class:`SizeOnlyMode`, the
``TorchDispatchMode`` active while the workers run, answers both:

- **Control values** that ride in tensors: the header of packed payloads (their lengths),
  WAGMA's message trailer (round stamp, kind, acknowledgement), the fraction of paused workers
  in its global average, AD-PSGD's request counts, a push-sum weight. These are created from
  Python numbers or small CPU tensors, so their values are known: the mode keeps the known
  bytes of each meta storage (at most :data:`KNOWN_LIMIT` bytes per tensor created), carries
  them through ``cat``, copies, views and element-wise arithmetic (the simulator's all-reduce
  sums them), and reads them back where the code calls ``item()``, ``tolist()`` or ``.cpu()``.
  A byte nobody wrote reads as zero: a model's values read as zeros, so every gradient counts
  as finite.
- **Data-dependent selections** (``nonzero``, boolean masks): every element offered is taken
  to be selected. A compressor that selects by a threshold (DGC's sampled threshold on large
  tensors) then falls back to its refinement to exactly its target count ``k``, which is the
  rule of this mode: DGC sends its target count, where the full simulator sends what the
  threshold gave (within DGC's own bounds of ``k``). Exact top-k of small tensors (the digits
  MLP's) is the same in both.

Example::

    with torch.device("meta"):
        model = build_model()          # shapes only
    world = SimWorld(10_000, network=..., compute=..., timing_only=True)
    world.run(worker)                  # the same worker function as the full simulator
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KNOWN_LIMIT", "META", "SizeOnlyMode"]

aten = torch.ops.aten
META = torch.device("meta")

#: bytes of a CPU tensor whose values are kept when it becomes a meta one (control values are
#: a few words; a model's tensors are not kept)
KNOWN_LIMIT = 4096
#: storages whose known bytes are kept at most: an entry outlives its storage (meta storages
#: cannot be watched), so the oldest go first; control values are read soon after they are made
KNOWN_STORAGES = 100_000


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among an operation's arguments (ATen nests them one level at most: a
    Tensor[] argument)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, torch.Tensor))
    return out


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_meta else []
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, torch.Tensor) and o.is_meta]
    return []


def tree_map(fn, tree):
    """``tree`` with ``fn`` applied to every leaf (tuples, lists and dicts kept)."""
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, item) for item in tree)
    if isinstance(tree, list):
        return [tree_map(fn, item) for item in tree]
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


def _kind(func) -> tuple[str, int | None]:
    """How an operation's result follows from its arguments' metadata: ``("fresh", None)``,
    new tensors of a shape the arguments decide; ``("inplace", i)``, argument ``i`` itself
    (``None``: nothing returned); ``("other", None)``: views and the rest, run every time."""
    schema = func._schema
    returns = schema.returns
    if not returns:
        return ("inplace", None) if schema.is_mutable else ("other", None)
    if all(r.alias_info is None for r in returns):
        if all(str(r.type) in ("Tensor", "List[Tensor]") for r in returns):
            return ("fresh", None)
        return ("other", None)
    if len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write:
        written = returns[0].alias_info.before_set
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.before_set == written:
                return ("inplace", i)
    return ("other", None)


def _signature(value):
    """What decides a meta operation's result: shapes, strides, dtypes and the other values."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.stride(), value.is_meta)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    return value if isinstance(value, (int, float, bool, str, type(None), torch.dtype,
                                       torch.device, torch.layout, torch.memory_format)) \
        else id(value)


def _spec(out):
    if isinstance(out, torch.Tensor):
        return (out.shape, out.stride(), out.dtype)
    return [_spec(o) for o in out]


def _make(spec):
    if isinstance(spec, tuple):
        shape, stride, dtype = spec
        return torch.empty_strided(shape, stride, dtype=dtype, device=META)
    return [_make(s) for s in spec]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``t`` covers in its storage, if they are contiguous."""
    if not t.is_contiguous():
        return None
    start = t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


class SizeOnlyMode(TorchDispatchMode):
    """Meta tensors that remember the values the program gave them (see the module docs)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ so that Dynamo never compiles it: a call
        # through two wrappers per operation, a fifth of a meta operation's cost here, for a
        # mode that never runs under torch.compile
        return False

    def __init__(self) -> None:
        super().__init__()
        #: storage -> {byte offset: byte value}: what is known of each meta storage
        self.known: dict[int, dict[int, int]] = {}
        self._functions = _Literals(self)
        #: what meta operations gave, by their arguments' metadata: torch's meta kernels are
        #: mostly Python (tens of microseconds each), and a worker repeats the same ones
        #: every step on tensors of the same shapes
        self._memo: dict[tuple, Any] = {}
        self._kinds: dict[Any, tuple[str, int | None]] = {}

    def call(self, func, args, kwargs):
        """``func(*args, **kwargs)`` on meta tensors, its result made from the memo when the
        same operation was seen on arguments of the same metadata."""
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind(func)
        if kind[0] == "other":
            return func(*args, **kwargs)
        key = (func, _signature(args), _signature(kwargs))
        hit = self._memo.get(key)
        if hit is not None:
            if kind[0] == "fresh":
                return _make(hit[0]) if not hit[1] else tuple(_make(hit[0]))
            return None if kind[1] is None else _argument(func, kind[1], args, kwargs)
        out = func(*args, **kwargs)
        if kind[0] == "fresh":
            if not (isinstance(out, torch.Tensor) or isinstance(out, (list, tuple)) and all(
                    isinstance(o, torch.Tensor) for o in out)):
                return out
            self._memo[key] = (_spec(out), isinstance(out, tuple))
        elif kind[1] is None or out is _argument(func, kind[1], args, kwargs):
            self._memo[key] = (None, False)
        return out

    def __enter__(self):
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)

    # -- the known bytes ------------------------------------------------------------------
    def _known_in(self, t: torch.Tensor) -> dict[int, int]:
        """The known bytes of ``t``, by offset from its first byte (contiguous ``t`` only)."""
        table = self.known.get(_key(t))
        span = _span(t)
        if not table or span is None:
            return {}
        start, end = span
        if end - start < len(table):
            return {b - start: table[b] for b in range(start, end) if b in table}
        return {b - start: v for b, v in table.items() if start <= b < end}

    def _write(self, t: torch.Tensor, data: dict[int, int] | None) -> None:
        """Record ``data`` (offset from ``t``'s first byte -> byte) as what is known of the
        bytes of ``t``; every other byte of ``t`` becomes unknown."""
        key = _key(t)
        table = self.known.get(key)
        span = _span(t)
        if span is None:
            if table:  # a strided write: forget the whole storage, to be safe
                del self.known[key]
            return
        start, end = span
        if table:
            for b in [b for b in table if start <= b < end]:
                del table[b]
        if data:
            if table is None:
                table = self.known[key] = {}
                if len(self.known) > KNOWN_STORAGES:  # the oldest are long dead, or read
                    del self.known[next(iter(self.known))]
            table.update({start + offset: v for offset, v in data.items()})

    def _real(self, t: torch.Tensor) -> torch.Tensor:
        """A CPU copy of meta ``t``: its known bytes, zeros elsewhere."""
        array = np.zeros(t.numel() * t.element_size(), dtype=np.uint8)
        known = self._known_in(t)
        if known:
            array[list(known)] = list(known.values())
        return torch.from_numpy(array).view(t.dtype).view(t.shape)

    def _known_elements(self, t: torch.Tensor) -> tuple[list[int], torch.Tensor] | None:
        """The flat indices of ``t``'s elements whose bytes are all known, and their values;
        None if none is."""
        known = self._known_in(t)
        if not known:
            return None
        size = t.element_size()
        counts: dict[int, int] = {}
        for offset in known:
            counts[offset // size] = counts.get(offset // size, 0) + 1
        elements = sorted(e for e, c in counts.items() if c == size)
        if not elements:
            return None
        data = [known[e * size + i] for e in elements for i in range(size)]
        return elements, torch.tensor(data, dtype=torch.uint8).view(t.dtype)

    def _record(self, out: torch.Tensor, value: torch.Tensor | None,
                elements: list[int] | None = None) -> None:
        """``out`` (meta) now holds ``value`` (CPU) at its flat ``elements`` (default: all,
        ``value`` of its shape), unknown values elsewhere."""
        if value is None or value.numel() * value.element_size() > KNOWN_LIMIT:
            self._write(out, None)
            return
        data = value.to(out.dtype).contiguous().view(-1).view(torch.uint8).tolist()
        if elements is None:
            self._write(out, dict(enumerate(data)))
            return
        size = out.element_size()
        self._write(out, {e * size + i: data[j * size + i]
                          for j, e in enumerate(elements) for i in range(size)})

    # -- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = mixed = False
        for a in _tensors(args, kwargs):
            if a.is_meta:
                meta = True
            else:
                mixed = True
        if not meta:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_meta:  # a factory, or a copy to meta
                self.known.pop(_key(out), None)
                if func is aten._to_copy.default and mixed:
                    self._record(out, args[0].to(dtype=out.dtype))
            return out
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(self, func, args, kwargs)
        return self._generic(func, args, kwargs, mixed)

    def _to_meta(self, args, kwargs):
        """Move CPU tensors mixed with meta ones to meta, keeping their (small) values."""
        def move(a):
            if isinstance(a, torch.Tensor) and not a.is_meta:
                out = a.to(META)
                self.known.pop(_key(out), None)
                self._record(out, a)
                return out
            return a
        return tree_map(move, (args, kwargs))

    def _generic(self, func, args, kwargs, mixed: bool = True):
        if mixed:
            args, kwargs = self._to_meta(args, kwargs)
        if not self.known:  # nothing to follow: the usual case for a model's tensors
            return self.call(func, args, kwargs)
        tensors = _tensors(args, kwargs)
        inputs = {_key(a) for a in tensors}
        out = self.call(func, args, kwargs)
        known = self.known  # (a set's isdisjoint walks the dict, not the few inputs)
        if not any(k in known for k in inputs):
            # nothing known flows in: the outputs are new storages with nothing known (one
            # that reuses a dead storage's address must not inherit its values), or inputs
            # written in place, of which nothing was known either
            for o in _outputs(out):
                self.known.pop(_key(o), None)
            return out
        outs = _outputs(out)
        for o in outs:
            if _key(o) not in inputs:
                self.known.pop(_key(o), None)  # a new storage: nothing known yet
        if not outs:
            return out
        pointwise = torch.Tag.pointwise in func.tags
        if pointwise and len(outs) == 1:
            self._pointwise(func, args, kwargs, outs[0])
        elif func._schema.is_mutable or "out" in kwargs:
            for o in outs:
                if _key(o) in inputs:
                    self._write(o, None)  # written by an operation not followed here
        return out

    def _pointwise(self, func, args, kwargs, out):
        """Compute an element-wise operation on the known values too, at the elements where
        every operand of the output's shape is known (a flag, a weight, a trailer)."""
        if not self.known or _span(out) is None:
            self._write(out, None)
            return
        operands = {id(a): a for a in _tensors(args, kwargs)}
        elements: set[int] | None = None
        found = {}
        for key, a in operands.items():
            if a.numel() == 1 and a.shape != out.shape:
                value = self._real(a) if a.is_meta else a
                found[key] = (None, value)
                if a.is_meta and not self._known_in(a):
                    elements = set()
                continue
            if a.shape != out.shape or _span(a) is None:
                self._write(out, None)
                return
            known = self._known_elements(a)
            if known is None:
                elements = set()
                break
            found[key] = known
            elements = set(known[0]) if elements is None else elements & set(known[0])
        if not elements:
            self._write(out, None)
            return
        chosen = sorted(elements)

        def swap(a):
            if not isinstance(a, torch.Tensor):
                return a
            indices, values = found[id(a)]
            if indices is None:
                return values.reshape(())
            position = {e: i for i, e in enumerate(indices)}
            return values[[position[e] for e in chosen]]
        r_args, r_kwargs = tree_map(swap, (args, kwargs))
        r_kwargs.pop("out", None)
        try:
            value = func(*r_args, **r_kwargs)
        except (RuntimeError, TypeError):
            self._write(out, None)
            return
        if not isinstance(value, torch.Tensor):
            value = r_args[0]
        self._record(out, value.reshape(-1), chosen)


class _Literals:
    """Tensors made from Python numbers on the meta device keep their values: torch.tensor()
    does not pass its data through the dispatcher. While the mode is active, the three
    constructors of tensors from data are wrapped (a TorchFunctionMode would see every call
    of every torch function, which costs more than the meta operations themselves)."""

    def __init__(self, mode: SizeOnlyMode) -> None:
        self.mode = mode
        self.saved: list[tuple[object, str, object]] = []

    def __enter__(self):
        for owner, name in ((torch, "tensor"), (torch, "as_tensor"),
                            (torch.Tensor, "new_tensor")):
            original = getattr(owner, name)
            self.saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, name == "new_tensor"))
        return self

    def __exit__(self, *exc) -> None:
        while self.saved:
            owner, name, original = self.saved.pop()
            setattr(owner, name, original)

    def _wrap(self, original, method: bool):
        mode = self.mode

        def literal(*args, **kwargs):
            out = original(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_meta \
                    and out.numel() * out.element_size() <= KNOWN_LIMIT:
                data = args[1] if method else args[0]
                if not isinstance(data, torch.Tensor) or not data.is_meta:
                    mode.known.pop(_key(out), None)
                    value = torch.as_tensor(data, dtype=out.dtype, device="cpu")
                    mode._record(out, value.view(out.shape))
            return out

        return literal


# -- the operations that read, select or move values -----------------------------------------


def _scalar(mode: SizeOnlyMode, func, args, kwargs):
    return mode._real(args[0]).item()


def _to_copy(mode: SizeOnlyMode, func, args, kwargs):
    device = kwargs.get("device")
    t = args[0]
    if device is not None and torch.device(device).type != "meta":  # .cpu(), tolist()
        dtype = kwargs.get("dtype") or t.dtype
        return mode._real(t).to(dtype=dtype, device=device)
    out = func(*args, **kwargs)
    mode.known.pop(_key(out), None)
    if mode.known:
        if out.dtype == t.dtype:
            mode._write(out, mode._known_in(t))
        else:
            known = mode._known_elements(t)
            if known is not None:
                mode._record(out, known[1], known[0])
    return out


def _clone(mode: SizeOnlyMode, func, args, kwargs):
    out = mode.call(func, args, kwargs)
    mode.known.pop(_key(out), None)
    if mode.known and out.is_contiguous():
        mode._write(out, mode._known_in(args[0]))
    return out


def _copy(mode: SizeOnlyMode, func, args, kwargs):
    dst, src = args[0], args[1]
    (dst, src), kwargs = mode._to_meta((dst, src), kwargs)
    out = mode.call(func, (dst, src, *args[2:]), kwargs)
    if not mode.known:
        return out
    if src.dtype == dst.dtype and src.shape == dst.shape:
        mode._write(dst, mode._known_in(src))
    elif src.shape == dst.shape:
        known = mode._known_elements(src)
        mode._record(dst, None if known is None else known[1], None if known is None
                     else known[0])
    else:
        mode._write(dst, None)
    return out


def _foreach_copy(mode: SizeOnlyMode, func, args, kwargs):
    """``torch._foreach_copy_``: one meta call when no known value is copied or overwritten,
    else each pair as ``copy_``, its known values followed."""
    dsts, srcs = args[0], args[1]
    known = mode.known
    if all(t.is_meta for t in srcs) and not (
            known and any(_key(t) in known for t in (*dsts, *srcs))):
        # run, not remembered: meta copies cost less than reading the lists' metadata
        return func(*args, **kwargs)
    for dst, src in zip(dsts, srcs, strict=True):
        _copy(mode, aten.copy_.default, (dst, src), {})
    return None


def _cat(mode: SizeOnlyMode, func, args, kwargs):
    (tensors, *rest), kwargs = mode._to_meta(tuple(args), kwargs)
    out = mode.call(func, (tensors, *rest), kwargs)  # torch's meta cat is Python: remembered
    mode.known.pop(_key(out), None)
    dim = rest[0] if rest else kwargs.get("dim", 0)
    if not mode.known or out.dim() != 1 or dim not in (0, -1):
        return out
    offset = 0
    data: dict[int, int] = {}
    for t in tensors:
        data.update({offset + b: v for b, v in mode._known_in(t).items()})
        offset += t.numel() * t.element_size()
    mode._write(out, data)
    return out


def _argument(func, index: int, args, kwargs):
    """Argument ``index`` of ``func``'s schema, given positionally or by name."""
    if index < len(args):
        return args[index]
    return kwargs[func._schema.arguments[index].name]


def _fill(mode: SizeOnlyMode, func, args, kwargs):
    out = func(*args, **kwargs)
    t, value = args[0], args[1]
    mode._record(t, torch.full(t.shape, value, dtype=t.dtype) if mode.known or t.numel() < 64
                 else None)
    return out


def _nonzero(mode: SizeOnlyMode, func, args, kwargs):
    t = args[0]
    return torch.empty((t.numel(), t.dim()), dtype=torch.int64, device=META)


def _index(mode: SizeOnlyMode, func, args, kwargs):
    t, indices = args[0], list(args[1])
    for i, index in enumerate(indices):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            # a mask selects every element it covers (the rule for selections)
            indices[i] = torch.empty(index.numel(), dtype=torch.int64, device=META)
    return mode._generic(func, (t, indices), kwargs)


_HANDLERS = {
    aten._local_scalar_dense.default: _scalar,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _clone,
    aten.copy_.default: _copy,
    aten._foreach_copy_.default: _foreach_copy,
    aten.cat.default: _cat,
    aten.fill_.Scalar: _fill,
    aten.nonzero.default: _nonzero,
    aten.index.Tensor: _index,
}
