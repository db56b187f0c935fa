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

import dataclasses
import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
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
