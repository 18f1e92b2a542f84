"""On-disk cache of compiled artifacts, keyed by everything that affects the vmfb.

Layout: ``<root>/<compiler version>/<target tag>/<spec name>-<key[:16]>/`` holding
``kernel.vmfb``, ``kernel.mlir``, ``compile_command.txt`` and ``spec.json``. The key is the sha256
of the IR text, the flags, the target and the compiler version. Writes go to a temporary file and
are renamed into place; an exclusive file lock plus a re-check after acquiring it means two
processes asking for the same artifact compile it once. ``spec.json`` records the vmfb's sha256: a
cached file that no longer matches it (truncated, overwritten) is compiled again, and a cache
folder that cannot be written is skipped with a warning (the kernel is compiled, not stored).

Environment:
    LINALG_PREFILL_CACHE_DIR   cache root (default ``~/.cache/linalg-prefill``)
    LINALG_PREFILL_CACHE=0     disable the cache (always compile, store nothing)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from iree.compiler.version import VERSION as COMPILER_VERSION

from .targets import Target

log = logging.getLogger(__name__)
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.ENOTDIR)  # cache unusable


def artifact_key(ir_text: str, target: Target) -> str:
    """sha256 over the IR, the target, its flags and the compiler version."""
    h = hashlib.sha256()
    for part in (COMPILER_VERSION, target.tag, "\0".join(target.flags()), ir_text):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file in the same folder and a rename; the
    file gets the mode a plain ``open`` would give it (0666 less the process umask), not
    mkstemp's 0600, so a build made by one user can be read by another."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~process_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def process_umask() -> int:
    """The process umask, read without changing it (Linux: /proc/self/status), else set and reset."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class ArtifactCache:
    """Compiled vmfb files under ``root``; ``enabled=False`` compiles every time."""

    def __init__(self, root: str | os.PathLike, *, enabled: bool = True):
        self.root = Path(root).expanduser()
        self.enabled = enabled

    def entry_dir(self, spec, target: Target, key: str) -> Path:
        return self.root / COMPILER_VERSION / target.tag / f"{spec.name}-{key[:16]}"

    def cached(self, spec, target: Target, ir_text: str) -> bytes | None:
        """The cached vmfb for (spec, target, ir_text), or None when missing, damaged or disabled."""
        if not self.enabled:
            return None
        return _read_verified(self.entry_dir(spec, target, artifact_key(ir_text, target)))

    def get_or_build(self, spec, target: Target, ir_text: str, build: Callable[[], bytes]) -> bytes:
        """The cached vmfb for (spec, target, ir_text), calling ``build()`` once if missing or damaged."""
        if not self.enabled:
            return build()
        key = artifact_key(ir_text, target)
        folder = self.entry_dir(spec, target, key)
        cached = _read_verified(folder)
        if cached is not None:
            log.debug("cache hit %s", folder)
            return cached
        data = None
        try:
            with file_lock(folder.with_name(folder.name + ".lock")):
                cached = _read_verified(folder)
                if cached is not None:
                    return cached
                data = build()
                _store(folder, spec, target, key, ir_text, data)
        except OSError as err:
            if err.errno not in _UNWRITABLE:
                raise
            log.warning("artifact cache %s is not writable (%s); using the kernel without storing it. Set "
                        "LINALG_PREFILL_CACHE_DIR to a writable folder or LINALG_PREFILL_CACHE=0", self.root, err)
            return data if data is not None else build()
        return data

    def clear(self) -> int:
        """Removes the entries this library wrote (``<version>/<target>/<spec>-<key>/`` folders
        holding its files, and their lock files), then the version and target folders they leave
        empty; returns how many entries were removed. The root and anything else in it stay."""
        import shutil

        removed = 0
        for entry in sorted(self.root.glob("*/*/*")):
            if _is_entry(entry):
                shutil.rmtree(entry)
                removed += 1
            elif entry.suffix == ".lock" and entry.is_file() and _ENTRY_NAME.fullmatch(entry.stem):
                entry.unlink()
        for folder in [*sorted(self.root.glob("*/*")), *sorted(self.root.glob("*"))]:
            with contextlib.suppress(OSError):  # only empty folders go
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        return removed


_ENTRY_NAME = re.compile(r".+-[0-9a-f]{16}")
_ENTRY_FILES = {"kernel.vmfb", "kernel.mlir", "compile_command.txt", "spec.json"}


def _is_entry(path: Path) -> bool:
    """A cache entry folder: named ``<spec name>-<16 hex digits>``, holding only files the cache
    writes (and their temporary files)."""
    if not path.is_dir() or not _ENTRY_NAME.fullmatch(path.name):
        return False
    names = [child.name for child in path.iterdir()]
    return bool(names) and all(n in _ENTRY_FILES or n.lstrip(".").split(".")[0] in {"kernel", "spec", "compile_command"}
                               for n in names)


def _read_verified(folder: Path) -> bytes | None:
    """The folder's vmfb when present and matching the sha256 in its spec.json, else None."""
    vmfb = folder / "kernel.vmfb"
    if not vmfb.exists():
        return None
    data = vmfb.read_bytes()
    try:
        recorded = json.loads((folder / "spec.json").read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        log.info("cached artifact %s has no recorded sha256; compiling it again", vmfb)
        return None
    if recorded != hashlib.sha256(data).hexdigest():
        log.warning("cached artifact %s is damaged (sha256 mismatch); compiling it again", vmfb)
        return None
    return data


def _store(folder: Path, spec, target: Target, key: str, ir_text: str, data: bytes) -> None:
    """Writes the vmfb last, after the spec.json that records its sha256."""
    atomic_write(folder / "kernel.mlir", ir_text.encode())
    atomic_write(folder / "compile_command.txt", " ".join(target.flags()).encode())
    atomic_write(folder / "spec.json", json.dumps(
        {"name": spec.name, "symbol": spec.symbol, "fields": spec.fields(), "target": target.tag, "key": key,
         "compiler_version": COMPILER_VERSION, "sha256": hashlib.sha256(data).hexdigest()},
        indent=2, sort_keys=True).encode())
    atomic_write(folder / "kernel.vmfb", data)


def default_cache() -> ArtifactCache:
    """The cache named by the environment (see module docstring)."""
    root = os.environ.get("LINALG_PREFILL_CACHE_DIR", "~/.cache/linalg-prefill")
    enabled = os.environ.get("LINALG_PREFILL_CACHE", "1") not in ("0", "false", "off", "no")
    return ArtifactCache(root, enabled=enabled)
