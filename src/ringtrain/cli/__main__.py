"""``python -m ringtrain.cli``: the ``ringtrain`` command."""

import sys

from ringtrain.cli.main import main

sys.exit(main())
