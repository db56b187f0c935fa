"""What a store's path can be, and that none goes silently elsewhere (issue 36, section 3).

A kvstore URL (``file://``, ``memory://``, ``s3://``, ``gs://``) is the kvstore it names, not a
folder ``./s3:/bucket/...`` in the current folder; any other ``scheme://`` is refused; a leading
``~`` is the user's home, not a folder named ``~``; a location that cannot be written is refused
when a store opens to write there (with a real read-only mount where this process may make one,
and with ``os.access`` faked everywhere), while ``read_only=True`` still reads it. The command
line takes the same paths. Also: a ``str`` subclass key that says another key is refused as a
key, and a compilation cache folder that is a file is refused naming it.
"""

from __future__ import annotations

import contextlib
import enum
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import residual_store as rs
import s3_server
from residual_store.cli import main as cli
from store_helpers import graded_version


def _check(ctx, expected) -> None:
    np.testing.assert_allclose(rs.backward(ctx), expected, rtol=1e-5, atol=1e-6)


def _everything_under(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), folder) for d, ds, fs in os.walk(folder) for n in ds + fs)


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty current folder: a path taken literally would show up in it."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


# -- kvstore URLs --------------------------------------------------------------------------------


def test_a_file_url_is_that_folder_and_a_memory_url_is_memory(tmp_path, cwd):
    ctx, expected = graded_version(0)
    folder = tmp_path / "runs" / "a"
    with rs.Store(f"file://{folder}") as store:
        store.put(ctx, "mb0")
    assert (folder / "residual-store.json").is_file()
    with rs.Store(str(folder), read_only=True) as store:  # the same store, by its folder
        _check(store.get("mb0"), expected)
    memory = f"memory://runs-{uuid.uuid4().hex[:8]}/a/"  # this process's memory kvstore
    with rs.Store(memory, device_budget=0, host_budget=0) as store:  # nothing kept in the tiers
        store.put(ctx, "mb0")
    with rs.Store(memory, read_only=True) as store:
        assert store.stats()["disk"]["contexts"] == 1
        _check(store.get("mb0"), expected)
    assert _everything_under(cwd) == []


def test_an_s3_url_is_the_object_store_not_a_local_folder(cwd, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "residual-store-test")  # no SDK noise about ~/.aws
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "residual-store-test")
    with pytest.raises(rs.ResidualStoreError, match="my-bucket") as info:
        rs.Store("s3://my-bucket/run-17", timeout=1)  # no such endpoint from here
    assert isinstance(info.value, rs.StoreUnavailableError), info.value
    assert "'driver': 's3'" in str(info.value) and "run-17" in str(info.value)
    assert _everything_under(cwd) == []  # not ./s3:/my-bucket/run-17


@pytest.mark.subprocess
@pytest.mark.skipif(not s3_server.available(), reason="moto[s3] and flask are in the test extra")
def test_internals_s3_url_resolves_to_the_s3_spec_that_round_trips():
    """An ``s3://`` URL cannot carry an endpoint (tensorstore 0.1.86 reads no ``AWS_ENDPOINT_URL``
    for its ``s3`` driver): the URL gives the bucket and path, and that very spec with the local
    server's endpoint added is a store that round-trips."""
    import tensorstore as ts

    from residual_store._src.store.disk.backends import resolve_path

    run = f"run-{uuid.uuid4().hex[:8]}"
    spec = resolve_path(f"s3://residuals/{run}/")
    assert spec == {"driver": "s3", "bucket": "residuals", "path": f"{run}/"}
    assert resolve_path(f"gs://residuals/{run}") == {"driver": "gcs", "bucket": "residuals", "path": run}
    ctx, expected = graded_version(0)
    with s3_server.serving("residuals") as server:
        where = {**spec, "endpoint": server.endpoint, "aws_region": s3_server.REGION}
        with rs.Store(where) as store:
            store.put(ctx, "mb0")
        with rs.Store(where, read_only=True) as store:
            _check(store.get("mb0"), expected)
        kv = ts.KvStore.open({"driver": "s3", "bucket": "residuals", "endpoint": server.endpoint,
                              "aws_region": s3_server.REGION, "aws_credentials": {"type": "environment"}}).result()
        keys = [k.decode() for k in kv.list().result()]
    assert f"{run}/residual-store.json" in keys and f"{run}/contexts/mb0.manifest" in keys


@pytest.mark.parametrize(
    "url, message",
    [
        ("foo://bucket/x", "does not open foo:// URLs"),
        ("http://example.com/x", "does not open http:// URLs"),  # tensorstore's http is read-only
        ("file://relative/x", "not a kvstore URL tensorstore reads"),
        ("s3://bucket/x?versionId=1", "not a kvstore URL tensorstore reads"),
        ("memory://|zip:", "'zip' kvstore, which a store cannot write"),
    ],
)
def test_other_schemes_and_bad_urls_are_refused_and_nothing_is_made(cwd, url, message):
    with pytest.raises(rs.InvalidArgumentError, match=message):
        rs.Store(url)
    assert _everything_under(cwd) == []


@pytest.mark.parametrize(
    "given, meant",
    [
        (Path("s3://bucket/x"), "s3://bucket/x"),  # pathlib makes it s3:/bucket/x
        ("s3:/bucket/x", "s3://bucket/x"),
        ("gs:/bucket/run", "gs://bucket/run"),
        (Path("file:///runs/a"), "file:///runs/a"),  # file:/runs/a
        ("memory:", "memory://"),
        ("http:/example.com/x", "http://example.com/x"),
    ],
)
def test_a_url_that_lost_a_slash_is_refused_with_the_url_it_meant(cwd, given, meant, capsys):
    with pytest.raises(rs.InvalidArgumentError, match="looks like a URL that lost a slash") as info:
        rs.Store(given)
    assert f"give {meant!r}" in str(info.value) and f"'./{os.fspath(given)}'" in str(info.value)
    assert cli(["ls", os.fspath(given)]) == 2
    assert f"give {meant!r}" in capsys.readouterr().err
    assert _everything_under(cwd) == []  # not ./s3:/bucket/x


def test_a_folder_whose_first_part_ends_with_a_colon_opens_as_dot_slash(cwd):
    ctx, expected = graded_version(0)
    with rs.Store("./s3:/bucket/x") as store:  # what the refusal offers for a folder so named
        store.put(ctx, "mb0")
    with rs.Store(cwd / "s3:" / "bucket" / "x", read_only=True) as store:  # no first part "s3:"
        _check(store.get("mb0"), expected)
    with rs.Store("ab:c/d") as store:  # "ab:c" is no scheme alone: a folder
        pass
    assert _everything_under(cwd)[:2] == ["ab:c", "ab:c/d"]


# -- ~ ---------------------------------------------------------------------------------------


def test_a_leading_tilde_is_the_home_folder(tmp_path, cwd, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    ctx, expected = graded_version(0)
    with rs.Store("~/runs/a") as store:
        store.put(ctx, "mb0")
    assert (home / "runs" / "a" / "residual-store.json").is_file()
    assert _everything_under(cwd) == []  # no folder named ~
    with rs.Store(Path("~/runs/a"), read_only=True) as store:
        _check(store.get("mb0"), expected)
    with pytest.raises(rs.InvalidArgumentError, match="no home folder for user"):
        rs.Store("~no-such-user-3f1c/runs")
    assert _everything_under(cwd) == []
    # the command line: the shell leaves a quoted ~ (and --store=~/x) as it is
    capsys.readouterr()
    assert cli(["ls", "~/runs/a", "--json"]) == 0
    assert "mb0" in capsys.readouterr().out


def test_the_command_line_takes_urls(tmp_path, cwd, capsys):
    ctx, _ = graded_version(0)
    folder = tmp_path / "store"
    with rs.Store(folder) as store:
        store.put(ctx, "mb0")
    capsys.readouterr()
    assert cli(["ls", f"file://{folder}", "--json"]) == 0
    assert "mb0" in capsys.readouterr().out
    empty = f"memory://nothing-{uuid.uuid4().hex[:8]}/"
    assert cli(["du", empty]) == 2
    assert f"no residual store in the kvstore {empty}" in capsys.readouterr().err
    assert cli(["rm", "foo://bucket/x", "mb0"]) == 2
    err = capsys.readouterr().err
    assert "does not open foo:// URLs" in err and len(err.strip().splitlines()) == 1
    assert _everything_under(cwd) == []


# -- a location that cannot be written -------------------------------------------------------


@contextlib.contextmanager
def _tmpfs(folder) -> Iterator[None]:
    """A small tmpfs mounted on ``folder`` (unmounted at the end); skips the test where this
    process may not mount one."""
    folder.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        made = None
    if made is None or made.returncode != 0:
        pytest.skip("mounting a tmpfs is not permitted here (the os.access test covers the check)")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def _remount_read_only(folder) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True, capture_output=True, timeout=30)


def test_a_read_only_mount_is_refused_at_open_and_read_with_read_only(tmp_path, capsys):
    ctx, expected = graded_version(0)
    mount = tmp_path / "mnt"
    with _tmpfs(mount):
        with rs.Store(mount / "store") as store:
            store.put(ctx, "mb0")
        (mount / "empty").mkdir()
        _remount_read_only(mount)
        assert not os.access(mount, os.W_OK)  # even for root: a read-only file system
        for where in ("store", "empty", "new"):
            with pytest.raises(rs.ReadOnlyStoreError, match="read-only file system.*read_only=True"):
                rs.Store(mount / where)
        with pytest.raises(rs.StoreNotFoundError):  # no store to open: that is what is wrong
            rs.Store(mount / "empty", create=False)
        with rs.Store(mount / "store", read_only=True) as store:
            _check(store.get("mb0"), expected)
        capsys.readouterr()
        assert cli(["rm", str(mount / "store"), "mb0"]) == 2
        err = capsys.readouterr().err
        assert "read-only file system" in err and len(err.strip().splitlines()) == 1
        assert "`residual-store rm` changes the store; ls, inspect" in err and "read_only=True" not in err
        assert cli(["ls", str(mount / "store")]) == 0
        assert sorted(os.listdir(mount)) == ["empty", "store"]


def test_a_folder_this_process_cannot_write_is_refused_at_open(tmp_path, monkeypatch):
    """``os.access`` faked: root passes permission bits, so the test says what it reports."""
    ctx, expected = graded_version(0)
    folder = tmp_path / "store"
    with rs.Store(folder) as store:
        store.put(ctx, "mb0")
    (tmp_path / "empty").mkdir()
    denied = {str(folder), str(tmp_path / "empty")}
    real = os.access

    def access(path, mode, *args, **kwargs):
        if os.fspath(path) in denied and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    for where in (folder, tmp_path / "empty"):
        with pytest.raises(rs.ReadOnlyStoreError, match="not writable by this process.*read_only=True"):
            rs.Store(where)
    with pytest.raises(rs.ReadOnlyStoreError):
        rs.Store(f"file://{folder}", create=False)
    with rs.Store(folder, read_only=True) as store:
        _check(store.get("mb0"), expected)
    assert sorted(os.listdir(tmp_path / "empty")) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self") or not os.path.isdir("/sys/kernel"), reason="Linux's /proc, /sys")
@pytest.mark.parametrize("path", ["/proc/x", "/sys/kernel/x"])
def test_a_kernel_file_system_is_refused_at_open_at_once(path):
    """The super-user passes ``access(2)`` there, and ``mkdir`` still fails (ENOENT, EPERM):
    once a raw FileNotFoundError or PermissionError from the first write, and the demo's after
    its first compile."""
    import time

    from store_helpers import run_cli

    start = time.monotonic()
    with pytest.raises(rs.ReadOnlyStoreError, match=rf"^{path}: the folder above it, .* read_only=True"):
        rs.Store(path)
    said = run_cli("demo", "--store", path, "--no-plot")
    assert said.returncode == 2 and said.stdout == "" and len(said.stderr.splitlines()) == 1, said
    assert said.stderr.startswith(f"residual-store demo: {path}: the folder above it") and "Errno" not in said.stderr
    assert time.monotonic() - start < 1.0 and not os.path.exists(path)


# -- keys and the compilation cache (issue 36, section 6) ------------------------------------


class _Lying(str):
    """A key whose characters are a fine key, and whose conversions say another one."""

    def __str__(self) -> str:
        return "../../outside"

    def __fspath__(self) -> str:
        return "../../outside"


class _Key(enum.StrEnum):
    FIRST = "mb0"


def test_a_str_subclass_key_that_says_another_key_is_refused(tmp_path):
    ctx, expected = graded_version(0)
    with rs.Store(tmp_path / "store") as store:
        for call in (lambda: store.put(ctx, _Lying("mb1")), lambda: store.get(_Lying("mb1")),
                     lambda: store.delete(_Lying("mb1"))):
            with pytest.raises(rs.InvalidKeyError, match="str subclass"):
                call()
        assert _Lying("mb1") not in store
        assert store.put(ctx, _Key.FIRST) == "mb0" and type(store.put(ctx, _Key.FIRST)) is str
        store.flush()
        _check(store.get("mb0"), expected)
        assert store.keys() == ["mb0"]
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_a_compilation_cache_folder_that_is_a_file_is_refused_naming_it(tmp_path):
    cache = tmp_path / "cache"
    cache.write_bytes(b"not a folder")
    with pytest.raises(rs.InvalidArgumentError, match=str(cache)):
        rs.enable_compilation_cache(cache)
    with pytest.raises(rs.InvalidArgumentError, match=str(cache / "below")):
        rs.enable_compilation_cache(cache / "below")
    assert cache.read_bytes() == b"not a folder"
