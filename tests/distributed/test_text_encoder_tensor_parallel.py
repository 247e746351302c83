"""Tensor parallelism for the large transformers text encoders (T5, UMT5, Qwen3, Qwen2.5-VL's language
model): loaded as TP shards, each rank reading only its slices of the safetensors file, they hold exactly
the whole `from_pretrained` model's slices (parameters, tied weights, buffers and dtypes), and on two gloo
ranks they give the whole model's hidden states, for padded prompts.

The tiny models are transformers' own classes with seeded random weights, saved by
`save_pretrained` (for Qwen2.5-VL that writes the older `model.layers...` / `visual...` key layout, which
loading renames as transformers does). The sharded-load checks run in this process; the forwards run on
two gloo ranks in one `run_distributed` call.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

from diffserve.distributed.config import ParallelConfig
from diffserve.distributed.parallel_embedding import ColumnParallelEmbedding, parallel_embedding_shards
from diffserve.distributed.state import build_parallel_state
from diffserve.errors import ModelLoadError
from diffserve.layers.tensor_parallel import (
    ColumnParallelLinear,
    TensorParallelRank,
    tensor_parallel_shards,
)
from diffserve.loader.text_encoder_tp import load_tensor_parallel_encoder
from diffserve.testing.distributed import LoadOnlyRank, run_distributed

VOCAB, WIDTH, HEADS, KV_HEADS, FFN = 64, 32, 4, 2, 48
T5_LIKE = dict(
    vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=FFN, num_layers=2, num_heads=HEADS,
    feed_forward_proj="gated-gelu", dense_act_fn="gelu_new",
)  # fmt: skip
QWEN_TEXT = dict(
    vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=2,
    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
#: Class -> config (built with random weights by the fixture). Qwen2.5-VL's multimodal rotary sections
#: cover the half head dimension (8 / 2 = 2 + 1 + 1).
CONFIGS: dict[str, transformers.PreTrainedConfig] = {
    "T5EncoderModel": transformers.T5Config(**T5_LIKE),
    "UMT5EncoderModel": transformers.UMT5Config(**T5_LIKE),
    "Qwen3Model": transformers.Qwen3Config(**QWEN_TEXT, head_dim=WIDTH // HEADS),
    "Qwen2_5_VLForConditionalGeneration": transformers.Qwen2_5_VLConfig(
        text_config={
            **QWEN_TEXT,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": WIDTH,
        },
        tie_word_embeddings=False,
    ),
}
#: Sharded tensors per model: T5 has q/k/v/o + wi_0/wi_1/wo per block and block 0's relative bias table;
#: UMT5 a table per block; the Qwens q/k/v/o + gate/up/down per layer, and Qwen2.5-VL's q/k/v biases.
SHARDED = {
    "T5EncoderModel": 2 * 7 + 1,
    "UMT5EncoderModel": 2 * 8,
    "Qwen3Model": 2 * 7,
    "Qwen2_5_VLForConditionalGeneration": 2 * 10,
}
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def encoder_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each encoder saved by `save_pretrained`, with seeded random weights (norm scales near 1)."""
    root = tmp_path_factory.mktemp("tp-text-encoders")
    dirs = {}
    for index, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(index)
        model = getattr(transformers, name)(config)
        with torch.no_grad():  # weights large enough that every layer moves the hidden states
            for key, param in model.named_parameters():
                param.normal_(1.0 if "norm" in key or "ln_" in key else 0.0, 0.2)
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
    return dirs


def whole(name: str, directory: Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    return getattr(transformers, name).from_pretrained(directory, dtype=dtype, local_files_only=True).eval()


def assert_holds_the_slices(
    shard: transformers.PreTrainedModel, full: transformers.PreTrainedModel
) -> dict[str, object]:
    """Every parameter and buffer of `shard` is the whole model's (its slice where sharded), in its dtype;
    tied parameters are one tensor. Returns the shard specs."""
    specs = tensor_parallel_shards(shard) | parallel_embedding_shards(shard)
    params = dict(shard.named_parameters(remove_duplicate=False))
    expected = dict(full.named_parameters(remove_duplicate=False))
    assert params.keys() == expected.keys()
    for key, param in params.items():
        want = specs[key].take(expected[key].detach()) if key in specs else expected[key]
        assert param.dtype == want.dtype and torch.equal(param, want), key
    buffers, expected_buffers = dict(shard.named_buffers()), dict(full.named_buffers())
    assert buffers.keys() == expected_buffers.keys()
    for key, buffer in buffers.items():  # rotary inv_freq: computed on load, not in the checkpoint
        assert buffer.dtype == expected_buffers[key].dtype and torch.equal(buffer, expected_buffers[key]), key
    for target, source in full.all_tied_weights_keys.items():
        assert shard.get_parameter(target) is shard.get_parameter(source), target
    return specs


# ----------------------------------------------------------------------------------- in this process


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_rank_holds_the_whole_models_slices(encoder_dirs: dict[str, Path], name: str) -> None:
    # float16: T5's `wo` stays float32 there (`_keep_in_fp32_modules`), as from_pretrained keeps it.
    directory = encoder_dirs[name]
    full = whole(name, directory, torch.float16)
    file_bytes = sum(t.numel() * t.element_size() for t in load_file(str(directory / WEIGHTS)).values())
    for rank in (0, 1):
        shard, num_bytes = load_tensor_parallel_encoder(
            name, directory, torch.device("cpu"), torch.float16, LoadOnlyRank(2, rank)
        )
        specs = assert_holds_the_slices(shard, full)
        assert len(specs) == SHARDED[name]
        # The loader read this rank's slices of the sharded tensors and nothing more (it counts what it read;
        # the file is float32, the parameters float16 or float32).
        read = sum(p.numel() * 4 for p in shard.parameters())
        assert num_bytes == read < file_bytes, (num_bytes, read, file_bytes)
        assert not shard.training and not any(p.requires_grad for p in shard.parameters())
    if name.startswith(("T5", "UMT5")):
        assert full.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
        attention = shard.encoder.block[0].layer[0].SelfAttention
        assert (attention.n_heads, attention.inner_dim) == (HEADS // 2, WIDTH // 2)
        assert isinstance(attention.relative_attention_bias, ColumnParallelEmbedding)
        assert specs["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].ranges == (
            (2, 4),
        )


def _rewrite(
    source: Path, target: Path, rename: dict[str, str], extra: dict[str, torch.Tensor] | None = None
) -> Path:
    """A copy of checkpoint folder `source` whose tensors are renamed by `rename` (others kept), plus
    the tensors `extra`."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = {rename.get(k, k): v for k, v in load_file(str(source / WEIGHTS)).items()}
    save_file(tensors | (extra or {}), str(target / WEIGHTS), metadata={"format": "pt"})
    return target


def test_other_checkpoint_layouts_load_as_from_pretrained_loads_them(
    encoder_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # T5 with the tied embedding under the encoder's name only (tied the other way round), and tensors
    # the encoder has no place for: a decoder's (which T5EncoderModel ignores) and another (skipped, named).
    extra = {"decoder.final_layer_norm.weight": torch.ones(WIDTH), "pooler.weight": torch.ones(2)}
    t5 = _rewrite(
        encoder_dirs["T5EncoderModel"],
        tmp_path / "t5",
        {"shared.weight": "encoder.embed_tokens.weight"},
        extra,
    )
    # Qwen2.5-VL in transformers 5's own module names (`model.language_model...`, `model.visual...`).
    vl_dir = encoder_dirs["Qwen2_5_VLForConditionalGeneration"]
    names = dict.fromkeys(load_file(str(vl_dir / WEIGHTS)))
    new = {k: "model.language_model." + k.removeprefix("model.") for k in names if k.startswith("model.")}
    new |= {k: "model." + k for k in names if k.startswith("visual.")}
    vl = _rewrite(vl_dir, tmp_path / "vl", new)
    for name, directory in (("T5EncoderModel", t5), ("Qwen2_5_VLForConditionalGeneration", vl)):
        shard, _ = load_tensor_parallel_encoder(
            name, directory, torch.device("cpu"), torch.float32, LoadOnlyRank(2, 1)
        )
        assert_holds_the_slices(shard, whole(name, directory))
        assert_holds_the_slices(shard, whole(name, encoder_dirs[name]))  # the same weights as the original
    skipped = [r.getMessage() for r in caplog.records if "checkpoint tensors, skipped" in r.getMessage()]
    assert len(skipped) == 1 and "pooler.weight" in skipped[0] and "decoder" not in skipped[0], skipped


def test_a_checkpoint_without_a_tensor_is_refused(encoder_dirs: dict[str, Path], tmp_path: Path) -> None:
    source = encoder_dirs["Qwen3Model"]
    target = tmp_path / "qwen3"
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / WEIGHTS))
    del tensors["layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(target / WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing keys: layers\.1\.mlp\.down_proj\.weight"):
        load_tensor_parallel_encoder(
            "Qwen3Model", target, torch.device("cpu"), torch.float32, LoadOnlyRank(2, 0)
        )


def load_component(class_name: str, directory: Path, tp: TensorParallelRank) -> nn.Module:
    """The component loader's step for one transformers encoder (its TP hook included)."""
    from diffserve.loader.component_loader import _load
    from diffserve.loader.model_index import ComponentSpec
    from diffserve.loader.native_classes import NativeClasses
    from diffserve.platforms.cpu import CpuPlatform

    spec = ComponentSpec("text_encoder", "transformers", class_name, directory)
    return _load(spec, NativeClasses.of([], []), CpuPlatform(), torch.float32, torch.float32, tp)


def test_the_loader_shards_the_large_encoders_and_keeps_clip_whole(
    encoder_dirs: dict[str, Path], tmp_path: Path
) -> None:
    t5 = load_component("T5EncoderModel", encoder_dirs["T5EncoderModel"], LoadOnlyRank(2, 0))
    q = t5.encoder.block[1].layer[0].SelfAttention.q
    assert isinstance(q, ColumnParallelLinear) and q.weight.shape == (WIDTH // 2, WIDTH)
    clip_dir = tmp_path / "clip"
    transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    ).save_pretrained(clip_dir)
    clip = load_component("CLIPTextModel", clip_dir, LoadOnlyRank(2, 0))
    linears = [type(m) for m in clip.modules() if isinstance(m, nn.Linear)]
    assert linears and set(linears) == {nn.Linear}


def test_heads_that_do_not_divide_the_tp_size_are_refused(encoder_dirs: dict[str, Path]) -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"--tp-size 3: the T5EncoderModel's 4 attention heads \(num_heads\) do not divide",
    ):
        load_component("T5EncoderModel", encoder_dirs["T5EncoderModel"], LoadOnlyRank(3, 0))
    with pytest.raises(
        ModelLoadError,
        match=r"--tp-size 4: the Qwen3Model's 2 key/value heads \(num_key_value_heads\) do not divide over 4",
    ):
        load_component("Qwen3Model", encoder_dirs["Qwen3Model"], LoadOnlyRank(4, 0))


def test_only_a_plain_embedding_is_column_sharded() -> None:
    with pytest.raises(TypeError, match="without max_norm"):
        ColumnParallelEmbedding.replacing(nn.Embedding(8, 4, max_norm=1.0), LoadOnlyRank(2, 0))


# ------------------------------------------------------------------------------------ on gloo ranks


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second padded (right, as the pipelines' tokenizers pad): ids and 0/1 mask."""
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    ids[1, 6:] = 0
    return ids, mask


def encode(name: str, model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """What the pipelines take from each encoder (stages/*_text_encoding.py), for the padded prompts."""
    ids, mask = prompts()
    with torch.no_grad():
        if name == "T5EncoderModel":  # SD3 encodes without a mask; masked as well, as FLUX-like callers may
            return {"last": model(ids)[0], "last_masked": model(ids, mask).last_hidden_state}
        if name == "UMT5EncoderModel":  # Wan
            return {"last_masked": model(ids, mask).last_hidden_state}
        if name == "Qwen3Model":  # Z-Image: the second-to-last layer's states, boolean mask
            out = model(input_ids=ids, attention_mask=mask.bool(), output_hidden_states=True)
            return {"hidden_-2": out.hidden_states[-2], "last": out.last_hidden_state}
        # Qwen-Image: the language model's last states, through `.model`
        return {"last": model.model(input_ids=ids, attention_mask=mask).last_hidden_state}


def _tp_encode(rank: int, world_size: int, dirs: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    state = build_parallel_state(
        ParallelConfig(num_gpus=world_size, tp_size=2), local_rank=rank, control_timeout=timedelta(seconds=60)
    )
    outputs = {}
    for name, directory in dirs.items():
        model, _ = load_tensor_parallel_encoder(name, directory, torch.device("cpu"), torch.float32, state)
        outputs[name] = encode(name, model)
    return outputs


def test_tp_encoders_equal_the_whole_models(encoder_dirs: dict[str, Path]) -> None:
    expected = {name: encode(name, whole(name, directory)) for name, directory in encoder_dirs.items()}
    results = run_distributed(_tp_encode, 2, encoder_dirs, timeout_s=120)
    for rank, result in enumerate(results):
        for name, outputs in expected.items():
            for what, want in outputs.items():
                error = (result[name][what] - want).abs().max().item()
                print(
                    f"{name} {what}, rank {rank}: max abs error {error:.2e} (max |x| {want.abs().max():.2f})"
                )
                # The row-parallel all-reduce only reorders fp32 sums.
                assert error < 1e-5 * want.abs().max().item(), (name, what, error)
