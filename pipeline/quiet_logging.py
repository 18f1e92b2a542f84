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
from typing import Iterator


@contextlib.contextmanager
def root_logger_left_alone() -> Iterator[None]:
    root = logging.getLogger()
    if root.handlers:
        yield
        return
    placeholder = logging.NullHandler()
    root.addHandler(placeholder)
    try:
        yield
    finally:
        root.removeHandler(placeholder)
