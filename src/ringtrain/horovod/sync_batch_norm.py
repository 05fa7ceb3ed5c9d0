"""``hvd.SyncBatchNorm``: batch normalisation with statistics over the global batch.

On CUDA this is ``torch.nn.SyncBatchNorm`` unchanged. torch's implementation refuses CPU tensors,
so on CPU (gloo) the training-mode forward computes the global mean and variance itself: each
rank's per-channel ``(sum, sum of squares, count)`` are summed with one differentiable allreduce
(its backward is the allreduce of the gradient, so the gradients are those of batch norm over the
concatenated batch), and the running statistics use the unbiased global variance, as torch does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _SumAllranks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        dist.all_reduce(out)
        return out


class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """``torch.nn.SyncBatchNorm`` that also works on CPU under gloo.

    Args: as ``torch.nn.SyncBatchNorm`` (``num_features``, ``eps``, ``momentum``, ``affine``,
    ``track_running_stats``). Input: ``(N, C, *)``.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if input.device.type != "cpu" or not self.training or not distributed:
            if input.device.type == "cpu" and self.training and not distributed:
                return torch.nn.functional.batch_norm(
                    input,
                    self.running_mean,
                    self.running_var,
                    self.weight,
                    self.bias,
                    True,
                    self._momentum(),
                    self.eps,
                )
            return super().forward(input)
        return self._cpu_sync_forward(input)

    def _momentum(self) -> float:
        if self.momentum is None:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
            return 1.0 / float(self.num_batches_tracked)
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        return float(self.momentum)

    def _cpu_sync_forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = _SumAllranks.apply(stats)
        c = x.shape[1]
        n = total[2 * c]
        mean = total[:c] / n
        var = total[c : 2 * c] / n - mean * mean
        if self.track_running_stats and self.running_mean is not None:
            momentum = self._momentum()
            with torch.no_grad():
                unbiased = var.detach() * (n.detach() / (n.detach() - 1).clamp(min=1))
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                assert self.running_var is not None
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y
