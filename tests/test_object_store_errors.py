"""Object stores that cannot be reached or refuse: every failure is one
``rs.StoreUnavailableError`` within a bounded time, and the SDKs' log lines stay off stderr.

* An unknown host, refused credentials: reported at once, never retried (tensorstore would retry
  a name that does not resolve 32 times, for 15 minutes); a store that does not answer: within
  the default timeout (30 s), or ``timeout=``.
* An object store whose bucket goes away (the server killed and started again without it, or
  the bucket deleted): a write (``flush``) and a listing raise ``rs.StoreUnavailableError`` naming
  the bucket, never tensorstore's plain ``ValueError``; nothing is reported as a damaged context
  (nothing stored is wrong); and the store still closes. A read of one object cannot tell a gone
  bucket from a missing object (S3 answers 404 to both): ``get`` says the context is not there.

No test reaches a public address: an unknown host is a name under ``.invalid`` (RFC 6761: it
never resolves), and every server is on loopback.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import pytest

import residual_store as rs
import s3_server
from residual_store_serializers import CorruptDataError, UnavailableError
from residual_store_serializers.kv_errors import convert_read_error, convert_write_error, is_unavailable
from store_helpers import python_env

# tensorstore's error for a request to a bucket that is not there, as the s3 driver raises it
NO_BUCKET = ValueError(
    "NOT_FOUND: NoSuchBucket: The specified bucket does not exist [http_response_code='404'] "
    "[http_response_body='<Error><Code>NoSuchBucket</Code></Error>']"
)


def test_a_missing_bucket_is_an_unavailable_store_not_missing_data():
    assert is_unavailable(NO_BUCKET)
    for convert in (convert_read_error, convert_write_error):
        err = convert(NO_BUCKET, "reading data/k.0/bundle.zip")
        assert isinstance(err, UnavailableError) and "NoSuchBucket" in str(err)
    # an object that is not there is still missing data, not an unavailable store
    missing = convert_read_error(ValueError("NOT_FOUND: Error opening file: No such file"), "reading x")
    assert isinstance(missing, CorruptDataError) and not is_unavailable(missing)


@pytest.mark.subprocess
@pytest.mark.skipif(not s3_server.available(), reason="moto[s3] and flask are in the test extra")
def test_a_server_killed_and_started_without_the_bucket_raises_store_unavailable():
    fwd = rs.split(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    w = jax.random.normal(jax.random.key(0), (3, 2))
    ctx = [fwd(w, jax.random.normal(jax.random.key(i + 1), (4, 3)))[1] for i in range(2)]
    with s3_server.serving("residuals") as server:
        spec = server.spec("residuals", f"run-{uuid.uuid4().hex[:8]}/")
        store = rs.Store(spec, timeout=5, device_budget=0, host_budget=0)  # gets read the store
        try:
            store.put(ctx[0], "mb0")
            store.flush()
            server.process.kill()  # killed (moto keeps its objects in memory: all gone) ...
            server.process.wait()
            server.stop()
            server.start()  # ... and started again on the same endpoint, without the bucket
            store.put(ctx[1], "mb1")
            with pytest.raises(rs.StoreUnavailableError, match="bucket 'residuals' is not there") as info:
                store.flush()
            assert isinstance(info.value, OSError) and "http_response_body" not in str(info.value)
            with pytest.raises(rs.StoreUnavailableError, match="bucket 'residuals'"):
                store.keys()  # a listing says the bucket is gone; a read of one object cannot
            with pytest.raises(rs.ResidualStoreError) as info:  # (S3 answers 404 for both)
                store.get("mb0")
            assert not isinstance(info.value, rs.CorruptContextError)  # nothing stored is wrong
            with pytest.raises(rs.StoreUnavailableError):
                store.verify()
        finally:
            store.close()  # closes: the failed write is not retried at close
        with pytest.raises(rs.InvalidArgumentError, match="closed"):
            store.keys()
        server.make_bucket("residuals")  # made again: the store opens (empty) and works
        with rs.Store(spec) as again:
            assert again.keys() == []
            again.put(ctx[1], "mb1")
            again.flush()
            assert again.keys() == ["mb1"]


# -- what cannot heal is not retried; what does not answer, within a bound -----------------------


def _s3(endpoint: str, **extra) -> dict:
    """An s3 spec on ``endpoint`` (anonymous: no credential lookup of this process's)."""
    return {"driver": "s3", "bucket": "residuals", "path": "run/", "endpoint": endpoint, "aws_region": "us-east-1",
            "aws_credentials": {"type": "anonymous"}, **extra}


@contextlib.contextmanager
def _refusing_server() -> Iterator[list[str]]:
    """An S3 endpoint on loopback that answers every request 403 InvalidAccessKeyId, as S3
    answers refused credentials; yields the requests it saw (method and path)."""
    seen: list[str] = []
    body = (b'<?xml version="1.0"?><Error><Code>InvalidAccessKeyId</Code><Message>The AWS Access Key Id '
            b"you provided does not exist in our records.</Message></Error>")

    class Refuse(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            seen.append(f"{self.command} {self.path}")
            self.send_response(403)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = answer

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        seen.append(f"http://127.0.0.1:{server.server_port}")
        yield seen
    finally:
        server.shutdown()
        server.server_close()


def test_refused_credentials_are_reported_at_once_and_not_retried():
    with _refusing_server() as seen:
        endpoint = seen.pop(0)
        t0 = time.monotonic()
        with pytest.raises(rs.StoreUnavailableError, match="refused the credentials") as info:
            rs.Store(_s3(endpoint))
        took = time.monotonic() - t0
    assert took < 10 and len(seen) == 1, (took, seen)  # one request: no retry of a refusal
    assert "InvalidAccessKeyId" in str(info.value) and not info.value.timed_out
    assert "http_response_body" not in str(info.value) and len(str(info.value).splitlines()) == 1


def test_an_unknown_host_is_reported_at_once_and_not_retried():
    t0 = time.monotonic()
    with pytest.raises(rs.StoreUnavailableError, match="host no-such-host.invalid is unknown") as info:
        rs.Store(_s3("http://no-such-host.invalid:9000"))
    assert time.monotonic() - t0 < 20  # one try (DNS says no at once, or after its own timeout)
    assert not info.value.timed_out and "give a longer timeout" not in str(info.value)
    assert "Check the endpoint and the network" in str(info.value)


def _silent_listener() -> socket.socket:
    """A listener on loopback that takes connections and never answers."""
    return socket.create_server(("127.0.0.1", 0))


@pytest.mark.slow
def test_a_store_that_never_answers_is_reported_within_the_default_timeout():
    with _silent_listener() as silent:
        t0 = time.monotonic()
        with pytest.raises(rs.StoreUnavailableError, match="did not answer within the default timeout of 30 s") as info:
            rs.Store(_s3(f"http://127.0.0.1:{silent.getsockname()[1]}"))
        took = time.monotonic() - t0
    assert 25 < took < 60, took  # the default bound, not tensorstore's minutes of retries
    assert info.value.timed_out and "or give timeout=SECONDS" in str(info.value)
    with _silent_listener() as silent:  # timeout= bounds each request
        t0 = time.monotonic()
        with pytest.raises(rs.StoreUnavailableError, match="did not answer within the timeout of 2 s") as info:
            rs.Store(_s3(f"http://127.0.0.1:{silent.getsockname()[1]}"), timeout=2)
        assert time.monotonic() - t0 < 10 and "give a longer timeout" in str(info.value)


@pytest.mark.slow  # seconds of waiting: the fast tier aims at 90 s
def test_a_refused_connection_is_retried_within_the_timeout():
    """Nothing listens on the port (a server restarting, perhaps): retried, within ``timeout``."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(rs.StoreUnavailableError, match="did not answer within the timeout of 1 s") as info:
        rs.Store(_s3(f"http://127.0.0.1:{port}"), timeout=1)
    assert time.monotonic() - t0 < 10 and info.value.timed_out


# -- the SDKs' log lines ------------------------------------------------------------------------

_NO_CREDENTIALS = """
import json, sys, residual_store as rs
try:
    rs.Store(json.loads(sys.argv[1]))
except rs.StoreUnavailableError as err:
    print(str(err).splitlines()[0], file=sys.stderr)
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_aws_sdks_log_lines_stay_off_stderr_and_go_to_the_logger(tmp_path):
    """No credentials anywhere (no environment, an empty home): the AWS SDK logs each file and
    service it could not get them from; the user sees one line, the error. With the library's
    logger at DEBUG, the SDK's lines are there."""
    env = {k: v for k, v in python_env().items() if not k.startswith("AWS_") or k == "AWS_CA_BUNDLE"}
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true")  # no instance metadata asked for
    spec = json.dumps({**_s3("http://no-such-host.invalid:9000"), "aws_credentials": {"type": "default"}})
    quiet = subprocess.run([sys.executable, "-c", _NO_CREDENTIALS, spec], capture_output=True, text=True,
                           env=env, timeout=120)
    assert quiet.stderr.strip().splitlines() == [quiet.stderr.strip()], quiet.stderr
    assert "no-such-host.invalid is unknown" in quiet.stderr
    logged = subprocess.run(
        [sys.executable, "-c", "import logging; logging.basicConfig(level=logging.DEBUG)\n" + _NO_CREDENTIALS, spec],
        capture_output=True, text=True, env=env, timeout=120,
    )
    sdk = [line for line in logged.stderr.splitlines() if "object store SDK:" in line]
    assert any(".aws" in line for line in sdk), logged.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_sdks_lines_of_the_retries_after_the_first_request_stay_off_stderr(tmp_path):
    """A refused connection is retried (a server may be starting): each retry looked for
    credentials again (the instance metadata, the default chain), and its 2-4 SDK lines, made
    after the first request's window, reached stderr before the one-line error."""
    env = {k: v for k, v in python_env().items() if not k.startswith("AWS_") or k == "AWS_CA_BUNDLE"}
    env.update(HOME=str(tmp_path))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]  # closed again: connections refused
    spec = json.dumps({"driver": "s3", "bucket": "residuals", "path": "run/", "endpoint": f"http://127.0.0.1:{port}",
                       "timeout": 3})  # the default credentials: looked for
    code = _NO_CREDENTIALS.replace("rs.Store(json.loads(sys.argv[1]))",
                                   "spec = json.loads(sys.argv[1]); rs.Store(spec, timeout=spec.pop('timeout'))")
    out = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert "did not answer within the timeout of 3 s" in out.stderr, out.stderr


def test_internals_the_window_hands_log_lines_to_the_logger_and_writes_the_rest_back(capfd, caplog):
    from residual_store._src.store.disk.sdk_logs import sdk_logs_to_logger, split_sdk_lines

    line = b"E1206 07:11:57.207264    7478 common-io:5] static: Failed to open file. path:'/root/.aws/config'"
    assert split_sdk_lines(line + b"\nsomething else\n") == ([line], b"something else\n")
    assert split_sdk_lines(b"E1206 is not a log line\n") == ([], b"E1206 is not a log line\n")
    with caplog.at_level(logging.DEBUG, logger="residual_store"), sdk_logs_to_logger():
        os.write(2, line + b"\n")
        print("a line of the program's own", file=sys.stderr)
    assert capfd.readouterr().err == "a line of the program's own\n"
    assert [r.getMessage() for r in caplog.records] == [f"object store SDK: {line.decode()}"]


def test_internals_a_window_inside_a_window_is_part_of_it(capfd, caplog):
    """A store's opening requests run in one window (each request's own window inside it): a
    credential lookup's line that comes between two requests is kept off stderr too."""
    from residual_store._src.store.disk.sdk_logs import sdk_logs_to_logger

    lines = [f"E1207 15:46:16.13750{i}    3907 http-stream:2053] id=static: Request path is invalid".encode()
             for i in range(3)]
    with caplog.at_level(logging.DEBUG, logger="residual_store"), sdk_logs_to_logger():
        with sdk_logs_to_logger():
            os.write(2, lines[0] + b"\n")
        os.write(2, lines[1] + b"\n")  # between two requests' windows
        with sdk_logs_to_logger():
            os.write(2, lines[2] + b"\n")
    assert capfd.readouterr().err == ""
    assert [r.getMessage() for r in caplog.records] == [f"object store SDK: {x.decode()}" for x in lines]


@pytest.mark.slow  # seconds of waiting: the fast tier aims at 90 s
def test_the_command_line_says_what_cannot_heal_in_one_line():
    from store_helpers import run_cli

    out = run_cli("ls", json.dumps(_s3("http://no-such-host.invalid:9000")))
    assert out.returncode == 2 and out.stdout == "", out
    assert len(out.stderr.strip().splitlines()) == 1 and "no-such-host.invalid is unknown" in out.stderr
    assert "timeout" not in out.stderr  # no wait heals it
    with _refusing_server() as seen:
        out = run_cli("ls", json.dumps(_s3(seen.pop(0))), "--timeout", "5")
    assert out.returncode == 2 and "refused the credentials" in out.stderr and len(seen) == 1, (out, seen)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
    out = run_cli("du", json.dumps(_s3(f"http://127.0.0.1:{port}")), "--timeout", "1")
    assert out.returncode == 2 and "did not answer within --timeout 1 s" in out.stderr, out
    assert "give a longer --timeout" in out.stderr and "timeout=" not in out.stderr
