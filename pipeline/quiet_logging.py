"""Calls into IREE without configuring the host program's logging.

IREE's Python packages log through the root logger (``logging.info(...)`` when compiling and
creating devices, ``logging.debug(...)`` when looking up a function), and a root-logger call made
while the root logger has no handler runs ``logging.basicConfig()``: the application's own
``basicConfig`` then does nothing. Inside :func:`root_logger_left_alone` the root logger holds a
``NullHandler`` if it had no handler, so IREE's records go nowhere and nothing is configured.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

_lock = threading.Lock()
_placeholder = logging.NullHandler()
_users = 0  # threads inside root_logger_left_alone while it holds the placeholder


@contextlib.contextmanager
def root_logger_left_alone() -> Iterator[None]:
    """Thread-safe (concurrent compiles at open): the placeholder stays until the last thread
    that needed it leaves."""
    global _users
    root = logging.getLogger()
    with _lock:
        placed = _users > 0 or not root.handlers
        if placed:
            if _users == 0:
                root.addHandler(_placeholder)
            _users += 1
    try:
        yield
    finally:
        if placed:
            with _lock:
                _users -= 1
                if _users == 0:
                    root.removeHandler(_placeholder)
