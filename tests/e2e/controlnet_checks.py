"""What the per-request ControlNet parity files (test_*controlnet*_parity.py) share: one family's requests
at one prompt and size (`ControlNetRequests`: diffserve's images, Diffusers' images, the sampling
parameters of a batched row), a ControlNet pipeline folder loaded on both sides, the check that a row
without a ControlNet is bit-identical whatever its neighbour carries, and the refusal of a bad entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.sampling_params import ControlNetChoice
from diffserve.errors import InvalidRequestError
from diffserve.request import Req
from diffserve.testing.parity import denoise_together, diffusers_uint8, stack_uint8


@dataclass(frozen=True)
class ControlNetRequests:
    """One family's requests in a parity file: `prompt` at `height` x `width` with its fixed keywords `kw`
    (steps, sequence length, guidance), on either side."""

    prompt: str
    height: int
    width: int
    kw: Mapping[str, Any] = field(default_factory=dict)

    def generate(self, ours: DiffGenerator, seed: int, **kwargs: Any) -> np.ndarray:
        """diffserve's images for one request, as uint8."""
        out = ours.generate(
            prompt=self.prompt, seed=seed, height=self.height, width=self.width, **self.kw, **kwargs
        )
        return stack_uint8(out.images)

    def reference(self, pipe: Callable[..., Any], seed: int, **kwargs: Any) -> np.ndarray:
        """Diffusers' images for the same request, as uint8."""
        return diffusers_uint8(
            pipe, seed=seed, prompt=self.prompt, height=self.height, width=self.width, **self.kw, **kwargs
        )

    def params(
        self, prompt: str, seed: int, controlnets: Iterable[ControlNetChoice] = (), **extra: Any
    ) -> SamplingParams:
        """A row for the batching tests: `prompt` at this size, `extra` over the fixed keywords."""
        return SamplingParams(
            prompt=prompt, seed=seed, height=self.height, width=self.width, controlnets=list(controlnets),
            **{**self.kw, **extra},
        )  # fmt: skip


def load_controlnet_folder(folder: Path, diffusers_cls: Any) -> tuple[DiffGenerator, Any]:
    """diffserve and Diffusers (`diffusers_cls`, fp32, no progress bar) on one ControlNet pipeline folder;
    diffserve must have loaded the folder's `controlnet` as "default"."""
    ours = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False)
    assert list(ours.pipeline.controlnets) == ["default"]
    pipe = diffusers_cls.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return ours, pipe


def assert_plain_row_unaffected(
    ours: DiffGenerator, plain: SamplingParams, controlled: SamplingParams, uncontrolled: SamplingParams
) -> None:
    """`plain` (a request without a ControlNet, prompt "plain") denoised next to `controlled` and next to
    `uncontrolled` (the same neighbour without its ControlNet): bit-identical images."""
    pipeline = ours.pipeline

    def batch_with(neighbour: SamplingParams) -> np.ndarray:
        running = [pipeline.run_pre_denoise(pipeline.validate(Req(params=p))) for p in (neighbour, plain)]
        done, _ = denoise_together(pipeline, running)
        return stack_uint8(done["plain"].outputs.images)

    assert np.array_equal(batch_with(controlled), batch_with(uncontrolled))


def assert_controlnets_refused(ours: DiffGenerator, params: SamplingParams, message: str) -> None:
    """Validating `params` is refused with a message matching `message`, naming the `controlnets` field."""
    with pytest.raises(InvalidRequestError, match=message) as caught:
        ours.pipeline.validate(Req(params=params))
    assert caught.value.param == "controlnets"
