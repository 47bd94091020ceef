"""Data loaders, the restricted unpickler, partitions and the shard sampler."""

import gzip
import hashlib
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from gossamer.train.data import (
    DATASETS,
    ShardSampler,
    describe_partition,
    load_cifar10,
    load_dataset,
    load_idx,
    load_mnist,
    load_text,
    partition,
    partition_dirichlet,
    partition_iid,
    unigram_loss,
)
from gossamer.train.safe_pickle import safe_load

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
MNIST_DIR = SHARED / "mnist"
SHAKESPEARE = SHARED / "tinyshakespeare.txt"


# --------------------------------------------------------------------------------- IDX / MNIST


def md5sums() -> dict[str, str]:
    lines = (SHARED / "MD5SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split() for line in lines if line.strip())}


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: Path, array: np.ndarray) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


@pytest.mark.slow
def test_digits_are_scikit_learns_read_without_importing_it():
    # the bundled CSV read directly (a worker would pay a second to import scikit-learn):
    # the same pixels and labels as scikit-learn's own loader, and scikit-learn not imported
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sklearn_digits

    from gossamer.train.data import _digits_arrays, load_digits

    pixels, labels = _digits_arrays()
    bunch = sklearn_digits()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)
    digits = load_digits()
    assert digits.x_train.shape == (1438, 64) and digits.x_test.shape == (359, 64)
    assert float(digits.x_train.max()) == 1.0 and digits.y_train.dtype == torch.int64
    code = ("import sys; from gossamer.train.data import load_digits; load_digits(); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", ["images-idx3-ubyte", "images-idx3-ubyte.gz"])
def test_idx_round_trip(tmp_path, name):
    images = np.random.default_rng(0).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    loaded = load_idx(write_idx(tmp_path / name, images))
    assert loaded.dtype == np.uint8 and loaded.shape == (5, 4, 3)
    np.testing.assert_array_equal(loaded, images)
    labels = np.arange(7, dtype=np.uint8)
    np.testing.assert_array_equal(load_idx(write_idx(tmp_path / "labels.gz", labels)), labels)


def test_idx_bad_magic(tmp_path):
    path = tmp_path / "bad-idx"
    path.write_bytes(b"\x01\x00\x08\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match=r"bad-idx: bad IDX magic number 0x01000801"):
        load_idx(path)
    path.write_bytes(b"\x00\x00\x0d\x01" + (1).to_bytes(4, "big") + b"abcd")
    with pytest.raises(ValueError, match="data type 0x0d"):
        load_idx(path)


def test_idx_truncated_and_trailing(tmp_path):
    data = idx_bytes(np.zeros((4, 5), dtype=np.uint8))
    path = tmp_path / "short.gz"
    path.write_bytes(gzip.compress(data[:-3]))
    with pytest.raises(ValueError, match=r"short.gz: truncated: expected 20 bytes of data, "
                       r"found 17"):
        load_idx(path)
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(data)[:-10])  # the gzip stream itself is cut short
    with pytest.raises(ValueError, match="cut.gz: cannot decompress"):
        load_idx(path)
    path = tmp_path / "long"
    path.write_bytes(data + b"\x00")
    with pytest.raises(ValueError, match="trailing"):
        load_idx(path)


def test_idx_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        load_idx(tmp_path / "nothing-here")


def fake_t10k(root: Path, n: int = 50) -> tuple[np.ndarray, np.ndarray]:
    root.mkdir(exist_ok=True)
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = (np.arange(n) % 10).astype(np.uint8)
    write_idx(root / "t10k-images-idx3-ubyte.gz", images)
    write_idx(root / "t10k-labels-idx1-ubyte", labels)  # raw and .gz may be mixed
    return images, labels


def test_mnist_only_t10k_splits_first_and_last(tmp_path):
    images, labels = fake_t10k(tmp_path / "mnist")
    ds = load_mnist(tmp_path / "mnist", train_count=30, test_count=20)
    assert ds.x_train.shape == (30, 1, 28, 28) and ds.x_test.shape == (20, 1, 28, 28)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    np.testing.assert_array_equal(ds.y_train.numpy(), labels[:30])
    np.testing.assert_array_equal(ds.y_test.numpy(), labels[30:])
    expected = (images[30:].astype(np.float32) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(ds.x_test[:, 0].numpy(), expected, rtol=1e-6, atol=1e-6)
    # fewer than all: still the first and the last
    small = load_mnist(tmp_path / "mnist", train_count=10, test_count=5)
    np.testing.assert_array_equal(small.y_test.numpy(), labels[-5:])
    with pytest.raises(ValueError, match="train_count=40 plus test_count=20"):
        load_mnist(tmp_path / "mnist", train_count=40, test_count=20)
    fashion = load_dataset("fashion-mnist", path=tmp_path / "mnist", train_count=30, test_count=20)
    assert fashion.name == "fashion-mnist" and fashion.y_train.shape == (30,)


def test_mnist_with_train_files(tmp_path):
    root = tmp_path / "mnist"
    _, test_labels = fake_t10k(root, n=12)
    train_labels = (np.arange(40) % 10)[::-1].astype(np.uint8)
    write_idx(root / "train-images-idx3-ubyte", np.zeros((40, 28, 28), dtype=np.uint8))
    write_idx(root / "train-labels-idx1-ubyte.gz", train_labels)
    ds = load_mnist(root, train_count=25)
    np.testing.assert_array_equal(ds.y_train.numpy(), train_labels[:25])
    np.testing.assert_array_equal(ds.y_test.numpy(), test_labels)


def test_mnist_missing_directory_and_files(tmp_path):
    with pytest.raises(ValueError, match="data directory .*absent.* does not exist"):
        load_mnist(tmp_path / "absent")
    (tmp_path / "a-file").write_bytes(b"")
    for load in (load_mnist, load_cifar10):  # a file where a directory is wanted: say so
        with pytest.raises(ValueError, match="data directory .*a-file is not a directory"):
            load(tmp_path / "a-file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte"):
        load_mnist(tmp_path / "empty")
    root = tmp_path / "half"
    fake_t10k(root)
    write_idx(root / "train-images-idx3-ubyte", np.zeros((3, 28, 28), dtype=np.uint8))
    with pytest.raises(ValueError, match="lacks train-labels-idx1-ubyte"):
        load_mnist(root)


def test_mnist_labels_and_images_disagree(tmp_path):
    root = tmp_path / "m"
    fake_t10k(root, n=10)
    write_idx(root / "t10k-labels-idx1-ubyte", np.zeros(9, dtype=np.uint8))
    with pytest.raises(ValueError, match="10 images but .* 9 labels"):
        load_mnist(root, train_count=5, test_count=5)


@pytest.mark.skipif(not MNIST_DIR.is_dir(), reason="needs ../shared/data/mnist (the project's "
                    "shared data)")
def test_real_mnist():
    labels_file = MNIST_DIR / "t10k-labels-idx1-ubyte.gz"
    assert md5sums()["mnist/t10k-labels-idx1-ubyte.gz"] == hashlib.md5(
        labels_file.read_bytes()).hexdigest()  # the files the test expects
    ds = load_dataset("mnist", path=MNIST_DIR)
    assert ds.x_train.shape == (8000, 1, 28, 28) and ds.x_test.shape == (2000, 1, 28, 28)
    assert ds.y_train.shape == (8000,) and ds.y_test.shape == (2000,)
    assert int(ds.y_train.min()) == 0 and int(ds.y_train.max()) == 9
    assert set(ds.y_test.tolist()) == set(range(10))
    assert abs(float(ds.x_train.mean())) < 0.1  # normalised


# ------------------------------------------------------------------------------- CIFAR / pickle


def cifar_batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"fake batch",
        b"labels": [int(v) for v in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [b"x.png"] * n,
    }


class _Py2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 str (SHORT_BINSTRING), as CIFAR-10's real batches hold them."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_bytes(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + len(obj).to_bytes(4, "little") + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_bytes


def py2_pickle(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    _Py2Pickler(buffer, protocol=2).dump(obj)
    # numpy 1 named the module numpy.core, as the real files do
    return buffer.getvalue().replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")


def write_cifar(root: Path, n: int = 4, protocol: int = 4) -> dict[str, dict]:
    root.mkdir(parents=True)
    batches = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        batches[name] = cifar_batch(n, seed=i)
        data = py2_pickle(batches[name]) if protocol == 2 else pickle.dumps(
            batches[name], protocol=protocol)
        (root / name).write_bytes(data)
    return batches


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar_fake_batches(tmp_path, protocol):
    batches = write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    ds = load_cifar10(tmp_path)  # the parent directory is accepted too
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32)
    assert ds.y_train.dtype == torch.int64 and ds.x_train.dtype == torch.float32
    assert ds.y_train[:4].tolist() == batches["data_batch_1"][b"labels"]
    assert ds.y_train[16:].tolist() == batches["data_batch_5"][b"labels"]
    # pixel (image 0, green, row 1, col 2) of the test batch, normalised by the green stats
    raw = batches["test_batch"][b"data"][0, 1024 + 32 + 2]
    assert float(ds.x_test[0, 1, 1, 2]) == pytest.approx((raw / 255 - 0.4822) / 0.2435, abs=1e-5)
    small = load_dataset("cifar10", path=tmp_path / "cifar-10-batches-py", train_count=6)
    assert small.y_train.shape == (6,)


def test_cifar_missing_batches(tmp_path):
    root = tmp_path / "c"
    write_cifar(root)
    (root / "data_batch_3").unlink()
    with pytest.raises(ValueError, match="lacks data_batch_3"):
        load_cifar10(root)


class _System:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


class _Eval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


@pytest.mark.parametrize("payload, refused", [(_System(), "system"), (_Eval(), "builtins.eval")])
def test_malicious_pickle_is_refused(tmp_path, payload, refused):
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": payload, b"labels": []}))
    with open(path, "rb") as f, pytest.raises(pickle.UnpicklingError, match=refused):
        safe_load(f)
    # and through the CIFAR loader
    write_cifar(tmp_path / "cifar")
    (tmp_path / "cifar" / "test_batch").write_bytes(path.read_bytes())
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        load_cifar10(tmp_path / "cifar")


def test_safe_load_plain_containers(tmp_path):
    obj = {"a": [1, 2.5, b"x", "y"], "arr": np.arange(5, dtype=np.int64), "s": np.float32(2)}
    path = tmp_path / "p"
    path.write_bytes(pickle.dumps(obj))
    with open(path, "rb") as f:
        loaded = safe_load(f)
    assert loaded["a"] == [1, 2.5, b"x", "y"] and loaded["s"] == np.float32(2)
    np.testing.assert_array_equal(loaded["arr"], np.arange(5))


# ------------------------------------------------------------------------------------- text


def test_load_text_split_and_windows(tmp_path):
    text = "".join(chr(ord("a") + i % 7) for i in range(200))
    path = tmp_path / "t.txt"
    path.write_text(text)
    ds = load_text(path, block_size=8, val_fraction=0.1)
    assert ds.vocab == "abcdefg" and ds.num_classes == 7 and ds.input_shape == (8,)
    # train: first 180 characters -> 20 windows of 9; validation: last 20 -> 2 windows
    assert ds.x_train.shape == (20, 8) and ds.y_train.shape == (20, 8)
    assert ds.x_test.shape == (2, 8) and ds.x_train.dtype == torch.int64

    def decode(row):
        return "".join(ds.vocab[i] for i in row.tolist())

    assert decode(ds.x_train[0]) == text[0:8] and decode(ds.y_train[0]) == text[1:9]
    assert decode(ds.x_train[1]) == text[9:17]  # windows do not overlap
    assert decode(ds.x_test[0]) == text[180:188] and decode(ds.y_test[1]) == text[190:198]
    with pytest.raises(ValueError, match="validation part has 20 characters"):
        load_text(path, block_size=32)
    with pytest.raises(ValueError, match="val_fraction"):
        load_text(path, val_fraction=1.0)


def test_unigram_loss(tmp_path):
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghij"))
    path = tmp_path / "u.txt"
    path.write_text("".join(rng.choice(letters, 20_000)))
    ds = load_text(path, block_size=16)
    assert unigram_loss(ds) == pytest.approx(math.log(10), abs=0.01)
    skewed = tmp_path / "s.txt"
    skewed.write_text("a" * 9000 + "ab" * 500)  # val is all "ab": p(b) is small
    assert unigram_loss(load_text(skewed, block_size=8)) > math.log(2)
    with pytest.raises(ValueError, match="not a text data set"):
        unigram_loss(load_dataset("digits"))


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="needs ../shared/data/tinyshakespeare.txt "
                    "(the project's shared data)")
def test_real_tinyshakespeare():
    ds = load_dataset("text", path=SHAKESPEARE, block_size=64)
    assert len(ds.vocab) == 65 and ds.num_classes == 65
    assert ds.x_train.shape[1:] == (64,) and ds.x_train.shape[0] == 1_003_854 // 65
    assert 3.0 < unigram_loss(ds) < 3.5  # the character entropy of English-like text


# ----------------------------------------------------------------------------------- by name


def test_load_dataset_names_and_paths(tmp_path):
    assert DATASETS == ("digits", "mnist", "fashion-mnist", "cifar10", "text")
    with pytest.raises(ValueError, match="dataset 'imagenet' is unknown; known: digits, mnist"):
        load_dataset("imagenet")
    for name in ("mnist", "fashion-mnist", "cifar10", "text"):
        with pytest.raises(ValueError, match="needs a data path"):
            load_dataset(name)
    with pytest.raises(ValueError, match="takes no option 'colour'"):
        load_dataset("mnist", path=tmp_path, colour=True)
    digits = load_dataset("digits", seed=3)
    assert digits.x_train.shape == (1438, 64) and digits.vocab is None


# ------------------------------------------------------------------------------- partitions


def labels_of(n_per_class: int = 100, classes: int = 10) -> np.ndarray:
    return np.repeat(np.arange(classes), n_per_class)


def test_dirichlet_reproducible_disjoint_covering():
    labels = labels_of()
    a = partition_dirichlet(labels, 8, alpha=0.5, seed=4)
    b = partition_dirichlet(labels, 8, alpha=0.5, seed=4)
    c = partition_dirichlet(labels, 8, alpha=0.5, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    merged = np.concatenate(a)
    assert len(merged) == len(labels) and np.array_equal(np.sort(merged), np.arange(len(labels)))
    assert min(len(s) for s in a) >= 1


def test_dirichlet_small_alpha_is_skewed():
    labels = labels_of(200)

    def top_class_share(alpha):
        split = describe_partition(partition_dirichlet(labels, 10, alpha, seed=0), labels, 10)
        counts = np.array(split["class_counts"], dtype=float)
        return float(np.mean(counts.max(axis=1) / counts.sum(axis=1)))

    assert top_class_share(0.05) > 0.6  # most of a worker's data is one class
    assert top_class_share(1000.0) < 0.2  # near IID: ~1/10 per class


def test_dirichlet_min_size_and_bad_arguments():
    labels = labels_of(30)
    shards = partition_dirichlet(labels, 10, alpha=0.3, seed=1, min_size=10)
    assert min(len(s) for s in shards) >= 10
    for alpha in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha must be > 0"):
            partition_dirichlet(labels, 4, alpha=alpha, seed=0)
    with pytest.raises(ValueError, match="min_size=100"):
        partition_dirichlet(labels, 4, alpha=1.0, seed=0, min_size=100)
    with pytest.raises(ValueError, match="min_size=29"):  # possible, but never drawn
        partition_dirichlet(labels, 10, alpha=0.01, seed=0, min_size=29, max_attempts=3)


def test_partition_schemes_and_describe():
    labels = labels_of(10)
    iid = partition(labels, 4, scheme="iid", seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(iid, partition_iid(100, 4, 2), strict=True))
    non_iid = partition(labels, 4, scheme="dirichlet", alpha=0.1, seed=2)
    summary = describe_partition(non_iid, labels, 10)
    assert summary["sizes"] == [len(s) for s in non_iid] and sum(summary["sizes"]) == 100
    assert [sum(c) for c in summary["class_counts"]] == summary["sizes"]
    assert all(isinstance(v, int) for row in summary["class_counts"] for v in row)
    with pytest.raises(ValueError, match="scheme 'shards' is unknown"):
        partition(labels, 4, scheme="shards")
    sequences = np.zeros((20, 8), dtype=np.int64)
    assert len(partition(sequences, 4, scheme="iid")) == 4
    with pytest.raises(ValueError, match="only scheme='iid'"):
        partition(sequences, 4, scheme="dirichlet")


# --------------------------------------------------------------------------------- sampler


def test_sampler_batch_larger_than_shard():
    with pytest.raises(ValueError, match="batch_size=33 is larger than this worker's shard of 32"):
        ShardSampler(np.arange(32), batch_size=33, seed=0)


def test_sampler_covers_shard_each_epoch():
    shard = np.arange(10, 30)
    sampler = ShardSampler(shard, batch_size=5, seed=0)
    epoch = torch.cat([sampler.next_batch() for _ in range(4)])
    assert sorted(epoch.tolist()) == shard.tolist() and sampler.epoch == 0


def test_sampler_state_round_trip():
    shard = np.arange(100, 123)
    sampler = ShardSampler(shard, batch_size=5, seed=7)
    for _ in range(6):  # into the second epoch, mid-order
        sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(12)]
    resumed = ShardSampler(shard, batch_size=5, seed=999)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    for want in expected:
        assert torch.equal(resumed.next_batch(), want)
    # the state survives torch.save / weights_only loading, as in a checkpoint
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    again = ShardSampler(shard, batch_size=5, seed=1)
    again.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(again.next_batch(), expected[0])
    with pytest.raises(ValueError, match="not a permutation"):
        ShardSampler(np.arange(23), batch_size=5, seed=0).load_state_dict(state)
