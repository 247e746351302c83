"""`CustomOp`: one op, a plain-torch reference (`forward_native`) and optional per-vendor kernels, each
an overridden `forward_<dispatch key>`. The method is chosen once for an explicit platform:
`CustomOp(platform)`, or `dispatch_custom_ops(model, platform)`, which the loader runs on every model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from diffserve.platforms.base import Platform

DISPATCH_KEYS: tuple[str, ...] = ("cuda", "hip", "musa", "xpu", "npu", "mps", "cpu")


class CustomOp(nn.Module):
    """Base for ops that may have backend-specific kernels."""

    def __init__(self, platform: Platform | None = None) -> None:
        """Dispatch for `platform`; None: `forward_native` until `bind_platform`."""
        super().__init__()
        self.dispatch_platform: Platform | None = None
        self._forward_impl: Callable[..., Any] = self.forward_native
        if platform is not None:
            self.bind_platform(platform)

    def bind_platform(self, platform: Platform) -> None:
        self.dispatch_platform = platform
        self._forward_impl = self.dispatch_forward(platform)

    def dispatch_forward(self, platform: Platform) -> Callable[..., Any]:
        """The bound `forward_<key>` for `platform` (native when the platform has no key of its own)."""
        key = platform.dispatch_key
        if key not in DISPATCH_KEYS:
            return self.forward_native
        return getattr(self, f"forward_{key}")

    @property
    def dispatched_method_name(self) -> str:
        return self._forward_impl.__name__

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_impl(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement forward_native")

    # Per-vendor entry points. Each falls back to the reference explicitly; override to add a kernel.
    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_hip(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_musa(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_xpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_npu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_mps(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)


def dispatch_custom_ops(module: nn.Module, platform: Platform) -> int:
    """Bind every `CustomOp` in `module` (itself included) to `platform`; returns how many were bound."""
    ops = [m for m in module.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.bind_platform(platform)
    return len(ops)
