"""Text sources tokenised into one token stream, cached on disk.

`embedded` is the text every Python installation ships (pydoc topics and the standard library's
source), so the demo run needs no download; it is identical on peers with the same Python version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import DataSpec

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
"""Bumped when the cached stream's layout changes, so old caches are not reused."""
FILE_SUFFIXES = (".txt", ".md", ".jsonl")
"""Files a `files` directory contributes."""
SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
"""Standard-library folders left out of the embedded corpus: third-party code and test fixtures."""
MAX_UINT16_VOCAB = 65535


class TextEncoder(Protocol):
    """The part of a tokenizer the corpus needs (crowdtrain.models' tokenizers fit)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        ...

    @property
    def identity(self) -> str:
        """Changes whenever the tokenizer's output could."""
        ...

    @property
    def eos_token_id(self) -> int | None:
        """The id that separates documents, if the tokenizer has one."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...


def load_token_stream(spec: DataSpec, tokenizer: TextEncoder, cache_dir: Path) -> np.ndarray:
    """All documents of `spec` as one 1-D token array, EOS between documents; cached in `cache_dir`."""
    files = source_files(spec)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= MAX_UINT16_VOCAB else np.int32)
    cache_path = Path(cache_dir) / f"{_cache_key(spec, tokenizer, files, dtype)}.npy"
    cached = _load_cached(cache_path, dtype)
    if cached is not None:
        return cached
    started = time.monotonic()
    tokens = _tokenise(read_documents(spec, files), tokenizer, dtype)
    logger.info(
        "Tokenised %d tokens from the %s corpus in %.1f s; cached at %s",
        len(tokens),
        spec.source,
        time.monotonic() - started,
        cache_path,
    )
    _save_atomically(cache_path, tokens)
    return np.load(cache_path, mmap_mode="r")


def source_files(spec: DataSpec) -> list[Path]:
    """The files `spec` reads, in reading order (none for `hf`)."""
    if spec.source == "embedded":
        return _stdlib_sources()
    if spec.source == "files":
        return _local_files(Path(spec.path).expanduser().resolve())
    return []


def read_documents(spec: DataSpec, files: list[Path]) -> Iterator[str]:
    """The documents of `spec` in a fixed order; `files` is what `source_files(spec)` returned."""
    if spec.source == "embedded":
        return _embedded_documents(files)
    if spec.source == "files":
        return _file_documents(files, spec.text_field)
    return _hf_documents(spec)


def _stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted by path, without tests, IDLE, lib2to3 or site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in SKIPPED_STDLIB_DIRS]
        found.extend(Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def _local_files(path: Path) -> list[Path]:
    """`path` itself, or the .txt/.md/.jsonl files under it sorted by path."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise BadInputError(f"Data path {path} does not exist; set data.path to a text file, JSONL file or folder.")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
    if not files:
        raise BadInputError(f"Data folder {path} holds no {', '.join(FILE_SUFFIXES)} files.")
    return files


def _embedded_documents(stdlib_files: list[Path]) -> Iterator[str]:
    """pydoc's topic texts, then each standard-library module's source."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]
    for path in stdlib_files:
        yield path.read_text(encoding="utf-8", errors="replace")


def _file_documents(files: list[Path], text_field: str) -> Iterator[str]:
    """Each text file is a document; each line of a .jsonl file is one."""
    for path in files:
        if path.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(path, text_field)
        else:
            yield _read_text(path)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    """`text_field` of every non-blank line of a JSONL file."""
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise BadInputError(f"{path} line {line_number} is not valid JSON.") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise BadInputError(f"{path} line {line_number} has no string field {text_field!r}.")
        yield text


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"Data file {path} is not UTF-8 text.") from None
    except OSError as e:
        raise BadInputError(f"Cannot read data file {path}: {e.strerror or e}.") from None


def _hf_documents(spec: DataSpec) -> Iterator[str]:
    """`text_field` of every row of the dataset's train split."""
    try:
        import datasets  # optional: only runs on HF data need it
    except ImportError:
        raise BadInputError("Data source 'hf' needs the datasets package: pip install datasets.") from None
    try:
        dataset: Any = datasets.load_dataset(spec.path, split="train")
    except Exception as e:  # datasets raises many types for a missing or malformed dataset
        raise BadInputError(f"Cannot load dataset {spec.path}: {' '.join(str(e).split())}".rstrip(".") + ".") from None
    if spec.text_field not in dataset.column_names:
        raise BadInputError(f"Dataset {spec.path} has no column {spec.text_field!r}.")
    for text in dataset[spec.text_field]:
        yield str(text)


def _tokenise(documents: Iterator[str], tokenizer: TextEncoder, dtype: np.dtype) -> np.ndarray:
    """Concatenate the documents' tokens, with EOS between documents."""
    eos = tokenizer.eos_token_id
    separator = np.array([] if eos is None else [eos], dtype=dtype)
    if eos is None:
        logger.warning("The tokenizer has no end-of-text token; documents are concatenated without a separator")
    chunks: list[np.ndarray] = []
    for document in documents:
        if chunks:
            chunks.append(separator)
        chunks.append(np.asarray(tokenizer.encode(document), dtype=dtype))
    if not chunks or not any(len(chunk) for chunk in chunks):
        raise BadInputError("The training data is empty: no document has any text.")
    return np.concatenate(chunks)


def _cache_key(spec: DataSpec, tokenizer: TextEncoder, files: list[Path], dtype: np.dtype) -> str:
    """A digest of everything the stream depends on: source, tokenizer and the files' sizes and times."""
    described: dict[str, Any] = {
        "format": CACHE_FORMAT_VERSION,
        "source": spec.source,
        "path": spec.path,
        "text_field": spec.text_field,
        "tokenizer": tokenizer.identity,
        "dtype": dtype.str,
        "files": [_describe_file(path) for path in files],
    }
    if spec.source == "embedded":
        described["python"] = sys.version
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _describe_file(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path), stat.st_size, stat.st_mtime_ns


def _load_cached(path: Path, dtype: np.dtype) -> np.ndarray | None:
    """The cached stream, or None when absent; a corrupt cache is removed and rebuilt."""
    if not path.exists():
        return None
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        if tokens.ndim != 1 or tokens.dtype != dtype or len(tokens) == 0:
            raise ValueError(f"holds a {tokens.dtype} array of shape {tokens.shape}")
    except (OSError, ValueError, EOFError) as e:
        logger.warning("Token cache %s is corrupt (%s); rebuilding it", path, e)
        path.unlink(missing_ok=True)
        return None
    logger.debug("Loaded %d tokens from cache %s", len(tokens), path)
    return tokens


def _save_atomically(path: Path, tokens: np.ndarray) -> None:
    """Write to a temporary file in the same folder, then rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            np.save(file, tokens, allow_pickle=False)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
