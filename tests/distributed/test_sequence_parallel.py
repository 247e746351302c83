"""Sequence-parallel attention (Ulysses, Ring, USP) on gloo ranks equals full-sequence SDPA.

Each world size is spawned once (module fixture) and runs every case; a case builds the same random
inputs on every rank, computes the full-sequence reference with SDPA, shards the inputs, runs the
sequence-parallel function, gathers the output and returns the max abs error against the reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from diffserve.distributed import sequence_parallel
from diffserve.distributed.sequence_parallel import (
    SequenceShard,
    as_key_mask,
    joint_key_valid,
    ring_attention,
    ulysses_attention,
    usp_attention,
)
from diffserve.testing import distributed as harness
from diffserve.testing.distributed import (
    CaseResult,
    DistributedRunError,
    MeshRuns,
    case_results,
    run_distributed,
)

#: fp32 tolerance against full SDPA; Ulysses runs the same kernel on the same numbers (key order
#: aside), Ring re-associates the softmax sums.
TOL = 1e-5

Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _inputs(
    batch: int, seq: int, heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(3))  # type: ignore[return-value]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    attn_mask = None if mask is None else mask[:, None, None, :]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask).transpose(1, 2)


def _text_mask(batch: int, seq: int, seed: int) -> torch.Tensor:
    """A per-sample key mask that keeps at least the first key of every sample."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, seq, generator=gen) > 0.4
    mask[:, 0] = True
    return mask


def _single_stream(attn: Attn, group: dist.ProcessGroup, *, seq: int, heads: int, masked: bool) -> float:
    """One sharded sequence (padded when `seq` does not divide the degree), optional per-key mask."""
    batch, dim = 2, 8
    q, k, v = _inputs(batch, seq, heads, dim, seed=seq * 31 + heads)
    mask = _text_mask(batch, seq, seed=seq) if masked else None
    shard = SequenceShard.for_group(seq, group)
    key_valid = shard.key_valid(batch, q.device, mask)
    out = attn(shard.split(q), shard.split(k), shard.split(v), key_valid)
    return (shard.gather(out, group) - _reference(q, k, v, mask)).abs().max().item()


def _joint_stream(attn: Attn, group: dist.ProcessGroup, *, text: int, image: int, heads: int) -> float:
    """[text | image], each stream sharded on its own, the text with a per-key padding mask."""
    batch, dim = 2, 8
    q, k, v = _inputs(batch, text + image, heads, dim, seed=text * 7 + image)
    text_mask = _text_mask(batch, text, seed=text)
    full_mask = torch.cat([text_mask, torch.ones(batch, image, dtype=torch.bool)], dim=1)
    txt, img = SequenceShard.for_group(text, group), SequenceShard.for_group(image, group)

    def local(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([txt.split(x[:, :text]), img.split(x[:, text:])], dim=1)

    key_valid = joint_key_valid([(txt, text_mask), (img, None)], batch, q.device)
    out = attn(local(q), local(k), local(v), key_valid)
    gathered = torch.cat(
        [txt.gather(out[:, : txt.shard_len], group), img.gather(out[:, txt.shard_len :], group)], dim=1
    )
    return (gathered - _reference(q, k, v, full_mask)).abs().max().item()


def _bf16_ring(group: dist.ProcessGroup) -> float:
    """bf16 inputs: computed in fp32 inside, returned as bf16; compared with fp32 SDPA."""
    q, k, v = _inputs(1, 24, 2, 16, seed=5)
    shard = SequenceShard.for_group(24, group)
    local = [shard.split(x.bfloat16()) for x in (q, k, v)]
    out = ring_attention(*local, group)
    ref = _reference(*(x.bfloat16().float() for x in (q, k, v)), None)
    return (shard.gather(out, group).float() - ref).abs().max().item()


def _chunked_ring(group: dist.ProcessGroup) -> float:
    """A score budget of a few rows, so each block is computed in several query chunks."""
    saved = sequence_parallel.RING_SCORE_BUDGET_BYTES
    sequence_parallel.RING_SCORE_BUDGET_BYTES = 2 * 4 * 4 * 19 * 3  # b * h * fp32 * sk * 3 rows
    try:
        return _single_stream(_ring(group), group, seq=37, heads=4, masked=True)
    finally:
        sequence_parallel.RING_SCORE_BUDGET_BYTES = saved


def _rejects_bad_key_valid(group: dist.ProcessGroup) -> str:
    q = torch.zeros(1, 4, 2, 8)
    try:
        ulysses_attention(q, q, q, group, key_valid=torch.ones(1, 5, dtype=torch.bool))
    except ValueError as error:
        return str(error)
    return "no error"


def _ulysses(group: dist.ProcessGroup) -> Attn:
    return lambda q, k, v, valid: ulysses_attention(q, k, v, group, valid)


def _ring(group: dist.ProcessGroup) -> Attn:
    return lambda q, k, v, valid: ring_attention(q, k, v, group, valid)


def _usp(ulysses_group: dist.ProcessGroup, ring_group: dist.ProcessGroup) -> Attn:
    return lambda q, k, v, valid: usp_attention(q, k, v, ulysses_group, ring_group, valid)


def _common_cases(name: str, attn: Attn, group: dist.ProcessGroup, heads: int) -> dict[str, float]:
    return {
        f"{name}/divisible": _single_stream(attn, group, seq=48, heads=heads, masked=False),
        f"{name}/seq37": _single_stream(attn, group, seq=37, heads=heads, masked=False),
        f"{name}/seq37_masked": _single_stream(attn, group, seq=37, heads=heads, masked=True),
        f"{name}/joint": _joint_stream(attn, group, text=7, image=37, heads=heads),
    }


def _cases_world2(rank: int, world_size: int) -> dict[str, object]:
    world = dist.group.WORLD
    results: dict[str, object] = {}
    results.update(_common_cases("ulysses2", _ulysses(world), world, heads=4))
    results.update(_common_cases("ring2", _ring(world), world, heads=4))
    results["ulysses2/heads3_padded"] = _single_stream(_ulysses(world), world, seq=37, heads=3, masked=True)
    results["ring2/heads3"] = _single_stream(_ring(world), world, seq=37, heads=3, masked=True)
    results["ring2/seq37_chunked"] = _chunked_ring(world)
    results["bf16/ring2"] = _bf16_ring(world)
    results["bad_key_valid"] = _rejects_bad_key_valid(world)
    return results


def _grid(rank: int, rows: list[list[int]]) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(row group, column group) of `rank` in a grid of ranks; every rank creates every group."""
    row_groups = [dist.new_group(row) for row in rows]
    col_groups = [dist.new_group(list(col)) for col in zip(*rows, strict=True)]
    row = next(i for i, r in enumerate(rows) if rank in r)
    col = rows[row].index(rank)
    return row_groups[row], col_groups[col]


def _cases_world4(rank: int, world_size: int) -> dict[str, object]:
    world = dist.group.WORLD
    results: dict[str, object] = {}
    results.update(_common_cases("ulysses4", _ulysses(world), world, heads=8))
    results.update(_common_cases("ring4", _ring(world), world, heads=2))
    results["ulysses4/heads6_padded"] = _single_stream(_ulysses(world), world, seq=37, heads=6, masked=True)
    # 5 tokens on 4 ranks: shards of 2, the last one all padding (a key block with no valid key).
    results["ring4/seq5"] = _single_stream(_ring(world), world, seq=5, heads=2, masked=True)
    results["ulysses4/seq5"] = _single_stream(_ulysses(world), world, seq=5, heads=4, masked=True)
    # USP 2x2: Ulysses within rows, Ring within columns; then the transposed grid.
    ulysses_group, ring_group = _grid(rank, [[0, 1], [2, 3]])
    results.update(_common_cases("usp2x2", _usp(ulysses_group, ring_group), world, heads=4))
    ulysses_t, ring_t = _grid(rank, [[0, 2], [1, 3]])
    results["usp2x2_transposed/seq37_masked"] = _single_stream(
        _usp(ulysses_t, ring_t), world, seq=37, heads=4, masked=True
    )
    results["usp2x2/heads3_padded"] = _single_stream(
        _usp(ulysses_group, ring_group), world, seq=37, heads=3, masked=True
    )
    return results


@pytest.fixture(scope="module")
def world2() -> list[dict[str, object]]:
    return run_distributed(_cases_world2, 2)


@pytest.fixture(scope="module")
def world4() -> list[dict[str, object]]:
    return run_distributed(_cases_world4, 4)


def _errors(results: list[dict[str, object]], prefix: str) -> dict[str, float]:
    """Max error over ranks for each case whose name starts with `prefix`."""
    names = [name for name in results[0] if name.startswith(prefix)]
    assert names, f"no case named {prefix}*"
    return {name: max(float(r[name]) for r in results) for name in names}  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["ulysses2", "ring2"])
def test_two_ranks_match_full_attention(world2: list[dict[str, object]], mode: str) -> None:
    errors = _errors(world2, mode + "/")
    print(f"{mode}: max abs error {errors}")
    assert set(errors) >= {f"{mode}/seq37", f"{mode}/seq37_masked", f"{mode}/joint"}
    assert all(error <= TOL for error in errors.values()), errors


@pytest.mark.parametrize("mode", ["ulysses4", "ring4", "usp2x2"])
def test_four_ranks_match_full_attention(world4: list[dict[str, object]], mode: str) -> None:
    errors = _errors(world4, mode)
    print(f"{mode}: max abs error {errors}")
    assert all(error <= TOL for error in errors.values()), errors


def test_heads_not_divisible_are_padded(
    world2: list[dict[str, object]], world4: list[dict[str, object]]
) -> None:
    errors = {**_errors(world2, "ulysses2/heads3"), **_errors(world4, "ulysses4/heads6")}
    errors.update(_errors(world4, "usp2x2/heads3"))
    assert all(error <= TOL for error in errors.values()), errors


def test_bf16_ring_is_close(world2: list[dict[str, object]]) -> None:
    error = _errors(world2, "bf16/ring2")["bf16/ring2"]
    assert error <= 2e-2, error  # one bf16 rounding of an O(1) output


def test_bad_key_valid_is_rejected(world2: list[dict[str, object]]) -> None:
    messages = {str(r["bad_key_valid"]) for r in world2}
    assert all("key_valid" in m and "(1, 4)" in m for m in messages), messages


# ------------------------------------------------------------------------------ in-process helpers


def test_split_pads_the_last_shards_and_key_valid_marks_them() -> None:
    x = torch.arange(5).reshape(1, 5, 1)
    shards = [SequenceShard(5, 4, i) for i in range(4)]
    assert [s.split(x).flatten().tolist() for s in shards] == [[0, 1], [2, 3], [4, 0], [0, 0]]
    assert [s.valid_len for s in shards] == [2, 2, 1, 0]
    valid = [s.key_valid(1, x.device) for s in shards]
    assert [v.flatten().tolist() for v in valid if v is not None] == [
        [True, True],
        [True, True],
        [True, False],
        [False, False],
    ]


def test_key_valid_is_none_without_padding_or_mask() -> None:
    shard = SequenceShard(8, 4, 1)
    assert shard.key_valid(2, torch.device("cpu")) is None
    mask = torch.tensor([[True] * 7 + [False]] * 2)
    last = SequenceShard(8, 4, 3).key_valid(2, torch.device("cpu"), mask[:, None, None, :])
    assert last is not None and last.tolist() == [[True, False]] * 2


def test_bad_shapes_are_rejected_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="expected 6 tokens"):
        SequenceShard(6, 2, 0).split(torch.zeros(1, 5, 3))
    with pytest.raises(ValueError, match="shard index"):
        SequenceShard(6, 2, 2)
    with pytest.raises(ValueError, match=r"key mask must have shape \(2, 6\)"):
        as_key_mask(torch.ones(2, 1, 6, 6, dtype=torch.bool), 2, 6)
    with pytest.raises(ValueError, match="must be bool"):
        as_key_mask(torch.ones(2, 6), 2, 6)


def _raises_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one failed on purpose")
    dist.barrier()  # rank 0 blocks here until the harness stops it
    return rank


def test_harness_reports_a_rank_error_with_its_traceback() -> None:
    with pytest.raises(DistributedRunError, match="rank 1 raised") as caught:
        run_distributed(_raises_on_rank_one, 2, timeout_s=60)
    assert "rank one failed on purpose" in str(caught.value)
    assert "_raises_on_rank_one" in str(caught.value)


def _exits_on_rank_one(rank: int, world_size: int) -> int:
    # Both ranks finish connecting first: a rank 0 that returned at once could close its end while rank 1
    # (slower on a loaded machine) was still connecting, and rank 1 would then fail in gloo's set-up
    # instead of dying as the test means it to.
    dist.barrier()
    if rank == 1:
        os._exit(3)  # dies without reporting, as a killed rank would
    dist.barrier()  # rank 0 waits for the peer that died (the harness reports the death)
    return rank


def test_harness_reports_a_rank_that_died() -> None:
    with pytest.raises(DistributedRunError, match="rank 1 exited with code 3 without a result"):
        run_distributed(_exits_on_rank_one, 2, timeout_s=60)


def test_harness_reports_ranks_that_run_out_of_time() -> None:
    class Running:
        exitcode = None

    with pytest.raises(DistributedRunError, match=r"ranks \[1\] did not finish in time"):
        harness._check_alive([Running(), Running()], {0: ("ok", b"")}, deadline=0.0, seen_dead=set())


def test_shared_mesh_runs_fail_only_the_case_that_raised() -> None:
    """`MeshRuns` starts each mesh's run once; a case that raised on a rank fails its own lookups only, and
    a run that failed fails every case on its mesh."""

    def case(rank: int, name: str) -> int:
        if name == "bad" and rank == 1:
            raise ValueError("bad case on purpose")
        return rank

    started: list[str] = []

    def start(mesh: str) -> list[dict[str, CaseResult]]:
        started.append(mesh)
        if mesh == "broken":
            raise DistributedRunError("rank 0 exited with code 3 without a result")
        return [case_results(lambda name, rank=rank: case(rank, name), ["good", "bad"]) for rank in range(2)]

    runs = MeshRuns(start)
    assert runs("good", "mesh") == [0, 1]
    with pytest.raises(DistributedRunError, match="rank 1 raised:") as caught:
        runs("bad", "mesh")
    assert "bad case on purpose" in str(caught.value) and "rank 0 raised" not in str(caught.value)
    for name in ("good", "bad"):
        with pytest.raises(DistributedRunError, match="exited with code 3"):
            runs(name, "broken")
    assert started == ["mesh", "broken"]
