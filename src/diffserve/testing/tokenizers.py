"""Small CLIP and T5 tokenizers built in memory, so tiny checkpoints need no download.

The CLIP tokenizer is byte-level BPE with every byte as a token (with and without the end-of-word
marker) and no merges; the T5 tokenizer is a Unigram model over letters, digits and punctuation.
Both save with `save_pretrained` in the layout Diffusers and transformers load.
"""

from __future__ import annotations

import re
import string

from transformers import CLIPTokenizer, GemmaTokenizer, T5Tokenizer


def _bytes_to_unicode() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (GPT-2's table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = []
    extra = 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    symbols = _bytes_to_unicode()
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def build_t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    alphabet = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    pieces += [("▁" + c, -3.0) for c in alphabet]
    pieces += [(c, -4.0) for c in alphabet]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")


def build_gemma_tokenizer(words_from: tuple[str, ...]) -> GemmaTokenizer:
    """A Gemma-style BPE tokenizer: Gemma's special tokens, 256 byte-fallback tokens, "▁" (space) and each
    printable ASCII character, and one token per space-led word of `words_from` (merged from its
    characters), as the real 256k vocabulary has; it prepends `<bos>` and adds no `<eos>`, as Gemma's does.
    The word tokens keep a long instruction (SANA's) about as many tokens long as with the real tokenizer (a few
    hundred), instead of one per character."""
    vocab = {token: i for i, token in enumerate(GEMMA_SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in ["▁", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(char, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in dict.fromkeys(re.findall(r"[A-Za-z]+", " ".join(words_from))):
        piece = "▁"
        for char in word:
            if piece + char not in vocab:
                merges.append((piece, char))
                vocab[piece + char] = len(vocab)
            piece += char
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)
