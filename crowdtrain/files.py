"""Files a node keeps across restarts: written atomically, and read back only when their checksum matches.

A checksummed file `<name>` has its SHA-256 beside it in `<name>.sha256`, so a truncated, torn or bit-flipped
file is detected before anything parses it (torch would load a flipped weight without a word).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path


class ChecksumError(ValueError):
    """A checksummed file that is missing, unreadable, or whose bytes don't match their checksum."""


def write_atomically(path: Path, data: bytes | memoryview) -> None:
    """Replace `path` by `data` all at once: a crash or a full disk midway leaves the old file as it was."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the error being raised is the one worth reporting
            temporary.unlink(missing_ok=True)
        raise


def checksum_path(path: Path) -> Path:
    """Where the SHA-256 of `path` is kept."""
    return path.with_name(path.name + ".sha256")


def write_checksummed(
    path: Path, data: bytes | memoryview, write_file: Callable[[Path, bytes | memoryview], None] = write_atomically
) -> None:
    """Write `data` to `path`, then its checksum beside it, each atomically (`write_file` is a seam for tests).
    Until the checksum is replaced, a reader finds the old checksum and refuses the new file: never a wrong read."""
    write_file(path, data)
    write_file(checksum_path(path), hashlib.sha256(data).hexdigest().encode())


def read_checksummed(path: Path) -> bytes:
    """The bytes of `path` if they match the checksum beside them; else ChecksumError, in one sentence."""
    try:
        data = path.read_bytes()
        expected = checksum_path(path).read_text().strip()
    except OSError as e:
        raise ChecksumError(f"{path} is unreadable: {e.strerror}") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise ChecksumError(f"{path} is corrupt or truncated (checksum mismatch)")
    return data


def remove_checksummed(path: Path) -> None:
    """Delete `path` and its checksum."""
    path.unlink(missing_ok=True)
    checksum_path(path).unlink(missing_ok=True)
