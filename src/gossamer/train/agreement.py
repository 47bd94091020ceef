"""Every worker must train the same thing: a check when training starts.

A worker started with other settings than the others (another algorithm option, another
topology, another number of steps, another version of gossamer) does not fail by itself: it
waits in a collective the others never call, or trains a different model without a word.
:func:`check_agreement` compares a fingerprint of a description of the run across the workers
(an all-gather of two int64 per worker: tensors only, nothing pickled) and, only when they
differ, a fingerprint of each field, so that every worker stops with the same ValueError,
naming the ranks and the fields that differ.

Example::

    check_agreement(comm, describe_run(config, comm.world_size))  # in every worker
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from gossamer.comm.base import Communicator

__all__ = ["LOCAL_FIELDS", "check_agreement", "describe_run", "fingerprint", "flatten"]

#: TrainConfig fields that may differ between workers: where each reads and writes, what it
#: prints, how long it waits. Every other field shapes the training or its collectives.
LOCAL_FIELDS = frozenset({"run_dir", "data_path", "quiet", "tensorboard", "timeout",
                          "log_every", "keep_checkpoints", "bind_all"})
_SHOWN = 6  # ranks named one by one in the error; the others are counted


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, default=repr).encode()


def fingerprint(value: Any) -> int:
    """A 64-bit fingerprint (truncated sha256) of a JSON-like ``value``, as a signed int64."""
    digest = hashlib.sha256(_canonical(value)).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def flatten(description: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: nested mappings become dotted field names."""
    fields: dict[str, Any] = {}
    for key, value in description.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            fields.update(flatten(value, name + "."))
        else:
            fields[name] = value
    return fields


def check_agreement(comm: Communicator, description: Mapping[str, Any],
                    what: str = "the run") -> None:
    """Collective: stop every worker unless all were given the same ``description``.

    The description is flattened (:func:`flatten`) and fingerprinted with sha256. When the
    fingerprints differ, the reference is the description most workers hold (ties: the one
    of the lowest rank), and every worker raises the same ValueError naming the ranks that
    differ from it and the fields in which they differ, followed by this worker's own values
    of those fields.

    Args:
        comm: the workers' communicator.
        description: JSON-like (nested mappings of plain values; others compared by repr).
        what: what is described, for the message (default ``"the run"``).
    """
    fields = flatten(description)
    whole = torch.frombuffer(bytearray(hashlib.sha256(_canonical(fields)).digest()[:16]),
                             dtype=torch.int64).clone()
    wholes = [tuple(t.tolist()) for t in comm.all_gather(whole)]
    if len(set(wholes)) == 1:
        return
    names = {fingerprint(k): k for k in fields}
    mine = torch.tensor([[fingerprint(k), fingerprint(v)] for k, v in sorted(fields.items())],
                        dtype=torch.int64).reshape(-1, 2)
    per_rank = [dict(map(tuple, t.tolist())) for t in comm.all_gather(mine)]
    counts = Counter(wholes)
    most = max(counts.values())
    reference = next(r for r, w in enumerate(wholes) if counts[w] == most)
    odd = [r for r, w in enumerate(wholes) if w != wholes[reference]]
    ref = per_rank[reference]
    parts, differing = [], set()
    for r in odd[:_SHOWN]:
        theirs = per_rank[r]
        keys = [k for k in set(theirs) | set(ref) if theirs.get(k) != ref.get(k)]
        known = sorted(names[k] for k in keys if k in names)
        unknown = len(keys) - len(known)
        differing.update(known)
        listed = ", ".join(known + ([f"{unknown} field(s) this worker lacks"] if unknown else []))
        parts.append(f"rank {r} differs in {listed}")
    if len(odd) > _SHOWN:
        parts.append(f"{len(odd) - _SHOWN} more rank(s) differ")
    own = ", ".join(f"{k}={fields[k]!r}" for k in sorted(differing))
    raise ValueError(
        f"the workers disagree on {what}: {'; '.join(parts)} (from rank {reference}, whose "
        f"settings {most} of {len(wholes)} workers share). Here, on rank {comm.rank}: {own}. "
        "Start every worker with the same settings and the same version of gossamer"
    )


def describe_run(config: Any, world_size: int, dataset: Any = None) -> dict[str, Any]:
    """What every worker of a training run must agree on: the version of gossamer, the world
    size, the algorithm with its options after validation (defaults filled in, strings
    converted), its topology, the training settings but :data:`LOCAL_FIELDS`, and the shape
    of the data set.

    Args:
        config: a :class:`~gossamer.train.config.TrainConfig`.
        world_size: the number of workers.
        dataset: the loaded :class:`~gossamer.train.data.Dataset` (default None: left out).
    """
    import gossamer

    algorithm = config.algorithm
    options = {f.name: _plain(getattr(algorithm, f.name))
               for f in dataclasses.fields(algorithm) if f.init}
    training = {k: v for k, v in config.as_dict().items()
                if k not in LOCAL_FIELDS and k != "algorithm"}
    description: dict[str, Any] = {
        "gossamer": gossamer.__version__,
        "world_size": world_size,
        "algorithm": {"name": algorithm.name, "options": options},
        "topology": _describe_topology(algorithm, world_size),
        "training": training,
    }
    if dataset is not None:
        description["data"] = {
            "train_examples": len(dataset.y_train), "test_examples": len(dataset.y_test),
            "input_shape": list(dataset.input_shape), "num_classes": dataset.num_classes,
        }
    return description


def _describe_topology(algorithm: Any, world_size: int) -> Any:
    """A topology given by name is described by its builder's arguments (building one can
    take a while at hundreds of workers); a Topology object by its matrices."""
    from gossamer.topology import Topology

    topology = getattr(algorithm, "topology", None)
    if topology is None:
        return None
    if isinstance(topology, Topology):
        return _plain(topology)
    options = algorithm.topology_options() if hasattr(algorithm, "topology_options") else {}
    return {"name": topology, "world_size": world_size, **options}


def _plain(value: Any) -> Any:
    from gossamer.topology import Topology

    if isinstance(value, Topology):
        digest = hashlib.sha256()
        for phase in range(value.period):
            digest.update(value.matrix(phase).tobytes())
        return {"name": value.name, "world_size": value.world_size, "period": value.period,
                "matrices": digest.hexdigest()[:16]}
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a compressor, say
        return {"type": type(value).__qualname__,
                **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    # anything else by its type only: a default repr holds a memory address, which differs
    # between processes
    return type(value).__qualname__
