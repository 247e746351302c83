"""Log format of every diffserve process (CLI, server, engine process): `[11-29 18:41:43] message`, as SGLang
Diffusion users know it."""

from __future__ import annotations

import logging
import warnings

LEVELS = ("debug", "info", "warning", "error")


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
