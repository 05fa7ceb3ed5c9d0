"""The communication layer: DDP wrapping and communication hooks, fused asynchronous allreduce
and gradient compression (used by ``prepare_model`` and by :mod:`ringtrain.horovod`)."""
