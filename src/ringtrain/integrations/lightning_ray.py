"""Ray Train's Lightning names (``ray.train.lightning``) on ringtrain's Lightning bridge.

A Ray Train script's Lightning lines run unchanged::

    trainer = pl.Trainer(devices="auto", accelerator="auto", strategy=RayDDPStrategy(),
                         plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()])
    trainer = prepare_trainer(trainer)

Each name is the bridge's own class under Ray's name (:mod:`ringtrain.integrations.lightning`):
the strategies are Lightning's, the environment is :class:`RingtrainEnvironment`, the callback
:class:`RingtrainCallback` (it writes ``RayTrainReportCallback.CHECKPOINT_NAME``, so Ray's
resume snippet finds the file). Users import them from :mod:`ringtrain.train.lightning`, which
picks this module for ``import lightning.pytorch as pl`` and its twin
:mod:`ringtrain.integrations.pytorch_lightning_ray` for ``import pytorch_lightning as pl``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from ringtrain.integrations.lightning import (
    CHECKPOINT_FILE,
    RingtrainCallback,
    RingtrainDeepSpeedStrategy,
    RingtrainEnvironment,
    RingtrainFSDPStrategy,
    prepare_trainer,
)

__all__ = [
    "RayDDPStrategy",
    "RayDeepSpeedStrategy",
    "RayFSDPStrategy",
    "RayLightningEnvironment",
    "RayTrainReportCallback",
    "prepare_trainer",
]


class RayDDPStrategy(DDPStrategy):
    """Ray Train's ``RayDDPStrategy``: Lightning's ``DDPStrategy`` (``strategy="ddp"``), whose
    devices and node count :func:`prepare_trainer` sets from ringtrain's worker group."""


class RayFSDPStrategy(RingtrainFSDPStrategy):
    """Ray Train's ``RayFSDPStrategy``: :class:`RingtrainFSDPStrategy` (Lightning's
    ``FSDPStrategy``, which also runs on CPU workers)."""


class RayDeepSpeedStrategy(RingtrainDeepSpeedStrategy):
    """Ray Train's ``RayDeepSpeedStrategy``: :class:`RingtrainDeepSpeedStrategy` (Lightning's
    ``DeepSpeedStrategy``, which also runs on CPU workers)."""


class RayLightningEnvironment(RingtrainEnvironment):
    """Ray Train's ``RayLightningEnvironment``: :class:`RingtrainEnvironment` (rank, world size
    and rendezvous address from ``ringtrain.get_context()``)."""


class RayTrainReportCallback(RingtrainCallback):
    """Ray Train's ``RayTrainReportCallback``: :class:`RingtrainCallback`, which reports
    ``trainer.callback_metrics`` and a checkpoint at the end of every training epoch.

    Ray's resume snippet works: ``checkpoint.as_directory()`` holds
    ``os.path.join(ckpt_dir, RayTrainReportCallback.CHECKPOINT_NAME)``. (``prepare_trainer``
    already points a restarted Trainer at it; a ``ckpt_path`` passed to ``fit`` wins.)
    """

    CHECKPOINT_NAME = CHECKPOINT_FILE
