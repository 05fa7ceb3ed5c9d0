"""The pipelined model that :func:`ringtrain.parallel.pipeline.prepare_pipeline` returns: this
rank's stage(s) under the original model's parameter names, the schedule that runs them, and the
gradient sum of parameters tied across pp ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Unit = tuple[str, nn.Module]


class StageModule(nn.Module):
    """One stage: runs its units in order, each on the previous output. The units are registered
    under their names in the original model (``blocks.4`` as child ``4`` of a plain container
    ``blocks``), so ``state_dict`` keys are the model's own."""

    def __init__(self, units: Sequence[Unit]) -> None:
        super().__init__()
        for name, module in units:
            _attach(self, name, module)
        self._order = [name for name, _ in units]

    def forward(self, *args: Any) -> Any:
        out: Any = args[0] if len(args) == 1 else args
        for name in self._order:
            out = self.get_submodule(name)(out)
        return out


def _attach(root: nn.Module, name: str, module: nn.Module) -> None:
    *parents, leaf = name.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)


# ------------------------------------------------------------------------------ the model


@dataclasses.dataclass(frozen=True)
class _Tie:
    """A parameter held by stages on several pp ranks: its gradient is summed over ``group``."""

    name: str
    group: ProcessGroup


class PipelineModel(nn.Module):
    """This rank's stage(s) of a pipelined model, built by :func:`prepare_pipeline`.

    Its parameters (``parameters()``, ``state_dict()``) are this rank's stages' under the
    original model's names: build the optimizer over them, register it in a
    :class:`ringtrain.TrainState`, which saves every rank's stages with
    ``torch.distributed.checkpoint``. Train with :meth:`step`, not by calling the module.

    Attributes:
        stage_indices: the indices of this rank's stages (0 is the first of the pipeline).
        num_stages: stages over all pp ranks.
        microbatches: the number of microbatches a batch is cut into.
        schedule_name: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``.
    """

    def __init__(
        self,
        stages: Sequence[tuple[int, StageModule, nn.Module]],
        num_stages: int,
        microbatches: int,
        schedule: str,
        pp_group: ProcessGroup,
        device: torch.device,
    ) -> None:
        super().__init__()
        for _, chain, _ in stages:
            for name in chain._order:
                _attach(self, name, chain.get_submodule(name))
        self.stage_indices = [index for index, _, _ in stages]
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.schedule_name = schedule
        self._wrapped = [wrapped for _, _, wrapped in stages]  # not registered: names stay
        self._pp_group = pp_group
        self._device = device
        self._ties: list[_Tie] = []  # set by prepare_pipeline (tie_groups)
        self._schedule: Any = None
        self._loss_fn: LossFn | None = None
        self._shapes: list[tuple[int, ...]] | None = None  # of the first batch

    saves_with_dcp = True
    """:class:`ringtrain.TrainState` saves this model and its optimizer with DCP (each rank holds
    other parameters)."""

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first stage (it feeds the inputs)."""
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it computes the loss)."""
        return self.num_stages - 1 in self.stage_indices

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a PipelineModel is trained with model.step(x, target=y, loss_fn=...), not called: "
            "its stages run on several ranks"
        )

    def step(
        self, *inputs: torch.Tensor, target: torch.Tensor | None = None, loss_fn: LossFn
    ) -> torch.Tensor | None:
        """One pipelined forward and backward of a batch; gradients accumulate in the stages'
        parameters (call ``optimizer.step()`` and ``zero_grad()`` as usual). Every pp rank
        calls it, with the same batch (``prepare_data_loader`` gives pp peers the same one);
        the first stage uses ``inputs``, the last ``target``, the others neither.

        Args:
            inputs: the model's inputs, batch first (``B`` must be a multiple of
                ``microbatches``); cut into ``microbatches`` along dimension 0. Every call must
                pass batches of the shape of the first (the stages set up their buffers then).
            target: the loss target, batch first, cut the same way.
            loss_fn: ``loss_fn(output, target) -> scalar``, a mean over the microbatch: the
                gradients are divided by ``microbatches``, so they equal those of the mean loss
                over the whole batch (as one process computes it).

        Returns:
            On the rank of the last stage, the detached loss of each microbatch, shape
            ``(microbatches,)`` (``.mean()`` is the batch's loss); ``None`` on the other ranks.

        Raises:
            ValueError: the batch size is not a multiple of ``microbatches``; no inputs on the
                first stage or no target on the last.
        """
        self._check_batch(inputs, target)
        schedule = self._schedule_for(loss_fn)
        losses: list[torch.Tensor] = []
        args = inputs if self.is_first else ()
        schedule.step(
            *args, target=target if self.is_last else None, losses=losses, return_outputs=False
        )
        self._sync_ties()
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses])

    @torch.no_grad()
    def eval_step(
        self, *inputs: torch.Tensor, target: torch.Tensor | None = None, loss_fn: LossFn
    ) -> torch.Tensor | None:
        """The forwards of :meth:`step` only (evaluation): no gradients, no backward.

        Returns:
            On the last stage's rank the loss of each microbatch, shape ``(microbatches,)``;
            ``None`` on the other ranks.
        """
        self._check_batch(inputs, target)
        losses: list[torch.Tensor] = []
        args = inputs if self.is_first else ()
        self._schedule_for(loss_fn).eval(
            *args, target=target if self.is_last else None, losses=losses
        )
        return torch.stack(losses) if self.is_last else None

    def _check_batch(self, inputs: Sequence[torch.Tensor], target: torch.Tensor | None) -> None:
        if self.is_first and not inputs:
            raise ValueError("PipelineModel.step: the first stage needs the inputs: step(x, ...)")
        if self.is_last and target is None:
            raise ValueError("PipelineModel.step: the last stage needs step(..., target=y)")
        for what, t in [("inputs", x) for x in inputs] + [("target", target)]:
            if t is not None and t.shape[0] % self.microbatches:
                raise ValueError(
                    f"PipelineModel.step: the batch size {t.shape[0]} of the {what} is not a "
                    f"multiple of microbatches={self.microbatches} (use a batch size of "
                    f"{self.microbatches} x k, or prepare_pipeline(microbatches=...) dividing "
                    f"{t.shape[0]})"
                )
        shapes = [tuple(t.shape) for t in [*inputs, target] if t is not None]
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError(
                f"PipelineModel.step: batches of shape {shapes}, but the stages were set up for "
                f"{self._shapes} at the first step (the stages exchange activation shapes once): "
                "give every step and eval_step batches of one shape (DataLoader(drop_last=True))"
            )

    def _schedule_for(self, loss_fn: LossFn) -> Any:
        """The schedule, built once (its first step exchanges the stages' shapes); the loss
        function of each call is looked up through ``self._loss_fn``, so a new one (a lambda
        made every step) costs nothing."""
        self._loss_fn = loss_fn
        if self._schedule is None:
            self._schedule = _build_schedule(self, self._current_loss)
        return self._schedule

    def _current_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def _sync_ties(self) -> None:
        import torch.distributed as dist

        for tie in self._ties:
            param = self.get_parameter(tie.name)  # FSDP/TP replace parameter objects: by name
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=tie.group)


def _build_schedule(model: PipelineModel, loss_fn: LossFn) -> Any:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    stages: list[Any] = [
        PipelineStage(wrapped, index, model.num_stages, model._device, group=model._pp_group)
        for index, wrapped in zip(model.stage_indices, model._wrapped, strict=True)
    ]
    if model.schedule_name == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(stages, model.microbatches, loss_fn=loss_fn)
    single = ScheduleGPipe if model.schedule_name == "GPipe" else Schedule1F1B
    return single(stages[0], model.microbatches, loss_fn=loss_fn)


def tie_groups(
    stage_units: Sequence[Sequence[Unit]], mesh: DeviceMesh, mine: Sequence[int]
) -> list[_Tie]:
    """Parameters held by stages on two or more pp ranks (tied weights), each with a process
    group over those pp ranks at this rank's data-parallel and TP coordinates; called before
    wrapping (it needs the names only). Every rank creates every group, in the same order
    (``new_group`` is a collective).

    Returns:
        For each tied parameter this rank holds: its name in this rank's stages and the group.
    """
    import torch.distributed as dist

    pp = mesh["pp"].size()
    owners: dict[int, dict[int, str]] = {}  # id(param) -> {stage: name in that stage}
    for index, units in enumerate(stage_units):
        for unit_name, module in units:
            for pname, p in module.named_parameters(remove_duplicate=False):
                owners.setdefault(id(p), {}).setdefault(index, f"{unit_name}.{pname}")
    shared = sorted(
        sorted(held.items()) for held in owners.values() if len({i % pp for i in held}) > 1
    )
    grid = mesh.mesh.reshape(pp, -1)  # (pp, the other coordinates)
    me = dist.get_rank()
    ties = []
    for held in shared:
        pp_ranks = sorted({index % pp for index, _ in held})
        local = [name for index, name in held if index in mine]
        for column in range(grid.shape[1]):
            members = [int(grid[r, column]) for r in pp_ranks]
            group = dist.new_group(members)
            if me in members:
                ties.append(_Tie(local[0], group))
    return ties
