"""The object-store SDKs' log lines, kept off the user's terminal.

tensorstore's ``s3`` driver hands the AWS SDK's log to absl, which writes each line of severity
warning and up straight to file descriptor 2: nine lines where no credentials are found (the
``~/.aws`` files it cannot open, the instance metadata it cannot reach), before the request
fails or goes on anonymously; its ``gcs`` driver writes one where no gcloud credentials file is
found. tensorstore's Python API has no switch for them (its flags hold no absl log threshold).
They come while a request looks for credentials: the first, and each retry until the store
answers (a refused connection is retried); so a store's opening requests, which end with the
first answered one or with the error, are made in one window of :func:`sdk_logs_to_logger`
(``backends.opening``: a lookup's last lines come as its request fails, before the next one
begins). It points fd 2 at a temporary file for its duration, then writes every line that is
not an absl log line back to stderr, and hands the log lines to the library's logger at DEBUG (``logging.getLogger("residual_store")``: an
application that wants them configures logging, as for the library's own records).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

from residual_store._src.logs import LOGGER

__all__ = ["sdk_logs_to_logger", "split_sdk_lines"]

# absl's prefix: severity and date, time, thread id, then the source (the AWS SDK puts its log
# subject there: "common-io:5]", "AuthCredentialsProvider:6146]")
_ABSL_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6}\s+\d+ [^\]\s]+\] ")
# one window at a time: fd 2 is the process's, and the window restores what it found; the
# thread holding it enters it again freely (``_depth``: its entries not yet left)
_WINDOW = threading.RLock()
_depth = 0


def split_sdk_lines(text: bytes) -> tuple[list[bytes], bytes]:
    """The absl log lines of ``text`` (without their line ends), and the rest of it, as it was."""
    logged: list[bytes] = []
    rest: list[bytes] = []
    for line in text.splitlines(keepends=True):
        (logged if _ABSL_LINE.match(line) else rest).append(line)
    return [line.rstrip(b"\r\n") for line in logged], b"".join(rest)


@contextlib.contextmanager
def sdk_logs_to_logger() -> Iterator[None]:
    """Runs the body with fd 2 in a temporary file; afterwards writes back to stderr what the
    body's threads wrote there (in its order) but the SDKs' log lines, which go to the logger.

    Where fd 2 cannot be redirected (closed, or no temporary file can be made), the body runs
    as it is. Another thread's window waits for this one to end; a window opened inside one is
    part of it (the outermost restores fd 2 and replays).
    """
    global _depth
    with _WINDOW:
        if _depth:
            _depth += 1
            try:
                yield
            finally:
                _depth -= 1
            return
        try:
            saved = os.dup(2)
        except OSError:
            yield
            return
        try:
            capture = tempfile.TemporaryFile()
        except OSError:
            os.close(saved)
            yield
            return
        with capture:
            _flush_stderr()
            os.dup2(capture.fileno(), 2)
            _depth = 1
            try:
                yield
            finally:
                _depth = 0
                _flush_stderr()
                os.dup2(saved, 2)
                os.close(saved)
                capture.seek(0)
                _replay(capture.read())


def _flush_stderr() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass  # no stderr, or a closed one: nothing buffered to keep in order


def _replay(text: bytes) -> None:
    logged, rest = split_sdk_lines(text)
    for line in logged:
        LOGGER.debug("object store SDK: %s", line.decode(errors="replace"))
    with contextlib.suppress(OSError):
        while rest:
            rest = rest[os.write(2, rest) :]
