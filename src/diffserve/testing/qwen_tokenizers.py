"""A small Qwen2-style byte-level BPE tokenizer built in memory, for tiny Qwen-Image and Z-Image checkpoints.

Every byte is a token, as in the real Qwen vocabulary, so any text encodes. On top of that, the words
of the prompt templates the Qwen-Image pipelines wrap prompts in get merges that make each of them one
token, as the real 151k-token vocabulary does. This matters because those pipelines drop a fixed count
of leading hidden states (34 for Qwen-Image, 64 for Qwen-Image-Edit) that is meant to be exactly the
system part of the template; with a bytes-only vocabulary the count would cut the template mid-way.

The special tokens are the Qwen2.5 / Qwen3 ones (chat turns, vision placeholders, tool calls, thinking)
in the real order, appended after the byte and merge tokens. The chat template is a minimal Jinja
template of our own that renders plain-text conversations the way Qwen3's does, including the
`enable_thinking` switch (an empty think block when it is False), which is all ZImagePipeline uses.
"""

from __future__ import annotations

from tokenizers import AddedToken
from tokenizers.models import BPE
from transformers import Qwen2Tokenizer

from diffserve.testing.tokenizers import _bytes_to_unicode

#: Control tokens, in the order the real Qwen2.5 vocabulary numbers them after its BPE tokens.
#: The bool says whether the token is "special" (dropped by decode(skip_special_tokens=True)).
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

#: Prompt templates whose words get whole-word tokens. Qwen-Image, Qwen-Image-Edit and -Edit-Plus
#: system prompts (facts of the released models; the pipelines hard-code them) and the chat markup.
TEMPLATE_TEXTS: tuple[str, ...] = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n",
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n",
    "<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "Picture 1: ",
    "<think>\n\n</think>\n\n",
)

#: Renders plain-text chats like Qwen3's template: one `<|im_start|>role\n...<|im_end|>\n` per message,
#: an open assistant turn when asked, and an empty think block when thinking is switched off.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _template_words(texts: tuple[str, ...]) -> list[str]:
    """Byte-level pre-tokenised chunks of the template texts, special tokens left out, first-seen order."""
    probe = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[])
    pre = probe.backend_tokenizer.pre_tokenizer
    specials = [tok for tok, _ in QWEN_ADDED_TOKENS]
    words: list[str] = []
    for text in texts:
        pieces = [text]
        for special in specials:
            pieces = [part for piece in pieces for part in piece.split(special)]
        for piece in pieces:
            for word, _ in pre.pre_tokenize_str(piece) if piece else ():
                if len(word) > 1 and word not in words:
                    words.append(word)
    return words


def _whole_word_merges(words: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges that make each word a single token, found by joining leftovers until nothing splits.

    A word's merges can split another word differently (BPE applies the lowest-ranked pair anywhere),
    so after each pass the words are re-tokenised and any still in pieces get merges that join the
    pieces they now fall into; a few passes reach a fixed point.
    """
    merges: list[tuple[str, str]] = []
    for _ in range(16):
        model = BPE(vocab=dict(vocab), merges=list(merges))
        changed = False
        for word in words:
            pieces = [tok.value for tok in model.tokenize(word)]
            while len(pieces) > 1:
                pair = (pieces[0], pieces[1])
                joined = pieces[0] + pieces[1]
                if pair not in merges:
                    merges.append(pair)
                    changed = True
                vocab.setdefault(joined, len(vocab))
                pieces = [joined, *pieces[2:]]
        if not changed:
            return merges
    raise RuntimeError("whole-word merges did not settle")


def build_qwen_tokenizer(
    model_max_length: int = 131072, chat_template: str = QWEN_CHAT_TEMPLATE
) -> Qwen2Tokenizer:
    """A Qwen2Tokenizer with every byte as a token, whole-word template merges and the Qwen control tokens.

    `<|endoftext|>` pads (as in the real tokenizers), `<|im_end|>` ends turns; padding is on the right.
    """
    vocab = {symbol: i for i, symbol in enumerate(_bytes_to_unicode())}
    merges = _whole_word_merges(_template_words(TEMPLATE_TEXTS), vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        padding_side="right",
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.add_tokens(
        [AddedToken(tok, special=special, normalized=False) for tok, special in QWEN_ADDED_TOKENS]
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [tok for tok, special in QWEN_ADDED_TOKENS[1:] if special]},
        replace_extra_special_tokens=True,
    )
    tokenizer.chat_template = chat_template
    return tokenizer
