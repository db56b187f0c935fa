"""residual-store's internals: importable, but not the public API.

Names here change without notice. The public face is ``residual_store`` itself (its
``__all__``), ``residual_store.orbax``, ``residual_store.pipeline`` and the command line. A test
that reaches in here says so in its name (``test_internals_*``; ``tests/test_private_line.py``
checks).
"""
