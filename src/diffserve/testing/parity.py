"""Parity with Diffusers: the scaffolding every model, scheduler and pipeline parity test shares.

- Models: `parity_pair` builds Diffusers' class from a tiny config with seeded, perturbed random weights
  and loads that state dict strictly into the native class (built on the meta device, as a checkpoint
  is); `assert_parity` compares the two outputs against a bar in dB (`snr_db`, `psnr_db`,
  `psnr_range_db`), max abs diff and/or cosine; `assert_same_state_dict_layout` and
  `diffusers_init_defaults` check the names, shapes and config defaults.
- Schedulers: both sample with one deterministic fake model (`sample_with_diffusers`, `sample_natively`,
  step by step `sample_in_lockstep`, several requests on one object `sample_interleaved`).
- Pipelines: Diffusers' pipeline and `DiffGenerator` run on the same tiny folder
  (`generator_and_reference`) and seed (`diffusers_uint8`, `stack_uint8`), and `assert_images_match`
  compares the 8-bit images or frames in dB (`assert_generation_matches`: one text-to-image request on
  both sides); `gradient_image` / `smooth_random_image` are the input images; `denoise_together` runs
  prepared requests through shared denoising steps (`denoise_joining`: requests joining the batch
  between steps), and `assert_batched_as_alone` checks that each gives what it gives alone.

Every failure message states the measure that missed its bar next to the others (dB, max abs diff), so
a failing run says how far off it is. Nothing here imports Diffusers: the tests pass its classes in
(and skip without it).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from PIL import Image
from torch import nn

from diffserve.testing.image_metrics import psnr_uint8

#: What the metrics take: tensors of any dtype or device, or numpy arrays.
ArrayLike = torch.Tensor | np.ndarray
#: A parity metric in dB, `metric(actual, expected)`: higher is closer, inf when identical.
Metric = Callable[[ArrayLike, ArrayLike], float]
ModuleT = TypeVar("ModuleT", bound=nn.Module)

#: The reference of a pipeline parity test must have more detail than this (std of its 8-bit values):
#: against a flat image any output scores well and the comparison would prove nothing.
MIN_REFERENCE_STD = 5.0


# ------------------------------------------------------------------------------------------------ metrics


def _double(x: ArrayLike) -> torch.Tensor:
    """`x` as a float64 CPU tensor (metrics are computed in double so that they measure the inputs)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64)
    return torch.from_numpy(np.array(x, dtype=np.float64))


def _db(signal: float, error: float) -> float:
    """10 log10(signal / error): inf for no error, -inf for an error against a zero signal."""
    if error == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / error)


def snr_db(actual: ArrayLike, expected: ArrayLike) -> float:
    """Signal-to-error ratio in dB: the energy of `expected` over that of `actual - expected`."""
    a, e = _double(actual), _double(expected)
    return _db(e.square().sum().item(), (a - e).square().sum().item())


def psnr_db(actual: ArrayLike, expected: ArrayLike) -> float:
    """PSNR in dB with the reference's largest magnitude as the peak (for tensors of no fixed range)."""
    a, e = _double(actual), _double(expected)
    return _db(e.abs().max().item() ** 2, (a - e).square().mean().item())


def psnr_range_db(actual: ArrayLike, expected: ArrayLike) -> float:
    """PSNR in dB with the reference's peak-to-peak range as the peak (pixels of a decoder, say)."""
    a, e = _double(actual), _double(expected)
    return _db((e.max() - e.min()).item() ** 2, (a - e).square().mean().item())


def max_abs_diff(actual: ArrayLike, expected: ArrayLike) -> float:
    """The largest absolute elementwise difference."""
    return (_double(actual) - _double(expected)).abs().max().item()


def cosine(actual: ArrayLike, expected: ArrayLike) -> float:
    """Cosine similarity of the two flattened (float64) arrays."""
    a, e = _double(actual).flatten(), _double(expected).flatten()
    return torch.nn.functional.cosine_similarity(a, e, dim=0).item()


@dataclass(frozen=True)
class Closeness:
    """How close an output is to its reference, by every measure a parity bar uses."""

    db: float
    max_abs: float
    cosine: float

    def __str__(self) -> str:
        return f"{self.db:.1f} dB, max abs diff {self.max_abs:.3e}, cosine {self.cosine:.8f}"


def closeness(actual: ArrayLike, expected: ArrayLike, metric: Metric = snr_db) -> Closeness:
    """`actual` against `expected`: dB by `metric`, max abs diff and cosine."""
    return Closeness(metric(actual, expected), max_abs_diff(actual, expected), cosine(actual, expected))


def assert_parity(
    actual: ArrayLike,
    expected: ArrayLike,
    what: str,
    *,
    min_db: float | None = None,
    max_abs: float | None = None,
    min_cos: float | None = None,
    metric: Metric = snr_db,
) -> Closeness:
    """Assert `actual` has `expected`'s shape and meets every bar given: at least `min_db` by `metric`,
    at most `max_abs` elementwise, a cosine of at least `min_cos`. Prints the measures (read with -s);
    a failure names `what`, the bar missed and all three measures."""
    if min_db is None and max_abs is None and min_cos is None:
        raise ValueError("assert_parity needs a bar: min_db, max_abs or min_cos")
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    result = closeness(actual, expected, metric)
    print(f"[{what}] {result}")
    if min_db is not None:
        assert result.db >= min_db, f"{what}: {result.db:.1f} dB < {min_db} dB ({result})"
    if max_abs is not None:
        assert result.max_abs <= max_abs, f"{what}: max abs diff {result.max_abs:.3e} > {max_abs} ({result})"
    if min_cos is not None:
        assert result.cosine >= min_cos, f"{what}: cosine {result.cosine:.8f} < {min_cos} ({result})"
    return result


# ------------------------------------------------------------------------------------ model pairs


def perturb_parameters(
    module: nn.Module, scale: float, gain_suffix: str | None = None, gain_std: float = 0.2
) -> None:
    """Move every parameter off its init with seeded noise (`scale` x N(0, 1) added), so that a weight
    the native class misroutes changes the output. Parameters named `*gain_suffix` (RMS-norm gains,
    which start at one) are redrawn as 1 + `gain_std` x N(0, 1) instead."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if gain_suffix is not None and name.endswith(gain_suffix):
                p.copy_(1.0 + gain_std * torch.randn_like(p))
            else:
                p.add_(scale * torch.randn_like(p))


def randomize_norms(module: nn.Module, std: float = 0.2) -> None:
    """Redraw the norm layers' affine parameters (Diffusers initialises them to the identity) as
    weight 1 + `std` x N(0, 1) and bias `std` x N(0, 1); other parameters are left as they are."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + std * torch.randn_like(p))


def native_from_reference(native_cls: type[ModuleT], reference: nn.Module, **config: Any) -> ModuleT:
    """The native twin of a Diffusers module: `native_cls` built on the meta device from the reference's
    config (updated with `config`: keys the released `config.json` has and Diffusers' class does not),
    filled with the reference's state dict by a strict load, as a checkpoint is loaded; in eval mode."""
    class_name = getattr(native_cls, "diffusers_class_name", native_cls.__name__)
    with torch.device("meta"):
        native = native_cls.from_config({**dict(reference.config), "_class_name": class_name, **config})
    native.load_state_dict(reference.state_dict(), strict=True, assign=True)
    left = [name for name, t in [*native.named_parameters(), *native.named_buffers()] if t.is_meta]
    assert not left, f"{native_cls.__name__}: left on the meta device after loading: {left}"
    return native.eval()


def parity_pair(
    diffusers_cls: Callable[..., nn.Module],
    native_cls: type[ModuleT],
    config: Mapping[str, Any],
    *,
    perturb: float | Callable[[nn.Module], None] = 0.05,
    seed: int = 0,
    **native_config: Any,
) -> tuple[nn.Module, ModuleT]:
    """A Diffusers module and its native twin on the same random weights, both in eval mode.

    Diffusers' class is built from `config` after `torch.manual_seed(seed)`, then perturbed: by
    `perturb_parameters(ref, perturb)` for a number, else by calling `perturb(ref)` (under no_grad).
    The native module is `native_from_reference(native_cls, ref, **native_config)`.
    """
    torch.manual_seed(seed)
    reference = diffusers_cls(**config).eval()
    if callable(perturb):
        with torch.no_grad():
            perturb(reference)
    else:
        perturb_parameters(reference, perturb)
    return reference, native_from_reference(native_cls, reference, **native_config)


def assert_same_state_dict_layout(native: nn.Module, reference: nn.Module, *, dtypes: bool = False) -> None:
    """The two state dicts have the same keys (the message lists the missing and the extra ones) and
    each key the same shape (and, with `dtypes`, the same dtype)."""

    def layout(module: nn.Module) -> dict[str, tuple[Any, ...]]:
        return {
            k: (tuple(v.shape), v.dtype) if dtypes else (tuple(v.shape),)
            for k, v in module.state_dict().items()
        }

    ours, theirs = layout(native), layout(reference)
    assert ours.keys() == theirs.keys(), (
        f"missing={sorted(theirs.keys() - ours.keys())} extra={sorted(ours.keys() - theirs.keys())}"
    )
    assert ours == theirs, {k: (v, theirs[k]) for k, v in ours.items() if theirs[k] != v}


def diffusers_init_defaults(diffusers_cls: type) -> dict[str, Any]:
    """The keyword defaults of a Diffusers class's constructor, by name: the config a native class's
    defaults must equal (a key Diffusers adds or a default it changes then fails the comparison)."""
    params = inspect.signature(diffusers_cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.name != "self"}


# ---------------------------------------------------------------------------------------- schedulers


class NativeSchedule(Protocol):
    """A native scheduler's schedule for one request."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor


class NativeMultistepScheduler(Protocol):
    """The native schedulers' per-request interface, as the sampling helpers drive it."""

    def schedule(self, num_steps: int, **kwargs: Any) -> NativeSchedule: ...

    def new_state(self) -> Any: ...

    def step(
        self, model_output: torch.Tensor, sample: torch.Tensor, sigmas: torch.Tensor, index: int, state: Any
    ) -> torch.Tensor: ...


#: A stand-in denoiser, `model(sample, timestep, noise)`.
FakeModel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fake_flow_model(sample: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A deterministic "model" of the sample and the timestep (0..1000): any difference in a single
    scheduler update compounds into the final sample."""
    return 0.3 * sample + torch.cos(t.to(torch.float32) / 1000) * noise


def diffusers_scheduler(diffusers_cls: Any, config: Mapping[str, Any]) -> Any:
    """Diffusers' scheduler from a `scheduler_config.json` dict (its `_`-prefixed metadata dropped)."""
    return diffusers_cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def latents_and_noise(shape: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded starting latents and the fake model's noise, in that order."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator), torch.randn(*shape, generator=generator)


def sample_with_diffusers(
    scheduler: Any,
    steps: int,
    latents: torch.Tensor,
    noise: torch.Tensor,
    *,
    begin_index: int | None = None,
    model: FakeModel = fake_flow_model,
) -> torch.Tensor:
    """Diffusers' sampling loop over `steps` steps (from `begin_index` when given) with the fake model."""
    scheduler.set_timesteps(steps)
    if begin_index is not None:
        scheduler.set_begin_index(begin_index)
    x = latents
    for t in scheduler.timesteps:
        x = scheduler.step(model(x, t, noise), t, x).prev_sample
    return x


def sample_natively(
    scheduler: NativeMultistepScheduler,
    steps: int,
    latents: torch.Tensor,
    noise: torch.Tensor,
    *,
    model: FakeModel = fake_flow_model,
) -> torch.Tensor:
    """The native scheduler's sampling loop over `steps` steps, one request's state, the fake model."""
    schedule = scheduler.schedule(steps)
    state = scheduler.new_state()
    x = latents
    for i, t in enumerate(schedule.timesteps):
        x = scheduler.step(model(x, t, noise), x, schedule.sigmas, i, state)
    return x


def sample_in_lockstep(
    reference: Any,
    native: NativeMultistepScheduler,
    steps: int,
    latents: torch.Tensor,
    noise: torch.Tensor,
    *,
    start: int = 0,
    mu: float | None = None,
    begin_index: int | None = None,
    model: FakeModel = fake_flow_model,
    reference_timesteps: bool = False,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Diffusers' scheduler and the native one sampling side by side from `latents`, from step `start`
    (Diffusers' `set_begin_index(begin_index)` when given; `mu` is passed to both schedules when given):
    yields `(step index, Diffusers' sample, native sample)` after each step, so that a test can compare
    every step or only the last. The model sees each scheduler's own timestep, or with
    `reference_timesteps` Diffusers' on both sides."""
    schedule_kwargs = {} if mu is None else {"mu": mu}
    reference.set_timesteps(steps, **schedule_kwargs)
    if begin_index is not None:
        reference.set_begin_index(begin_index)
    schedule = native.schedule(steps, **schedule_kwargs)
    state = native.new_state()
    x_ref = x = latents
    for i in range(start, len(reference.timesteps)):
        t = reference.timesteps[i]
        x_ref = reference.step(model(x_ref, t, noise), t, x_ref).prev_sample
        t_native = t if reference_timesteps else schedule.timesteps[i]
        x = native.step(model(x, t_native, noise), x, schedule.sigmas, i, state)
        yield i, x_ref, x


def sample_interleaved(
    scheduler: NativeMultistepScheduler,
    requests: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    *,
    head_start: int = 3,
    model: FakeModel = fake_flow_model,
) -> list[torch.Tensor]:
    """Several requests `(steps, latents, noise)` sampled on one native scheduler object, their steps
    interleaved as the engine interleaves requests: the first runs `head_start` steps alone, then each
    round takes one step of every unfinished request, the last request first. Each request has its own
    state, so each result must equal `sample_natively` of that request alone."""
    schedules = [scheduler.schedule(steps) for steps, _, _ in requests]
    states = [scheduler.new_state() for _ in requests]
    samples = [latents for _, latents, _ in requests]
    done = [0] * len(requests)

    def step(r: int) -> None:
        schedule, i, noise = schedules[r], done[r], requests[r][2]
        x = samples[r]
        samples[r] = scheduler.step(model(x, schedule.timesteps[i], noise), x, schedule.sigmas, i, states[r])
        done[r] += 1

    for _ in range(head_start):
        step(0)
    while any(d < steps for d, (steps, _, _) in zip(done, requests, strict=True)):
        for r in reversed(range(len(requests))):
            if done[r] < requests[r][0]:
                step(r)
    return samples


# ----------------------------------------------------------------------------------------- pipelines


def gradient_image(width: int, height: int) -> Image.Image:
    """A deterministic RGB image with structure in both directions (horizontal and vertical ramps and
    vertical stripes): an input image for image-to-video requests."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x / width, y / height, 0.5 + 0.5 * np.sin(x / 5.0)], axis=-1) * 255
    return Image.fromarray(rgb.astype(np.uint8))


def smooth_random_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB picture (a seeded 4x4 random grid upsampled bicubically), so that the VAE sees
    structure: an input or reference image for image-to-image and edit requests."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8))
    return coarse.resize((width, height), Image.Resampling.BICUBIC)


def to_uint8(array: np.ndarray) -> np.ndarray:
    """A Diffusers `output_type="np"` array (floats in [0, 1]) as 8-bit values, rounded as PIL output is."""
    return (np.asarray(array) * 255).round().astype(np.uint8)


def stack_uint8(images: Sequence[Any]) -> np.ndarray:
    """diffserve's output images (PIL) or frames (arrays) stacked into one uint8 array."""
    return np.stack([np.asarray(image) for image in images])


def diffusers_uint8(
    pipeline: Callable[..., Any], *, seed: int, video: bool = False, **kwargs: Any
) -> np.ndarray:
    """Run Diffusers' `pipeline(**kwargs)` with a CPU generator seeded `seed` (as diffserve seeds a
    request) and return its images, or with `video` its frames, as uint8."""
    out = pipeline(generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return to_uint8(out.frames if video else out.images)


def generator_and_reference(generator_cls: Any, root: Any, diffusers_cls: Any) -> tuple[Any, Any]:
    """diffserve's `generator_cls` (`DiffGenerator`: CPU, no progress bar) and Diffusers' `diffusers_cls`
    pipeline (fp32, no progress bar) on one model folder: the two sides of a pipeline parity test. The
    generator class is passed in: `testing` is imported by the families' tiny builders, so it may not
    import the API (the package graph stays acyclic). The generator batches every request of a shape
    (`batch_policy="throughput"`), so a test of requests sharing steps gets shared steps whatever the
    measured step times say."""
    reference = diffusers_cls.from_pretrained(root, dtype=torch.float32)
    reference.set_progress_bar_config(disable=True)
    ours = generator_cls.from_pretrained(root, device="cpu", show_progress=False, batch_policy="throughput")
    return ours, reference


def max_pixel_diff(a: np.ndarray, b: np.ndarray) -> int:
    """The largest absolute difference of two uint8 arrays (no wrap-around)."""
    return int(np.abs(a.astype(np.int64) - b.astype(np.int64)).max())


def assert_images_match(
    ours: np.ndarray,
    reference: np.ndarray,
    what: str,
    *,
    min_db: float,
    shape: tuple[int, ...] | None = None,
    control: np.ndarray | None = None,
) -> float:
    """Assert diffserve's uint8 images (or video frames) match Diffusers' at `min_db` PSNR and return
    the PSNR. The arrays must have one shape (`shape`, when given), and the reference more detail than
    `MIN_REFERENCE_STD`. With `control` (diffserve's output with one input changed), that output must
    score below `min_db`, so that a pass shows the input is really used."""
    assert ours.shape == reference.shape, f"{what}: shape {ours.shape} != the reference's {reference.shape}"
    if shape is not None:
        assert ours.shape == shape, f"{what}: shape {ours.shape} != {shape}"
    assert reference.std() > MIN_REFERENCE_STD, (
        f"{what}: the reference is flat; the comparison would prove nothing"
    )
    value = psnr_uint8(ours, reference)
    report = f"PSNR {value:.2f} dB, max abs pixel diff {max_pixel_diff(ours, reference)}"
    control_db = None if control is None else psnr_uint8(control, reference)
    if control_db is not None:
        report += f"; one input changed: {control_db:.2f} dB"
    print(f"{what}: {report}")
    assert value >= min_db, f"{what}: {value:.2f} dB < {min_db} dB ({report})"
    if control_db is not None:
        assert control_db < min_db, (
            f"{what}: the control scores {control_db:.2f} dB >= {min_db} dB ({report})"
        )
    return value


def assert_generation_matches(
    ours: Any,
    reference: Callable[..., Any],
    what: str,
    *,
    min_db: float,
    prompt: str,
    seed: int,
    reference_extra: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> np.ndarray:
    """diffserve's `ours.generate(prompt=..., seed=..., **kwargs)` (a `DiffGenerator`) against Diffusers'
    `reference` pipeline given the same arguments (`num_outputs_per_prompt` as `num_images_per_prompt`) and
    `reference_extra`: `assert_images_match` at `min_db`, both of shape (outputs, height, width, 3).
    Returns diffserve's uint8 images."""
    n = kwargs.get("num_outputs_per_prompt", 1)
    shared = {k: v for k, v in kwargs.items() if k != "num_outputs_per_prompt"}
    ours_u8 = stack_uint8(ours.generate(prompt=prompt, seed=seed, **kwargs).images)
    ref_u8 = diffusers_uint8(
        reference, seed=seed, prompt=prompt, num_images_per_prompt=n, **shared, **(reference_extra or {})
    )
    shape = (n, kwargs["height"], kwargs["width"], 3)
    assert_images_match(ours_u8, ref_u8, what, min_db=min_db, shape=shape)
    return ours_u8


class _DenoisingPipeline(Protocol):
    """The part of a native pipeline that `denoise_together` drives (requests already prepared)."""

    def denoise_step(self, reqs: list[Any]) -> None: ...

    def run_post_denoise(self, req: Any) -> Any: ...


def denoise_together(pipeline: _DenoisingPipeline, running: list[Any]) -> tuple[dict[str, Any], list[int]]:
    """Denoise prepared requests (`run_pre_denoise` done) together, as the engine batches them: one
    `denoise_step` over every unfinished request at a time, each finished by `run_post_denoise` once it
    is denoised. Returns the outputs by prompt and the number of requests each step held; `running` is
    emptied."""
    done: dict[str, Any] = {}
    step_sizes: list[int] = []
    while running:
        step_sizes.append(len(running))
        pipeline.denoise_step(running)
        for req in [r for r in running if r.is_denoised]:
            running.remove(req)
            done[req.params.prompt] = pipeline.run_post_denoise(req)
    return done, step_sizes


def assert_batched_as_alone(
    generator: Any,
    params: Sequence[Any],
    what: str,
    check_prepared: Callable[[list[Any]], None] | None = None,
    video: bool = False,
) -> list[int]:
    """Each request of `params` (`SamplingParams`, distinct prompts) run alone through `generator` (a
    `DiffGenerator`), then all of them prepared as the engine admits them, which must give them one batch
    key, and denoised together (`denoise_together`): each one's images (`video`: frames) must be within 1
    (uint8) of what it gives alone. `check_prepared(requests)` asserts more on the prepared requests (their
    step counts) before they are denoised. Returns the number of requests each step held."""
    from diffserve.request import Req

    def pixels(outputs: Any) -> np.ndarray:
        return stack_uint8(outputs.frames if video else outputs.images)

    pipeline = generator.pipeline
    alone = [pixels(generator.generate_from_params(p)) for p in params]
    running = [pipeline.run_pre_denoise(pipeline.validate(Req(params=p))) for p in params]
    keys = {pipeline.batch_key(r) for r in running}
    assert len(keys) == 1, f"{what}: the requests do not share a batch: {keys}"
    if check_prepared is not None:
        check_prepared(running)
    done, step_sizes = denoise_together(pipeline, running)
    for p, want in zip(params, alone, strict=True):
        got = pixels(done[p.prompt].outputs)
        diff = max_pixel_diff(got, want)
        print(
            f"{what} batched vs alone {p.prompt!r} (strength {p.strength}): max diff {diff}, "
            f"PSNR {psnr_uint8(got, want):.1f} dB"
        )
        assert diff <= 1, f"{what}: {p.prompt!r} batched is {diff} off its output alone"
    return step_sizes


def denoise_joining(pipeline: Any, params: Sequence[Any], join_after: Sequence[int]) -> dict[str, Any]:
    """Requests joining a running step batch, as the engine admits them: request i (`params[i]`, distinct
    prompts) is validated and prepared once `join_after[i]` steps have run, each step runs one
    `denoise_step` per batch key over the running requests, and a denoised request leaves
    (`run_post_denoise`). Returns each request's result by prompt."""
    from diffserve.request import Req

    waiting = [(Req(params=p), after) for p, after in zip(params, join_after, strict=True)]
    running: list[Any] = []
    done: dict[str, Any] = {}
    steps = 0
    while waiting or running:
        for req, after in [w for w in waiting if w[1] <= steps]:
            waiting.remove((req, after))
            running.append(pipeline.run_pre_denoise(pipeline.validate(req)))
        groups: dict[Any, list[Any]] = {}
        for req in running:
            groups.setdefault(pipeline.batch_key(req), []).append(req)
        for group in groups.values():
            pipeline.denoise_step(group)
        steps += 1
        for req in [r for r in running if r.is_denoised]:
            running.remove(req)
            done[req.params.prompt] = pipeline.run_post_denoise(req)
    return done
