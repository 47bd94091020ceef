"""Data sets and how they are split across workers.

The embedded default is scikit-learn's bundled digits (1,797 8x8 images, 10 classes), which
needs no download, so ``gossamer train`` works on a fresh machine. The others read files the user
gives: MNIST / Fashion-MNIST IDX files, CIFAR-10's python batches and a plain-text file for the
character-level language model. Nothing is downloaded. A name ``pkg.module:factory`` is the
user's own ``torch.utils.data.Dataset`` (:func:`load_user_dataset`).

Splits across workers: IID (:func:`partition_iid`) and the usual non-IID Dirichlet label skew
(:func:`partition_dirichlet`); :func:`describe_partition` summarises one for the run's record.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.data

from gossamer.train.factory import call_factory, import_factory, is_factory, parameters
from gossamer.train.safe_pickle import safe_load


@dataclass(frozen=True)
class Dataset:
    """Train and test tensors of one data set.

    For a sequence data set (``"text"``), x are LongTensor windows (N, block_size) of character
    indices, y the next characters (N, block_size), ``num_classes`` the vocabulary size and
    ``vocab`` the characters in index order.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    vocab: str | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's digits, pixels scaled to [0, 1], split train/test by a seeded shuffle."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    pixels, labels = _digits_arrays()
    x = torch.tensor(pixels / 16.0, dtype=torch.float32)
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.tensor(np.random.default_rng(seed).permutation(len(y)))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test], num_classes=10)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (0-16) and labels, read from the CSV file scikit-learn bundles, as
    ``sklearn.datasets.load_digits`` reads it: importing scikit-learn takes about a second,
    which every worker of a run would pay. scikit-learn's own loader where the file is not
    where it keeps it."""
    spec = importlib.util.find_spec("sklearn")
    roots = spec.submodule_search_locations if spec is not None else None
    path = Path(roots[0]) / "datasets" / "data" / "digits.csv.gz" if roots else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits as sklearn_digits

        bunch = sklearn_digits()
        return bunch.data, bunch.target
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# MNIST / Fashion-MNIST


_IDX_DTYPES = {0x08: np.uint8}  # the only type MNIST and Fashion-MNIST use


def load_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (LeCun's MNIST format), gzip-compressed if its name ends in ``.gz``.

    The header is a magic number (two zero bytes, a data type code, the number of dimensions)
    then one big-endian uint32 per dimension. Only unsigned bytes (type 0x08) are supported.
    ValueError naming the file for a bad magic number, bad dimensions, or a payload that is not
    exactly the size the header announces; FileNotFoundError naming a missing file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file {path} does not exist")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            raw = path.read_bytes()
    except (OSError, EOFError) as e:  # gzip's BadGzipFile is an OSError; a cut stream, EOF
        raise ValueError(f"{path}: cannot decompress: {e}") from e
    if len(raw) < 4:
        raise ValueError(f"{path}: truncated: {len(raw)} bytes, shorter than an IDX header")
    magic = int.from_bytes(raw[:4], "big")
    code, ndim = raw[2], raw[3]
    if raw[0] != 0 or raw[1] != 0 or ndim == 0:
        raise ValueError(f"{path}: bad IDX magic number 0x{magic:08x}")
    if code not in _IDX_DTYPES:
        raise ValueError(
            f"{path}: IDX data type 0x{code:02x} (magic number 0x{magic:08x}) is not supported; "
            "only 0x08 (unsigned byte)"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(
            f"{path}: truncated: header announces {ndim} dimensions, file has {len(raw)} bytes"
        )
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = math.prod(shape) * dtype.itemsize
    found = len(raw) - header
    if found < expected:
        raise ValueError(f"{path}: truncated: expected {expected} bytes of data, found {found}")
    if found > expected:
        raise ValueError(
            f"{path}: {found - expected} trailing bytes: expected {expected} bytes of data "
            f"for shape {shape}, found {found}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).copy()


_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# (mean, std) of the training pixels in [0, 1]
_MNIST_STATS = (0.1307, 0.3081)
_FASHION_STATS = (0.2860, 0.3530)


def _find(root: Path, stem: str) -> Path | None:
    for candidate in (root / stem, root / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _check_dir(root: str | Path) -> Path:
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ValueError(f"data directory {root} is not a directory: give the directory "
                         "that holds the data set's files")
    if not root.is_dir():
        raise ValueError(f"data directory {root} does not exist")
    return root


def _check_count(arg: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{arg} must be >= 1, got {value}")


def _head(arg: str, value: int | None, available: int) -> int:
    """How many of ``available`` examples to keep: all, or the first ``value``."""
    if value is None:
        return available
    if value > available:
        raise ValueError(f"{arg}={value} exceeds the {available} examples available")
    return value


def _read_mnist_pair(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = load_idx(images_path), load_idx(labels_path)
    if images.ndim != 3:
        raise ValueError(f"{images_path}: expected 3-D images, got shape {images.shape}")
    if labels.ndim != 1:
        raise ValueError(f"{labels_path}: expected 1-D labels, got shape {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(
            f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels"
        )
    if labels.size and labels.max() > 9:
        raise ValueError(f"{labels_path}: label {labels.max()} is outside 0..9")
    return images, labels


def load_mnist(
    root: str | Path,
    *,
    train_count: int | None = None,
    test_count: int | None = None,
    seed: int = 0,
    fashion: bool = False,
) -> Dataset:
    """MNIST or Fashion-MNIST from a directory of IDX files (raw or ``.gz``).

    With ``train-*`` and ``t10k-*`` files, train is the train files (the first ``train_count``
    if given) and test is the t10k files (the first ``test_count`` if given).

    With only the t10k files (10,000 images, as in the project's shared data), the t10k set is
    split without shuffling: the first ``train_count`` images (default 8,000) are for training
    and the last ``test_count`` (default 2,000) for evaluation; the two must not overlap.

    Pixels become float32 in [0, 1], shaped (N, 1, 28, 28), normalised by the usual mean/std
    (MNIST 0.1307/0.3081; Fashion-MNIST its own 0.2860/0.3530). Labels are int64.

    Args:
        root: the directory.
        train_count, test_count: how many examples to keep (see above).
        seed: unused: the split is fixed so that every result states the same one; accepted
            so that :func:`load_dataset` passes its seed to every loader alike.
        fashion: name the data set "fashion-mnist" and use its normalisation.
    """
    del seed
    root = _check_dir(root)
    _check_count("train_count", train_count)
    _check_count("test_count", test_count)
    found = {key: _find(root, stem) for key, stem in _MNIST_FILES.items()}
    has_train = [found["train_images"] is not None, found["train_labels"] is not None]
    if found["test_images"] is None or found["test_labels"] is None or any(has_train) != all(
        has_train
    ):
        missing = [stem for key, stem in _MNIST_FILES.items() if found[key] is None]
        raise ValueError(
            f"data directory {root} lacks {', '.join(missing)} (raw or .gz); expected "
            f"{_MNIST_FILES['test_images']} and {_MNIST_FILES['test_labels']}, and optionally "
            f"{_MNIST_FILES['train_images']} with {_MNIST_FILES['train_labels']}"
        )
    test_images, test_labels = _read_mnist_pair(found["test_images"], found["test_labels"])
    if all(has_train):
        train_images, train_labels = _read_mnist_pair(
            found["train_images"], found["train_labels"]
        )
        n_train = _head("train_count", train_count, len(train_images))
        n_test = _head("test_count", test_count, len(test_images))
        train_images, train_labels = train_images[:n_train], train_labels[:n_train]
        test_images, test_labels = test_images[:n_test], test_labels[:n_test]
    else:
        n_train = 8000 if train_count is None else train_count
        n_test = 2000 if test_count is None else test_count
        total = len(test_images)
        if n_train + n_test > total:
            raise ValueError(
                f"train_count={n_train} plus test_count={n_test} exceed the {total} t10k "
                f"images in {root} (there are no train-* files, so both come from t10k)"
            )
        train_images, train_labels = test_images[:n_train], test_labels[:n_train]
        test_images, test_labels = test_images[total - n_test :], test_labels[total - n_test :]

    mean, std = _FASHION_STATS if fashion else _MNIST_STATS

    def pixels(images: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
        return (x - mean) / std

    return Dataset(
        "fashion-mnist" if fashion else "mnist",
        pixels(train_images), torch.from_numpy(train_labels.astype(np.int64)),
        pixels(test_images), torch.from_numpy(test_labels.astype(np.int64)),
        num_classes=10,
    )


# ---------------------------------------------------------------------------------------------
# CIFAR-10

_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
_CIFAR_STD = (0.2470, 0.2435, 0.2616)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        # "bytes": the batches were written by Python 2, whose str is bytes here
        batch = safe_load(f, encoding="bytes")
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    # real batches have bytes keys; accept str keys from batches re-pickled by Python 3
    entries = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in entries or "labels" not in entries:
        raise ValueError(f"{path}: a CIFAR-10 batch needs 'data' and 'labels' entries")
    data = np.asarray(entries["data"])
    labels = np.asarray(entries["labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(
            f"{path}: data must be uint8 of shape (N, 3072), got {data.dtype} {data.shape}"
        )
    if labels.shape != (len(data),):
        raise ValueError(f"{path}: {len(data)} images but labels of shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must be in 0..9")
    # rows are 1024 red, 1024 green, 1024 blue values, each row-major 32x32
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(
    root: str | Path,
    *,
    train_count: int | None = None,
    test_count: int | None = None,
    seed: int = 0,
) -> Dataset:
    """CIFAR-10 from its python batches (``data_batch_1`` .. ``data_batch_5``, ``test_batch``).

    ``root`` is the ``cifar-10-batches-py`` directory or one that contains it. The pickles are
    read by :func:`gossamer.train.safe_pickle.safe_load`, which builds numpy arrays and refuses
    every other global, so a tampered file cannot run code. Images become (N, 3, 32, 32)
    float32, normalised per channel by the usual CIFAR-10 mean and std; labels int64.

    Args:
        root: the directory.
        train_count, test_count: keep only the first this many examples (default: all).
        seed: unused (the split is fixed); accepted so that :func:`load_dataset` passes it alike.
    """
    del seed
    root = _check_dir(root)
    _check_count("train_count", train_count)
    _check_count("test_count", test_count)
    if not (root / "test_batch").is_file() and (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [name for name in names if not (root / name).is_file()]
    if missing:
        raise ValueError(
            f"data directory {root} lacks {', '.join(missing)}; expected {', '.join(names)} "
            "(CIFAR-10's python version, cifar-10-batches-py)"
        )
    train = [_read_cifar_batch(root / name) for name in names[:-1]]
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    x_test, y_test = _read_cifar_batch(root / "test_batch")
    n_train = _head("train_count", train_count, len(x_train))
    n_test = _head("test_count", test_count, len(x_test))
    mean = torch.tensor(_CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(_CIFAR_STD).view(1, 3, 1, 1)

    def pixels(images: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(images.astype(np.float32) / 255.0) - mean) / std

    return Dataset(
        "cifar10",
        pixels(x_train[:n_train]), torch.from_numpy(y_train[:n_train]),
        pixels(x_test[:n_test]), torch.from_numpy(y_test[:n_test]),
        num_classes=10,
    )


# ---------------------------------------------------------------------------------------------
# Plain text for the character-level language model


def load_text(path: str | Path, *, block_size: int = 64, val_fraction: float = 0.1) -> Dataset:
    """A character-level language-modelling data set from a UTF-8 text file.

    The vocabulary is the sorted set of the file's characters. The first ``1 - val_fraction``
    of the text is for training, the rest for validation. Each part is cut into non-overlapping
    windows of ``block_size + 1`` characters (a short tail is dropped): x is a window's first
    ``block_size`` characters and y the same shifted by one, the next character at every position.

    Args:
        path: the text file.
        block_size: context length of the model (default 64).
        val_fraction: share of the text held out for validation (default 0.1).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"text file {path} is a directory: the text data set reads one "
                         "plain-text file")
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"text file {path} is not UTF-8 text (byte "
                         f"{error.object[error.start]:#04x} at offset {error.start}): the text "
                         "data set reads a plain-text file") from None
    vocab = "".join(sorted(set(text)))
    index = {ch: i for i, ch in enumerate(vocab)}
    codes = np.fromiter((index[ch] for ch in text), dtype=np.int64, count=len(text))
    cut = int(len(codes) * (1 - val_fraction))
    window = block_size + 1

    def windows(part: np.ndarray, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(part) // window
        if n == 0:
            raise ValueError(
                f"{path}: the {which} part has {len(part)} characters, fewer than one window of "
                f"block_size + 1 = {window}; use a longer text or a smaller block_size"
            )
        w = torch.from_numpy(part[: n * window].reshape(n, window))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    x_train, y_train = windows(codes[:cut], "training")
    x_test, y_test = windows(codes[cut:], "validation")
    return Dataset(
        "text", x_train, y_train, x_test, y_test, num_classes=len(vocab), vocab=vocab
    )


def unigram_loss(dataset: Dataset) -> float:
    """Cross-entropy (nats per character) of a unigram model on the validation targets.

    The character frequencies are counted over the training windows (add-one smoothed, so a
    character absent from training costs a finite loss) and evaluated on ``y_test``, the same
    positions a language model's validation loss averages over: the baseline it must beat.
    """
    if dataset.vocab is None:
        raise ValueError(f"dataset {dataset.name!r} is not a text data set (it has no vocab)")
    # every character of every training window: x plus the last target
    train_chars = torch.cat([dataset.x_train.flatten(), dataset.y_train[:, -1]])
    counts = torch.bincount(train_chars, minlength=dataset.num_classes).double() + 1.0
    log_p = torch.log(counts / counts.sum())
    return float(-log_p[dataset.y_test.flatten()].mean())


# ---------------------------------------------------------------------------------------------
# The user's own torch.utils.data.Dataset

#: Share of a single data set that a factory returns held out for evaluation.
USER_TEST_FRACTION = 0.2


def _is_label(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        inexact = value.is_floating_point() or value.is_complex()
        return not inexact and value.dtype != torch.bool
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _materialise(data: Any, spec: str, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack every ``(x, y)`` item of one data set into tensors (x, y)."""
    if isinstance(data, torch.utils.data.IterableDataset):
        items = list(data)
    else:
        items = [data[i] for i in range(len(data))]
    if not items:
        raise ValueError(f"dataset {spec!r}: the {which} set is empty")
    xs, ys = [], []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValueError(f"dataset {spec!r}: {which} item {i} is a {type(item).__name__}, "
                             "not a pair (x, y)")
        x, y = item
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"dataset {spec!r}: {which} item {i}'s x is a {type(x).__name__}, "
                             "not a tensor")
        if not _is_label(y):
            raise ValueError(
                f"dataset {spec!r}: {which} item {i}'s y is {y!r}, not an integer class label "
                "(or a tensor of class indices)")
        y = torch.as_tensor(y, dtype=torch.int64)
        for name, value, first in (("x", x, xs), ("y", y, ys)):
            if first and (value.shape != first[0].shape or value.dtype != first[0].dtype):
                raise ValueError(
                    f"dataset {spec!r}: {which} item {i}'s {name} is {value.dtype} of shape "
                    f"{tuple(value.shape)}, item 0's {first[0].dtype} of shape "
                    f"{tuple(first[0].shape)}: every item must be alike")
        xs.append(x)
        ys.append(y)
    return torch.stack(xs), torch.stack(ys)


def _declared_classes(data: Any, spec: str) -> int | None:
    """``num_classes`` or ``len(classes)`` of the data set, if it declares either."""
    declared = getattr(data, "num_classes", None)
    if declared is None and getattr(data, "classes", None) is not None:
        declared = len(data.classes)
    if declared is None:
        return None
    if not isinstance(declared, int | np.integer) or declared < 1:
        raise ValueError(f"dataset {spec!r}: num_classes is {declared!r}, not an integer >= 1")
    return int(declared)


def load_user_dataset(
    spec: str, seed: int = 0, *, path: str | Path | None = None, **options: Any
) -> Dataset:
    """The user's own data set: what ``factory()`` from ``spec`` returns, as tensors.

    ``spec`` is ``pkg.module:factory``, imported with the current directory on ``sys.path``.
    The factory returns a pair ``(train, test)`` of ``torch.utils.data.Dataset`` or a single
    one, of which a seeded shuffle holds out :data:`USER_TEST_FRACTION` (20%) for evaluation,
    the same for every run. Each item is ``(x, y)``: x a tensor (or numpy array), all of one
    shape and dtype; y an integer class label, or an integer tensor of class indices (one per
    position, for a sequence model). Every item is read once and stacked in memory.
    ``num_classes`` is the data set's ``num_classes`` attribute, else ``len(classes)``, else the
    largest label + 1. Errors are ``ValueError`` naming ``dataset``.

    Args:
        spec: ``MODULE:FACTORY``.
        seed: the shuffle that splits a single data set.
        path: passed to the factory as ``path=``; only if it has a ``path`` parameter.
        **options: further keyword arguments for the factory.
    """
    factory = import_factory(spec, "dataset")
    takes = parameters(factory)
    if path is not None:
        if "path" not in takes and "*" not in takes:
            raise ValueError(f"dataset {spec!r} takes no data path (its factory has no `path` "
                             f"argument), got {path}")
        options = {**options, "path": str(path)}
    result = call_factory(factory, spec, "dataset", options,
                          hint="; a data set factory takes nothing, or path")
    datasets = torch.utils.data.Dataset
    if isinstance(result, datasets):
        x, y = _materialise(result, spec, "data")
        if len(y) < 2:
            raise ValueError(f"dataset {spec!r} holds {len(y)} example: at least 2 are needed "
                             "to hold some out for evaluation")
        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
        n_test = max(1, round(len(y) * USER_TEST_FRACTION))
        train, test = order[:-n_test], order[-n_test:]
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
        declared = _declared_classes(result, spec)
    elif (isinstance(result, tuple | list) and len(result) == 2
          and all(isinstance(part, datasets) for part in result)):
        x_train, y_train = _materialise(result[0], spec, "train")
        x_test, y_test = _materialise(result[1], spec, "test")
        if x_train.shape[1:] != x_test.shape[1:] or y_train.shape[1:] != y_test.shape[1:]:
            raise ValueError(
                f"dataset {spec!r}: train items are x {tuple(x_train.shape[1:])}, y "
                f"{tuple(y_train.shape[1:])}; test items x {tuple(x_test.shape[1:])}, y "
                f"{tuple(y_test.shape[1:])}: they must be alike")
        declared = _declared_classes(result[0], spec)
    else:
        raise ValueError(
            f"dataset {spec!r}: the factory returned a {type(result).__name__}, not a "
            "torch.utils.data.Dataset or a pair (train, test) of them")
    lowest = int(min(y_train.min(), y_test.min()))
    largest = int(max(y_train.max(), y_test.max()))
    if lowest < 0:
        raise ValueError(f"dataset {spec!r}: label {lowest} is negative")
    num_classes = largest + 1 if declared is None else declared
    if largest >= num_classes:
        raise ValueError(f"dataset {spec!r}: label {largest} is out of range for its "
                         f"num_classes={num_classes}")
    return Dataset(spec, x_train, y_train, x_test, y_test, num_classes=num_classes)


# ---------------------------------------------------------------------------------------------
# By name

# name -> (loader, whether it reads a path)
_LOADERS: dict[str, tuple[Callable[..., Dataset], bool]] = {
    "digits": (load_digits, False),
    "mnist": (load_mnist, True),
    "fashion-mnist": (functools.partial(load_mnist, fashion=True), True),
    "cifar10": (load_cifar10, True),
    "text": (load_text, True),
}
DATASETS: tuple[str, ...] = tuple(_LOADERS)
_PATH_HINTS = {
    "mnist": "a directory of MNIST IDX files",
    "fashion-mnist": "a directory of Fashion-MNIST IDX files",
    "cifar10": "the cifar-10-batches-py directory",
    "text": "a plain-text file",
}


def load_dataset(
    name: str, seed: int = 0, *, path: str | Path | None = None, **options: Any
) -> Dataset:
    """Load a data set by name; ValueError listing the known names otherwise.

    Args:
        name: one of :data:`DATASETS`, or ``pkg.module:factory`` (:func:`load_user_dataset`).
        seed: for loaders with a random split (digits, a single user data set).
        path: the file or directory to read; required for all but ``"digits"``.
        **options: the loader's keyword arguments, e.g. ``train_count=8000`` for ``"mnist"``,
            ``block_size=128`` for ``"text"``.
    """
    if is_factory(name):
        return load_user_dataset(name, seed, path=path, **options)
    if name not in _LOADERS:
        raise ValueError(f"dataset {name!r} is unknown; known: {', '.join(DATASETS)}, or "
                         "MODULE:FACTORY for your own")
    loader, reads_path = _LOADERS[name]
    parameters = inspect.signature(loader).parameters
    accepted = set(parameters) - {"path", "root", "seed", "fashion"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"dataset {name!r} takes no option {unknown[0]!r}; "
            f"its options: {', '.join(sorted(accepted)) or 'none'}"
        )
    if not reads_path:
        if path is not None:
            raise ValueError(f"dataset {name!r} is embedded and takes no path, got {path}")
        return loader(seed=seed, **options)
    if path is None:
        raise ValueError(
            f"dataset {name!r} needs a data path (--data-path, or path=): {_PATH_HINTS[name]}"
        )
    if "seed" in parameters:
        options["seed"] = seed
    return loader(path, **options)


# ---------------------------------------------------------------------------------------------
# Partitions across workers


def partition_iid(num_examples: int, world_size: int, seed: int) -> list[np.ndarray]:
    """Shuffle the example indices (seeded) and deal them into ``world_size`` near-equal shards."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_examples < world_size:
        raise ValueError(
            f"world_size={world_size} exceeds the {num_examples} training examples: "
            "every worker needs at least one"
        )
    order = np.random.default_rng(seed).permutation(num_examples)
    return [shard.copy() for shard in np.array_split(order, world_size)]


def _class_labels(labels: Any) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(
            f"a label-skewed split needs one class label per example, got labels of shape "
            f"{labels.shape}; sequence data supports only scheme='iid'"
        )
    return labels


def partition_dirichlet(
    labels: np.ndarray,
    world_size: int,
    alpha: float,
    seed: int,
    min_size: int = 1,
    max_attempts: int = 100,
) -> list[np.ndarray]:
    """Non-IID label skew: each class is dealt to the workers in Dirichlet(alpha) proportions.

    The usual federated-learning split (Hsu et al., 2019, "Measuring the Effects of Non-Identical
    Data Distribution"; Wang et al., 2020, FedMA): for every class, proportions p ~ Dir(alpha)
    over the workers, and that class's shuffled examples are cut accordingly. Lower alpha, more
    skew: alpha -> 0 gives each class to few workers, large alpha approaches IID. Draws repeat
    (same seeded generator, at most ``max_attempts``) until every worker holds ``min_size``.

    Args:
        labels: one class label per training example (1-D).
        world_size: number of workers.
        alpha: Dirichlet concentration, > 0.
        seed: the split is a function of it.
        min_size: fewest examples any worker may get (default 1).
        max_attempts: draws before giving up with a ValueError (default 100).

    Returns one sorted index array per worker; together they cover every example once.
    """
    labels = _class_labels(labels)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not alpha > 0:  # also catches NaN
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    if len(labels) < world_size * min_size:
        raise ValueError(
            f"world_size={world_size} workers of min_size={min_size} need "
            f"{world_size * min_size} examples, there are {len(labels)}"
        )
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(max_attempts):
        parts: list[list[np.ndarray]] = [[] for _ in range(world_size)]
        for members in by_class:
            members = rng.permutation(members)
            p = rng.dirichlet(np.full(world_size, float(alpha)))
            cuts = np.floor(np.cumsum(p)[:-1] * len(members)).astype(np.int64)
            for worker, piece in enumerate(np.split(members, cuts)):
                parts[worker].append(piece)
        shards = [np.sort(np.concatenate(pieces)) for pieces in parts]
        if min(len(s) for s in shards) >= min_size:
            return shards
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split in {max_attempts} draws gave each of the "
        f"{world_size} workers min_size={min_size} examples; raise alpha or lower min_size"
    )


PARTITIONS = ("iid", "dirichlet")


def partition(
    labels: Any, world_size: int, scheme: str = "iid", alpha: float = 0.5, seed: int = 0
) -> list[np.ndarray]:
    """Split the training examples across workers by ``scheme``: one index array per worker.

    Args:
        labels: the training labels (1-D for ``"dirichlet"``; any shape for ``"iid"``).
        world_size: number of workers.
        scheme: ``"iid"`` (:func:`partition_iid`) or ``"dirichlet"``
            (:func:`partition_dirichlet`); sequence data supports only ``"iid"``.
        alpha: Dirichlet concentration, used by ``"dirichlet"`` only (default 0.5).
        seed: the split is a function of it (default 0).
    """
    if scheme == "iid":
        return partition_iid(len(labels), world_size, seed)
    if scheme == "dirichlet":
        return partition_dirichlet(_class_labels(labels), world_size, alpha, seed)
    raise ValueError(f"scheme {scheme!r} is unknown; known: {', '.join(PARTITIONS)}")


def describe_partition(
    shards: Sequence[np.ndarray], labels: Any, num_classes: int
) -> dict[str, Any]:
    """A JSON-friendly summary of a split, for the run's record.

    Returns ``{"sizes": [examples per worker], "class_counts": [[count per class] per worker]}``;
    for sequence data the class counts are over every target token of the worker's windows.
    """
    labels = np.asarray(labels)
    counts = [
        np.bincount(labels[np.asarray(s)].ravel(), minlength=num_classes).tolist()
        for s in shards
    ]
    return {"sizes": [len(s) for s in shards], "class_counts": counts}


class ShardSampler:
    """Endless minibatches of one worker's shard, reshuffled every local epoch (seeded).

    ``state_dict()`` / ``load_state_dict()`` carry the generator, epoch, order and position, so
    a resumed run draws the same batches as one that never stopped.
    """

    def __init__(self, indices: np.ndarray, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > len(indices):
            raise ValueError(
                f"batch_size={batch_size} is larger than this worker's shard of "
                f"{len(indices)} examples"
            )
        self.indices = indices
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self._order = self.rng.permutation(self.indices)
        self._position = 0

    def next_batch(self) -> torch.Tensor:
        batch = []
        while len(batch) < self.batch_size:
            if self._position == len(self._order):
                self._order = self.rng.permutation(self.indices)
                self._position = 0
                self.epoch += 1
            take = min(self.batch_size - len(batch), len(self._order) - self._position)
            batch.extend(self._order[self._position : self._position + take])
            self._position += take
        return torch.as_tensor(np.asarray(batch), dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        """Generator state, epoch, this epoch's order (a tensor) and the position in it."""
        return {
            "rng": self.rng.bit_generator.state,
            "epoch": self.epoch,
            "order": torch.as_tensor(np.asarray(self._order), dtype=torch.int64),
            "position": self._position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; ValueError if it belongs to another shard."""
        order = np.asarray(state["order"], dtype=np.int64)
        if not np.array_equal(np.sort(order), np.sort(np.asarray(self.indices))):
            raise ValueError("state['order'] is not a permutation of this sampler's shard")
        position = int(state["position"])
        if not 0 <= position <= len(order):
            raise ValueError(f"state['position']={position} is outside 0..{len(order)}")
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]  # raises if it is another kind of generator
        self.rng = rng
        self.epoch = int(state["epoch"])
        self._order = order.astype(np.asarray(self.indices).dtype, copy=False)
        self._position = position
