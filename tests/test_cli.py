"""The command line, run as a user would against a real store: most commands through the entry
point's function in this process, and in new processes where the process is what is tested (the
entry point, one-line errors, terminals, pipes, imports)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs
from store_helpers import run_cli, run_cli_process

pytestmark = pytest.mark.subprocess


_cli = run_cli  # the command line in this process; _cli_process: in a new one


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli-store"))
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w[0]) @ w[1]))
    w = (jax.random.normal(jax.random.key(0), (3, 2)), jax.random.normal(jax.random.key(9), (2, 2)))
    with rs.Store(path) as store:
        for i in range(3):
            x = jax.random.normal(jax.random.key(i + 1), (4, 3))
            store.put(fwd(w, x)[1], f"mb{i}")
    return path


def test_ls_and_inspect(store_path):
    out = run_cli_process("ls", store_path)
    assert out.returncode == 0, out.stderr
    assert "mb0" in out.stdout and "rs2-" in out.stdout and "3 contexts" in out.stdout
    listed = json.loads(_cli("ls", store_path, "--json").stdout)
    assert sorted(e["key"] for e in listed) == ["mb0", "mb1", "mb2"]
    inspected = json.loads(_cli("inspect", store_path, "mb1", "--json").stdout)
    kinds = {r["kind"] for r in inspected["residuals"]}
    assert all(r["chunks"] == 1 and r["chunk_shape"] is None for r in inspected["residuals"])
    assert kinds == {"weight", "input", "intermediate"}
    by_kind = {r["kind"]: r for r in inspected["residuals"]}
    assert by_kind["weight"]["shared"] and by_kind["weight"]["path"].startswith("weights/")
    assert by_kind["input"]["name"] == "input x" and not by_kind["input"]["shared"]  # its own
    assert by_kind["input"]["path"].startswith("data/mb1.")
    text = _cli("inspect", store_path, "mb1").stdout
    assert "tanh" in text and "intermediate" in text
    x_row = next(line for line in text.splitlines() if "input x" in line)
    assert " 48 B " in x_row  # float32[4, 3]: sizes as ls writes them (the --json keeps bytes)
    assert by_kind["input"]["bytes"] == 48


def test_du_and_gc(store_path):
    du = json.loads(_cli("du", store_path, "--json").stdout)
    (entry,) = du["signatures"].values()
    assert entry["contexts"] == 3 and entry["intermediate"] > 0 and entry["weights"] > 0
    assert entry["inputs"] == 3 * 4 * 3 * 4  # each context's batch x, float32[4, 3]
    orphan = os.path.join(store_path, "weights", "0" * 32)
    os.makedirs(orphan)
    gc = json.loads(_cli("gc", store_path, "--older-than", "0", "--json").stdout)
    assert gc["weights"] == 1 and not os.path.exists(orphan)
    assert gc["backwards"] == 0  # the one stored backward has its contexts
    assert json.loads(_cli("verify", store_path, "--json").stdout)["damaged"] == []


def _two_contexts(path: str, second: str) -> None:
    """A store at ``path`` with two contexts of one signature: ``good`` and ``second``."""
    fwd = rs.split(lambda x: jnp.sum(jnp.sin(x) ** 2))
    with rs.Store(path) as store:
        store.put(fwd(jnp.arange(4.0))[1], "good")
        store.put(fwd(jnp.arange(4.0) + 1)[1], second)


def test_verify_finds_damage(tmp_path):
    path = str(tmp_path / "store")
    _two_contexts(path, "bad")
    clean = _cli("verify", path)
    assert clean.returncode == 0 and "0 damaged" in clean.stdout
    record_dir = [d for d in os.listdir(os.path.join(path, "data")) if d.startswith("bad.")][0]
    chunks = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(path, "data", record_dir)) for f in fs if f != "zarr.json"]
    with open(chunks[0], "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x10]))
    damaged = _cli("verify", path)
    assert damaged.returncode == 1
    assert "DAMAGED bad" in damaged.stdout and "checksum mismatch" in damaged.stdout
    assert "good" not in damaged.stdout.split("DAMAGED", 1)[1].split("\n")[0]
    report = json.loads(_cli("verify", path, "--json").stdout)
    assert [d["key"] for d in report["damaged"]] == ["bad"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("ls", "/no/such/store"), "no such folder"),
        (("inspect", "{tmp}", "k"), "not a residual store"),
        (("gc", "{tmp}/typo"), "no such folder"),
        (("inspect", "{store}", "missing"), "no context 'missing'"),
        (("inspect", "{store}", "../escape"), "invalid store key"),
        (("verify", "{store}", "a/b"), "invalid store key"),
    ],
)
def test_bad_paths_and_keys_give_one_line(store_path, tmp_path, args, message):
    args = [a.format(tmp=str(tmp_path), store=store_path) for a in args]
    out = run_cli_process(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert not re.search(r"\b[a-z_]+=", out.stderr), out.stderr  # command-line advice, not Python arguments
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


# -- conventions and the commands of issue 14 ------------------------------------------------


def test_version():
    out = run_cli_process("--version")
    assert out.returncode == 0 and out.stdout.startswith("residual-store ") and f"jax {jax.__version__}" in out.stdout


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A store whose listing is longer than a pipe holds (64 KiB)."""
    path = str(tmp_path_factory.mktemp("cli-many"))
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x * w)))
    with rs.Store(path, durable=False) as store:
        for i in range(300):
            store.put(fwd(jnp.ones(3), jnp.full(3, float(i)))[1], f"context-with-a-long-name-{i:04d}")
    return path


def test_a_closed_pipe_ends_quietly(many):
    for args in (["ls", many, "--json"], ["ls", many]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "residual_store", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        first = proc.stdout.readline()
        proc.stdout.close()  # what `| head -1` does
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0, err
        assert first and "Traceback" not in err and err == "", err


def test_rm_export_diff(tmp_path):
    path = str(tmp_path / "store")
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)), argnums=(0, 1))  # residuals: w, x, tanh, 1 - tanh**2
    w = jax.random.normal(jax.random.key(0), (3, 2))
    xs = [jax.random.normal(jax.random.key(i + 1), (4, 3)) for i in range(3)]
    with rs.Store(path) as store:
        contexts = [fwd(w, x)[1] for x in xs]
        for i, c in enumerate(contexts):
            store.put(c, f"mb{i}")
    # export: every residual, by name, equal to the context's
    out = tmp_path / "mb1.npz"
    assert _cli("export", path, "mb1", "-o", str(out)).returncode == 0
    import numpy as np

    with np.load(out) as got:
        assert sorted(got.files) == sorted(contexts[1].spec.names)
        for name, x in zip(contexts[1].spec.names, contexts[1].residuals):
            np.testing.assert_array_equal(got[name], np.asarray(x))
    one = tmp_path / "one.npz"
    assert _cli("export", path, "mb1", "-o", str(one), "--residual", "input x").returncode == 0
    with np.load(one) as got:
        assert got.files == ["input x"]
    bad = _cli("export", path, "mb1", "--residual", "nope")
    assert bad.returncode == 2 and "no residual 'nope'" in bad.stderr and len(bad.stderr.splitlines()) == 1
    # -o without .npz: the file NumPy writes is the file named; a folder that is not there is
    # refused before the context is read (the key need not even exist)
    said = _cli("export", path, "mb1", "-o", str(tmp_path / "noext"), "--residual", "input x")
    assert said.returncode == 0 and said.stdout.strip().endswith(f"to {tmp_path / 'noext.npz'}"), said
    assert (tmp_path / "noext.npz").is_file() and not (tmp_path / "noext").exists()
    for key in ("mb1", "nope"):
        lost = _cli("export", path, key, "-o", str(tmp_path / "missing" / "x.npz"))
        assert lost.returncode == 2 and len(lost.stderr.splitlines()) == 1, lost
        assert f"no folder {tmp_path / 'missing'} to write it in" in lost.stderr and "Errno" not in lost.stderr
    # diff: the same context, and two of one signature
    same_out = _cli("diff", path, "mb0", "mb0", "--json")
    same = json.loads(same_out.stdout)
    assert same_out.returncode == 0  # equal: 0, as diff and git diff --exit-code say
    assert same["same_signature"] and {r["status"] for r in same["residuals"]} == {"same"}
    two_out = _cli("diff", path, "mb0", "mb2", "--json")
    assert two_out.returncode == 1  # they differ: 1
    two = json.loads(two_out.stdout)
    by_name = {r["name"]: r for r in two["residuals"]}
    assert by_name["input w"]["status"] == "same"
    x_diff = float(np.max(np.abs(np.asarray(xs[0]) - np.asarray(xs[2]))))
    assert by_name["input x"]["status"] == "differs" and abs(by_name["input x"]["max_abs"] - x_diff) < 1e-6
    text = _cli("diff", path, "mb0", "mb2").stdout
    assert "input x" in text and "differs" in text and "3 residuals of 4 differ" in text  # all but w
    # rm, then ls; an unknown key removes nothing
    missing = _cli("rm", path, "mb0", "nope")
    assert missing.returncode == 2 and "no context 'nope'" in missing.stderr
    assert json.loads(_cli("ls", path, "--json").stdout)[0]["key"] == "mb0"
    removed = _cli("rm", path, "mb0", "mb1")
    assert removed.returncode == 0 and "removed 2 contexts: mb0, mb1" in removed.stdout
    assert [e["key"] for e in json.loads(_cli("ls", path, "--json").stdout)] == ["mb2"]
    assert "1 context\n" in _cli("ls", path).stdout  # one context, not "1 contexts"
    with rs.Store(path, read_only=True) as store:
        assert store.keys() == ["mb2"]


def test_gc_dry_run_then_gc_and_du(tmp_path):
    path = str(tmp_path / "store")
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    with rs.Store(path) as store:
        for i in range(3):
            store.put(fwd(jnp.ones((3, 2)), jnp.full((4, 3), float(i)))[1], f"mb{i}")
        store.flush()
        store.delete("mb0")  # its data folder is kept in data/.free for reuse
    young = _cli("gc", path, "--older-than", "1h")
    assert young.returncode == 0 and "removed nothing; kept 1 unneeded item younger than 1h" in young.stdout
    before = sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)
    dry = json.loads(_cli("gc", path, "--older-than", "0", "--dry-run", "--json").stdout)
    after = sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)
    assert before == after and dry["dry_run"] and dry["recycled"] == 1 and dry["bytes"] > 0
    du = json.loads(_cli("du", path, "--json").stdout)
    assert du["measured"] and du["total"] == sum(os.path.getsize(os.path.join(path, f)) for f in before)
    assert du["gc_would_free"] == dry["bytes"] and du["recycled"] == dry["bytes"]
    assert "gc --older-than 0 would free" in _cli("du", path).stdout
    done = json.loads(_cli("gc", path, "--older-than", "0s", "--json").stdout)
    assert {k: done[k] for k in ("weights", "data", "recycled", "backwards", "temporary", "bytes")} == {
        k: dry[k] for k in ("weights", "data", "recycled", "backwards", "temporary", "bytes")
    }
    assert json.loads(_cli("du", path, "--json").stdout)["gc_would_free"] == 0
    bad = _cli("gc", path, "--older-than", "1x")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "not a duration" in bad.stderr


def test_a_kvstore_spec_as_path_and_corrupt_manifests(tmp_path):
    path = str(tmp_path / "store")
    _two_contexts(path, "broken")
    spec = json.dumps({"driver": "file", "path": path})
    assert [e["key"] for e in json.loads(_cli("ls", spec, "--json").stdout)] == ["broken", "good"]
    assert _cli("verify", spec).returncode == 0
    assert "intermediate" in _cli("inspect", spec, "good").stdout
    assert json.loads(_cli("verify", spec, "good", "--json").stdout)["verified"] == 1
    for bad_spec, message in (('{"driver": ', "not valid JSON"), ('{"path": "/x"}', 'with a "driver"')):
        out = _cli("ls", bad_spec)
        assert out.returncode == 2 and message in out.stderr, out.stderr
    manifest = [os.path.join(path, "contexts", f) for f in os.listdir(os.path.join(path, "contexts")) if f.startswith("broken")][0]
    with open(manifest, "r+b") as f:
        f.truncate(20)
    gc = _cli("gc", path, "--older-than", "0")
    assert gc.returncode == 2 and len(gc.stderr.strip().splitlines()) == 1 and "Traceback" not in gc.stderr
    broken = "DAMAGED broken: manifest contexts/broken.manifest: "  # the file once, relative to the store
    for args in (("inspect", path, "broken"), ("export", path, "broken"), ("diff", path, "good", "broken")):
        out = _cli(*args)  # damage met: said as ls says it, with the next step, status 1
        assert out.returncode == 1 and out.stdout.startswith(broken) and out.stderr == "", (args, out)
        assert f"next: `residual-store verify {path}` checks every byte; `residual-store rm {path} broken`" in out.stdout
        assert out.stdout.count("broken.manifest") == 1 and tmp_path.name not in out.stdout.split("\n")[0]
    ls = _cli("ls", path)
    assert ls.returncode == 1 and "CORRUPT" in ls.stdout and "2 contexts, 1 damaged" in ls.stdout, ls.stdout
    assert _cli("ls", path, "--json").returncode == 1
    verify = _cli("verify", path, "--json")
    assert verify.returncode == 1 and [d["key"] for d in json.loads(verify.stdout)["damaged"]] == ["broken"]
    unknown = _cli("verify", path, "good", "nope")
    assert unknown.returncode == 2 and "no context 'nope'" in unknown.stderr and "DAMAGED" not in unknown.stdout
    du = _cli("du", path, "--json")
    assert du.returncode == 1 and [e["contexts"] for e in json.loads(du.stdout)["signatures"].values()] == [1]
    assert json.loads(du.stdout)["gc_would_free"] is None
    assert [d["key"] for d in json.loads(du.stdout)["damaged"]] == ["broken"]
    text = _cli("du", path).stdout
    assert "a manifest is unreadable" in text and broken in text, text  # which one, not only that one is
    # the way out: rm the damaged context, then everything works again
    assert _cli("rm", path, "broken").returncode == 0
    assert _cli("verify", path).returncode == 0 and _cli("gc", path, "--older-than", "0").returncode == 0
    fixed = _cli("ls", path, "--json")
    assert fixed.returncode == 0 and [e["key"] for e in json.loads(fixed.stdout)] == ["good"]


def test_every_command_on_a_kvstore_spec(tmp_path):
    """The file driver through tensorstore: the kvstore path of every command (no modification
    times, no sizes in a listing)."""
    path = str(tmp_path / "store")
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)), argnums=(0, 1))
    spec_store = {"driver": "file", "path": path, "file_io_sync": False}  # an option: the kvstore path, not the folder's
    with rs.Store(spec_store) as store:
        for i in range(2):
            store.put(fwd(jnp.ones((3, 2)), jnp.full((4, 3), float(i)))[1], f"mb{i}")
    spec = json.dumps(spec_store)
    assert "2 contexts" in _cli("ls", spec).stdout
    assert "intermediate" in _cli("inspect", spec, "mb0").stdout
    assert _cli("verify", spec).returncode == 0
    du = json.loads(_cli("du", spec, "--json").stdout)
    assert du["measured"] is False and du["total"] is None and du["signatures"]
    assert "not measurable on this kvstore" in _cli("du", spec).stdout
    out = tmp_path / "mb1.npz"
    assert _cli("export", spec, "mb1", "-o", str(out)).returncode == 0 and out.exists()
    assert "3 residuals of 4 differ" in _cli("diff", spec, "mb0", "mb1").stdout  # all but the weight w
    assert _cli("rm", spec, "mb0").returncode == 0
    # rm on a kvstore removes the data at once (no folders to recycle): nothing is left for gc
    dry = json.loads(_cli("gc", spec, "--older-than", "0", "--dry-run", "--json").stdout)
    assert dry["data"] == dry["recycled"] == dry["young"] == 0 and dry["bytes"] == 0
    assert _cli("gc", spec, "--older-than", "0").stdout.startswith("removed nothing")
    assert [e["key"] for e in json.loads(_cli("ls", spec, "--json").stdout)] == ["mb1"]


# -- the command line a user meets (issue 27) ------------------------------------------------


@pytest.mark.parametrize(
    "argv, status, said",
    [(["--help"], 0, "usage: residual-store"), (["ls", "--help"], 0, "--timeout SECONDS"),
     (["lss", "/data/s"], 2, "invalid choice: 'lss'"), (["gc"], 2, "required: path"),
     (["demo", "--help"], 0, "residual_store_demo.png)")],  # the plot's default shown
)
def test_help_and_usage_errors_answer_without_importing_jax(argv, status, said):
    code = f"""
import contextlib, io, sys
from residual_store.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        main({argv!r})
    except SystemExit as exit:
        status = exit.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "numpy", "tensorstore"))
print(status, heavy, {said!r} in out.getvalue())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(status), "[]", "True"], out.stdout
    # and the same through python -m residual_store, as the import log shows
    log = subprocess.run([sys.executable, "-X", "importtime", "-m", "residual_store", *argv],
                         capture_output=True, text=True, timeout=120, env=os.environ)
    assert log.returncode == status and said in log.stdout + log.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in log.stderr.splitlines() if line.startswith("import time:")]
    assert "residual_store.cli" in imported and not [m for m in imported if m.split(".")[0] in ("jax", "numpy")]


def _on_a_terminal(*args: str) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """Runs the command line with stderr on a pseudo-terminal: its result and what it drew."""
    import pty

    master, terminal = pty.openpty()
    try:
        out = subprocess.run([sys.executable, "-m", "residual_store", *args], stdout=subprocess.PIPE,
                             stderr=terminal, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    finally:
        os.close(terminal)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the terminal's other end is closed: all read
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    return out, drawn.decode()


@pytest.mark.parametrize("command, label", [("verify", "verifying: "), ("du", "measuring: ")])
def test_progress_in_bytes_is_drawn_on_a_terminal_only(store_path, command, label):
    out, drawn = _on_a_terminal(command, store_path)
    assert out.returncode == 0
    assert label in drawn and re.search(r"\d+(\.\d)? (B|KiB)", drawn.split(label, 1)[1]), drawn
    if command == "verify":  # the whole is known beforehand
        assert " of " in drawn.split(label, 1)[1] and "3 of 3 contexts verified" in out.stdout.decode()
    piped = _cli(command, store_path)
    assert piped.returncode == 0 and piped.stderr == ""  # not a terminal: nothing drawn


def test_store_commands_leave_accelerators_alone(store_path):
    """A store command reads into host memory: run beside a job on a GPU, it must not start
    the GPU (nor take its memory); JAX_PLATFORMS, where given, still decides."""
    code = f"""
import contextlib, io, os
from residual_store.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    status = main(["ls", {store_path!r}])
import jax
print(status, jax.config.jax_platforms)
"""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.split() == ["0", "cpu"], out.stdout + out.stderr


def test_gc_draws_the_bytes_it_removes_on_a_terminal(tmp_path):
    path = str(tmp_path / "store")
    _two_contexts(path, "gone")
    assert _cli("rm", path, "gone").returncode == 0  # its data folder is kept for reuse: gc removes it
    out, drawn = _on_a_terminal("gc", path, "--older-than", "0")
    assert out.returncode == 0 and "removed 1 recycled folder" in out.stdout.decode()
    assert re.search(r"removing: \d+(\.\d)? (B|KiB)", drawn), drawn


# -- what a look says about where things are (issue 37) -------------------------------------


def test_inspect_says_a_bundled_residual_is_a_group_inside_the_bundle(store_path):
    inspected = json.loads(_cli("inspect", store_path, "mb1", "--json").stdout)
    own = [r for r in inspected["residuals"] if not r["shared"]]
    assert own and all(r["bundle"].endswith("/bundle.zip") for r in own)
    assert all(r["bundle"] is None for r in inspected["residuals"] if r["shared"])  # a weight's own file
    folder = os.path.join(store_path, *own[0]["bundle"].split("/"))
    assert os.path.isfile(folder) and not os.path.exists(os.path.join(store_path, *own[0]["path"].split("/")))
    text = _cli("inspect", store_path, "mb1").stdout
    x_row = next(line for line in text.splitlines() if "input x" in line)
    assert re.search(r"data/mb1\.\w+/bundle\.zip:\d+/$", x_row), x_row
    assert "is the group G/ inside that zip file, not a folder" in text


def test_ls_of_a_folder_holding_a_store_points_to_it(tmp_path, store_path):
    import shutil

    step = tmp_path / "checkpoints" / "7"  # an Orbax step: one folder per item
    (step / "state").mkdir(parents=True)
    shutil.copytree(store_path, step / "contexts")
    out = _cli("ls", str(step))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert f"not a residual store; the store in it: {step / 'contexts'}" in out.stderr
    assert _cli("ls", str(step / "contexts")).returncode == 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _interrupting(kind: str):
    """A command that meets a Ctrl-C: raised in it, raised inside a function C code called (its
    ``SystemError``), or raised in a ``__del__`` (which Python only prints, then runs on)."""
    import time

    class Dropped:
        def __del__(self):
            raise KeyboardInterrupt

    def run(args):
        sys.stderr.write("\rmeasuring: 1.0 KiB")  # a status line drawn, as du draws it
        if kind == "raised":
            raise KeyboardInterrupt
        if kind == "inside C":
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as err:
                raise SystemError("returned a result with an exception set") from err
        Dropped()
        for _ in range(100 if kind == "in __del__" else 0):  # the main thread takes it back at a next step
            time.sleep(0.01)
        return 0  # (at once: raised as the command ends)

    return run


@pytest.mark.parametrize("kind", ["raised", "inside C", "in __del__", "in __del__ as it ends"])
def test_ctrl_c_is_said_on_a_line_of_its_own_with_status_130(monkeypatch, kind):
    from residual_store import cli

    monkeypatch.setattr(cli, "_cmd_du", _interrupting(kind))
    err, hook = _Terminal(), sys.unraisablehook
    monkeypatch.setattr(sys, "stderr", err)
    status = cli.main(["du", "anywhere"])
    assert status == 130, err.getvalue()
    assert err.getvalue() == "\rmeasuring: 1.0 KiB\r\x1b[Kresidual-store du: interrupted (Ctrl-C)\n"
    assert sys.unraisablehook is hook  # put back


def test_ctrl_c_while_the_arguments_are_parsed_names_the_command(monkeypatch):
    """A Ctrl-C before the parser has read the arguments (a loaded machine: 0.3 s after the
    start) is said with the command the arguments name, as one after."""
    from residual_store import cli

    def interrupted_parser():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_parser", interrupted_parser)
    for argv, said in ((["--quiet", "demo", "--store", "s"], "residual-store demo"), (["--version"], "residual-store")):
        err = _Terminal()
        monkeypatch.setattr(sys, "stderr", err)
        assert cli.main(argv) == 130
        assert err.getvalue() == f"\r\x1b[K{said}: interrupted (Ctrl-C)\n"
