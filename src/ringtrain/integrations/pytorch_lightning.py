"""``ringtrain.integrations.lightning`` for the ``pytorch_lightning`` package
(``import pytorch_lightning as pl``): the same code, importing ``pytorch_lightning`` and
``lightning_fabric`` instead of ``lightning.pytorch`` and ``lightning.fabric``
(:mod:`ringtrain.integrations._flavor`)."""

from ringtrain.integrations._flavor import run_twin

run_twin(globals(), "lightning")
