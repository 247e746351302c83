"""Errors a user can act on. The CLI prints them as one line and exits with code 2; the server maps
them to HTTP 4xx. Anything else is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (a parameter, a path, a file). The message says what is allowed."""


class InvalidRequestError(UserError):
    """A sampling parameter is out of range or inconsistent with the model. `param` names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(UserError):
    """The model folder is missing, not a Diffusers model, unsupported, or has broken weight files."""


class RequestCancelledError(Exception):
    """The request was cancelled (client gone, DELETE, shutdown) before it finished. Not a failure."""


class LoraError(UserError):
    """A LoRA adapter cannot be loaded or used: unreadable or corrupt file, keys that match no module of
    the model (or another family's), an unknown adapter name, a path outside `--lora-dir`, or unloading
    an adapter that running requests use. The message names the adapter and what is wrong."""


class LoraBusyError(LoraError):
    """A LoRA adapter cannot be made resident now: the adapters running requests use fill
    `--max-lora-memory`. Not the file's fault: the same call succeeds once they finish (the server's 503
    with Retry-After)."""


class LoraLimitError(LoraError):
    """The engine knows `--max-loras` adapters already: unload one before loading another (the server's
    409)."""
