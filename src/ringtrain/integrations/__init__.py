"""Bridges to training frameworks, each an optional extra.

* :mod:`ringtrain.integrations.lightning`: run a ``LightningModule`` with Lightning's own DDP
  strategy on ringtrain's workers (``pip install 'ringtrain[lightning]'``).

Nothing here is imported by ``import ringtrain``: a framework is imported only when its bridge
module is.
"""
