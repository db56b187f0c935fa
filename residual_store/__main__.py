"""``python -m residual_store``: the command line (see :mod:`residual_store.cli`)."""

from residual_store.cli import main

raise SystemExit(main())
