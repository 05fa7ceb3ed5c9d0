"""``horovod.runner`` as far as Horovod's test helpers (``test/utils/common.py``) import it."""
