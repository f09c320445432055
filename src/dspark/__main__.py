"""``python -m dspark``: the ``dspark`` command (torchrun's ``-m dspark train ...`` launches it)."""

from .cli import main

raise SystemExit(main())
