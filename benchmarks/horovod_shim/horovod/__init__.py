"""A package named ``horovod`` whose ``horovod.torch`` is :mod:`ringtrain.horovod`.

Only for running Horovod's own test module against ringtrain (``benchmarks/horovod_test_module.py``
puts this folder first on ``PYTHONPATH``): ``import horovod.torch as hvd`` then binds
``ringtrain.horovod`` itself. The ranks come from the variables ``horovodrun --gloo`` sets
(``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
``HOROVOD_CROSS_RANK``); they are copied to the torchrun names ringtrain reads (``RANK``,
``WORLD_SIZE``...) when those are unset. ``MASTER_ADDR``/``MASTER_PORT`` name the rendezvous.
"""

from __future__ import annotations

import os
import sys

_NAMES = {
    "HOROVOD_RANK": "RANK",
    "HOROVOD_SIZE": "WORLD_SIZE",
    "HOROVOD_LOCAL_RANK": "LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE": "LOCAL_WORLD_SIZE",
    "HOROVOD_CROSS_RANK": "GROUP_RANK",
}
for _hvd_name, _torch_name in _NAMES.items():
    if _hvd_name in os.environ:
        os.environ.setdefault(_torch_name, os.environ[_hvd_name])

import ringtrain.horovod as torch  # noqa: E402  (after the variables above)

sys.modules[__name__ + ".torch"] = torch
