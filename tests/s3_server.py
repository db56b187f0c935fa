"""An S3-compatible object store on loopback for the tests and the benchmarks: ``moto``'s server.

``S3Server.start()`` runs ``python -m moto.server`` on a free 127.0.0.1 port (no network beyond
loopback), waits until it answers, and ``make_bucket`` creates a bucket with one HTTP ``PUT``;
``stop()`` ends that one process (by its id) and nothing else. moto keeps objects in the server's
memory: a stopped server forgets them.

The stores open it through tensorstore's ``s3`` kvstore driver with the spec from ``spec()``;
credentials come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (any value: moto accepts
every key), which ``environment()`` gives for the processes that use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "residual-store-test", "AWS_SECRET_ACCESS_KEY": "residual-store-test"}
REGION = "us-east-1"


def available() -> bool:
    """Whether ``moto``'s server can run here (the ``test`` extra installs it)."""
    return all(importlib.util.find_spec(m) is not None for m in ("moto", "flask", "flask_cors"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class S3Server:
    """One moto server process on loopback."""

    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> S3Server:
        self.port = self.port or _free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **CREDENTIALS},
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto server exited with status {self.process.returncode}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return self
            except urllib.error.HTTPError:
                return self  # it answers (with an error for a bare GET): up
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not answer on {self.endpoint} within {timeout:.0f} s")
                time.sleep(0.1)

    def make_bucket(self, name: str) -> str:
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10).close()
        return name

    def spec(self, bucket: str, path: str) -> dict[str, Any]:
        """The tensorstore kvstore spec a user writes for this server (credentials from the
        environment)."""
        return {"driver": "s3", "bucket": bucket, "path": path, "endpoint": self.endpoint, "aws_region": REGION}

    @staticmethod
    def environment() -> dict[str, str]:
        return dict(CREDENTIALS)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


@contextlib.contextmanager
def serving(bucket: str) -> Iterator[S3Server]:
    """A server with ``bucket`` made, and this process's environment (so its children's) holding
    the test credentials while it runs; stopped, and the environment restored, at the end."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = S3Server().start()
    try:
        server.make_bucket(bucket)
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Proxy:
    """A TCP relay on loopback to ``port`` (a moto server) that the test can cut: ``cut()``
    closes the listening socket and every relayed connection, so the endpoint then refuses
    connections, as an object store that went away does. With ``cut_on``, the relay cuts itself
    as soon as a request line containing those bytes arrives, before forwarding it (a store
    that goes away at that very request). Threads only; nothing outside loopback."""

    def __init__(self, port: int, cut_on: bytes | None = None) -> None:
        import threading

        self.target = port
        self.cut_on = cut_on
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.is_cut = False
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                if self.is_cut:
                    client.close()
                    upstream.close()
                    return
                self.sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if watch and self.cut_on is not None and self.cut_on in data:
                    self.cut()
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        with self._lock:
            self.is_cut = True
            sockets, self.sockets = self.sockets, []
        self.listener.close()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
