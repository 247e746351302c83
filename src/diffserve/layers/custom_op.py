"""`CustomOp`: one op, one reference implementation, optional per-vendor kernels.

`forward_native` is the reference written in plain torch. Each platform has a
`forward_<dispatch_key>` method (cuda, hip, musa, xpu, npu, mps, cpu); the base class makes each
of them call `forward_native` explicitly, so a vendor kernel is added by overriding one method and
nothing changes for the other vendors. The method is chosen once, when the op is built, from the
current platform (see `diffserve.platforms`), so the hot path pays no lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from diffserve.platforms import Platform, current_platform

#: Every dispatch key a platform may declare; a CustomOp has one forward_<key> per entry.
DISPATCH_KEYS: tuple[str, ...] = ("cuda", "hip", "musa", "xpu", "npu", "mps", "cpu")


class CustomOp(nn.Module):
    """Base for ops that may have backend-specific kernels."""

    def __init__(self, platform: Platform | None = None) -> None:
        super().__init__()
        self._forward_impl: Callable[..., Any] = self.dispatch_forward(platform or current_platform())

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
