"""Resolving a model path: a local Diffusers folder as is, or a Hugging Face Hub repo id (`owner/name`)
found in the local Hugging Face cache or, unless offline, downloaded into it.

Offline first: a repo id whose revision is already in the cache (`HF_HUB_CACHE`, by default
`$HF_HOME/hub`) is used without contacting the Hub, so a cached model starts with no network and a branch
such as `main` stays at the commit that was downloaded (`hf download owner/name` updates it). Otherwise,
unless `HF_HUB_OFFLINE=1`, the repo is downloaded with huggingface_hub's own progress bars (its token:
`HF_TOKEN` or `hf auth login`, for gated and private repos).

Only the files diffserve reads are downloaded (`DOWNLOAD_PATTERNS`): model_index.json, the components'
JSON files, their `.safetensors` weights and tokenizer files. Never `.bin`/`.ckpt`/`.pt` weights (diffserve
loads only safetensors), root-level single-file checkpoints (FLUX.1-dev's `flux1-dev.safetensors`
duplicates its `transformer/` folder), nor precision variants such as `model.fp16.safetensors`
(diffserve casts the full-precision weights to `--dtype` itself).
"""

from __future__ import annotations

import logging
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import (
    HFValidationError,
    HTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from diffserve.configs.quality import CALIBRATION_FILE
from diffserve.errors import ModelLoadError, UserError

logger = logging.getLogger("diffserve.loader")

#: What a Diffusers folder needs, as huggingface_hub `allow_patterns` (fnmatch; `*` also matches `/`).
DOWNLOAD_PATTERNS: tuple[str, ...] = (
    "model_index.json",
    "diffserve.json",  # the folder's sampling defaults (loader.folder_defaults)
    CALIBRATION_FILE,  # calibrated quality tiers (`diffserve calibrate-cache`)
    "*/*.json",  # component, scheduler, tokenizer and processor configs; safetensors shard indexes
    "*/*.safetensors",  # component weights (a slash: root-level single-file checkpoints are left out)
    "*/*.txt",  # tokenizer vocabularies and merges
    "*/*.model",  # sentencepiece tokenizers (T5)
    "*/*.jinja",  # chat templates (Qwen processors)
)
#: Precision variants of the weights (`diffusion_pytorch_model.fp16.safetensors`, their shards and
#: indexes): diffserve loads the plain files only.
SKIPPED_PATTERNS: tuple[str, ...] = ("*/*.fp16.*", "*/*.fp16-*", "*/*.bf16.*", "*/*.bf16-*")


def is_repo_id(text: str) -> bool:
    """Whether `text` reads as a Hub model repo id `owner/name` (a bare `name` is taken for a folder)."""
    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_model_path(model_path: str | Path, revision: str | None = None) -> Path:
    """The local folder to load `model_path` from: an existing path as is (a folder, or a file that
    `read_model_index` then refuses), else the cached or downloaded snapshot of the Hub repo it names.

    `revision` (a branch, tag or commit hash; None: `main`) applies to repo ids only: given with a local
    folder it is an error rather than ignored. A path that is neither is returned unchanged, for
    `read_model_index` to report as missing."""
    path = Path(model_path).expanduser()
    if path.exists():
        if revision is not None:
            raise UserError(
                f"revision {revision!r} applies to Hugging Face repo ids only; {str(model_path)!r} is a local path"
            )
        return path
    if not is_repo_id(str(model_path)):
        return path
    return _snapshot(str(model_path), revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """The snapshot folder of `repo_id` at `revision`: from the cache, else downloaded (unless offline)."""
    try:
        folder = Path(_download(repo_id, revision, local_files_only=True))
    except LocalEntryNotFoundError:  # not cached, or only partly (huggingface_hub checks): the Hub's turn
        return _downloaded(repo_id, revision)
    logger.info(
        "Model %s (revision %s, commit %s) from the Hugging Face cache",
        repo_id, revision or constants.DEFAULT_REVISION, folder.name,
    )  # fmt: skip
    return folder


def _downloaded(repo_id: str, revision: str | None) -> Path:
    """`repo_id` at `revision` downloaded into the cache; a clear error when offline or unreachable."""
    if constants.HF_HUB_OFFLINE:
        raise _not_found(repo_id, revision, "HF_HUB_OFFLINE is set, so the Hub was not contacted")
    logger.info(
        "Downloading %s (revision %s) from the Hugging Face Hub",
        repo_id,
        revision or constants.DEFAULT_REVISION,
    )
    try:
        folder = Path(_download(repo_id, revision, local_files_only=False))
    except (OSError, HTTPError) as exc:  # huggingface_hub's HTTP, connection, not-found and disk errors
        raise _not_found(repo_id, revision, _reason(exc)) from exc
    logger.info("Downloaded %s (commit %s) to %s", repo_id, folder.name, folder)
    return folder


def _download(repo_id: str, revision: str | None, *, local_files_only: bool) -> str:
    return snapshot_download(
        repo_id,
        revision=revision,
        local_files_only=local_files_only,
        allow_patterns=list(DOWNLOAD_PATTERNS),
        ignore_patterns=list(SKIPPED_PATTERNS),
    )


def _reason(exc: BaseException) -> str:
    """`exc` as one line (huggingface_hub's messages span several), with a hint for access errors."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, RepositoryNotFoundError):  # also gated repos, and private ones without a token
        text += " (a gated or private repo needs a token: set HF_TOKEN or run `hf auth login`)"
    return text


def _not_found(repo_id: str, revision: str | None, reason: str) -> ModelLoadError:
    at = f" at revision {revision!r}" if revision is not None else ""
    return ModelLoadError(
        f"model {repo_id!r}{at} is not a local folder, not in the Hugging Face cache "
        f"(HF_HUB_CACHE={constants.HF_HUB_CACHE}), and could not be downloaded: {reason}"
    )
