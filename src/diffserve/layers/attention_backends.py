"""The attention kernels `layers/attention.py` can run, what each needs, and the selector that picks one
for an engine (`--attention-backend`, default `auto`).

| name             | kernel                                                   | needs                                    |
|------------------|----------------------------------------------------------|------------------------------------------|
| `sdpa`           | `F.scaled_dot_product_attention`, torch's own choice     | nothing (every platform)                 |
| `flash_attn_3`   | FlashAttention 3, `flash_attn_interface.flash_attn_func` | NVIDIA Hopper (sm90), fp16/bf16, d<=256  |
| `flash_attn`     | FlashAttention 2, `flash_attn.flash_attn_func`           | NVIDIA sm80+ or ROCm, fp16/bf16, d<=256  |
| `sage_attn`      | SageAttention, `sageattention.sageattn` (8-bit QK)       | NVIDIA sm80+, fp16/bf16, d in 64/96/128  |
| `sdpa_cudnn`     | SDPA pinned to `SDPBackend.CUDNN_ATTENTION`              | NVIDIA sm80+, cuDNN 9, fp16/bf16, d<=128 |
| `sdpa_efficient` | SDPA pinned to `SDPBackend.EFFICIENT_ATTENTION`          | a CUDA/ROCm device                       |

None of the fast kernels takes an arbitrary attention mask except `sdpa_efficient`: a masked call (text
padding, batch padding) runs on SDPA, logged once (`layers/attention.py`), as does a call whose dtype or
head dim the kernel cannot take. Every kernel here reads and writes (batch, seq, heads, head_dim), the
layout `attention()` uses, so FlashAttention and SageAttention need no transposes (the SDPA ones do).

Selection (`select_attention_backend`), once per engine from the device and the model's dtype:

- a forced name must be able to run here (package installed, device, dtype), else a ValueError says why;
- `auto` takes the first exact kernel that can run, in the order `AUTO_ORDER` (FlashAttention 3 on
  Hopper, FlashAttention 2, cuDNN on Hopper, then torch's SDPA), and logs why each faster one was not
  taken. SageAttention is approximate (8-bit QK products) and `sdpa_efficient` is one of the kernels
  torch's SDPA already chooses from, so `auto` never picks them: name them to use them.

`DeviceFacts` carries what selection reads (device type, vendor, compute capability, dtype), so the
choice is testable without the device; "installed" means importable here (a module placed in
`sys.modules` counts, which is how the tests inject fake kernels).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

#: The value of `--attention-backend` that lets the selector choose.
AUTO = "auto"


class AttentionBackend(str, Enum):
    """The kernels `attention()` dispatches to (see the module docstring's table)."""

    SDPA = "sdpa"
    FLASH_ATTN_3 = "flash_attn_3"
    FLASH_ATTN = "flash_attn"
    SAGE_ATTN = "sage_attn"
    SDPA_CUDNN = "sdpa_cudnn"
    SDPA_EFFICIENT = "sdpa_efficient"


#: What `auto` tries, fastest first; the first that can run is chosen (SDPA always can).
AUTO_ORDER: tuple[AttentionBackend, ...] = (
    AttentionBackend.FLASH_ATTN_3,
    AttentionBackend.FLASH_ATTN,
    AttentionBackend.SDPA_CUDNN,
    AttentionBackend.SDPA,
)
#: Why `auto` never picks these (they run only when named).
NOT_AUTOMATIC: dict[AttentionBackend, str] = {
    AttentionBackend.SAGE_ATTN: "approximate (8-bit QK products): used only when named",
    AttentionBackend.SDPA_EFFICIENT: "torch's SDPA already chooses it where it is fastest: used only when named",
}
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DeviceFacts:
    """What backend selection reads about the device the model runs on."""

    device_type: str  # torch device type: "cuda" (NVIDIA and ROCm), "cpu", "musa", ...
    #: CUDA compute capability (major, minor) of an NVIDIA device; None elsewhere.
    capability: tuple[int, int] | None = None
    is_hip: bool = False  # a ROCm build of torch (device type "cuda")
    #: The DiT's compute dtype; None: not known (dtype conditions are then checked per call only).
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype | None = None) -> DeviceFacts:
        """The facts of a real device (the compute capability is read from CUDA where it is available)."""
        is_hip = torch.version.hip is not None
        capability = None
        if device.type == "cuda" and not is_hip and torch.cuda.is_available():
            capability = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
        return cls(device.type, capability, is_hip and device.type == "cuda", dtype)

    def describe(self) -> str:
        if self.device_type != "cuda":
            return f"a {self.device_type!r} device"
        if self.is_hip:
            return "a ROCm device"
        if self.capability is None:
            return "a CUDA device of unknown compute capability"
        return f"an NVIDIA device of compute capability {self.capability[0]}.{self.capability[1]}"


def installed(package: str) -> bool:
    """Whether `package` can be imported here (already imported, or found on the path)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _nvidia(facts: DeviceFacts, minimum: tuple[int, int], exactly_major: int | None = None) -> str | None:
    """Why `facts` is not an NVIDIA device of compute capability >= `minimum` (or of major `exactly_major`)."""
    if facts.device_type != "cuda" or facts.is_hip or facts.capability is None:
        return f"needs an NVIDIA GPU, not {facts.describe()}"
    if exactly_major is not None and facts.capability[0] != exactly_major:
        return f"needs compute capability {exactly_major}.x (Hopper), not {facts.describe()}"
    if facts.capability < minimum:
        return f"needs compute capability >= {minimum[0]}.{minimum[1]}, not {facts.describe()}"
    return None


def _half_dtype(facts: DeviceFacts) -> str | None:
    if facts.dtype is not None and facts.dtype not in _HALF:
        return f"needs fp16/bf16 inputs, and the model runs in {facts.dtype} (--dtype bfloat16)"
    return None


def _cudnn_attention_available() -> bool:
    """torch's cuDNN SDPA needs cuDNN 9 (torch >= 2.5 ships it)."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return version is not None and version >= 90000


# -- per-backend facts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendSpec:
    """One kernel: the package it needs (None: torch itself), whether the device and dtype can run it
    (`unavailable`), whether one call's inputs can (`call_unsupported`), and the call itself (`run`:
    (batch, seq, heads, head_dim) q/k/v and optional mask in, same layout out)."""

    backend: AttentionBackend
    package: str | None
    unavailable: Callable[[DeviceFacts], str | None]
    call_unsupported: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], str | None]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

    def unavailable_reason(self, facts: DeviceFacts) -> str | None:
        """Why this backend cannot run for `facts`, or None when it can."""
        if self.package is not None and not installed(self.package):
            return f"the '{self.package}' package is not installed"
        return self.unavailable(facts)


def _head_dim_check(allowed: Callable[[int], bool], wording: str):
    def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str | None:
        if mask is not None:
            return "does not take an attention mask"
        if q.dtype not in _HALF:
            return f"needs fp16/bf16 inputs, got {q.dtype}"
        if not allowed(q.shape[-1]) or v.shape[-1] != q.shape[-1]:
            return f"needs a head dim {wording}, got {q.shape[-1]}"
        return None

    return check


def _first(result: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The attention output of a kernel that may also return its softmax statistics."""
    return result[0] if isinstance(result, tuple | list) else result


def _flash_attn_3(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    from flash_attn_interface import flash_attn_func

    return _first(flash_attn_func(q, k, v, causal=False))


def _flash_attn_2(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    from flash_attn import flash_attn_func

    return _first(flash_attn_func(q, k, v, dropout_p=0.0, causal=False))


def _sage_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="NHD", is_causal=False)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """torch's SDPA (its own kernel choice) in the (batch, seq, heads, head_dim) layout."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)


def _pinned_sdpa(kernel_name: str) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, kernel_name)]):
            return sdpa(q, k, v, mask)

    return run


def _efficient_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> str | None:
    if q.dtype not in (*_HALF, torch.float32):
        return f"needs fp16/bf16/fp32 inputs, got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"needs a head dim that is a multiple of 8 and at most 256, got {q.shape[-1]}"
    return None


def _not_cuda_device(facts: DeviceFacts) -> str | None:
    return None if facts.device_type == "cuda" else f"needs a CUDA/ROCm GPU, not {facts.describe()}"


def _flash2_device(facts: DeviceFacts) -> str | None:
    if facts.device_type == "cuda" and facts.is_hip:  # flash-attn has a ROCm build
        return _half_dtype(facts)
    return _nvidia(facts, (8, 0)) or _half_dtype(facts)


def _cudnn_device(facts: DeviceFacts) -> str | None:
    reason = _nvidia(facts, (8, 0)) or _half_dtype(facts)
    if reason is None and not _cudnn_attention_available():
        return "needs cuDNN 9 (torch.backends.cudnn.version() >= 90000)"
    return reason


def _no_reason(facts: DeviceFacts) -> str | None:
    return None


def _any_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    return None


_SPECS: tuple[BackendSpec, ...] = (
    BackendSpec(AttentionBackend.SDPA, None, _no_reason, _any_call, sdpa),
    BackendSpec(
        AttentionBackend.FLASH_ATTN_3, "flash_attn_interface",
        lambda f: _nvidia(f, (9, 0), exactly_major=9) or _half_dtype(f),
        _head_dim_check(lambda d: d % 8 == 0 and d <= 256, "that is a multiple of 8 and at most 256"),
        _flash_attn_3,
    ),
    BackendSpec(
        AttentionBackend.FLASH_ATTN, "flash_attn", _flash2_device,
        _head_dim_check(lambda d: d % 8 == 0 and d <= 256, "that is a multiple of 8 and at most 256"),
        _flash_attn_2,
    ),
    BackendSpec(
        AttentionBackend.SAGE_ATTN, "sageattention", lambda f: _nvidia(f, (8, 0)) or _half_dtype(f),
        _head_dim_check(lambda d: d in (64, 96, 128), "of 64, 96 or 128"), _sage_attn,
    ),
    BackendSpec(
        AttentionBackend.SDPA_CUDNN, None, _cudnn_device,
        _head_dim_check(lambda d: d % 8 == 0 and d <= 128, "that is a multiple of 8 and at most 128"),
        _pinned_sdpa("CUDNN_ATTENTION"),
    ),
    BackendSpec(
        AttentionBackend.SDPA_EFFICIENT, None, _not_cuda_device, _efficient_call,
        _pinned_sdpa("EFFICIENT_ATTENTION"),
    ),
)  # fmt: skip
SPECS: dict[AttentionBackend, BackendSpec] = {spec.backend: spec for spec in _SPECS}


# -- selection ---------------------------------------------------------------------------------------


class AttentionBackendUnavailableError(ValueError):
    """A backend named with `--attention-backend` cannot run here; the message says why."""


@dataclass(frozen=True)
class Selection:
    """The chosen backend, whether it was named or chosen by `auto`, and why the others were not."""

    backend: AttentionBackend
    requested: str
    not_chosen: tuple[tuple[AttentionBackend, str], ...] = ()

    def describe(self) -> str:
        """One log line's worth: the choice, then why each other backend was not taken."""
        how = "named" if self.requested != AUTO else "auto"
        text = f"{self.backend.value} ({how})"
        if self.not_chosen:
            text += "; not chosen: " + "; ".join(f"{b.value}: {why}" for b, why in self.not_chosen)
        return text


def parse_backend_name(name: str) -> str:
    """`name` as a backend value or `auto`; ValueError listing the choices for anything else."""
    if name == AUTO or name in {b.value for b in AttentionBackend}:
        return name
    choices = ", ".join([AUTO, *(b.value for b in AttentionBackend)])
    raise ValueError(f"unknown attention backend {name!r}; choose one of: {choices}")


def select_attention_backend(requested: str, facts: DeviceFacts) -> Selection:
    """The backend for `requested` (a backend name or `auto`) on the device `facts` describes.

    A named backend that cannot run here is an `AttentionBackendUnavailableError` (no silent
    substitute); `auto` returns the first of `AUTO_ORDER` that can run, with the reasons the others
    were passed over."""
    requested = parse_backend_name(requested)
    if requested != AUTO:
        backend = AttentionBackend(requested)
        reason = SPECS[backend].unavailable_reason(facts)
        if reason is not None:
            raise AttentionBackendUnavailableError(
                f"--attention-backend {backend.value} cannot run on {facts.describe()}: {reason} "
                f"(omit the flag, or pass auto, to let diffserve choose)"
            )
        return Selection(backend, requested)
    not_chosen: list[tuple[AttentionBackend, str]] = []
    chosen = AttentionBackend.SDPA
    for backend in AUTO_ORDER:
        reason = SPECS[backend].unavailable_reason(facts)
        if reason is None:
            chosen = backend
            break
        not_chosen.append((backend, reason))
    later = AUTO_ORDER[AUTO_ORDER.index(chosen) + 1 :]
    not_chosen += [(backend, f"{chosen.value} comes first") for backend in later]
    not_chosen += [(backend, why) for backend, why in NOT_AUTOMATIC.items()]
    return Selection(chosen, requested, tuple(not_chosen))
