"""``python -m ringtrain``: the ``ringtrain`` command."""

import sys

from ringtrain.cli.main import main

sys.exit(main())
