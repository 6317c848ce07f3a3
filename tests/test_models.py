"""Model builders: the byte tokenizer, saved tokenizers, identical initial weights, training losses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from crowdtrain.errors import BadInputError
from crowdtrain.manifest import ModelSpec, demo
from crowdtrain.models import ByteTokenizer, build_model, count_parameters, load_tokenizer, model_kind, training_loss
from crowdtrain.models.build import mask_tokens

TINY_LLAMA = {
    "vocab_size": 260,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
}
TINY_ALBERT = {
    "vocab_size": 260,
    "embedding_size": 16,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
}


def test_byte_tokenizer_round_trips_non_ascii_text() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo, 世界 🙂\nnew line"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text
    specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert specials == [256, 257, 258]
    assert tokenizer.vocab_size == 259
    assert tokenizer.decode([256, *ids, 257, 258]) == text


def test_byte_tokenizer_replaces_invalid_utf8() -> None:
    assert ByteTokenizer().decode([0x61, 0xFF, 0x62]) == "a\ufffdb"


def test_load_tokenizer_bytes() -> None:
    assert isinstance(load_tokenizer(ModelSpec(tokenizer="bytes")), ByteTokenizer)


def test_demo_model_weights_depend_only_on_seed() -> None:
    spec = demo().model
    first = build_model(spec, ByteTokenizer().vocab_size, seed=0).state_dict()
    same = build_model(spec, ByteTokenizer().vocab_size, seed=0).state_dict()
    other = build_model(spec, ByteTokenizer().vocab_size, seed=1).state_dict()
    assert first.keys() == same.keys() == other.keys()
    assert all(torch.equal(first[name], same[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_demo_model_has_a_few_million_parameters_and_trains_from_chance() -> None:
    spec = demo().model
    model = build_model(spec, ByteTokenizer().vocab_size)
    assert model.training
    assert 1_000_000 < count_parameters(model) < 10_000_000
    batch = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = training_loss(model, batch, model_kind(spec))
    loss.backward()
    assert math.isfinite(loss.item())
    assert abs(loss.item() - math.log(spec.config["vocab_size"])) < 0.5
    gradients = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in gradients)


def test_build_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(ModelSpec(config=TINY_LLAMA), 259, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_albert_masked_lm_builds_and_trains_one_step() -> None:
    spec = ModelSpec(architecture="AlbertForMaskedLM", config=TINY_ALBERT)
    assert model_kind(spec) == "masked"
    model = build_model(spec, ByteTokenizer().vocab_size)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (2, 32), generator=generator)
    batch[1, 20:] = ByteTokenizer.pad_token_id
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = training_loss(model, batch, "masked", generator=generator, pad_token_id=ByteTokenizer.pad_token_id)
    loss.backward()
    optimizer.step()
    assert math.isfinite(loss.item())
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_mask_tokens_masks_some_non_pad_tokens_only() -> None:
    batch = torch.arange(400).reshape(4, 100) % 250
    batch[:, 50:] = 258
    inputs, labels = mask_tokens(
        batch, vocab_size=260, generator=torch.Generator().manual_seed(0), mask_token_id=259, pad_token_id=258
    )
    masked = labels != -100
    assert 0.05 < masked[:, :50].float().mean().item() < 0.3
    assert not masked[:, 50:].any()
    assert torch.equal(labels[masked], batch[masked])
    assert (inputs[masked] == 259).all()
    assert torch.equal(inputs[~masked], batch[~masked])


def test_mask_tokens_masks_at_least_one_token() -> None:
    batch = torch.tensor([[5]])
    _, labels = mask_tokens(batch, vocab_size=260, generator=torch.Generator().manual_seed(0))
    assert labels.tolist() == [[5]]


@pytest.mark.parametrize(
    "architecture", ["NopeForCausalLM", "LlamaModel", "LlamaConfig", "BertForSequenceClassification"]
)
def test_bad_architecture_is_named(architecture: str) -> None:
    with pytest.raises(BadInputError, match=architecture):
        build_model(ModelSpec(architecture=architecture, config=TINY_LLAMA), 259)


def test_unknown_config_key_is_named() -> None:
    with pytest.raises(BadInputError, match="hidden_sizee"):
        build_model(ModelSpec(config={**TINY_LLAMA, "hidden_sizee": 64}), 259)


def test_config_value_rejected_by_transformers_is_bad_input() -> None:
    with pytest.raises(BadInputError, match="hidden size"):
        build_model(ModelSpec(config={**TINY_LLAMA, "hidden_size": 30, "num_attention_heads": 4}), 259)


def test_vocab_smaller_than_the_tokenizer_is_refused() -> None:
    with pytest.raises(BadInputError, match="vocab_size 100"):
        build_model(ModelSpec(config={**TINY_LLAMA, "vocab_size": 100}), 259)


def _save_word_level_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    wrapped.save_pretrained(directory)


def test_local_tokenizer_directory_loads_offline(tmp_path: Path) -> None:
    _save_word_level_tokenizer(tmp_path)
    tokenizer = load_tokenizer(ModelSpec(tokenizer=str(tmp_path)))
    assert tokenizer.encode("hello world hello") == [3, 4, 3]
    assert tokenizer.encode("unseen") == [0]
    assert tokenizer.decode([3, 2, 4, 1]) == "hello world"
    assert tokenizer.vocab_size == 5
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1)
    assert str(tmp_path.resolve()) in tokenizer.identity


def test_missing_tokenizer_directory_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(BadInputError, match="no-such-tokenizer"):
        load_tokenizer(ModelSpec(tokenizer=str(missing)))


def test_directory_without_a_tokenizer_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(BadInputError, match=str(tmp_path.resolve())):
        load_tokenizer(ModelSpec(tokenizer=str(tmp_path)))
