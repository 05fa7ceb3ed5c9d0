# ruff: noqa
# fmt: off
"""Ray Train's ``torch_fashion_mnist_example.py`` (ray 2.60) ported to ringtrain.

Changed from Ray's file (docs/ray.md shows the diff): the three ``ray`` import lines; the data,
because FashionMNIST cannot be downloaded here: ``get_dataloaders`` builds a synthetic stand-in of
the same shape (28x28 images, 10 classes, labels a fixed function of the image; the sample count
is ``$FASHION_MNIST_SAMPLES``, default 6000, a sixth of it for the test set), so the torchvision
and filelock imports go; and the last line, which asked for 4 GPUs.
"""

import os
from typing import Dict

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import ringtrain as ray
from ringtrain.train import ScalingConfig
from ringtrain.train.torch import TorchTrainer


def synthetic_fashion_mnist(train: bool) -> TensorDataset:
    """Normalised 1x28x28 images (seeded; never the global RNG) and labels in [0, 10)."""
    samples = int(os.environ.get("FASHION_MNIST_SAMPLES", "6000"))
    n = samples if train else max(samples // 6, 1)
    g = torch.Generator().manual_seed(0 if train else 1)
    images = torch.randn(n, 1, 28, 28, generator=g)
    projection = torch.randn(28 * 28, 10, generator=torch.Generator().manual_seed(2))
    labels = (images.flatten(1) @ projection).argmax(1)
    return TensorDataset(images, labels)


def get_dataloaders(batch_size):
    # A synthetic stand-in for the FashionMNIST download (see the module docstring)
    training_data = synthetic_fashion_mnist(train=True)
    test_data = synthetic_fashion_mnist(train=False)

    # Create data loaders
    train_dataloader = DataLoader(training_data, batch_size=batch_size, shuffle=True)
    test_dataloader = DataLoader(test_data, batch_size=batch_size)

    return train_dataloader, test_dataloader


# Model Definition
class NeuralNetwork(nn.Module):
    def __init__(self):
        super(NeuralNetwork, self).__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 10),
            nn.ReLU(),
        )

    def forward(self, x):
        x = self.flatten(x)
        logits = self.linear_relu_stack(x)
        return logits


def train_func_per_worker(config: Dict):
    ray.train.torch.enable_reproducibility()

    lr = config["lr"]
    epochs = config["epochs"]
    batch_size = config["batch_size_per_worker"]

    # Get dataloaders inside the worker training function
    train_dataloader, test_dataloader = get_dataloaders(batch_size=batch_size)

    # [1] Prepare Dataloader for distributed training
    # Shard the datasets among workers and move batches to the correct device
    # =======================================================================
    train_dataloader = ray.train.torch.prepare_data_loader(train_dataloader)
    test_dataloader = ray.train.torch.prepare_data_loader(test_dataloader)

    model = NeuralNetwork()

    # [2] Prepare and wrap your model with DistributedDataParallel
    # Move the model to the correct GPU/CPU device
    # ============================================================
    model = ray.train.torch.prepare_model(model)

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    # Model training loop
    for epoch in range(epochs):
        if ray.train.get_context().get_world_size() > 1:
            # Required for the distributed sampler to shuffle properly across epochs.
            train_dataloader.sampler.set_epoch(epoch)

        model.train()
        for X, y in tqdm(train_dataloader, desc=f"Train Epoch {epoch}"):
            pred = model(X)
            loss = loss_fn(pred, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        test_loss, num_correct, num_total = 0, 0, 0
        with torch.no_grad():
            for X, y in tqdm(test_dataloader, desc=f"Test Epoch {epoch}"):
                pred = model(X)
                loss = loss_fn(pred, y)

                test_loss += loss.item()
                num_total += y.shape[0]
                num_correct += (pred.argmax(1) == y).sum().item()

        test_loss /= len(test_dataloader)
        accuracy = num_correct / num_total

        # [3] Report metrics to Ray Train
        # ===============================
        ray.train.report(metrics={"loss": test_loss, "accuracy": accuracy})


def train_fashion_mnist(num_workers=2, use_gpu=False):
    global_batch_size = 32

    train_config = {
        "lr": 1e-3,
        "epochs": 10,
        "batch_size_per_worker": global_batch_size // num_workers,
    }

    # Configure computation resources
    scaling_config = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)

    # Initialize a Ray TorchTrainer
    trainer = TorchTrainer(
        train_loop_per_worker=train_func_per_worker,
        train_loop_config=train_config,
        scaling_config=scaling_config,
    )

    # [4] Start distributed training
    # Run `train_func_per_worker` on all workers
    # =============================================
    result = trainer.fit()
    print(f"Training result: {result}")


if __name__ == "__main__":
    train_fashion_mnist(num_workers=4, use_gpu=torch.cuda.is_available())
