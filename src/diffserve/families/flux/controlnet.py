"""ControlNets for FLUX.1 text-to-image, per request (Diffusers' `FluxControlNetPipeline`, one ControlNet or
several as its `FluxMultiControlNetModel`, Union ControlNets with a control mode).

The engine holds named ControlNets (`loader/controlnets.py`); a request lists the ones it applies
(`SamplingParams.controlnets`). Diffusers' recipe, kept here:

1. each control image, resized to the output size (Lanczos) and repeated once per output, is VAE-encoded
   with a *sampled* posterior, in the order listed, before the initial noise is drawn (each draw comes
   from the request's generator), then packed into 2x2 tokens; an XLabs ControlNet
   (`conditioning_embedding_channels`) takes the resized image itself (its `input_hint_block` encodes it;
   no draw), and the DiT cycles its double-stream samples over its blocks (`controlnet_blocks_repeat`);
2. at step `i` of `n`, a ControlNet entry acts unless `i / n < start` or `(i + 1) / n > end`; an acting
   entry's ControlNet reads the noisy latents, its control latents, the prompt's text states and pooled
   embedding, the timestep and (if it embeds guidance) the guidance scale, and returns per-block residuals
   times its scale. A request's entries' residuals are summed in order (blocks paired up as `zip` pairs
   them), and added to the DiT's image stream for the prompt's rows and, with true CFG, the same ones
   for the negative prompt's rows.

In a step batch, each ControlNet runs once over the rows of every request that applies it at that step;
the DiT adds each request's sum to its own rows only (`models/controlnets/residuals.py`): requests without
a ControlNet share the batch and keep their values bit for bit.

On several ranks the ControlNets run whole on every rank (they are small next to the DiT, and need no
communication then): under CFG-parallel each cfg rank runs them over its branch view's rows, on the
prompt's text (`prompt_request`), so both ranks add the residuals one rank would; under sequence
parallelism the DiT adds to each image shard the matching slice of the whole-sequence residuals; under
tensor parallelism the DiT's image stream is whole on every rank and takes them as on one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from diffserve.configs.sampling_params import SamplingParams
from diffserve.errors import InvalidRequestError, ModelLoadError
from diffserve.families.flux.conditioning import FluxConditioning
from diffserve.models.controlnets.flux import ControlNetBatch, FluxControlNetModel
from diffserve.models.controlnets.residuals import BlockResiduals
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.pipelines.controlnet_conditioning import ControlImageStage
from diffserve.pipelines.controlnet_steps import check_controlnet_entries, merge_samples, prompt_request
from diffserve.request import Req
from diffserve.stages.image_to_image import encode_sampled
from diffserve.stages.latent_preparation import pack_latents


@dataclass
class ControlInput:
    """One of a request's ControlNet entries, ready for the steps: the ControlNet's name, the packed control
    latents (one row per output), its scale, start and end fractions and Union mode, and the prompt's text
    states through that ControlNet's context embedder (computed at its first step)."""

    name: str
    latents: torch.Tensor
    scale: float
    start: float
    end: float
    mode: int | None
    context: torch.Tensor | None = None

    def acts_at(self, step: int, num_steps: int) -> bool:
        """Diffusers' `controlnet_keep` for this entry at `step` of `num_steps` (1.0 in Diffusers)."""
        return not (step / num_steps < self.start or (step + 1) / num_steps > self.end)


@dataclass
class FluxControls:
    """What a FLUX.1 request carries for its ControlNets (`FluxConditioning.controls`)."""

    inputs: list[ControlInput] = field(default_factory=list)


def check_controlnets(params: SamplingParams, nets: Mapping[str, nn.Module], pipeline_name: str) -> None:
    """The model checks of a request's `controlnets` (the model-free ones are `SamplingParams`'): each name
    loaded, a mode exactly when the ControlNet is a Union one, within its modes, and no mix of XLabs' and
    InstantX-style ControlNets (the DiT adds their double-stream samples by different rules, and Diffusers'
    Multi ControlNet applies its first net's rule to their sum)."""
    check_controlnet_entries(params, nets, pipeline_name)
    kinds = {_reads_pixels(nets[entry.name]) for entry in params.controlnets}
    if len(kinds) > 1:
        raise InvalidRequestError(
            "controlnets mixes XLabs ControlNets (which read the control image) with ones that read its "
            "latents (InstantX / Shakker-Labs); apply one kind per request",
            param="controlnets",
        )


def check_controlnet_fits(
    name: str, net: FluxControlNetModel, dit: FluxTransformer2DModel, pixels: int
) -> None:
    """ModelLoadError unless ControlNet `name` can feed `dit` on this folder's latent grid (`pixels` per
    token side: the VAE's scale factor x 2): it reads the DiT's image tokens and text states, so their
    widths (`in_channels`, `joint_attention_dim`, `pooled_projection_dim`) must be the DiT's; its residuals
    join the DiT's image stream, so its blocks must be as wide; and an XLabs hint must tile the control
    image into the latents' token grid. Diffusers fails at the first step on any of these."""
    ours, theirs = net.config, dit.config
    problems = [
        f"{key} {getattr(ours, key)} (the DiT's: {getattr(theirs, key)})"
        for key in ("in_channels", "joint_attention_dim", "pooled_projection_dim")
        if getattr(ours, key) != getattr(theirs, key)
    ]
    if ours.inner_dim != theirs.inner_dim:
        problems.append(
            f"num_attention_heads x attention_head_dim {ours.num_attention_heads} x "
            f"{ours.attention_head_dim} (the DiT's: {theirs.num_attention_heads} x {theirs.attention_head_dim})"
        )
    hint = net.hint_pixels_per_token
    if hint is not None and hint != pixels:
        problems.append(
            f"an XLabs hint token covering {hint}x{hint} pixels (its encoder's downsampling x patch_size "
            f"{ours.patch_size}), where a latent token covers {pixels}x{pixels} (the VAE's scale x 2)"
        )
    if problems:
        raise ModelLoadError(
            f"ControlNet {name!r} does not fit this model's DiT: it has {'; '.join(problems)}"
        )


def _reads_pixels(net: nn.Module) -> bool:
    return isinstance(net, FluxControlNetModel) and net.config.reads_pixels


class ControlImageEncodingStage(ControlImageStage):
    """Step 1 above: every control image's packed latents into `conditioning.controls`. Runs before the
    input image's encoding and the initial noise: its posterior draws come first from the generator."""

    needs = ("generator",)

    def encode_controls(self, req: Req) -> None:
        p = req.params
        inputs = []
        for entry in p.controlnets:
            pixels = self.control_pixels(entry, req, req.batch_size)
            if _reads_pixels(self.nets[entry.name]):  # XLabs': the image itself, no VAE draw
                control = pixels.to(device=self.device, dtype=self.dtype)
            else:
                latents = encode_sampled(self.vae, pixels, req.generator)
                control = pack_latents(latents.to(device=self.device, dtype=self.dtype))
            inputs.append(ControlInput(entry.name, control, entry.scale, entry.start, entry.end, entry.mode))
        FluxConditioning.of(req).controls = FluxControls(inputs)


class ControlNetRunner:
    """Runs the ControlNets of one step batch and hands the DiT each request's residuals."""

    def __init__(self, nets: Mapping[str, FluxControlNetModel]) -> None:
        self.nets = nets

    def residuals(
        self, reqs: list[Req], image_ids: torch.Tensor, text_ids: torch.Tensor
    ) -> list[BlockResiduals]:
        """The DiT's residual groups for this step: rows of requests whose entries act now (each request's
        prompt rows, and its negative rows with true CFG); requests sharing their samples' block counts
        share a group. Empty when no entry acts."""
        acting: list[tuple[int, int, ControlInput]] = []  # (request, entry index, entry)
        for r, req in enumerate(reqs):
            controls = FluxConditioning.of(req).controls
            if controls is None:
                continue
            for k, entry in enumerate(controls.inputs):
                if entry.acts_at(req.step_index, req.num_steps):
                    acting.append((r, k, entry))
        if not acting:
            return []
        samples = self._run_nets(reqs, acting, image_ids, text_ids)
        # Each request's sum over its acting entries, in the order it listed them.
        per_request: dict[int, tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]] = {}
        for r, k, _ in acting:
            double, single = samples[(r, k)]
            total_double, total_single = per_request.get(r, (None, None))
            per_request[r] = (merge_samples(total_double, double), merge_samples(total_single, single))
        # Batch rows of each request (`gather_branches`: its prompt rows, then its negative rows).
        offsets, offset = [], 0
        for req in reqs:
            offsets.append(offset)
            offset += req.batch_size * (2 if req.do_cfg else 1)
        total_rows = offset
        groups: dict[tuple[int, int], list[tuple[list[int], list[torch.Tensor], list[torch.Tensor]]]] = {}
        for r, (double, single) in per_request.items():
            req, start = reqs[r], offsets[r]
            double, single = double or [], single or []
            branches = 2 if req.do_cfg else 1
            rows = list(range(start, start + branches * req.batch_size))
            if branches == 2:
                double = [torch.cat([s, s]) for s in double]
                single = [torch.cat([s, s]) for s in single]
            repeat = self._repeats(acting, r)
            groups.setdefault((len(double), len(single), repeat), []).append((rows, double, single))
        out = []
        for (n_double, n_single, repeat), members in groups.items():
            rows = [row for member in members for row in member[0]]
            out.append(
                BlockResiduals(
                    double=[torch.cat([m[1][j] for m in members]) for j in range(n_double)],
                    single=[torch.cat([m[2][j] for m in members]) for j in range(n_single)],
                    rows=None if rows == list(range(total_rows)) else tuple(rows),
                    repeat=repeat,
                )
            )
        return out

    def _repeats(self, acting: list[tuple[int, int, ControlInput]], request: int) -> bool:
        """Whether request `request`'s samples cycle over the DiT's double-stream blocks (Diffusers'
        `controlnet_blocks_repeat`): its ControlNets are XLabs' (one kind per request: `check_controlnets`)."""
        name = next(entry.name for r, _, entry in acting if r == request)
        return _reads_pixels(self.nets[name])

    def _run_nets(
        self,
        reqs: list[Req],
        acting: list[tuple[int, int, ControlInput]],
        image_ids: torch.Tensor,
        text_ids: torch.Tensor,
    ) -> dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Each ControlNet once over the rows of the entries that use it; (request, entry) -> its samples."""
        by_net: dict[str, list[tuple[int, int, ControlInput]]] = {}
        for item in acting:
            by_net.setdefault(item[2].name, []).append(item)
        out = {}
        for name, items in by_net.items():
            net = self.nets[name]
            dtype = items[0][2].latents.dtype
            parts: dict[str, list[torch.Tensor]] = {
                k: [] for k in ("x", "c", "ctx", "pooled", "t", "g", "m", "s")
            }
            for r, _, entry in items:
                req = reqs[r]
                n, device = req.batch_size, req.latents.device
                prompt = prompt_request(req)  # the prompt's text on both CFG ranks
                if entry.context is None:
                    entry.context = net.embed_context(prompt.prompt_embeds)
                parts["x"].append(req.latents)
                parts["c"].append(entry.latents)
                parts["ctx"].append(entry.context)
                parts["pooled"].append(prompt.pooled_prompt_embeds)
                parts["t"].append(req.schedule.timesteps[req.step_index].expand(n).to(dtype) / 1000)
                guidance = float(req.params.guidance_scale or 0.0)
                parts["g"].append(torch.full((n,), guidance, dtype=torch.float32, device=device))
                parts["m"].append(torch.full((n,), entry.mode or 0, dtype=torch.long, device=device))
                parts["s"].append(torch.full((n,), float(entry.scale), dtype=torch.float32, device=device))
            batch = ControlNetBatch(
                latents=torch.cat(parts["x"]),
                control=torch.cat(parts["c"]),
                context=torch.cat(parts["ctx"]),
                pooled=torch.cat(parts["pooled"]),
                timestep=torch.cat(parts["t"]),
                guidance=torch.cat(parts["g"]) if net.config.guidance_embeds else None,
                modes=torch.cat(parts["m"]) if net.is_union else None,
                scales=torch.cat(parts["s"]),
            )
            double, single = net(batch, image_ids, text_ids)
            start = 0
            for r, k, _ in items:
                stop = start + reqs[r].batch_size
                out[(r, k)] = ([s[start:stop] for s in double], [s[start:stop] for s in single])
                start = stop
        return out
