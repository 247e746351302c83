"""Tokenizers load from both layouts real checkpoints use: tokenizer.json, and the older
vocab.json + merges.txt (CLIP) / spiece.model (T5) files; slow and fast class names are accepted."""

from __future__ import annotations

import io
import json

import pytest

from diffserve.loader.component_loader import load_tokenizer
from diffserve.loader.model_index import ComponentSpec
from diffserve.testing.tokenizers import build_clip_tokenizer, build_t5_tokenizer


@pytest.mark.parametrize("class_name", ["CLIPTokenizer", "CLIPTokenizerFast"])
def test_clip_from_tokenizer_json(tmp_path, class_name) -> None:
    build_clip_tokenizer().save_pretrained(tmp_path)
    tok = load_tokenizer(ComponentSpec("tokenizer", "transformers", class_name, tmp_path))
    assert tok("a red fox").input_ids[0] == tok.bos_token_id
    assert tok.model_max_length == 77


def test_clip_from_vocab_and_merges_files(tmp_path) -> None:
    reference = build_clip_tokenizer()
    (tmp_path / "vocab.json").write_text(json.dumps(reference.get_vocab()))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))
    tok = load_tokenizer(ComponentSpec("tokenizer", "transformers", "CLIPTokenizer", tmp_path))
    assert tok("a red fox").input_ids == reference("a red fox").input_ids


@pytest.mark.parametrize("class_name", ["T5Tokenizer", "T5TokenizerFast"])
def test_t5_from_tokenizer_json(tmp_path, class_name) -> None:
    build_t5_tokenizer().save_pretrained(tmp_path)
    tok = load_tokenizer(ComponentSpec("tokenizer_2", "transformers", class_name, tmp_path))
    assert tok("a red fox").input_ids[-1] == tok.eos_token_id


def test_t5_from_sentencepiece_model(tmp_path) -> None:
    sentencepiece = pytest.importorskip(
        "sentencepiece", reason="sentencepiece is needed to write spiece.model"
    )
    model = io.BytesIO()
    sentences = ["a red fox in the snow", "a blue bird on a branch", "the quick brown fox"] * 20
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=24,
        model_type="unigram",
        minloglevel=2,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
    )
    (tmp_path / "spiece.model").write_bytes(model.getvalue())
    tok = load_tokenizer(ComponentSpec("tokenizer_2", "transformers", "T5TokenizerFast", tmp_path))
    ids = tok("a red fox").input_ids
    assert ids[-1] == 1 and len(ids) > 2
    assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == "aredfox"
