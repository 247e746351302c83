"""Issue 31 items 14, 15, 16 and 20: LoRA adapters against hostile files and admin ops, in process (a tiny
FLUX `DiffGenerator` with a --lora-dir, and the engine process's side of the admin routes, `EngineLoras`).

- 14: a file is read off the denoising loop (a generation finishes while a load's read is stuck, and while
  another request's --lora-dir adapter is read), a bad file is refused at once when named again
  (remembered by path, size and mtime; read again once it changes), and a header declaring a huge
  number of tensors is refused naming the limit;
- 15: --max-loras caps the adapters known (409 `too_many_loras`), empty adapters are refused, and a
  restarted engine's replayed loads are lazy (nothing read until a request names the adapter);
- 16: a queued request holds the adapters it names: unloading one answers 409 until it ends, and its
  name cannot be taken over by another file meanwhile;
- 20: hostile admin loads (a NUL byte, a 5,000-character name, a 3,000-level path, a header nested
  100,000 deep, a name ending in a newline, NaN, int64 and rank-0 files) are 400s, never 500s; the LoRA
  memory being full is a 503 with Retry-After for a load, and a wait in the queue for a request.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diffserve import DiffGenerator, SamplingParams
from diffserve.configs.sampling_params import LoraChoice
from diffserve.errors import InvalidRequestError, LoraError
from diffserve.layers.lora_rows import AppliedLora
from diffserve.request import Req
from diffserve.runtime import lora_registry
from diffserve.server import protocol as msg
from diffserve.server.engine_loras import EngineLoras
from diffserve.server.errors import as_api_error
from diffserve.server.lora_client import LoraOpError, LoraOps
from diffserve.testing.tiny_lora import dit_linears, write_random_lora

BASE = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 3.5, "seed": 7}
ANSWER_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def lora_dir(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hardening-loras")
    write_random_lora(tiny_flux_dir, directory / "style.safetensors", rank=2, seed=1, std=0.08)
    write_random_lora(tiny_flux_dir, directory / "other.safetensors", rank=2, seed=2, std=0.08)
    return directory


@pytest.fixture(scope="module")
def gen(tiny_flux_dir: Path, lora_dir: Path) -> Iterator[DiffGenerator]:
    generator = DiffGenerator.from_pretrained(
        tiny_flux_dir, device="cpu", show_progress=False, lora_dir=lora_dir, max_loras=8
    )
    yield generator
    generator.close()


class Answers:
    """The engine process's channel to the front end: what `EngineLoras` answers, by op id."""

    def __init__(self) -> None:
        self.got: dict[str, msg.LoraOpDone | msg.LoraOpFailed] = {}
        self.arrived = threading.Condition()

    def send(self, message: msg.LoraOpDone | msg.LoraOpFailed) -> None:
        with self.arrived:
            self.got[message.op_id] = message
            self.arrived.notify_all()

    def wait(self, op_id: str, timeout: float = ANSWER_TIMEOUT_S) -> msg.LoraOpDone | msg.LoraOpFailed:
        with self.arrived:
            assert self.arrived.wait_for(lambda: op_id in self.got, timeout), f"no answer to {op_id}"
            return self.got[op_id]


@pytest.fixture
def admin(gen: DiffGenerator) -> Iterator[tuple[EngineLoras, Answers]]:
    answers = Answers()
    loras = EngineLoras(gen.engine, answers)
    yield loras, answers
    loras.close()


_ops = iter(range(1_000_000))


def run_op(admin: tuple[EngineLoras, Answers], op_type: type, **fields) -> msg.LoraOpDone | msg.LoraOpFailed:
    loras, answers = admin
    op = op_type(op_id=f"op{next(_ops)}", **fields)
    loras.handle(op)
    return answers.wait(op.op_id)


def load(admin, name: str, path: str, **fields) -> msg.LoraOpDone | msg.LoraOpFailed:
    return run_op(admin, msg.LoadLora, name=name, path=path, **fields)


def unload(admin, name: str) -> msg.LoraOpDone | msg.LoraOpFailed:
    return run_op(admin, msg.UnloadLora, name=name)


def refused(answer: msg.LoraOpDone | msg.LoraOpFailed, status: int, *words: str) -> msg.LoraOpFailed:
    assert isinstance(answer, msg.LoraOpFailed), answer
    assert answer.status == status, answer
    for word in words:
        assert word in answer.message, answer.message
    return answer


def target(tiny_flux_dir: Path) -> tuple[str, int, int]:
    """One Linear a LoRA may target: its Diffusers path, out and in features."""
    name, (out_features, in_features) = next(
        (n, shape) for n, shape in dit_linears(tiny_flux_dir).items() if "transformer_blocks.0.attn.to_q" in n
    )
    return name, out_features, in_features


def write_pair(tiny_flux_dir: Path, path: Path, rank: int = 2, dtype=torch.float32, fill=None) -> Path:
    """A one-layer LoRA on a real target of the tiny FLUX (`fill`: a value put in its down factor)."""
    name, out_features, in_features = target(tiny_flux_dir)
    down = (torch.randn(rank, in_features) * 0.05).to(dtype)
    if fill is not None and rank:
        down[0, 0] = fill
    tensors = {
        f"transformer.{name}.lora_A.weight": down,
        f"transformer.{name}.lora_B.weight": (torch.randn(out_features, rank) * 0.05).to(dtype),
    }
    save_file(tensors, str(path))
    return path


def write_raw(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def many_tensors_header(count: int) -> bytes:
    """A header declaring `count` zero-size tensors (the issue's file: 1.4 million in 83 MB)."""
    entry = b'{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    return b"{" + b",".join(b'"t%d":%s' % (i, entry) for i in range(count)) + b"}"


def generate_in_thread(gen: DiffGenerator, **params) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(gen.generate("a red fox", **{**BASE, **params}))
        except Exception as exc:  # reported to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def stall_lora_file_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Every LoRA file read from now on sets `reading`, then waits for `release` (up to the answer timeout)
    before it reads: (reading, release)."""
    reading, release = threading.Event(), threading.Event()
    real_read = lora_registry.read_lora_file

    def slow_read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        reading.set()
        assert release.wait(ANSWER_TIMEOUT_S)
        return real_read(path)

    monkeypatch.setattr(lora_registry, "read_lora_file", slow_read)
    return reading, release


def assert_a_generation_finishes(gen: DiffGenerator, failure: str) -> None:
    """A plain generation, in a thread, ends with its output within the answer timeout; else the test fails
    with `failure` and what the thread left."""
    thread, outcome = generate_in_thread(gen)
    thread.join(ANSWER_TIMEOUT_S)
    assert outcome and not isinstance(outcome[0], Exception), f"{failure}: {outcome}"


def pin_one_adapter_in_a_full_lora_memory(
    gen: DiffGenerator, admin: tuple[EngineLoras, Answers]
) -> tuple[lora_registry.LoraRegistry, tuple[AppliedLora, ...], int]:
    """Load style.safetensors as "pinned", pin it as a running request does and cap the LoRA memory one
    byte above its size: (the registry, the pin to release, the budget to restore)."""
    registry = gen.engine.runner.loras
    assert isinstance(load(admin, "pinned", "style.safetensors"), msg.LoraOpDone)
    pinned = registry.acquire([LoraChoice("pinned")])  # as a running request pins it
    budget = registry.max_bytes
    registry.max_bytes = registry.infos()[registry.names().index("pinned")].num_bytes + 1
    return registry, pinned, budget


# -- item 14: reads off the denoising loop, remembered failures, capped headers ----------------------------


def test_a_load_reads_its_file_off_the_denoising_loop(gen, admin, monkeypatch) -> None:
    """While a load's file read is stuck, a generation still runs to the end (the old engine read files
    between two steps, so every request waited for the read: 46 s for the issue's file)."""
    reading, release = stall_lora_file_reads(monkeypatch)
    loras, answers = admin
    op = msg.LoadLora(op_id="slow-load", name="slow", path="style.safetensors")
    loras.handle(op)
    try:
        assert reading.wait(ANSWER_TIMEOUT_S)
        assert_a_generation_finishes(gen, "a generation did not finish while a LoRA file was being read")
        assert "slow-load" not in answers.got  # the load waits for its read, not the other way round
    finally:
        release.set()
    done = answers.wait("slow-load")
    assert isinstance(done, msg.LoraOpDone) and done.adapter is not None and done.adapter["resident"]
    assert isinstance(unload(admin, "slow"), msg.LoraOpDone)


def test_a_requests_adapter_is_read_off_the_denoising_loop(gen, lora_dir, tiny_flux_dir, monkeypatch) -> None:
    """A request naming a --lora-dir file not read yet waits for its read in the queue; the others run on
    meanwhile (the old engine read it when the request started, between two steps: everyone waited)."""
    write_pair(tiny_flux_dir, lora_dir / "ondemand.safetensors")
    reading, release = stall_lora_file_reads(monkeypatch)
    named, named_outcome = generate_in_thread(gen, loras=[{"name": "ondemand"}])
    try:
        assert reading.wait(ANSWER_TIMEOUT_S)
        assert_a_generation_finishes(
            gen, "a plain generation did not finish while another request's adapter was being read"
        )
        assert not named_outcome  # still waiting for its adapter
    finally:
        release.set()
    named.join(ANSWER_TIMEOUT_S)
    assert named_outcome and not isinstance(named_outcome[0], Exception), named_outcome
    assert {info.name: info.resident for info in gen.loras()}.get("ondemand") is True


def test_a_bad_file_is_remembered_and_refused_at_once_until_it_changes(
    gen, admin, lora_dir, tiny_flux_dir, monkeypatch
) -> None:
    reads: list[Path] = []
    real_read = lora_registry.read_lora_file

    def counted(path: Path):
        reads.append(Path(path))
        return real_read(path)

    monkeypatch.setattr(lora_registry, "read_lora_file", counted)
    bad = write_raw(lora_dir / "nested.safetensors", b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    refused(load(admin, "nested", "nested.safetensors"), 400, "nested too deeply")
    assert len(reads) == 1
    # Named again, by the admin route or by requests: refused with the same reason, the file not read again.
    refused(load(admin, "nested", "nested.safetensors"), 400, "nested too deeply", "failed to load before")
    for _ in range(3):
        start = time.perf_counter()
        with pytest.raises(InvalidRequestError, match="nested too deeply") as info:
            gen.generate("a red fox", **BASE, loras=[{"name": "nested"}])
        assert info.value.param == "loras" and time.perf_counter() - start < 5
    assert len(reads) == 1, f"the bad file was read {len(reads)} times"
    assert "nested" not in [info.name for info in gen.loras()]
    # Fixed in place (a new size and mtime): read again, and served.
    write_pair(tiny_flux_dir, bad)
    os.utime(bad, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert gen.generate("a red fox", **BASE, loras=[{"name": "nested"}]).images
    assert len(reads) == 2
    assert isinstance(unload(admin, "nested"), msg.LoraOpDone)


def test_a_header_declaring_too_many_tensors_is_refused_at_once(admin, lora_dir) -> None:
    write_raw(lora_dir / "many.safetensors", many_tensors_header(200_000))
    start = time.perf_counter()
    answer = refused(load(admin, "many", "many.safetensors"), 400, "200000 tensors", "MAX_LORA_TENSORS")
    assert time.perf_counter() - start < 5, "refusing a header by its tensor count must not parse it"
    assert answer.param == "path"
    huge = lora_dir / "huge.safetensors"
    with huge.open("wb") as f:  # a header over the size cap: refused without reading it
        f.write((32 * 2**20).to_bytes(8, "little"))
        f.truncate(8 + 32 * 2**20)
    refused(load(admin, "huge", "huge.safetensors"), 400, "MAX_LORA_HEADER_BYTES")


# -- item 15: the adapters' count, empty adapters, lazy restore -------------------------------------------


def test_the_adapter_count_is_capped(gen, admin, lora_dir, tiny_flux_dir) -> None:
    registry = gen.engine.runner.loras
    assert registry is not None and registry.max_count == 8  # --max-loras, from `max_loras=8`
    for name in registry.names():  # what earlier tests left
        unload(admin, name)
    names = [f"cap{i}" for i in range(8)]
    try:
        for name in names:
            assert isinstance(load(admin, name, "other.safetensors"), msg.LoraOpDone)
        answer = refused(load(admin, "one-more", "other.safetensors"), 409, "--max-loras 8")
        assert answer.code == "too_many_loras"
        # A request naming another file of --lora-dir is refused too (nothing idle to forget).
        write_pair(tiny_flux_dir, lora_dir / "extra.safetensors")
        with pytest.raises(InvalidRequestError, match="--max-loras 8"):
            gen.generate("a red fox", **BASE, loras=[{"name": "extra"}])
    finally:
        for name in names:
            unload(admin, name)
    assert "extra" not in registry.names()


def test_empty_adapters_are_refused(admin, lora_dir, tiny_flux_dir) -> None:
    write_pair(tiny_flux_dir, lora_dir / "rank0.safetensors", rank=0)
    refused(load(admin, "rank0", "rank0.safetensors"), 400, "rank-0")
    write_raw(lora_dir / "no-tensors.safetensors", b"{}")
    refused(load(admin, "none", "no-tensors.safetensors"), 400, "no tensors")


def test_a_replayed_load_is_lazy(gen, admin, monkeypatch) -> None:
    reads: list[Path] = []
    real_read = lora_registry.read_lora_file
    monkeypatch.setattr(lora_registry, "read_lora_file", lambda path: reads.append(path) or real_read(path))
    done = load(admin, "replayed", "style.safetensors", lazy=True)
    assert isinstance(done, msg.LoraOpDone) and done.adapter is not None
    assert not done.adapter["resident"] and reads == []  # known, not read
    assert gen.generate("a red fox", **BASE, loras=[{"name": "replayed"}]).images
    assert len(reads) == 1
    assert isinstance(unload(admin, "replayed"), msg.LoraOpDone)


def test_the_front_end_replays_loads_lazily() -> None:
    sent: list[object] = []
    ops = LoraOps("engine", sent.append)
    ops.record(msg.LoadLora("a", "style", "style.safetensors"))

    async def scenario() -> None:
        import asyncio

        task = asyncio.create_task(ops.restore(lambda: True))
        await asyncio.sleep(0)
        (op,) = sent
        assert isinstance(op, msg.LoadLora) and op.lazy and op.name == "style"
        ops.answer(msg.LoraOpDone(op.op_id, {"adapters": []}))
        await task

    import asyncio

    asyncio.run(scenario())


# -- item 16: queued requests hold their adapters --------------------------------------------------------


def test_a_queued_request_holds_its_adapters(gen, admin) -> None:
    assert isinstance(load(admin, "held", "style.safetensors"), msg.LoraOpDone)
    engine = gen.engine
    params = SamplingParams(prompt="a red fox", **BASE, loras=[LoraChoice("held"), LoraChoice("other")])
    sr = engine.enqueue(engine.prepare(Req(params=params)))  # nobody drives the loop: it stays queued
    try:
        error = refused(unload(admin, "held"), 409, "used by 1 request (0 running, 1 queued)")
        assert error.code == "lora_in_use"
        with pytest.raises(LoraError, match="used by 1 request"):
            engine.runner.loras.unload("held")
        # "other" (a file of --lora-dir) is bound to that file now: its name cannot be taken over.
        refused(load(admin, "other", "style.safetensors"), 409, "already loaded")
        cards = {info.name: info for info in gen.loras()}
        assert cards["held"].in_use == 1 and cards["held"].queued == 1
    finally:
        assert engine.cancel(sr.request_id) == "waiting"
    assert sr.state == "cancelled"
    assert isinstance(unload(admin, "held"), msg.LoraOpDone)
    assert "other" not in [info.name for info in gen.loras()]  # never read, nobody holds it: forgotten


def test_a_request_prepared_but_never_queued_holds_nothing(gen, admin) -> None:
    assert isinstance(load(admin, "kept", "style.safetensors"), msg.LoraOpDone)
    good = SamplingParams(prompt="a", **BASE, loras=[LoraChoice("kept")])
    bad = SamplingParams(prompt="b", **BASE, loras=[LoraChoice("nope")])
    with pytest.raises(InvalidRequestError, match="unknown LoRA 'nope'"):  # the first is never queued
        gen.generate_many([good, bad])
    assert isinstance(unload(admin, "kept"), msg.LoraOpDone)


# -- item 20: 400s, not 500s ------------------------------------------------------------------------------


def test_hostile_loads_are_400s(gen, admin, lora_dir, tiny_flux_dir) -> None:
    write_pair(tiny_flux_dir, lora_dir / "nan.safetensors", fill=float("nan"))
    write_pair(tiny_flux_dir, lora_dir / "inf.safetensors", fill=float("inf"))
    write_pair(tiny_flux_dir, lora_dir / "int64.safetensors", dtype=torch.int64)
    deep = "/".join(["d"] * 3000) + "/x.safetensors"
    cases = [
        ({"name": "x", "path": "style\x00.safetensors"}, "path", "NUL byte"),
        ({"name": "x" * 5000, "path": "style.safetensors"}, "name", "not valid"),
        ({"name": "a\n", "path": "style.safetensors"}, "name", "not valid"),
        ({"name": "x", "path": deep}, "path", ""),
        ({"name": "x", "path": "x" * 5000 + ".safetensors"}, "path", ""),
        ({"name": "x", "path": "nan.safetensors"}, "path", "NaN or infinite"),
        ({"name": "x", "path": "inf.safetensors"}, "path", "NaN or infinite"),
        ({"name": "x", "path": "int64.safetensors"}, "path", "dtype I64"),
    ]
    for fields, param, words in cases:
        answer = refused(load(admin, **fields), 400, words)
        assert answer.param == param, (fields["path"][:40], answer)
    assert "x" not in [info.name for info in gen.loras()]
    assert gen.generate("a red fox", **BASE).images  # the engine serves on


def test_an_integer_alpha_scalar_is_accepted(admin, lora_dir, tiny_flux_dir) -> None:
    """Some trainers store `alpha` as an integer scalar: the one non-float tensor a LoRA file may hold."""
    name, out_features, in_features = target(tiny_flux_dir)
    tensors = {
        f"transformer.{name}.lora_down.weight": torch.randn(2, in_features) * 0.05,
        f"transformer.{name}.lora_up.weight": torch.randn(out_features, 2) * 0.05,
        f"transformer.{name}.alpha": torch.tensor(2, dtype=torch.int64),
    }
    save_file(tensors, str(lora_dir / "int-alpha.safetensors"))
    answer = load(admin, "int-alpha", "int-alpha.safetensors")
    assert isinstance(answer, msg.LoraOpDone), answer
    assert isinstance(unload(admin, "int-alpha"), msg.LoraOpDone)


def test_names_are_matched_whole() -> None:
    for name in ("a\n", "a\nb", "\na", "a" * 129, "..", "a..b", "-a", ""):
        with pytest.raises(LoraError, match="not valid"):
            lora_registry.check_name(name)
    assert lora_registry.check_name("a.b_c-1") == "a.b_c-1"


def test_lora_memory_full_is_a_503_with_retry_after(gen, admin) -> None:
    registry, pinned, budget = pin_one_adapter_in_a_full_lora_memory(gen, admin)
    try:
        answer = refused(load(admin, "late", "other.safetensors"), 503, "retry when they finish")
        assert answer.code == "lora_memory_full"
        error = as_api_error(LoraOpError(answer.message, answer.status, answer.param, answer.code))
        assert error.status == 503 and error.headers == {"Retry-After": "5"}
    finally:
        registry.max_bytes = budget
        registry.release(pinned)
    assert "late" not in registry.names()
    assert isinstance(unload(admin, "pinned"), msg.LoraOpDone)


def test_a_request_waits_while_pinned_adapters_fill_the_lora_memory(gen, admin) -> None:
    """A request whose adapter does not fit beside the ones running requests pin waits in the queue and
    runs once they are released (it failed with a 400 "retry later" before)."""
    registry, pinned, budget = pin_one_adapter_in_a_full_lora_memory(gen, admin)
    try:
        thread, outcome = generate_in_thread(gen, loras=[{"name": "other"}])
        time.sleep(1.0)
        assert not outcome, f"the request should wait for room, not end: {outcome}"
    finally:
        registry.release(pinned)
    thread.join(ANSWER_TIMEOUT_S)
    registry.max_bytes = budget
    assert outcome and not isinstance(outcome[0], Exception), outcome
    assert isinstance(unload(admin, "pinned"), msg.LoraOpDone)


def test_loaded_adapters_are_not_maps_of_their_files(gen, admin, lora_dir, tiny_flux_dir) -> None:
    """Rewriting a loaded adapter's file changes nothing loaded, and no map of it stays open (the issue's
    5,000 loads left 5,015 maps)."""
    path = write_pair(tiny_flux_dir, lora_dir / "mapped.safetensors")
    assert isinstance(load(admin, "mapped", "mapped.safetensors"), msg.LoraOpDone)
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    assert isinstance(unload(admin, "mapped"), msg.LoraOpDone)


def test_the_registry_summary_is_json(gen) -> None:
    assert json.dumps([info.to_dict() for info in gen.loras()])
