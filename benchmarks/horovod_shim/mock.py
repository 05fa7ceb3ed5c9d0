"""The ``mock`` package's API (``import mock`` in Horovod's test helpers) from the standard
library's :mod:`unittest.mock`, so that the runner needs no extra package."""

from unittest.mock import *  # noqa: F403
from unittest.mock import patch  # noqa: F401
