"""Elastic training: lose workers (and get them back) without restarting from disk.

``ScalingConfig(num_workers=(min, max))`` turns it on; see docs/elastic.md. The worker side
(:mod:`ringtrain.elastic.worker`) keeps in-memory TrainState snapshots
(:mod:`ringtrain.elastic.snapshot`) and re-enters the train function after a resize; the driver
side (:mod:`ringtrain.elastic.policy`) decides between a resize in place and the full restart
from the disk checkpoint.
How the batch and the learning rate follow the world size (``elastic_batch_policy``) is
:mod:`ringtrain.elastic.batch`.
"""
