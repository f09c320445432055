"""``python -m dspark``: the ``dspark`` command."""

import sys

from dspark.cli import main

sys.exit(main())
