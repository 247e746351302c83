"""CustomOp dispatch: the op picks `forward_<platform.dispatch_key>` once, for the platform it is given
(at build time, or when a loaded model is bound), and every key without a vendor kernel falls back to
`forward_native` with identical output."""

from __future__ import annotations

import pytest
import torch

from diffserve.layers.custom_op import DISPATCH_KEYS, CustomOp, dispatch_custom_ops
from diffserve.platforms import (
    CpuPlatform,
    CudaPlatform,
    MpsPlatform,
    MusaPlatform,
    NpuPlatform,
    Platform,
    RocmPlatform,
    XpuPlatform,
)

# Every real platform and the dispatch key it declares.
PLATFORM_KEYS = {
    CudaPlatform: "cuda",
    RocmPlatform: "hip",
    MusaPlatform: "musa",
    XpuPlatform: "xpu",
    NpuPlatform: "npu",
    MpsPlatform: "mps",
    CpuPlatform: "cpu",
}


class FakePlatform(CpuPlatform):
    """A platform that claims an arbitrary dispatch key (no hardware needed to build an op for it)."""

    def __init__(self, dispatch_key: str) -> None:
        self.dispatch_key = dispatch_key


class ScaleShift(CustomOp):
    """Toy op: x * 2 + 1, with a 'MUSA kernel' that is observably different."""

    def __init__(self, platform: Platform | None = None) -> None:
        super().__init__(platform)
        self.native_calls = 0
        self.musa_calls = 0

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        self.native_calls += 1
        return x * 2 + 1

    def forward_musa(self, x: torch.Tensor) -> torch.Tensor:
        self.musa_calls += 1
        return x * 2 + 1 + 1000  # distinguishable from the reference on purpose


def test_every_dispatch_key_is_declared_by_exactly_one_platform():
    assert set(PLATFORM_KEYS.values()) == set(DISPATCH_KEYS)
    assert len(PLATFORM_KEYS) == len(DISPATCH_KEYS)
    for cls, key in PLATFORM_KEYS.items():
        assert cls.dispatch_key == key


def test_custom_op_has_a_forward_method_per_dispatch_key():
    for key in DISPATCH_KEYS:
        assert callable(getattr(CustomOp, f"forward_{key}"))


@pytest.mark.parametrize("key", DISPATCH_KEYS)
def test_dispatch_picks_the_platform_key(key):
    op = ScaleShift(FakePlatform(key))
    assert op.dispatched_method_name == f"forward_{key}"


@pytest.mark.parametrize("cls", list(PLATFORM_KEYS), ids=lambda c: c.name)
def test_dispatch_under_each_real_platform_class(cls):
    op = ScaleShift(cls())
    assert op.dispatched_method_name == f"forward_{PLATFORM_KEYS[cls]}"


def test_overridden_key_runs_the_vendor_kernel():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    op = ScaleShift(MusaPlatform())
    out = op(x)
    assert op.musa_calls == 1 and op.native_calls == 0
    torch.testing.assert_close(out, x * 2 + 1 + 1000)


@pytest.mark.parametrize("key", [k for k in DISPATCH_KEYS if k != "musa"])
def test_non_overridden_keys_fall_back_to_native_with_identical_output(key):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    reference = ScaleShift(FakePlatform("not-a-key"))
    assert reference.dispatched_method_name == "forward_native"
    expected = reference(x)

    op = ScaleShift(FakePlatform(key))
    assert op.dispatched_method_name == f"forward_{key}"
    out = op(x)
    assert op.native_calls == 1 and op.musa_calls == 0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("key", ["native", "tpu", ""])
def test_platform_without_a_known_key_uses_native(key):
    op = ScaleShift(FakePlatform(key))
    assert op.dispatched_method_name == "forward_native"
    x = torch.ones(3)
    assert torch.equal(op(x), x * 2 + 1)


def test_fallback_passes_keyword_arguments_through():
    class Add(CustomOp):
        def forward_native(self, x: torch.Tensor, *, bias: float = 0.0) -> torch.Tensor:
            return x + bias

    for key in DISPATCH_KEYS:
        assert torch.equal(Add(FakePlatform(key))(torch.zeros(2), bias=3.0), torch.full((2,), 3.0))


def test_op_built_without_a_platform_runs_the_reference_until_bound():
    op = ScaleShift()
    assert op.dispatch_platform is None
    assert op.dispatched_method_name == "forward_native"
    platform = FakePlatform("musa")
    op.bind_platform(platform)
    assert op.dispatch_platform is platform
    assert op.dispatched_method_name == "forward_musa"


def test_dispatch_custom_ops_binds_every_op_of_a_model():
    model = torch.nn.Sequential(ScaleShift(), torch.nn.Sequential(torch.nn.Identity(), ScaleShift()))
    platform = FakePlatform("musa")
    assert dispatch_custom_ops(model, platform) == 2
    assert [m.dispatched_method_name for m in model.modules() if isinstance(m, CustomOp)] == [
        "forward_musa"
    ] * 2
    model(torch.zeros(1))
    assert model[0].musa_calls == 1 and model[1][1].musa_calls == 1


def test_dispatch_is_fixed_at_build_time():
    op = ScaleShift(FakePlatform("musa"))
    other = ScaleShift(CpuPlatform())  # another platform in the same process does not move it
    assert op.dispatched_method_name == "forward_musa"
    assert other.dispatched_method_name == "forward_cpu"
    op(torch.zeros(1))
    assert op.musa_calls == 1


def test_missing_forward_native_is_a_clear_error():
    class NoReference(CustomOp):
        pass

    op = NoReference(CpuPlatform())
    with pytest.raises(NotImplementedError, match="NoReference must implement forward_native"):
        op(torch.zeros(1))


def test_custom_op_is_an_nn_module_with_parameters():
    class Scale(CustomOp):
        def __init__(self, platform: Platform | None = None) -> None:
            super().__init__(platform)
            self.weight = torch.nn.Parameter(torch.full((3,), 2.0))

        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    op = Scale(FakePlatform("hip"))
    assert [name for name, _ in op.named_parameters()] == ["weight"]
    out = op(torch.ones(3))
    out.sum().backward()
    assert torch.equal(op.weight.grad, torch.ones(3))
