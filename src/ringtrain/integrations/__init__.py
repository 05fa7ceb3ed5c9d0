"""Bridges to training frameworks, each an optional extra.

* :mod:`ringtrain.integrations.lightning`: run a ``LightningModule`` with Lightning's own DDP
  strategy on ringtrain's workers (``pip install 'ringtrain[lightning]'``), for
  ``import lightning.pytorch as pl``; :mod:`ringtrain.integrations.pytorch_lightning` is the same
  bridge for ``import pytorch_lightning as pl`` (built from the same source,
  :mod:`ringtrain.integrations._flavor`); :mod:`ringtrain.integrations.lightning_ray` gives its
  classes Ray Train's names (``ringtrain.train.lightning`` picks the package in use).

Nothing here is imported by ``import ringtrain``: a framework is imported only when its bridge
module is.
"""
