"""Opening a store: ``create=False`` and ``read_only=True`` never make one, a read-only store
changes nothing on disk, and bad paths get the library's own errors with nothing written."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import residual_store as rs
from models import init_mlp, mlp_loss
from store_helpers import run_cli, run_cli_process


def snapshot(root) -> dict[str, tuple[int, int, str]]:
    """Every file and folder under ``root``: size, mtime and content digest."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.stat(path)
            digest = ""
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, root)] = (st.st_size if digest else 0, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def stored(tmp_path, rng):
    kp, kx, ky = jax.random.split(rng, 3)
    params = init_mlp(kp)
    batches = [
        (jax.random.normal(jax.random.fold_in(kx, i), (3, 8)), jax.random.normal(jax.random.fold_in(ky, i), (3, 4)))
        for i in range(2)
    ]
    fwd = rs.split(mlp_loss)
    root = tmp_path / "store"
    with rs.Store(root) as store:
        for i, (x, y) in enumerate(batches):
            store.put(fwd(params, x, y)[1], f"mb{i}")
    return root, fwd, params, batches


@pytest.mark.parametrize("options", [{"create": False}, {"read_only": True}])
def test_no_store_at_the_path_raises_and_creates_nothing(tmp_path, options):
    missing = tmp_path / "typo" / "store"
    with pytest.raises(rs.StoreNotFoundError, match="no such folder") as info:
        rs.Store(missing, **options)
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "typo").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(rs.StoreNotFoundError, match="not a residual store"):
        rs.Store(empty, **options)
    assert os.listdir(empty) == []
    with pytest.raises(rs.StoreNotFoundError):
        rs.Store({"driver": "memory", "path": "nothing/"}, **options)


@pytest.mark.slow
def test_a_read_only_store_reads_everything_and_changes_nothing(stored):
    root, fwd, params, batches = stored
    before = snapshot(root)
    with rs.Store(root, read_only=True, device_budget=0) as store:
        assert store.keys() == ["mb0", "mb1"] and "mb0" in store and len(store) == 2
        store.prefetch("mb1")
        for i, (x, y) in enumerate(batches):
            got = rs.backward(store.get(f"mb{i}"))
            want = jax.grad(mlp_loss)(params, x, y)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert store.stats()["disk"]["contexts"] == 2
        ctx = store.get("mb0")
        for call in (lambda: store.put(ctx, "new"), lambda: store.pop("mb0"),
                     lambda: store.delete("mb0"), lambda: store.gc(older_than=0)):
            with pytest.raises(rs.ReadOnlyStoreError, match="read_only=True") as info:
                call()
            assert isinstance(info.value, PermissionError)
        store.flush()
    assert snapshot(root) == before


@pytest.mark.subprocess
def test_the_command_line_only_reads_a_store_it_inspects(stored):
    root, *_ = stored
    before = snapshot(root)
    # the entry point's function in this process; the first command in a new process too
    assert _cli("ls", str(root)).returncode == 0
    for args in (["ls", str(root)], ["inspect", str(root), "mb0"], ["verify", str(root)], ["du", str(root)]):
        out = run_cli(*args)
        assert out.returncode == 0, out.stderr
    assert snapshot(root) == before
    # and a mistyped path is an error, not a new empty store
    typo = str(root) + "-typo"
    for command in ("ls", "verify", "gc", "du"):
        out = run_cli(command, typo)
        assert out.returncode == 2 and "no such folder" in out.stderr, (command, out.stderr)
    assert not os.path.exists(typo)


def test_a_path_that_is_a_file_or_a_folder_of_other_files_is_refused(tmp_path, rng):
    afile = tmp_path / "notes.txt"
    afile.write_text("my notes")
    with pytest.raises(rs.InvalidArgumentError, match="is a file"):
        rs.Store(afile)
    with pytest.raises(rs.StoreNotFoundError):
        rs.Store(afile, create=False)
    assert afile.read_text() == "my notes"
    project = tmp_path / "project"
    (project / "weights").mkdir(parents=True)  # someone's model checkpoint, say
    (project / "weights" / "w.npy").write_bytes(b"important")
    before = snapshot(project)
    with pytest.raises(rs.InvalidArgumentError, match="holds files but no residual store"):
        rs.Store(project)
    assert snapshot(project) == before


def test_a_store_that_lost_its_marker_is_told_how_to_restore_it(stored):
    """Not "give an empty folder" (writable) nor "open it with create=True" (read-only): advice
    that loops. Restored as said, it opens and verifies, nothing lost."""
    root = stored[0]
    marker = root / "residual-store.json"
    line = marker.read_text().strip()
    marker.unlink()
    before = snapshot(root)
    for kwargs in ({}, {"create": False}, {"read_only": True}):
        with pytest.raises(rs.CorruptContextError) as err:
            rs.Store(root, **kwargs)
        said = str(err.value)
        assert f"holds a residual store's contexts (contexts/) but not its marker {marker.name}" in said
        assert f"write the file {marker.name} again with the one line {line}" in said
        assert "create=True" not in said and "empty or new folder" not in said
    assert snapshot(root) == before  # nothing written
    out = run_cli("ls", str(root))
    assert out.returncode == 1 and "write the file residual-store.json again" in out.stdout + out.stderr, out
    marker.write_text(line + "\n")
    with rs.Store(root, read_only=True) as store:
        assert store.keys() == ["mb0", "mb1"] and store.verify().ok


def test_create_false_opens_an_existing_store(stored):
    root, fwd, params, batches = stored
    with rs.Store(root, create=False) as store:
        store.put(fwd(params, *batches[0])[1], "mb9")
    with rs.Store(root, read_only=True) as store:
        assert store.keys() == ["mb0", "mb1", "mb9"]


def test_bad_inputs_change_nothing_on_disk(stored):
    root, fwd, params, batches = stored
    before = snapshot(root)
    other = rs.split(lambda v: jnp.sum(jnp.sin(v)))
    with rs.Store(root, read_only=True) as store:
        ctx = store.get("mb0")
        with pytest.raises(rs.SignatureMismatchError):
            other.backward(ctx)
        with pytest.raises(rs.SignatureMismatchError, match="cotangent"):
            fwd.backward(ctx, jnp.ones((2,)))
        with pytest.raises(rs.SignatureMismatchError, match="cotangent leaf 0 must be float32"):
            rs.backward(ctx, {"a": jnp.float32(1.0)})
        with pytest.raises(rs.ContextNotFoundError):
            store.get("nope")
        with pytest.raises(rs.InvalidKeyError):
            store.get("../etc")
    assert snapshot(root) == before


@pytest.mark.subprocess
def test_processes_opening_a_new_store_at_once_all_succeed(tmp_path):
    """The processes of a job open one new store together: whichever writes the marker first,
    the others must not take its files for someone else's folder."""
    script = (
        "import sys, time, residual_store as rs\n"
        "start = float(sys.argv[2])\n"
        "while time.time() < start: time.sleep(0.001)\n"
        "for i in range(30):\n"
        "    rs.Store(f'{sys.argv[1]}/s{i}').close()\n"
    )
    import time

    start = time.time() + 4.0  # after every process has imported JAX
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(start)], stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert all((tmp_path / f"s{i}" / "residual-store.json").exists() for i in range(30))


# -- kvstore specs tensorstore refuses, object stores that do not answer ------------------------

BAD_SPECS = [
    {"driver": "fil", "path": "/nowhere"},  # a typo of "file"
    {"driver": "s3", "bucket": "Not_A_Bucket!", "path": "p/"},
    {"driver": "s3", "bucket": "residuals", "endpoint": "ftp://127.0.0.1:9"},
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The command line in a new process, with credentials for the S3 server (its own checks)."""
    return run_cli_process(*args, env={"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"})


def _one_line(out: subprocess.CompletedProcess, *words: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr)
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.mark.parametrize("spec", BAD_SPECS, ids=["driver", "bucket", "endpoint"])
def test_a_spec_tensorstore_refuses_is_invalid_argument(spec):
    with pytest.raises(rs.InvalidArgumentError, match="tensorstore refuses the kvstore spec"):
        rs.Store(spec)
    with pytest.raises(rs.InvalidArgumentError):
        rs.Store(spec, read_only=True)


@pytest.mark.subprocess
def test_the_command_line_refuses_a_bad_spec_in_one_line(aws_environment):
    """Every spec and command in this process (the entry point's function), and the first of
    each spec in a new process."""
    import json

    for spec in BAD_SPECS:
        for i, command in enumerate((["ls"], ["verify"], ["inspect", "--timeout", "1"], ["gc", "--dry-run"])):
            args = [command[0], json.dumps(spec), *(["k"] if command[0] == "inspect" else []), *command[1:]]
            _one_line((_cli if i == 0 else run_cli)(*args), "tensorstore refuses the kvstore spec")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _s3_spec(port: int) -> dict:
    return {"driver": "s3", "bucket": "residuals", "path": "run/", "endpoint": f"http://127.0.0.1:{port}",
            "aws_region": "us-east-1"}


@pytest.fixture
def aws_environment(monkeypatch):
    """Credentials in the environment (any values), as a user of an S3-compatible store has."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["closed", "silent"])
def test_an_object_store_that_does_not_answer_is_store_unavailable_within_the_timeout(aws_environment, where):
    """A closed port (connections refused: tensorstore's retries, fitted into the timeout, run
    out) and a listener that never answers (the wait runs out): rs.StoreUnavailableError, an
    OSError, within a generous bound of the 1 s timeout; nothing is created."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1] if where == "silent" else _closed_port()
        for options in ({}, {"read_only": True}):
            t0 = time.monotonic()
            with pytest.raises(rs.StoreUnavailableError, match="did not answer within the timeout of 1 s") as info:
                rs.Store(_s3_spec(port), timeout=1, **options)
            assert time.monotonic() - t0 < 30
            assert isinstance(info.value, OSError) and isinstance(info.value, rs.ResidualStoreError)


@pytest.mark.subprocess
def test_the_command_line_on_an_unreachable_object_store_says_so_in_one_line(aws_environment):
    """Each command in this process (the entry point's function), the first in a new process too."""
    import json
    import time

    spec = json.dumps(_s3_spec(_closed_port()))
    for i, command in enumerate((["ls", spec], ["ls", spec], ["verify", spec], ["inspect", spec, "k"], ["du", spec], ["rm", spec, "k"])):
        t0 = time.monotonic()
        out = (_cli if i == 0 else run_cli)(*command, "--timeout", "1")
        assert time.monotonic() - t0 < 60
        line = _one_line(out, "did not answer within --timeout 1 s", "CURL error", "a longer --timeout")
        assert not any(n in out.stderr for n in ("Failed to open file", "aws-error", "AuthCredentialsProvider")), line
    assert "positive number of seconds" in _cli("ls", spec, "--timeout", "0").stderr


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), True, "1"])
def test_a_bad_timeout_is_refused(tmp_path, timeout):
    with pytest.raises(rs.InvalidArgumentError, match="timeout"):
        rs.Store(tmp_path / "s", timeout=timeout)
    assert not (tmp_path / "s").exists()
