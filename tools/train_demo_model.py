#!/usr/bin/env python
# ruff: noqa: E402  (OMP_WAIT_POLICY must be set before torch is imported)
"""Train the demo model shipped with diffserve: a small FLUX.1-architecture model that draws
coloured shapes (`diffserve.demo.shapes_data`), and write it in Diffusers' FluxPipeline layout.

    .venv/bin/python tools/train_demo_model.py            # defaults = the shipped weights

Steps: (1) procedural data; (2) a word-level tokenizer over the caption vocabulary (CLIP and T5
flavours); (3) tiny random CLIP and T5 text encoders, frozen; (4) the KL autoencoder (diffserve's
native `AutoencoderKL`); (5) latent scale/shift from the data; (6) the FLUX DiT (diffserve's native
`FluxTransformer2DModel`) with rectified flow matching, caption dropout and weight EMA;
(7) adherence on held-out attribute combinations for a few sampling settings, the recommended
defaults picked from those measurements; (8) the folder, a `diffserve.json` with the defaults, a
model card (`README.md`) and `training_report.json` with every measured number.

Everything runs on CPU with a fixed seed; every setting is an argument whose default is what the
shipped weights used. Timings depend on the machine (the shipped run: 2 shared CPU cores).
"""

from __future__ import annotations

import os

# Sleeping (not spinning) OpenMP workers: on a CPU shared with other jobs, spinning threads make
# every op wait for a descheduled sibling (measured 2-4x slower steps with 2 threads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

from diffserve.demo import shapes_data, shapes_eval
from diffserve.demo.shapes_data import Attributes, caption, held_out_attributes, make_dataset, render
from diffserve.families.flux.tiny import flux_model_index
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.models.schedulers.flow_match_euler import FlowMatchEulerScheduler
from diffserve.models.vaes.autoencoder_kl import AutoencoderKL
from diffserve.stages.latent_preparation import latent_image_ids, pack_latents, unpack_latents
from diffserve.testing.tiny_writing import diffusers_config, save_diffusers_model

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "src" / "diffserve" / "assets" / "shapes-demo"
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0..3; CLIP's eos id must not be 2 (legacy path)


@dataclass
class Settings:
    """Every knob of the run; the defaults are what the shipped weights were trained with."""

    seed: int = 0
    threads: int = 2
    num_images: int = 12000
    max_offset: int = 2
    # text
    t5_length: int = 16  # max_sequence_length in training and at inference
    clip_length: int = 32
    text_hidden: int = 64
    text_layers: int = 2
    # autoencoder
    vae_channels: tuple[int, ...] = (16, 32, 64)
    vae_groups: int = 8
    latent_channels: int = 16
    vae_steps: int = 600
    vae_batch: int = 16
    vae_lr: float = 1e-3
    vae_max_minutes: float = 10.0  # wall-clock cap (see `Schedule`)
    vae_kl_weight: float = 1e-5
    vae_foreground_weight: float = 10.0  # extra loss weight on shape pixels (a few % of each image)
    # DiT
    dit_double_blocks: int = 2
    dit_single_blocks: int = 4
    dit_heads: int = 4
    dit_head_dim: int = 32
    dit_rope_axes: tuple[int, int, int] = (8, 12, 12)
    dit_steps: int = 2200
    dit_batch: int = 32
    dit_lr: float = 1e-3
    dit_warmup: int = 100
    dit_max_minutes: float = 20.0  # wall-clock cap (see `Schedule`)
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    # sampling (scheduler) and evaluation
    scheduler_shift: float = 1.0
    eval_steps: int = 20
    eval_cfg_scales: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0)
    eval_seed_base: int = 1000  # seeds for picking defaults; the e2e test measures with others


def parse_args(argv: list[str] | None = None) -> tuple[Settings, Path, bool, Path | None]:
    defaults = Settings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    p.add_argument(
        "--rewrite-card", metavar="DIR", help="only regenerate DIR/README.md from its training_report.json"
    )
    p.add_argument(
        "--reevaluate",
        metavar="DIR",
        help="only measure DIR again on the held-out grid, update its report and README.md",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny step counts: checks the whole script end to end"
    )
    p.add_argument(
        "--vae-from",
        type=Path,
        default=None,
        help="reuse the vae/ of an earlier output folder instead of training one (for DiT experiments)",
    )
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, tuple):
            p.add_argument(flag, type=type(value[0]), nargs="+", default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)
    ns = p.parse_args(argv)
    not_settings = ("out", "smoke", "vae_from", "rewrite_card", "reevaluate")  # handled in main()
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items() if k not in not_settings}
    settings = Settings(**values)
    if ns.smoke:
        settings.num_images, settings.vae_steps, settings.dit_steps, settings.dit_warmup = 512, 20, 30, 5
        settings.eval_cfg_scales = (1.0, 3.0)
    return settings, ns.out, ns.smoke, ns.vae_from


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------------- text


def build_tokenizer(words: list[str], template: str, max_length: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: lower-cased, anything but letters is a separator, unknown words -> <unk>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Lowercase(), normalizers.Replace(Regex("[^a-z]+"), " ")]
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [(t, vocab[t]) for t in ("<bos>", "<eos>") if t in template]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    tokenizer.save_pretrained(directory)
    # Name the class every transformers version knows (5.x writes its internal `TokenizersBackend`).
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def build_text_encoders(s: Settings, vocab_size: int) -> tuple[CLIPTextModel, T5EncoderModel]:
    torch.manual_seed(s.seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=s.text_hidden,
            intermediate_size=s.text_hidden * 2,
            num_hidden_layers=s.text_layers,
            num_attention_heads=4,
            max_position_embeddings=s.clip_length,
            projection_dim=s.text_hidden,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,  # pooled output = the hidden state at the first <eos>
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=s.text_hidden,
            d_kv=16,
            d_ff=s.text_hidden * 2,
            num_layers=s.text_layers,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=3,
            decoder_start_token_id=0,
        )
    )
    return clip.eval().requires_grad_(False), t5.eval().requires_grad_(False)


class TextEmbedder:
    """Frozen encoders + tokenizers, exactly as the pipelines call them (padding to max_length)."""

    def __init__(self, clip_tok, clip, t5_tok, t5, clip_length: int, t5_length: int) -> None:
        self.clip_tok, self.clip, self.t5_tok, self.t5 = clip_tok, clip, t5_tok, t5
        self.clip_length, self.t5_length = clip_length, t5_length

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        def ids(tok, length):
            return tok(
                prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
            ).input_ids

        pooled = self.clip(ids(self.clip_tok, self.clip_length)).pooler_output
        sequence = self.t5(ids(self.t5_tok, self.t5_length))[0]
        return sequence.float(), pooled.float()


# ------------------------------------------------------------------------------------- autoencoder


def vae_config(s: Settings) -> dict:
    n = len(s.vae_channels)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * n,
        "up_block_types": ["UpDecoderBlock2D"] * n,
        "block_out_channels": list(s.vae_channels),
        "layers_per_block": 1,
        "act_fn": "silu",
        "latent_channels": s.latent_channels,
        "norm_num_groups": s.vae_groups,
        "sample_size": shapes_data.IMAGE_SIZE,
        "scaling_factor": 1.0,  # replaced by the measured values after training
        "shift_factor": 0.0,
        "use_quant_conv": False,
        "use_post_quant_conv": False,
        "force_upcast": True,
        "mid_block_add_attention": True,
    }


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


class Schedule:
    """Linear warmup, then cosine decay to `floor` x peak, over `steps` steps or `max_minutes` of wall
    time, whichever runs out first: progress = max(step fraction, time fraction). On an idle machine
    the step count binds and the run is reproducible step for step; on a busy shared one the time cap
    ends training early but still with a fully decayed learning rate (the report records the steps run).
    """

    def __init__(self, steps: int, max_minutes: float, peak: float, warmup: int, floor: float = 0.1) -> None:
        self.steps, self.max_seconds, self.peak, self.warmup, self.floor = (
            steps,
            max_minutes * 60,
            peak,
            warmup,
            floor,
        )
        self.start = time.perf_counter()

    def progress(self, step: int) -> float:
        elapsed = (time.perf_counter() - self.start) / self.max_seconds
        return max(
            (step - self.warmup) / max(1, self.steps - self.warmup), elapsed if step >= self.warmup else 0.0
        )

    def done(self, step: int) -> bool:
        return step >= self.steps or self.progress(step) >= 1.0

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        progress = min(1.0, self.progress(step))
        return self.peak * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB between image batches in [-1, 1] (as 8-bit pixels)."""
    mse = ((a.clamp(-1, 1) - b.clamp(-1, 1)) / 2).pow(2).mean().item()
    return 10 * math.log10(1 / max(mse, 1e-12))


def foreground_masks(data: shapes_data.ShapesDataset) -> torch.Tensor:
    """(N, 1, H, W) bool: the pixels that differ from the image's background colour (the shape)."""
    backgrounds = np.array([shapes_data.BACKGROUND_COLOURS[a.background] for a in data.attributes], np.int16)
    differs = np.abs(data.images.astype(np.int16) - backgrounds[:, None, None, :]).max(axis=-1) > 8
    return torch.from_numpy(differs)[:, None]


def train_vae(s: Settings, pixels: torch.Tensor, foreground: torch.Tensor, report: dict) -> AutoencoderKL:
    torch.manual_seed(s.seed + 1)
    vae = AutoencoderKL.from_config(vae_config(s))
    opt = torch.optim.Adam(vae.parameters(), lr=s.vae_lr, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(s.seed + 2)
    start = time.perf_counter()
    history = []
    schedule = Schedule(s.vae_steps, s.vae_max_minutes, s.vae_lr, warmup=50)
    step = 0
    while not schedule.done(step):
        for group in opt.param_groups:
            group["lr"] = schedule.lr(step)
        idx = torch.randint(len(pixels), (s.vae_batch,), generator=gen)
        x = pixels[idx]
        # Most pixels are background: weight the shape's pixels up, or its colour is learned last.
        weight = 1.0 + s.vae_foreground_weight * foreground[idx].float()
        posterior = vae.encode(x)
        recon = vae.decode(posterior.sample(gen))
        err = recon - x
        rec = ((err.abs() + err.pow(2)) * weight).sum() / (weight.sum() * x.shape[1])
        kl = 0.5 * (posterior.mean.pow(2) + posterior.logvar.exp() - 1 - posterior.logvar).mean()
        loss = rec + s.vae_kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or schedule.done(step + 1):
            p = psnr(recon.detach(), x)
            history.append({"step": step, "loss": loss.item(), "rec": rec.item(), "kl": kl.item(), "psnr": p})
            log(
                f"vae step {step:5d}  loss {loss.item():.4f}  kl {kl.item():.3f}  psnr {p:.2f} dB  "
                f"lr {schedule.lr(step):.2e}  ({time.perf_counter() - start:.0f} s)"
            )
        step += 1
    report["vae_steps_run"] = step
    report["vae_seconds"] = time.perf_counter() - start
    report["vae_history"] = history
    return vae.eval().requires_grad_(False)


def load_vae(directory: Path, s: Settings) -> AutoencoderKL:
    from safetensors.torch import load_file

    config = {
        k: v for k, v in json.loads((directory / "config.json").read_text()).items() if not k.startswith("_")
    }
    config["scaling_factor"], config["shift_factor"] = 1.0, 0.0  # measured again below
    if config != vae_config(s):
        raise SystemExit(f"--vae-from: {directory} was trained with other VAE settings")
    vae = AutoencoderKL.from_config(config)
    vae.load_state_dict(load_file(str(directory / "diffusion_pytorch_model.safetensors")))
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_all(
    vae: AutoencoderKL, pixels: torch.Tensor, batch: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    means, stds = [], []
    for i in range(0, len(pixels), batch):
        posterior = vae.encode(pixels[i : i + batch])
        means.append(posterior.mean)
        stds.append(posterior.std)
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def evaluate_vae(vae: AutoencoderKL, report: dict) -> None:
    """Reconstruction PSNR and shapes_eval on every attribute set (held-out ones included), unshifted."""
    attrs = shapes_data.all_combinations()
    images = np.stack([np.asarray(render(a)) for a in attrs])
    x = to_tensor(images)
    recon = torch.cat([vae.decode(vae.encode(x[i : i + 256]).mean) for i in range(0, len(x), 256)])
    report["vae_psnr_db"] = psnr(recon, x)
    pils = tensor_to_uint8(recon)
    results = [shapes_eval.measure(img, a) for img, a in zip(pils, attrs, strict=True)]
    report["vae_reconstruction_adherence"] = shapes_eval.summarize(results)
    log(
        f"vae reconstruction: {report['vae_psnr_db']:.2f} dB, adherence {report['vae_reconstruction_adherence']}"
    )


def tensor_to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [-1, 1] -> (B, H, W, 3) uint8, rounded as the pipelines do."""
    array = (images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().numpy()
    return (array * 255).round().astype(np.uint8)


# --------------------------------------------------------------------------------------------- DiT


def dit_config(s: Settings) -> dict:
    return {
        "patch_size": 1,
        "in_channels": s.latent_channels * 4,
        "out_channels": None,
        "num_layers": s.dit_double_blocks,
        "num_single_layers": s.dit_single_blocks,
        "attention_head_dim": s.dit_head_dim,
        "num_attention_heads": s.dit_heads,
        "joint_attention_dim": s.text_hidden,
        "pooled_projection_dim": s.text_hidden,
        "guidance_embeds": False,
        "axes_dims_rope": list(s.dit_rope_axes),
    }


def zero_init_modulation(dit: FluxTransformer2DModel) -> None:
    """adaLN-Zero (DiT paper): every block starts as the identity and the output as zero."""
    for name, module in dit.named_modules():
        if isinstance(module, nn.Linear) and (
            name.endswith("norm1.linear")
            or name.endswith("norm1_context.linear")
            or name.endswith("norm.linear")
            or name == "norm_out.linear"
        ):
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)
    nn.init.zeros_(dit.proj_out.weight)
    nn.init.zeros_(dit.proj_out.bias)


class LatentData:
    """Precomputed VAE posteriors (mean, std) and text embeddings of every training image."""

    def __init__(self, mean, std, caption_ids, text_seq, text_pooled, shift, scale) -> None:
        self.mean, self.std, self.caption_ids = mean, std, caption_ids
        self.text_seq, self.text_pooled = text_seq, text_pooled  # row 0 = the empty prompt
        self.shift, self.scale = shift, scale

    def batch(self, size: int, gen: torch.Generator, dropout: float):
        idx = torch.randint(len(self.mean), (size,), generator=gen)
        z = self.mean[idx] + self.std[idx] * torch.randn(self.mean[idx].shape, generator=gen)
        z = (z - self.shift) * self.scale
        cap = self.caption_ids[idx].clone()
        cap[torch.rand(size, generator=gen) < dropout] = 0
        return pack_latents(z), self.text_seq[cap], self.text_pooled[cap]


def train_dit(
    s: Settings, data: LatentData, report: dict
) -> tuple[FluxTransformer2DModel, FluxTransformer2DModel]:
    torch.manual_seed(s.seed + 3)
    dit = FluxTransformer2DModel.from_config(dit_config(s))
    zero_init_modulation(dit)
    ema = FluxTransformer2DModel.from_config(dit_config(s))
    ema.load_state_dict(dit.state_dict())
    ema.requires_grad_(False)
    report["dit_params"] = sum(p.numel() for p in dit.parameters())
    opt = torch.optim.AdamW(dit.parameters(), lr=s.dit_lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(s.seed + 4)
    h = w = shapes_data.IMAGE_SIZE // 2 ** (len(s.vae_channels) - 1)
    img_ids = latent_image_ids(h // 2, w // 2, torch.device("cpu"), torch.float32)
    txt_ids = torch.zeros(s.t5_length, 3)
    rope = dit.rope_tables(txt_ids, img_ids)
    ema_params = list(ema.parameters())
    params = list(dit.parameters())
    start = time.perf_counter()
    history, running = [], []
    schedule = Schedule(s.dit_steps, s.dit_max_minutes, s.dit_lr, warmup=s.dit_warmup)
    step = 0
    while not schedule.done(step):
        for group in opt.param_groups:
            group["lr"] = schedule.lr(step)
        x0, seq, pooled = data.batch(s.dit_batch, gen, s.caption_dropout)
        t = torch.sigmoid(torch.randn(s.dit_batch, generator=gen))  # logit-normal(0, 1)
        noise = torch.randn(x0.shape, generator=gen)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
        pred = dit(xt, seq, pooled, t, img_ids, txt_ids, rope=rope)
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(s.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        running.append(loss.item())
        if step % 100 == 0 or schedule.done(step + 1):
            mean_loss = sum(running) / len(running)
            running = []
            history.append({"step": step, "loss": mean_loss})
            log(
                f"dit step {step:5d}  loss {mean_loss:.4f}  lr {schedule.lr(step):.2e}  "
                f"({time.perf_counter() - start:.0f} s)"
            )
        step += 1
    report["dit_steps_run"] = step
    report["dit_seconds"] = time.perf_counter() - start
    report["dit_history"] = history
    return dit.eval().requires_grad_(False), ema.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ sampling


@torch.no_grad()
def sample(
    dit: FluxTransformer2DModel,
    vae: AutoencoderKL,
    embed: TextEmbedder,
    prompts: list[str],
    seeds: list[int],
    steps: int,
    cfg: float,
    scheduler: FlowMatchEulerScheduler,
    shift: float,
    scale: float,
) -> np.ndarray:
    """The diffserve/Diffusers FluxPipeline computation, batched over prompts (same noise per seed)."""
    c = vae.config["latent_channels"]
    h = w = shapes_data.IMAGE_SIZE // 2 ** (len(vae.config["block_out_channels"]) - 1)
    noise = torch.cat(
        [torch.randn((1, c, h, w), generator=torch.Generator("cpu").manual_seed(sd)) for sd in seeds]
    )
    latents = pack_latents(noise)
    seq, pooled = embed(prompts)
    if cfg > 1:
        neg_seq, neg_pooled = embed([""])
        seq = torch.cat([seq, neg_seq.expand_as(seq)])
        pooled = torch.cat([pooled, neg_pooled.expand_as(pooled)])
    img_ids = latent_image_ids(h // 2, w // 2, torch.device("cpu"), torch.float32)
    txt_ids = torch.zeros(seq.shape[1], 3)
    rope = dit.rope_tables(txt_ids, img_ids)
    image_seq_len = latents.shape[1]
    schedule = scheduler.schedule(
        steps, mu=scheduler.resolution_shift_mu(image_seq_len), sigmas=np.linspace(1.0, 1 / steps, steps)
    )
    n = len(prompts)
    for i in range(steps):
        sigma = schedule.sigmas[i]
        x_in = torch.cat([latents, latents]) if cfg > 1 else latents
        pred = dit(x_in, seq, pooled, sigma.expand(x_in.shape[0]), img_ids, txt_ids, rope=rope)
        if cfg > 1:
            pred = pred[n:] + cfg * (pred[:n] - pred[n:])
        latents = scheduler.step(pred, latents, sigma.expand(n), schedule.sigmas[i + 1].expand(n))
    z = unpack_latents(latents, h, w) / scale + shift
    return tensor_to_uint8(vae.decode(z))


def adherence(images: np.ndarray, attrs: list[Attributes]) -> dict[str, float]:
    return shapes_eval.summarize([shapes_eval.measure(img, a) for img, a in zip(images, attrs, strict=True)])


# ------------------------------------------------------------------------------------------ writing


def scheduler_config(s: Settings) -> dict:
    return {
        "num_train_timesteps": 1000,
        "shift": s.scheduler_shift,
        "use_dynamic_shifting": False,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    }


def write_folder(out: Path, s: Settings, parts: dict, defaults: dict, report: dict) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    parts["clip"].save_pretrained(out / "text_encoder")
    parts["t5"].save_pretrained(out / "text_encoder_2")
    save_tokenizer(parts["clip_tok"], out / "tokenizer")
    save_tokenizer(parts["t5_tok"], out / "tokenizer_2")
    save_diffusers_model(parts["dit"], out / "transformer", "FluxTransformer2DModel", dit_config(s))
    save_diffusers_model(parts["vae"], out / "vae", "AutoencoderKL", parts["vae_config"])
    (out / "scheduler").mkdir()
    (out / "scheduler" / "scheduler_config.json").write_text(
        json.dumps(diffusers_config("FlowMatchEulerDiscreteScheduler", scheduler_config(s)), indent=2) + "\n"
    )
    model_index = flux_model_index("PreTrainedTokenizerFast", "PreTrainedTokenizerFast")
    (out / "model_index.json").write_text(json.dumps(model_index, indent=2) + "\n")
    (out / "diffserve.json").write_text(json.dumps({"sampling_defaults": defaults}, indent=2) + "\n")
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "README.md").write_text(model_card(s, defaults, report))


def model_card(s: Settings, defaults: dict, r: dict) -> str:
    rows = "\n".join(
        f"| {e['cfg']:g} | {e['steps']} | {e['matches']:.0%} | {e['colour']:.0%} | {e['position']:.0%} "
        f"| {e['background']:.0%} | {e['size']:.0%} | {e.get('shape', float('nan')):.0%} |"
        for e in r["adherence"]
    )
    vocab = ", ".join(shapes_data.vocabulary())
    at_defaults = next(
        (
            e
            for e in r["adherence"]
            if e["cfg"] == defaults["true_cfg_scale"] and e["steps"] == defaults["num_inference_steps"]
        ),
        r["adherence"][0],
    )
    shape_rate = at_defaults.get("shape")
    shape_text = (
        ""
        if shape_rate is None
        else f" The named *shape* is drawn only {shape_rate:.0%} of the time (chance: 33%): it draws a blob of the right "
        "colour and place, not a clean circle, square or triangle."
        if shape_rate < 0.6
        else f" The named shape comes out {shape_rate:.0%} of the time."
    )
    flags = " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in asdict(s).items()
        if v != getattr(Settings(), k)
    )
    command = f".venv/bin/python tools/train_demo_model.py {flags}".rstrip()
    return f"""# shapes-demo: a small FLUX.1-architecture model trained on coloured shapes

The model `diffserve generate` uses when no `--model-path` is given. It is a real, trained text-to-image
model with FLUX.1's architecture (CLIP pooled + T5 sequence conditioning, MMDiT double-stream and
single-stream blocks, 3-axis RoPE, a KL autoencoder with 16 latent channels, rectified flow), only tiny,
so it runs anywhere in a second. The folder is in Diffusers' `FluxPipeline` layout: diffusers loads it
unchanged.

## What it draws
64x64 images of one shape in a named colour and size, at one of five positions, on a plain background:

    a {{small|large}} {{{"|".join(shapes_data.SHAPE_COLOURS)}}} {{{"|".join(shapes_data.SHAPES)}}}
      {{at the top left|at the top right|at the bottom left|at the bottom right|in the center}}
      on a {{{"|".join(shapes_data.BACKGROUND_COLOURS)}}} background

e.g. `a large yellow triangle at the bottom right on a gray background`. Vocabulary ({len(shapes_data.vocabulary())} words):
{vocab}. Other words map to `<unk>`; the model knows nothing else.

At the recommended settings, on attribute combinations it never saw in training, colour, position and
background all come out as asked in {at_defaults["matches"]:.0%} of images; size in {at_defaults["size"]:.0%}.{shape_text}
It cannot draw two shapes, other colours, textures, other sizes than 64x64, or anything outside this vocabulary.

## Data
{s.num_images} procedural images (`diffserve.demo.shapes_data`, seed {s.seed}, no downloads), drawn with PIL
at 4x and box-filtered down, each shape shifted by up to {s.max_offset} px. 3 shapes x 6 colours x 2 sizes x
5 positions x 3 backgrounds = 540 attribute sets; 30 of the 270 (shape, colour, position, background)
combinations (both sizes: 60 attribute sets) are held out of training entirely and used to measure adherence.

## Architecture
| component | class | parameters |
| --- | --- | --- |
| transformer | `FluxTransformer2DModel`: {s.dit_double_blocks} double + {s.dit_single_blocks} single blocks, {s.dit_heads} heads x {s.dit_head_dim}, RoPE axes {list(s.dit_rope_axes)}, no guidance embedding | {r["params"]["transformer"] / 1e6:.2f}M |
| vae | `AutoencoderKL`: blocks {list(s.vae_channels)} (x{2 ** (len(s.vae_channels) - 1)} downsampling), {s.latent_channels} latent channels | {r["params"]["vae"] / 1e6:.2f}M |
| text_encoder | `CLIPTextModel`: hidden {s.text_hidden}, {s.text_layers} layers, random and frozen | {r["params"]["text_encoder"] / 1e6:.2f}M |
| text_encoder_2 | `T5EncoderModel`: d_model {s.text_hidden}, {s.text_layers} layers, random and frozen | {r["params"]["text_encoder_2"] / 1e6:.2f}M |
| tokenizer, tokenizer_2 | `PreTrainedTokenizerFast`: word level over the vocabulary + `<pad> <unk> <bos> <eos>`; CLIP's adds `<bos>`/`<eos>` (pooled output at `<eos>`), T5's adds `<eos>` | |

## Training (measured on {r["machine"]})
- Autoencoder: {r["vae_steps_run"]} steps (of {s.vae_steps}, cap {s.vae_max_minutes:g} min), batch {s.vae_batch}, Adam {s.vae_lr:g} (cosine), L1 + L2 + {s.vae_kl_weight:g} x KL:
  {r["vae_seconds"] / 60:.1f} min, reconstruction PSNR {r["vae_psnr_db"]:.1f} dB on all 540 attribute sets.
  Latent shift {r["shift_factor"]:.4f}, scale {r["scaling_factor"]:.4f} (mean and 1/std of the training latents).
- Transformer: {r["dit_steps_run"]} steps (of {s.dit_steps}, cap {s.dit_max_minutes:g} min), batch {s.dit_batch}, AdamW {s.dit_lr:g} (warmup {s.dit_warmup}, cosine),
  rectified flow (x_t = (1-t) x0 + t noise, target noise - x0, t ~ logit-normal(0, 1)), {s.caption_dropout:.0%}
  caption dropout to the empty prompt (for true CFG), EMA {s.ema_decay} (shipped: the {r["shipped_weights"]} weights; the EMA unless the last-step weights measure
  better on the held-out prompts):
  {r["dit_seconds"] / 60:.1f} min, loss {r["dit_history"][0]["loss"]:.3f} -> {r["dit_history"][-1]["loss"]:.3f}.
- Total, data and evaluation included: {r["total_seconds"] / 60:.1f} min.
- Sampler: `FlowMatchEulerDiscreteScheduler`, fixed shift {s.scheduler_shift:g}, no dynamic shifting (the model
  is trained at one resolution, 64 image tokens).

## Adherence on held-out combinations
All 60 held-out attribute sets, one seed each (seeds {s.eval_seed_base}..; `diffserve.demo.shapes_eval`:
colour, position and background must all match; size and shape are reported on their own):

| true_cfg_scale | steps | matches | colour | position | background | size | shape |
| --- | --- | --- | --- | --- | --- | --- | --- |
{rows}

Recommended defaults (`diffserve.json`): {json.dumps(defaults)}. Use `max_sequence_length`
{s.t5_length} (the training length) and 64x64; other sizes and lengths are outside what it was trained on.

## Reproduce
    {command}

Seeded and deterministic on one machine, except that each stage stops at its wall-clock cap if that
comes first (see `Schedule` in the script): on a busy machine a rerun trains fewer steps than on an
idle one. `--reevaluate DIR` measures a folder again on the table above; `tests/e2e/test_demo_model.py`
measures it through `DiffGenerator` on 30 held-out prompts with other seeds, and checks that diffusers'
`FluxPipeline` draws the same pixels from this folder.
"""


# --------------------------------------------------------------------------------------------- main


def rewrite_card(folder: Path) -> int:
    """Regenerate README.md of a trained folder from its training_report.json (no training)."""
    report = json.loads((folder / "training_report.json").read_text())
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in report["settings"].items()}
    defaults = json.loads((folder / "diffserve.json").read_text())["sampling_defaults"]
    (folder / "README.md").write_text(model_card(Settings(**values), defaults, report))
    log(f"rewrote {folder / 'README.md'}")
    return 0


def reevaluate(folder: Path) -> int:
    """Measure the saved folder again on the held-out grid (same seeds and settings as at the end of
    training), store the numbers in training_report.json and regenerate README.md."""
    from safetensors.torch import load_file

    report = json.loads((folder / "training_report.json").read_text())
    s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in report["settings"].items()})
    torch.set_num_threads(s.threads)
    vae_cfg = {
        k: v
        for k, v in json.loads((folder / "vae" / "config.json").read_text()).items()
        if not k.startswith("_")
    }
    vae = AutoencoderKL.from_config(vae_cfg)
    vae.load_state_dict(load_file(str(folder / "vae" / "diffusion_pytorch_model.safetensors")))
    dit = FluxTransformer2DModel.from_config(dit_config(s))
    dit.load_state_dict(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors")))
    embed = TextEmbedder(
        PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer"),
        CLIPTextModel.from_pretrained(folder / "text_encoder").eval(),
        PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer_2"),
        T5EncoderModel.from_pretrained(folder / "text_encoder_2").eval(),
        s.clip_length,
        s.t5_length,
    )
    scheduler = FlowMatchEulerScheduler.from_config(scheduler_config(s))
    attrs = held_out_attributes()
    prompts = [caption(a) for a in attrs]
    seeds = [s.eval_seed_base + i for i in range(len(attrs))]
    results = []
    for old in report["adherence"]:
        images = sample(
            dit.eval(),
            vae.eval(),
            embed,
            prompts,
            seeds,
            old["steps"],
            old["cfg"],
            scheduler,
            vae_cfg["shift_factor"],
            vae_cfg["scaling_factor"],
        )
        results.append({"cfg": old["cfg"], "steps": old["steps"], **adherence(images, attrs)})
        log(
            f"cfg {old['cfg']:g}, {old['steps']} steps: {results[-1]} (at training time: {old['matches']:.3f})"
        )
    report["adherence"] = results
    (folder / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return rewrite_card(folder)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rewrite-card"]:
        return rewrite_card(Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT)
    if argv[:1] == ["--reevaluate"]:
        return reevaluate(Path(argv[1]) if len(argv) > 1 else DEFAULT_OUT)
    s, out, smoke, vae_from = parse_args(argv)
    torch.set_num_threads(s.threads)
    t_start = time.perf_counter()
    report: dict = {
        "settings": asdict(s),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
    }
    log(f"settings: {asdict(s)}")

    # (1) data
    data = make_dataset(s.num_images, seed=s.seed, max_offset=s.max_offset)
    pixels = to_tensor(data.images)
    log(f"data: {len(pixels)} images, {len(set(data.captions))} distinct captions")

    # (2) tokenizers, (3) frozen text encoders
    words = shapes_data.vocabulary()
    clip_tok = build_tokenizer(words, "<bos> $A <eos>", s.clip_length)
    t5_tok = build_tokenizer(words, "$A <eos>", s.t5_length)
    clip, t5 = build_text_encoders(s, len(clip_tok))
    embed = TextEmbedder(clip_tok, clip, t5_tok, t5, s.clip_length, s.t5_length)
    unique = [""] + sorted(set(data.captions))
    text_seq, text_pooled = embed(unique)
    index = {c: i for i, c in enumerate(unique)}
    caption_ids = torch.tensor([index[c] for c in data.captions])

    # (4) autoencoder
    if vae_from is None:
        vae = train_vae(s, pixels, foreground_masks(data), report)
    else:
        vae = load_vae(vae_from / "vae", s)
        report["vae_from"] = str(vae_from)
        report["vae_seconds"] = 0.0
        report["vae_steps_run"] = 0
        report["vae_history"] = []
    evaluate_vae(vae, report)

    # (5) latent statistics -> VAE config
    mean, std = encode_all(vae, pixels)
    shift = mean.mean().item()
    scale = 1.0 / (mean - shift).std().item()
    report["shift_factor"], report["scaling_factor"] = shift, scale
    log(f"latents: shift {shift:.4f} scale {scale:.4f} (posterior std mean {std.mean().item():.4f})")
    config = vae_config(s)
    config["scaling_factor"], config["shift_factor"] = scale, shift

    # (6) DiT
    latent_data = LatentData(mean, std, caption_ids, text_seq, text_pooled, shift, scale)
    raw, ema = train_dit(s, latent_data, report)

    # (7) adherence on held-out combinations -> recommended defaults
    attrs = held_out_attributes()
    prompts = [caption(a) for a in attrs]
    seeds = [s.eval_seed_base + i for i in range(len(attrs))]
    scheduler = FlowMatchEulerScheduler.from_config(scheduler_config(s))
    results = []
    eval_start = time.perf_counter()
    # The shipped weights are the EMA unless the raw (last-step) weights measure better (short runs).
    probe_cfg = max(s.eval_cfg_scales) if len(s.eval_cfg_scales) else 1.0
    probe = {}
    for name, model in (("ema", ema), ("raw", raw)):
        images = sample(model, vae, embed, prompts, seeds, s.eval_steps, probe_cfg, scheduler, shift, scale)
        probe[name] = adherence(images, attrs)
        log(f"held-out adherence of the {name} weights, cfg {probe_cfg:g}: {probe[name]}")
    report["weights_probe"] = {"cfg": probe_cfg, **probe}
    shipped_name = "raw" if probe["raw"]["matches"] > probe["ema"]["matches"] else "ema"
    report["shipped_weights"] = shipped_name
    shipped = raw if shipped_name == "raw" else ema
    for steps, cfg in [(s.eval_steps, c) for c in s.eval_cfg_scales]:
        images = sample(shipped, vae, embed, prompts, seeds, steps, cfg, scheduler, shift, scale)
        rates = adherence(images, attrs)
        results.append({"cfg": cfg, "steps": steps, **rates})
        log(f"held-out adherence, cfg {cfg:g}, {steps} steps: {rates}")
    best = max(results, key=lambda e: (round(e["matches"], 6), -e["cfg"]))
    for steps in (10, 30):
        images = sample(shipped, vae, embed, prompts, seeds, steps, best["cfg"], scheduler, shift, scale)
        results.append({"cfg": best["cfg"], "steps": steps, **adherence(images, attrs)})
        log(f"held-out adherence, cfg {best['cfg']:g}, {steps} steps: {results[-1]}")
    report["adherence"] = results
    report["eval_seconds"] = time.perf_counter() - eval_start
    defaults = {
        "height": shapes_data.IMAGE_SIZE,
        "width": shapes_data.IMAGE_SIZE,
        "num_inference_steps": s.eval_steps,
        "max_sequence_length": s.t5_length,
        "true_cfg_scale": best["cfg"],
        "negative_prompt": "" if best["cfg"] > 1 else None,
        "guidance_scale": None,
    }

    # (8) the folder
    report["params"] = {
        "transformer": sum(p.numel() for p in shipped.parameters()),
        "vae": sum(p.numel() for p in vae.parameters()),
        "text_encoder": sum(p.numel() for p in clip.parameters()),
        "text_encoder_2": sum(p.numel() for p in t5.parameters()),
    }
    report["total_seconds"] = time.perf_counter() - t_start
    parts = {
        "clip": clip,
        "t5": t5,
        "clip_tok": clip_tok,
        "t5_tok": t5_tok,
        "dit": shipped,
        "vae": vae,
        "vae_config": config,
    }
    write_folder(out, s, parts, defaults, report)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    log(
        f"wrote {out} ({size / 2**20:.1f} MB) in {report['total_seconds'] / 60:.1f} min total"
        f"{' (smoke run)' if smoke else ''}; defaults {defaults}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
