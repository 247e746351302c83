"""Log format of every diffserve process (CLI, server, engine process): `[11-29 18:41:43] message`, as SGLang
Diffusion users know it; and `shown_text`, how client-supplied text (prompts) appears in a log line."""

from __future__ import annotations

import logging
import re
import warnings

LEVELS = ("debug", "info", "warning", "error")

#: Characters of a prompt a log line shows (the rest is elided, its length said).
LOGGED_PROMPT_CHARS = 80
#: What could forge or garble a log line or its quoting: C0/C1 controls, DEL, U+2028/9, backslash, quote.
_UNSAFE = re.compile(r'[\x00-\x1f\x7f-\x9f\u2028\u2029\\"]')


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    if char in '\\"':
        return "\\" + char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown_text(text: str, limit: int = LOGGED_PROMPT_CHARS) -> str:
    """`text` (client-supplied) for one log line: double-quoted, its first `limit` characters with controls,
    quotes and backslashes escaped, and `…(N chars)` after the quote when it was cut. A prompt can be
    thousands of characters: logging it whole would flood the log and copy a client's text into it."""
    quoted = '"' + _UNSAFE.sub(_escape_char, text[:limit]) + '"'
    return quoted if len(text) <= limit else f"{quoted}…({len(text)} chars)"


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="[%(asctime)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
        force=True,
    )
    if level != "debug":
        # Third-party chatter (tokenizer conversion notes, deprecation warnings) is not for users.
        for name in ("transformers", "huggingface_hub", "urllib3"):
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
        # transformers' own per-file "Loading weights" bars would interleave with our component log.
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
