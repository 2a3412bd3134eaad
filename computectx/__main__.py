"""``python -m computectx``: the same as the ``computectx`` console script."""

import sys

from computectx.cli import main

sys.exit(main())
