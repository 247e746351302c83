"""GGUF and FP8 single files stay quantized in the loaded DiT (issue 31 item 10).

A tiny FLUX with enough blocks that they dominate its weights, as in the published models (3 double- and
12 single-stream blocks, 256 wide, 78 MB in float32), is written as city96-layout GGUF Q8_0 and Q4_K
files and as a ComfyUI scaled-FP8 file, and loaded twice: kept quantized (the default: `GGUFLinear`s,
FP8 `QuantizedLinear`s) and dequantized at load (`dequantized_at_load()`, the previous behaviour).

- Resident DiT bytes against float32: Q8_0 <= 30%, Q4_K <= 17% (FP8 <= 30%); the engine's memory model
  (admission) counts those bytes, and the memory plan sizes the file as the loader keeps it.
- The image against the dequantized-at-load one: >= 60 dB.
- LoRA adapters and tensor parallelism refuse the quantized DiT with a message naming why.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffserve import DiffGenerator
from diffserve.errors import LoraError, ModelLoadError
from diffserve.families.flux.tiny import TinyFluxSpec, build_tiny_flux
from diffserve.layers.gguf_linear import GGUFLinear
from diffserve.layers.quantized_linear import QuantizedLinear
from diffserve.loader.model_index import read_model_index
from diffserve.loader.quantize import quantizable_linears, tensor_bytes
from diffserve.loader.single_file import dequantized_at_load, load_transformer_weights_file
from diffserve.models.dits.flux import FluxTransformer2DModel
from diffserve.offload.sizes import component_entries, size_of
from diffserve.registry import DIT_FACTS
from diffserve.testing.image_metrics import psnr_uint8
from diffserve.testing.tiny_lora import write_random_lora
from diffserve.testing.tiny_single_file import fp8_state_dict, original_state_dict

gguf = pytest.importorskip("gguf", reason="the gguf package is needed for .gguf checkpoints")

SPEC = TinyFluxSpec(num_layers=3, num_single_layers=12, attention_head_dim=128, axes_dims_rope=(16, 56, 56))
REQUEST = dict(height=64, width=64, num_inference_steps=2, max_sequence_length=32, guidance_scale=3.5)
#: Resident DiT bytes / float32 bytes, at most (issue 31).
RESIDENT_BARS = {"Q8_0": 0.30, "Q4_K": 0.17, "fp8": 0.30}
PSNR_BAR_DB = 60.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_flux(tmp_path_factory.mktemp("kept-quantized") / "flux", SPEC)


@pytest.fixture(scope="module")
def original(folder) -> dict[str, torch.Tensor]:
    state = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    return original_state_dict("FluxTransformer2DModel", state)


def _write(kind: str, original: dict[str, torch.Tensor], directory: Path) -> Path:
    if kind == "fp8":
        path = directory / "flux-fp8-scaled.safetensors"
        state = fp8_state_dict(original, "scaled", per_row=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        return path
    from diffserve.testing.tiny_single_file import write_gguf

    path = directory / f"flux-{kind}.gguf"
    write_gguf(path, original, kind, "flux")
    return path


def _meta_dit(folder: Path) -> FluxTransformer2DModel:
    config = json.loads((folder / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        return FluxTransformer2DModel.from_config(config)


def _generate(folder: Path, weights: Path) -> tuple[DiffGenerator, torch.nn.Module, np.ndarray]:
    gen = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, transformer_weights=weights
    )
    dit = gen.pipeline.context.get("transformer")
    image = np.asarray(gen.generate(prompt="a red fox in the snow", seed=7, **REQUEST).images[0])
    return gen, dit, image


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "fp8"])
def test_quantized_file_stays_quantized(folder, original, tmp_path, caplog, kind) -> None:
    path = _write(kind, original, tmp_path)
    with caplog.at_level(logging.INFO, logger="diffserve.loader"):
        gen, dit, image = _generate(folder, path)
    with dequantized_at_load():
        ref_gen, ref_dit, ref_image = _generate(folder, path)

    layer_type = QuantizedLinear if kind == "fp8" else GGUFLinear
    layers = [m for m in dit.modules() if isinstance(m, layer_type)]
    assert not any(isinstance(m, (GGUFLinear, QuantizedLinear)) for m in ref_dit.modules())
    # Every Linear the family lets be quantized (all but the embedders and the output head) is.
    unfused = quantizable_linears(_meta_dit(folder), "FluxTransformer2DModel", DIT_FACTS)
    assert len(layers) == len(unfused) > 100
    if kind == "fp8":
        assert all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    else:
        assert all(m.qtype == kind and m.weight.dtype == torch.uint8 for m in layers)
        assert f"Linears kept quantized (GGUF {kind} x {len(layers)}; dequantized per layer" in caplog.text

    full, kept = tensor_bytes(ref_dit), tensor_bytes(dit)
    ratio = kept / full
    value = psnr_uint8(image, ref_image)
    # Admission: the engine's memory model counts the weights as they are held.
    resident = gen.build_memory_model().weights.resident_bytes
    ref_resident = ref_gen.build_memory_model().weights.resident_bytes
    # The memory plan sizes the file as the loader keeps it (not as the folder's float32 weights).
    planned = size_of(
        component_entries(read_model_index(folder).components["transformer"], path), torch.float32
    )
    print(
        f"\n{kind}: DiT {kept / 2**20:.2f} MiB resident vs {full / 2**20:.2f} MiB dequantized at load "
        f"({ratio:.1%}); planned {planned.total_bytes / 2**20:.2f} MiB; PSNR vs dequantized at load "
        f"{value:.2f} dB; {len(layers)} quantized layers"
    )
    assert ratio <= RESIDENT_BARS[kind]
    assert value >= PSNR_BAR_DB
    assert image.std() > 5, "a flat image would prove nothing"
    assert ref_resident - resident == full - kept
    if kind != "fp8":
        assert abs(planned.total_bytes - kept) <= 0.05 * kept


def test_lora_and_tensor_parallelism_refuse_a_gguf_dit(folder, original, tmp_path) -> None:
    path = _write("Q8_0", original, tmp_path)
    gen = DiffGenerator.from_pretrained(folder, device="cpu", show_progress=False, transformer_weights=path)
    lora = write_random_lora(folder, tmp_path / "style.safetensors")
    with pytest.raises(
        LoraError, match=r"quantized weights \(GGUF Q8_0 x \d+ layers: .*GGUF --transformer-weights"
    ):
        gen.load_lora("style", lora)

    module = _meta_dit(folder)
    module.shard_for_tensor_parallel(SimpleNamespace(tp_group=None, tp_size=2, tp_rank=0))
    with pytest.raises(ModelLoadError, match="cannot be combined with tensor parallelism"):
        load_transformer_weights_file(
            module, path, "FluxTransformer2DModel", torch.device("cpu"), torch.float32, DIT_FACTS
        )


@pytest.mark.parametrize("offload", ["dit_cpu_offload", "dit_layerwise_offload"])
def test_offloaded_gguf_dit_gives_the_same_image(folder, original, tmp_path, offload) -> None:
    """The blocks move like any weights: a fused file tensor's rows (FLUX's qkv) are each in a storage
    of their own, as offloading needs, and the image is the resident one's."""
    path = _write("Q4_K", original, tmp_path)
    _, _, resident = _generate(folder, path)
    gen = DiffGenerator.from_pretrained(
        folder, device="cpu", show_progress=False, transformer_weights=path, **{offload: True}
    )
    image = np.asarray(gen.generate(prompt="a red fox in the snow", seed=7, **REQUEST).images[0])
    assert np.array_equal(image, resident)
