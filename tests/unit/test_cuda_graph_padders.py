"""Breakable CUDA graphs on the CPU (`runtime/cuda_graph/`, the dry-run capture backend): the per-DiT
prompt padders leave eager outputs unchanged, bit for bit in fp32, and what cannot be captured falls back.

- Qwen-Image (masked text): a prompt padded to each token bucket, at batch 1 (where a mask is made: masks
  stay on at batch 1) and at batch > 1 with and without a padding mask, gives the unpadded eager output
  exactly, because every attention is a break point that drops the padding (the padded call attends
  otherwise slightly differently: shown); a prompt over the largest bucket runs eager, logged once.
- Z-Image (native length): the caption keeps its length; prompts rounding to the same multiple of 32 replay
  one capture.
- FLUX (fixed length): only the batch is padded.
- A batch padded to its bucket keeps its real rows to within fp32 rounding (the CPU's small-M matmuls of
  the per-sample embeddings round differently by row count), and the unseen-shape, over-limit, step-cache
  and LoRA paths run eager with one log line each.
The same on a GPU with real CUDA graphs: tests/gpu/test_cuda_graph_gpu.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from diffserve.layers.lora_rows import AppliedLora, LoraRows, lora_rows_scope
from diffserve.registry import PROMPT_PADDERS
from diffserve.runtime.cuda_graph import (
    Buckets,
    CaptureMismatchError,
    DryRunBackend,
    GraphRunner,
    padder_for,
)
from diffserve.runtime.cuda_graph.padders import AttentionSpan
from diffserve.testing.graph_emulation import EmulatedGraphBackend
from diffserve.testing.tiny_dits import FLUX, LONGCAT_IMAGE, QWEN_IMAGE, Z_IMAGE, tiny_dit, tiny_dit_inputs

LOGGER = "diffserve.cuda_graph"
BUCKETS = Buckets(batch=(1, 2, 4), tokens=(8, 16, 64))


def same(a: Any, b: Any) -> bool:
    """Bit-identical outputs (a tensor, or Z-Image's list of per-sample tensors)."""
    if isinstance(a, list):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


def eager_and_runner(
    name: str, buckets: Buckets = BUCKETS, backend: str = "dry-run", **runner_options: Any
) -> tuple[Any, GraphRunner]:
    """The tiny DiT `name` and a runner for it (not installed) with the dry-run backend (recomputes each
    replay eagerly through the static buffers) or the emulated one (replays recorded ops on the recorded
    tensors, as a CUDA graph replays its kernels: `testing/graph_emulation.py`)."""
    dit = tiny_dit(name)
    capture = DryRunBackend() if backend == "dry-run" else EmulatedGraphBackend()
    return dit, GraphRunner(dit, padder_for(dit, PROMPT_PADDERS), capture, buckets, **runner_options)


BACKENDS = pytest.mark.parametrize("backend", ["dry-run", "emulated"])


@pytest.fixture(autouse=True)
def _one_thread_inference():
    """One CPU thread: a multi-threaded CPU matmul splits its work by the row count, so the last bits of
    the real text rows would then depend on how many padding rows share their matmul (on a GPU, whether
    its kernels do is what tests/gpu/test_cuda_graph_gpu.py measures)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(threads)


# -- Qwen-Image: masked text ----------------------------------------------------------------------------


@BACKENDS
@pytest.mark.parametrize("text", [7, 8, 13])
@pytest.mark.parametrize(("batch", "ragged"), [(1, False), (2, False), (2, True), (4, True)])
def test_qwen_image_padding_to_every_bucket_is_bit_exact(
    text: int, batch: int, ragged: bool, backend: str
) -> None:
    dit, runner = eager_and_runner(QWEN_IMAGE, backend=backend)
    inputs = tiny_dit_inputs(QWEN_IMAGE, batch, text, ragged=ragged)
    expected = dit(**inputs)
    runner.install()
    for bucket in (b for b in BUCKETS.tokens if b >= text):
        padded = runner.padder.pad(inputs, batch, bucket)
        assert padded.call["encoder_hidden_states"].shape[1] == bucket
        record = runner._capture(runner.padder.signature(padded), padded)
        assert same(runner.padder.unpad(runner._replay(record, padded), padded), expected)
    assert same(dit(**inputs), expected)  # and through the installed forward (its own bucket)
    assert runner.summary()["replayed"] == 1 and runner.summary()["fallback"] == 0


def test_qwen_image_pads_embeddings_mask_rope_and_lengths_together() -> None:
    dit = tiny_dit(QWEN_IMAGE)
    padder = padder_for(dit, PROMPT_PADDERS)
    inputs = tiny_dit_inputs(QWEN_IMAGE, 1, 7)
    padded = padder.pad(inputs, 1, 16)
    text, mask = padded.call["encoder_hidden_states"], padded.call["encoder_hidden_states_mask"]
    assert text.shape == (1, 16, 32) and torch.equal(text[:, :7], inputs["encoder_hidden_states"])
    assert not text[:, 7:].any()
    # Batch 1 had no mask: one is made, so the replay does not attend the padding.
    assert mask is not None and mask.dtype == torch.bool and mask[0, :7].all() and not mask[0, 7:].any()
    assert padded.span == AttentionSpan(start=7, stop=16, joint_length=16 + 16, mask_made=True)
    assert (padded.text_length, padded.token_bucket) == (7, 16)
    # The text RoPE follows the padded length; the real tokens' rows are the unpadded ones.
    cos7, sin7 = dit.rope_tables([(1, 4, 4)], 7, torch.device("cpu"))
    cos16, sin16 = dit.rope_tables([(1, 4, 4)], 16, torch.device("cpu"))
    assert cos16.shape[0] == 16 + 16
    assert torch.equal(cos16[:7], cos7[:7]) and torch.equal(sin16[16:], sin7[7:])  # text, then image rows


def test_qwen_image_padding_needs_the_break_points_and_the_mask() -> None:
    """Why the padder is built as it is: the padded call run as a plain eager call, with its mask, is
    close but not bit-identical (attention sums over more keys); without the mask it attends the padding."""
    dit = tiny_dit(QWEN_IMAGE)
    inputs = tiny_dit_inputs(QWEN_IMAGE, 1, 7)
    expected = dit(**inputs)
    padded = padder_for(dit, PROMPT_PADDERS).pad(inputs, 1, 64).call
    with_mask = dit(**padded)
    torch.testing.assert_close(with_mask, expected, rtol=1e-4, atol=1e-4)
    without_mask = dit(**{**padded, "encoder_hidden_states_mask": None})
    assert (without_mask - expected).abs().max() > 1e-3


def test_qwen_image_over_limit_prompt_runs_eager_with_one_log_line(caplog) -> None:
    dit, runner = eager_and_runner(QWEN_IMAGE)
    inputs = tiny_dit_inputs(QWEN_IMAGE, 1, 70)
    expected = dit(**inputs)
    runner.install()
    caplog.set_level(logging.INFO, logger=LOGGER)
    caplog.clear()  # what an earlier test's logging set-up let through (the warm-up's lines) is not this test's
    for _ in range(3):
        assert same(dit(**inputs), expected)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert lines == [
        "[BCG] transformer: eager fallback: a prompt of 70 text tokens is longer than the largest token bucket (64)"
    ]
    assert runner.summary()["fallback"] == 3 and runner.summary()["captured"] == 0


# -- Z-Image: native length -------------------------------------------------------------------------------


@BACKENDS
@pytest.mark.parametrize(("batch", "ragged"), [(1, False), (2, True), (4, True)])
def test_zimage_keeps_native_prompt_length_and_is_bit_exact(batch: int, ragged: bool, backend: str) -> None:
    dit, runner = eager_and_runner(Z_IMAGE, backend=backend)
    short, long = (
        tiny_dit_inputs(Z_IMAGE, batch, 20, ragged),
        tiny_dit_inputs(Z_IMAGE, batch, 25, ragged, seed=1),
    )
    expected = [dit(**short), dit(**long)]
    runner.install()
    padded = runner.padder.pad(short, batch, None)
    assert [c.shape for c in padded.call["cap_feats"]] == [
        c.shape for c in short["cap_feats"]
    ]  # no tokens added
    assert padded.span is None and padded.extra == (32,) * batch  # the DiT's own rounding, in the key
    assert same(dit(**short), expected[0]) and same(dit(**long), expected[1])
    # 20 and 25 tokens both round to 32: one capture per batch bucket, replayed for both prompts.
    assert runner.summary()["replayed"] == 2
    assert (
        len(
            {
                record.key
                for record in runner.graphs.values()
                if record.description.startswith(f"batch bucket {batch} ")
            }
        )
        == 1
    )


# -- FLUX: fixed length ------------------------------------------------------------------------------------


@BACKENDS
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_flux_passes_the_text_through_and_is_bit_exact(batch: int, backend: str) -> None:
    dit, runner = eager_and_runner(FLUX, backend=backend)
    inputs = tiny_dit_inputs(FLUX, batch, 12)
    expected = dit(**inputs)
    runner.install()
    padded = runner.padder.pad(inputs, batch, None)
    assert padded.call["encoder_hidden_states"] is inputs["encoder_hidden_states"] and padded.span is None
    assert not runner.padder.breaks_at_attention
    assert same(dit(**inputs), expected) and same(dit(**inputs), expected)
    [record] = [r for r in runner.graphs.values() if r.description.startswith(f"batch bucket {batch} ")]
    assert record.breaks == 0 and len(record.blocks) == 3  # 1 double + 2 single blocks, one segment each


@BACKENDS
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_longcat_image_passes_the_text_through_and_is_bit_exact(batch: int, backend: str) -> None:
    """FLUX's fixed-length contract on its blocks: every prompt is the pipeline's 512 tokens."""
    dit, runner = eager_and_runner(LONGCAT_IMAGE, backend=backend)
    inputs = tiny_dit_inputs(LONGCAT_IMAGE, batch, 12)
    expected = dit(**inputs)
    runner.install()
    padded = runner.padder.pad(inputs, batch, None)
    assert padded.call["encoder_hidden_states"] is inputs["encoder_hidden_states"] and padded.span is None
    assert same(dit(**inputs), expected) and same(dit(**inputs), expected)


# -- batch buckets ------------------------------------------------------------------------------------------


@BACKENDS
@pytest.mark.parametrize("name", [QWEN_IMAGE, Z_IMAGE, FLUX])
def test_a_batch_padded_to_its_bucket_keeps_its_rows(name: str, backend: str) -> None:
    dit, runner = eager_and_runner(name, backend=backend)
    inputs = tiny_dit_inputs(name, 3, 7, ragged=True)
    expected = dit(**inputs)
    runner.install()
    out = dit(**inputs)
    assert [r for r in runner.graphs.values() if r.description.startswith("batch bucket 4 (3 rows)")]
    for got, want in zip(out, expected, strict=True):  # 3 rows back, each within fp32 rounding
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_rows_over_the_largest_batch_bucket_run_eager() -> None:
    dit, runner = eager_and_runner(FLUX, Buckets(batch=(1, 2), tokens=(8,)))
    inputs = tiny_dit_inputs(FLUX, 3, 7)
    expected = dit(**inputs)
    runner.install()
    assert same(dit(**inputs), expected) and runner.summary()["fallback"] == 1


# -- capture policy, fallbacks and checks -------------------------------------------------------------------


def test_after_the_warm_up_an_unseen_shape_is_missed_once_and_runs_eager(caplog) -> None:
    dit, runner = eager_and_runner(QWEN_IMAGE, capture_all_buckets=False)
    runner.install()
    dit(**tiny_dit_inputs(QWEN_IMAGE, 1, 7))  # the warm-up: captures batch 1, token bucket 8
    runner.capture_enabled = False
    caplog.set_level(logging.INFO, logger=LOGGER)
    caplog.clear()  # what an earlier test's logging set-up let through (the warm-up's lines) is not this test's
    inputs = tiny_dit_inputs(QWEN_IMAGE, 1, 12)
    runner.uninstall()
    expected = dit(**inputs)
    runner.install()
    for _ in range(2):
        assert same(dit(**inputs), expected)
    assert [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)] == [
        "[BCG] transformer: MISSED batch bucket 1 (1 row), token bucket 16 (12 tokens) (not captured at warm-up): eager"
    ]
    assert runner.summary() == {
        "captured": 1, "replayed": 1, "missed": 2, "fallback": 0, "eager": 0, "capture_failed": 0,
    }  # fmt: skip


def test_warm_up_captures_every_larger_bucket_of_a_shape() -> None:
    dit, runner = eager_and_runner(QWEN_IMAGE)
    runner.install()
    dit(**tiny_dit_inputs(QWEN_IMAGE, 2, 7))
    described = sorted(r.description for r in runner.graphs.values())
    assert described == sorted(
        f"batch bucket {b} (2 rows), token bucket {t} (7 tokens)" for b in (2, 4) for t in (8, 16, 64)
    )


def test_step_caches_and_lora_rows_run_eager_with_one_log_line_each(caplog) -> None:
    dit, runner = eager_and_runner(FLUX)
    runner.install()
    caplog.set_level(logging.INFO, logger=LOGGER)
    caplog.clear()  # what an earlier test's logging set-up let through (the warm-up's lines) is not this test's
    inputs = tiny_dit_inputs(FLUX, 1, 7)
    with lora_rows_scope(LoraRows.uniform([AppliedLora(0, "ink", 1.0)])):
        runner.forward(**inputs)
        runner.forward(**inputs)
    sentinel = object()
    calls = []
    runner.original_forward = lambda **call: calls.append(call["step_cache"]) or torch.zeros(1)
    runner.forward(**inputs, step_cache=sentinel)
    assert calls == [sentinel]
    lines = [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]
    assert lines == [
        "[BCG] transformer: eager (per-request LoRA adapters (their row map is read on the host))",
        "[BCG] transformer: eager (an approximate quality tier's step cache reuses block outputs between steps)",
    ]
    assert runner.summary()["eager"] == 3 and not runner.graphs


def test_a_replay_that_leaves_its_capture_is_an_error(monkeypatch) -> None:
    dit, runner = eager_and_runner(QWEN_IMAGE, capture_all_buckets=False)
    runner.install()
    inputs = tiny_dit_inputs(QWEN_IMAGE, 1, 7)
    dit(**inputs)

    def run_all_with_text(x, ctx, temb, rope, mask, cond, controls=None):  # noqa: ANN001, ANN202
        for block in dit.transformer_blocks:  # the last block too computes its text output
            ctx, x = block(x, ctx, temb, rope, mask, cond, text_out=True)
        return x

    monkeypatch.setattr(dit, "_run_blocks", run_all_with_text)
    with pytest.raises(CaptureMismatchError, match="block call 1, argument .*: True was False at capture"):
        dit(**inputs)


def test_dry_run_records_what_a_cuda_capture_would_hold() -> None:
    dit, runner = eager_and_runner(QWEN_IMAGE, capture_all_buckets=False)
    runner.install()
    dit(**tiny_dit_inputs(QWEN_IMAGE, 1, 7))
    [record] = runner.graphs.values()
    # Two double-stream blocks, each broken at its joint attention: two segments and one break apiece.
    assert len(record.blocks) == 2 and record.breaks == 2 and record.segments == 4
    assert runner.backend.graphs == 4
    first, second = record.blocks
    x_out = first.outputs[1]
    assert second.statics[0] is x_out  # block 1 reads block 0's static output: no copy between blocks
    assert second.outputs[0] is None and second.outputs[1] is x_out  # outputs share one buffer per position
    assert first.breaks[0].mask is not None  # batch 1, and the mask is kept


def test_install_and_uninstall_leave_the_module_as_it_was() -> None:
    dit, runner = eager_and_runner(FLUX)
    names = [name for name, _ in dit.named_parameters()]
    runner.install()
    assert [name for name, _ in dit.named_parameters()] == names and "forward" in vars(dit)
    runner.uninstall()
    assert "forward" not in vars(dit) and not any("forward" in vars(b) for b in runner.blocks)


def test_the_padder_table_names_dits_only() -> None:
    assert set(PROMPT_PADDERS) == {QWEN_IMAGE, Z_IMAGE, FLUX, LONGCAT_IMAGE}
    assert {p.contract for p in PROMPT_PADDERS.values()} == {"masked text", "native length", "fixed length"}


@pytest.mark.parametrize("name", [QWEN_IMAGE, Z_IMAGE, FLUX])
def test_replays_of_one_capture_with_new_inputs_follow_the_inputs(name: str) -> None:
    """Graph semantics: each replay of a captured call reads the new call's values from the static
    buffers (a runner that kept the first call's inputs would repeat its output)."""
    dit, runner = eager_and_runner(name, backend="emulated", capture_all_buckets=False)
    calls = [tiny_dit_inputs(name, 2, 7, ragged=True, seed=seed) for seed in range(3)]
    expected = [dit(**call) for call in calls]
    runner.install()
    for call, want in zip(calls, expected, strict=True):
        assert same(dit(**call), want)
    assert runner.summary()["captured"] == 1 and runner.summary()["replayed"] == 3
    assert runner.backend.replays > 0


def test_the_emulated_backend_replays_like_a_graph() -> None:
    """The emulation itself: a replay recomputes from what the recorded tensors hold now, in-place
    writes and views included."""
    backend = EmulatedGraphBackend()
    x = torch.tensor([1.0, 2.0])
    out = torch.zeros(2)
    backend.begin_segment()
    y = x * 2 + 1
    out.copy_(y)
    view = out[1:]
    view.mul_(10)
    segment = backend.end_segment()
    assert out.tolist() == [3.0, 50.0]
    x.copy_(torch.tensor([0.0, 1.0]))
    backend.replay(segment)
    assert out.tolist() == [1.0, 30.0] and y.tolist() == [1.0, 3.0]
