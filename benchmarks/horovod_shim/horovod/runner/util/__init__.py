"""``horovod.runner.util`` (see :mod:`horovod.runner`)."""
