"""What one device call would carry, against its limit: the repository's tracked and untracked
(not ignored) files plus the folders it carries.

    .venv/bin/python bench/carry_size.py build/gpu-bundle build/gpu-sweep

Prints the sizes in MiB and exits 1 when their sum is over LIMIT_MIB (a device call refuses a
working tree over 64 MiB before it starts: `make gpu-session` checks here, with no GPU at hand).
"""

from __future__ import annotations

import os
import subprocess
import sys

LIMIT_MIB = 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_bytes(root: str) -> int:
    """Bytes of the files git would send from ``root``: tracked, and untracked but not ignored."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    paths = (os.path.join(root, os.fsdecode(name)) for name in names if name)
    return sum(os.path.getsize(path) for path in paths if os.path.isfile(path))


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(parent, name)) for parent, _, names in os.walk(folder) for name in names)


def main(folders: list[str]) -> int:
    sizes = {"the repository's files": tree_bytes(ROOT), **{folder: folder_bytes(folder) for folder in folders}}
    for what, size in sizes.items():
        print(f"{size / 2 ** 20:7.2f} MiB  {what}")
    total = sum(sizes.values()) / 2 ** 20
    verdict = "fits" if total <= LIMIT_MIB else "over"
    print(f"{total:7.2f} MiB  in all: {verdict} the {LIMIT_MIB} MiB a device call carries")
    return 0 if total <= LIMIT_MIB else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
