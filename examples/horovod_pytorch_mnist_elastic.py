"""Elastic MNIST with Horovod's elastic API on ringtrain: training that survives a lost worker.

ringtrain's own example, written against ``horovod.torch.elastic`` as a Horovod user would
(Horovod's code is not vendored here). Everything that must survive a restart lives in one
``hvd.elastic.TorchState`` (model, optimizer, an ``ElasticSampler``, the epoch and the batch);
the training function is wrapped in ``@hvd.elastic.run``; ``state.commit()`` after every batch
makes a verified ringtrain checkpoint; a reset callback rescales the learning rate to the new
``hvd.size()``. When a worker dies, ringtrain restarts the group (``--max-failures``) and every
rank resumes from the last commit, and the sampler skips the samples already seen this epoch.

Run it (the model and data are those of ``examples/horovod_mnist.py``)::

    ringtrain run -np 2 --max-failures 1 examples/horovod_pytorch_mnist_elastic.py --epochs 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from horovod_mnist import ConvNet, Normalized, averaged, sharded
from mnist import load_data


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Elastic MNIST with the Horovod API on ringtrain")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.01, help="per worker; scaled by hvd.size()")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log-every", type=int, default=10, help="batches between progress lines")
    p.add_argument("--fp16-allreduce", action="store_true", help="hvd.Compression.fp16")
    p.add_argument("--data-dir", help="directory with MNIST's IDX files (default: the sample)")
    return p.parse_args()


def main() -> None:
    args = options()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_items, test_items = load_data(args.data_dir)
    train_set = Normalized(train_items)
    # An ElasticSampler re-shards what is left of the epoch whenever the group changes.
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = ConvNet()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(
        sgd,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Average,
    )

    def rescale_lr() -> None:  # the group may have grown or shrunk
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, train_sampler=sampler, epoch=1, batch=0
    )
    state.register_reset_callbacks([rescale_lr])

    @hvd.elastic.run
    def fit(state: hvd.elastic.TorchState) -> None:
        # On entry (first start or after a restart), state is rank 0's last commit.
        while state.epoch <= args.epochs:
            state.model.train()
            if state.batch == 0:  # a fresh epoch: reshuffle (a resumed one keeps its order)
                state.train_sampler.set_epoch(state.epoch)
            resumed_at = state.batch  # batches done; the loader yields only the unseen samples
            for i, (images, labels) in enumerate(loader):
                state.optimizer.zero_grad()
                loss = F.nll_loss(state.model(images), labels)
                loss.backward()
                state.optimizer.step()
                state.train_sampler.record_batch(i, args.batch_size)
                state.batch = resumed_at + i + 1
                if i % args.log_every == 0 and hvd.rank() == 0:
                    print(f"epoch {state.epoch} batch {state.batch}: loss {loss.item():.4f}")
                state.commit()
            state.epoch, state.batch = state.epoch + 1, 0

    fit(state)

    # every rank scores its shard of the test set; the averages are the same everywhere
    test_loader, test_sampler = sharded(Normalized(test_items), 1000)
    model.eval()
    loss_sum, correct = 0.0, 0.0
    with torch.no_grad():
        for images, labels in test_loader:
            log_probs = model(images)
            loss_sum += F.nll_loss(log_probs, labels, reduction="sum").item()
            correct += (log_probs.argmax(dim=1) == labels).sum().item()
    loss = averaged(loss_sum / len(test_sampler), "test_loss")
    accuracy = averaged(correct / len(test_sampler), "test_accuracy")
    if hvd.rank() == 0:
        print(
            f"\nTest set: Average loss: {loss:.4f}, Accuracy: {100 * accuracy:.2f}%\n", flush=True
        )


if __name__ == "__main__":
    main()
