"""The library's logger: commits, failed writes and gc are logged with the process index."""

from __future__ import annotations

import logging

import jax

import residual_store as rs
from store_helpers import init_params, mlp_batch, mlp_loss

FWD = rs.split(mlp_loss)


def test_commits_and_gc_are_logged_with_the_process_index(tmp_path, caplog):
    params = init_params(jax.random.key(0))
    x, y = mlp_batch(jax.random.key(1), 4)
    with caplog.at_level(logging.DEBUG, logger="residual_store"), rs.Store(tmp_path / "s") as store:
        store.put(FWD(params, x, y)[1], "k")
        store.flush()
        store.delete("k")
        store.flush()
        store.gc(older_than=0)
    records = [r for r in caplog.records if r.name == "residual_store"]
    commits = [r for r in records if r.getMessage().startswith("[process 0] commit ")]
    assert len(commits) == 1 and commits[0].rs_fields["key"] == "k" and commits[0].rs_process == 0
    assert "[process 0] commit key='k'" in commits[0].getMessage()
    gcs = [r for r in records if r.getMessage().startswith("[process 0] gc ")]
    assert len(gcs) == 1 and gcs[0].levelno == logging.INFO and gcs[0].rs_fields["weights"] >= 1


def test_a_failed_put_is_a_warning(tmp_path, caplog, monkeypatch):
    params = init_params(jax.random.key(0))
    x, y = mlp_batch(jax.random.key(2), 4)
    with rs.Store(tmp_path / "s") as store:
        backend = store._persistence.disk.backend

        def full(temporary, key, *, fsync):  # the commit: the manifest renamed into place
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(backend, "publish", full)
        with caplog.at_level(logging.WARNING, logger="residual_store"):
            store.put(FWD(params, x, y)[1], "k")
            try:
                store.flush()
            except rs.StoreFullError:
                pass
        monkeypatch.undo()
    (warning,) = [r for r in caplog.records if r.name == "residual_store"]
    assert warning.levelno == logging.WARNING and "put failed key='k'" in warning.getMessage()


_UNCONFIGURED = r"""
import logging, sys
import residual_store as rs
logging.getLogger("residual_store").warning("put failed key='k'")  # as a failed write logs it
print("logged", file=sys.stdout)
"""


def test_nothing_is_printed_unless_the_application_configures_logging(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _UNCONFIGURED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "logged\n"
    assert done.stderr == ""  # no last-resort handler printing the WARNING (docs/store.md)
    configured = _UNCONFIGURED.replace("import residual_store as rs", "import residual_store as rs\nlogging.basicConfig()")
    done = subprocess.run([sys.executable, "-c", configured], capture_output=True, text=True, timeout=120)
    assert "put failed key='k'" in done.stderr  # and the application's own configuration still sees it
