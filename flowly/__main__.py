"""``python -m flowly``: the ``flowly`` command line (see :mod:`flowly.cli`)."""

from .cli import main

raise SystemExit(main())
