"""Training data: the embedded corpus, local files, the token cache, and per-peer window sampling."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from crowdtrain.data import BatchPrefetcher, WindowSampler, load_token_stream, peer_seed_from_peer_id
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import DataSpec
from crowdtrain.models import ByteTokenizer

EOS = ByteTokenizer.eos_token_id


class RefusingTokenizer(ByteTokenizer):
    """A ByteTokenizer that fails if asked to tokenise: proves a stream came from the cache."""

    def encode(self, text: str) -> list[int]:
        raise AssertionError("the stream should have been served from the cache")


@pytest.fixture(scope="module")
def embedded_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embedded-cache")


def _bytes_of(*documents: str) -> list[int]:
    tokens: list[int] = []
    for document in documents:
        if tokens:
            tokens.append(EOS)
        tokens.extend(document.encode("utf-8"))
    return tokens


def test_embedded_stream_is_large_deterministic_and_cached(embedded_cache: Path, tmp_path: Path) -> None:
    first = load_token_stream(DataSpec(), ByteTokenizer(), embedded_cache)
    assert first.ndim == 1 and first.dtype == np.uint16
    assert len(first) >= 5_000_000
    assert int(first.max()) <= EOS
    (cache_file,) = embedded_cache.glob("*.npy")
    modified_ns = cache_file.stat().st_mtime_ns

    cached = load_token_stream(DataSpec(), RefusingTokenizer(), embedded_cache)
    assert isinstance(cached, np.memmap)
    assert cache_file.stat().st_mtime_ns == modified_ns
    assert np.array_equal(cached, first)

    rebuilt = load_token_stream(DataSpec(), ByteTokenizer(), tmp_path)
    assert [p.name for p in tmp_path.glob("*.npy")] == [cache_file.name]
    assert np.array_equal(rebuilt, first)


def test_embedded_corpus_holds_python_docs_and_stdlib_but_not_tests(embedded_cache: Path) -> None:
    tokens = load_token_stream(DataSpec(), ByteTokenizer(), embedded_cache)
    text = np.asarray(tokens).astype(np.uint8).tobytes()  # EOS wraps to a control byte; fine for search
    assert b'The "if" statement is used for conditional execution' in text  # pydoc topic "if"
    assert b"def namedtuple(" in text  # collections/__init__.py
    assert b"class IdleConf" not in text  # idlelib is left out
    assert b"class Test_TestLoader" not in text  # unittest/test is left out


def test_files_source_reads_a_folder_of_text_and_jsonl_in_order(tmp_path: Path) -> None:
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "dé"}) + "\n\n" + json.dumps({"text": "f", "x": 1}) + "\n")
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("# g")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    spec = DataSpec(source="files", path=str(tmp_path))
    tokens = load_token_stream(spec, ByteTokenizer(), tmp_path / "cache")
    assert tokens.tolist() == _bytes_of("abc", "dé", "f", "# g")


def test_files_source_reads_one_text_file_and_one_jsonl_file(tmp_path: Path) -> None:
    text_file = tmp_path / "book.txt"
    text_file.write_text("one document\nwith two lines\n")
    jsonl_file = tmp_path / "rows.jsonl"
    jsonl_file.write_text('{"body": "x"}\n{"body": "yz"}\n')
    text_tokens = load_token_stream(DataSpec(source="files", path=str(text_file)), ByteTokenizer(), tmp_path)
    jsonl_spec = DataSpec(source="files", path=str(jsonl_file), text_field="body")
    assert text_tokens.tolist() == _bytes_of("one document\nwith two lines\n")
    assert load_token_stream(jsonl_spec, ByteTokenizer(), tmp_path).tolist() == _bytes_of("x", "yz")


def test_a_changed_file_is_tokenised_again(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("old")
    spec = DataSpec(source="files", path=str(data))
    assert load_token_stream(spec, ByteTokenizer(), tmp_path / "cache").tolist() == _bytes_of("old")
    data.write_text("newer")
    assert load_token_stream(spec, ByteTokenizer(), tmp_path / "cache").tolist() == _bytes_of("newer")


def test_a_corrupt_cache_is_rebuilt_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data.txt"
    data.write_text("hello")
    spec = DataSpec(source="files", path=str(data))
    load_token_stream(spec, ByteTokenizer(), tmp_path / "cache")
    (cache_file,) = (tmp_path / "cache").glob("*.npy")
    cache_file.write_bytes(cache_file.read_bytes()[:-3])
    with caplog.at_level(logging.WARNING, logger="crowdtrain.data.corpus"):
        assert load_token_stream(spec, ByteTokenizer(), tmp_path / "cache").tolist() == _bytes_of("hello")
    assert "corrupt" in caplog.text
    assert load_token_stream(spec, RefusingTokenizer(), tmp_path / "cache").tolist() == _bytes_of("hello")


@pytest.mark.parametrize(
    ("second_line", "message"),
    [("{not json", "line 2 is not valid JSON"), ('{"title": "no text"}', "line 2 has no string field 'text'")],
)
def test_a_bad_jsonl_line_is_named(tmp_path: Path, second_line: str, message: str) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "fine"}\n' + second_line + "\n")
    with pytest.raises(BadInputError, match=message) as raised:
        load_token_stream(DataSpec(source="files", path=str(data)), ByteTokenizer(), tmp_path)
    assert str(data) in str(raised.value)


def test_a_missing_data_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="nowhere"):
        load_token_stream(DataSpec(source="files", path=str(tmp_path / "nowhere")), ByteTokenizer(), tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_source_without_datasets_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="pip install datasets"):
        load_token_stream(DataSpec(source="hf", path="some/dataset"), ByteTokenizer(), tmp_path)


def test_peer_seeds_are_stable_and_distinct() -> None:
    seed = peer_seed_from_peer_id("QmPeerA")
    assert seed == peer_seed_from_peer_id("QmPeerA")
    assert seed != peer_seed_from_peer_id("QmPeerB")
    assert 0 <= seed < 2**63


def _position_stream(num_tokens: int = 10_000) -> np.ndarray:
    """Token i is i, so a window shows where it was cut from."""
    return np.arange(num_tokens, dtype=np.int32)


def test_windows_are_reproducible_per_peer_epoch_and_step() -> None:
    sampler = WindowSampler(_position_stream(), sequence_length=16, peer_seed=1)
    batch = sampler.batch(epoch=3, batch_size=8, step=5)
    assert batch.shape == (8, 16) and str(batch.dtype) == "torch.int64"
    assert (batch[:, 1:] - batch[:, :-1] == 1).all()
    again = WindowSampler(_position_stream(), sequence_length=16, peer_seed=1).batch(epoch=3, batch_size=8, step=5)
    assert batch.equal(again)
    assert not batch.equal(sampler.batch(epoch=3, batch_size=8, step=6))
    assert not batch.equal(sampler.batch(epoch=4, batch_size=8, step=5))


def test_different_peers_draw_different_windows() -> None:
    peer_seeds = [peer_seed_from_peer_id(f"peer-{i}") for i in range(4)]
    batches = [WindowSampler(_position_stream(), 16, seed).batch(0, 8, 0) for seed in peer_seeds]
    first_tokens = [tuple(batch[:, 0].tolist()) for batch in batches]
    assert len(set(first_tokens)) == len(first_tokens)


def test_training_never_touches_the_held_out_tail() -> None:
    sampler = WindowSampler(_position_stream(), sequence_length=16, peer_seed=0)
    assert sampler.num_held_out_tokens == 100  # 1% of 10,000 tokens
    largest = max(int(sampler.batch(0, 64, step).max()) for step in range(200))
    assert sampler.train_end - 50 <= largest < sampler.train_end
    held_out = sampler.eval_batches(batch_size=4, num_batches=3)
    assert len(held_out) == 3 and all(batch.shape == (4, 16) for batch in held_out)
    assert all(int(batch.min()) >= sampler.train_end for batch in held_out)
    assert int(held_out[-1].max()) == 9_999


def test_held_out_windows_are_the_same_on_every_peer_and_at_least_one_window() -> None:
    short = WindowSampler(_position_stream(100), sequence_length=16, peer_seed=1)
    assert short.num_held_out_tokens == 16
    other = WindowSampler(_position_stream(100), sequence_length=16, peer_seed=2)
    assert all(a.equal(b) for a, b in zip(short.eval_batches(2, 2), other.eval_batches(2, 2), strict=True))


def test_a_stream_too_short_for_two_windows_is_refused() -> None:
    with pytest.raises(BadInputError, match="needs at least 32"):
        WindowSampler(_position_stream(31), sequence_length=16, peer_seed=0)


def test_cache_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("text")
    load_token_stream(DataSpec(source="files", path=str(data)), ByteTokenizer(), tmp_path / "cache")
    assert [name.endswith(".npy") for name in os.listdir(tmp_path / "cache")] == [True]


# --- prefetching ---------------------------------------------------------------------------------


def test_prefetched_batches_are_the_samplers_across_epoch_changes() -> None:
    sampler = WindowSampler(_position_stream(), sequence_length=16, peer_seed=1)
    prefetcher = BatchPrefetcher(sampler, batch_size=4, device="cpu")
    try:
        # steps run on within an epoch; the epoch changes mid-way (a global step), and once more at once
        for epoch, step in [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (2, 6), (2, 7)]:
            assert torch.equal(prefetcher.get(epoch, step), sampler.batch(epoch, 4, step)), (epoch, step)
    finally:
        prefetcher.close()
    assert not prefetcher._thread.is_alive()


def test_a_failing_sampler_surfaces_in_the_training_thread() -> None:
    class Broken(WindowSampler):
        def batch(self, epoch: int, batch_size: int, step: int) -> torch.Tensor:
            raise OSError("the token cache vanished")

    prefetcher = BatchPrefetcher(Broken(_position_stream(), 16, 1), batch_size=4, device="cpu")
    with pytest.raises(RuntimeError, match="the token cache vanished"):
        prefetcher.get(0, 0)
    prefetcher.close()
