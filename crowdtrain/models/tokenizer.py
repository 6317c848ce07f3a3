"""Tokenizers behind one interface: the built-in byte tokenizer or a saved transformers tokenizer.

Peers must tokenise identically, so only local files are read: a tokenizer is never downloaded.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import ModelSpec

logger = logging.getLogger(__name__)

NUM_BYTES = 256


class Tokenizer(Protocol):
    """What crowdtrain needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included."""
        ...

    @property
    def identity(self) -> str:
        """A string that changes whenever the tokenizer's output could (keys the token cache)."""
        ...

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    mask_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens skipped."""
        ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, then BOS=256, EOS=257, PAD=258."""

    bos_token_id: int | None = NUM_BYTES
    eos_token_id: int | None = NUM_BYTES + 1
    pad_token_id: int | None = NUM_BYTES + 2
    mask_token_id: int | None = None

    @property
    def vocab_size(self) -> int:
        """259: the 256 bytes and three special tokens."""
        return NUM_BYTES + 3

    @property
    def identity(self) -> str:
        """Constant: the byte tokenizer never changes."""
        return "bytes-v1"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """UTF-8 text of the byte ids; special ids are skipped, invalid sequences replaced."""
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


class HFTokenizer:
    """A saved transformers tokenizer seen through the `Tokenizer` interface."""

    def __init__(self, tokenizer: Any, identity: str) -> None:
        self._tokenizer = tokenizer
        self._identity = identity
        self.bos_token_id: int | None = tokenizer.bos_token_id
        # Documents need a separator; tokenizers of encoders often have SEP but no EOS.
        self.eos_token_id: int | None = tokenizer.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = tokenizer.sep_token_id
        self.pad_token_id: int | None = tokenizer.pad_token_id
        self.mask_token_id: int | None = tokenizer.mask_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._tokenizer)

    @property
    def identity(self) -> str:
        """The directory and a digest of its files' names, sizes and modification times."""
        return self._identity

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens skipped."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """`bytes` gives the ByteTokenizer; anything else is a local directory with a saved tokenizer."""
    if spec.tokenizer == "bytes":
        return ByteTokenizer()
    path = Path(spec.tokenizer).expanduser().resolve()
    if not path.is_dir():
        raise BadInputError(f"Tokenizer directory {path} does not exist; use 'bytes' or a saved tokenizer's directory.")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; all mean "not a usable tokenizer"
        raise BadInputError(f"Cannot load a tokenizer from {path}: {e}".rstrip(".") + ".") from None
    logger.info("Loaded tokenizer %s from %s (%d tokens)", type(tokenizer).__name__, path, len(tokenizer))
    return HFTokenizer(tokenizer, identity=f"hf:{path}:{_directory_digest(path)}")


def _directory_digest(path: Path) -> str:
    """A digest of the names, sizes and modification times of the files in `path`."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]
