"""Per-request log lines of the serving engine (issue 17, item 16) and client text kept out of logs and files
(item 18): the engine process driven in-process with the fake generator, its log captured with caplog."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from PIL import Image

from diffserve.configs.engine_args import EngineArgs
from diffserve.configs.sampling_params import MAX_PROMPT_CHARS, SamplingParams
from diffserve.logging_setup import shown_text
from diffserve.outputs.images import MAX_METADATA_TEXT_CHARS, bounded_metadata
from diffserve.runtime.engine import RequestLog
from diffserve.server import protocol as msg
from diffserve.testing.fake_pipeline import FAILING_PROMPT, FakeGenerator

#: A prompt the engine accepts (under MAX_PROMPT_CHARS) but no log line or file may hold whole.
LONG_PROMPT = "a lighthouse on a cliff at dusk, " * 270  # 8,910 characters
assert 2 * MAX_METADATA_TEXT_CHARS < len(LONG_PROMPT) < MAX_PROMPT_CHARS


def make_engine(tmp_path, interval: float = 3600.0, generator: FakeGenerator | None = None):
    from diffserve.server.engine_process import EngineProcess, EngineProcessConfig

    channel = SimpleNamespace(sent=[])
    channel.send = channel.sent.append
    args = EngineArgs(model_path="/fake/model", output_path=str(tmp_path))
    config = EngineProcessConfig(args, "", "", 1, progress_log_interval=interval)
    return EngineProcess(config, channel, generator=generator or FakeGenerator())


@pytest.fixture
def engine(tmp_path) -> Iterator:
    engine = make_engine(tmp_path)
    yield engine
    engine.encoder.shutdown(wait=True)


@pytest.fixture
def log(caplog) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="diffserve")
    return caplog


def submit(engine, rid: str, prompt: str = "a red fox", **params) -> None:
    engine._handle(msg.GenerateJob(rid, SamplingParams(prompt, **params)))


def lines(caplog, rid: str, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"Request {rid} {word}")]


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Progress: ")]


def test_start_line_has_the_id_resolved_parameters_and_a_shortened_escaped_prompt(engine, log) -> None:
    prompt = 'line one\nline two "quoted" ' + LONG_PROMPT
    submit(engine, "req-start", prompt, seed=7, guidance_scale=3.5)
    engine.run_until_idle()
    (line,) = lines(log, "req-start", "started")
    # Resolved: 32x32 and 3 steps are the fake family's defaults, n=1 and the seed as sent.
    for part in ("32x32", "3 steps", "guidance 3.5", "seed 7", "quality", "n=1", "(queued "):
        assert part in line, (part, line)
    assert '"line one\\x0aline two \\"quoted\\" a lighthouse' in line
    assert f"…({len(prompt)} chars)" in line
    assert "\n" not in line and len(line) < 400


def test_progress_lines_report_steps_and_seconds_per_step(tmp_path, log) -> None:
    generator = FakeGenerator()
    generator.pipeline.on_step = lambda req: time.sleep(0.002)  # each step takes longer than the interval
    engine = make_engine(tmp_path, interval=1e-4, generator=generator)
    submit(engine, "req-slow", num_inference_steps=10)
    engine.run_until_idle()
    found = progress_lines(log)
    assert found, "no progress line"
    assert all("req-slow step " in line and "/10, " in line and " s/step, ~" in line for line in found), found
    assert len(found) <= 10


def test_a_fast_request_logs_no_progress_line(engine, log) -> None:
    submit(engine, "req-fast", num_inference_steps=20)
    engine.run_until_idle()
    assert progress_lines(log) == []
    assert lines(log, "req-fast", "started") and lines(log, "req-fast", "completed")


class StepClock:
    """A clock that advances one second per reading: progress timing without wall-clock waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_running_requests_share_one_progress_line_per_interval(engine, log) -> None:
    from diffserve.server.engine_process import _is_client_job

    engine.engine.request_log = RequestLog(5.0, include=_is_client_job, clock=StepClock())
    ids = ["req-a", "req-b", "req-c"]
    for rid in ids:  # one batch: they share every DiT step
        submit(engine, rid, num_inference_steps=30)
    engine.run_until_idle()
    found = progress_lines(log)
    assert 2 <= len(found) <= 30 // 5 + 1, found  # about one line per 5 clock seconds, not 3 per step
    # Each line lists every request denoising for 5 clock seconds, once (the first may precede the others').
    assert all(all(line.count(f"{rid} step ") <= 1 for rid in ids) for line in found), found
    assert sum(all(f"{rid} step " in line for rid in ids) for line in found) >= len(found) - 1, found


def test_finish_line_has_status_and_timings(engine, log, monkeypatch) -> None:
    monkeypatch.setattr(engine.engine.runner, "peak_memory_bytes", lambda: 3 * 2**20)
    submit(engine, "req-done", num_inference_steps=4)
    engine.run_until_idle()
    (line,) = lines(log, "req-done", "completed in ")
    for part in ("queued ", "prepare ", "denoise ", "(4/4 steps, ", " s/step", "decode ", "output "):
        assert part in line, (part, line)
    assert "peak memory 3 MiB" in line and line.endswith("1 image(s)")
    assert any(isinstance(m, msg.JobFinished) for m in engine.channel.sent)


def test_finish_line_of_a_cancelled_and_a_failed_request(engine, log) -> None:
    def cancel_at_step_two(req) -> None:
        if req.step_index == 2:
            engine.engine.cancel("req-cancel")

    engine.generator.pipeline.on_step = cancel_at_step_two
    submit(engine, "req-cancel", num_inference_steps=10)
    engine.run_until_idle()
    (line,) = lines(log, "req-cancel", "cancelled at step 2 in ")  # the words the server tests wait for
    assert "(2/10 steps" in line and "decode" not in line
    submit(engine, "req-fail", FAILING_PROMPT)
    engine.run_until_idle()
    (line,) = lines(log, "req-fail", "failed (RuntimeError) in ")
    assert "queued " in line and "denoise" not in line


def test_a_cancelled_waiting_request_gets_a_finish_line(engine, log) -> None:
    submit(engine, "req-waiting")
    engine._handle(msg.CancelJob("req-waiting"))
    (line,) = lines(log, "req-waiting", "cancelled while waiting in ")
    assert "queued " in line
    assert lines(log, "req-waiting", "started") == []
    assert engine.engine.request_log._tracked == {}


def test_health_probes_are_not_logged_per_request(engine, log) -> None:
    engine._handle(msg.GenerateJob("probe-1", SamplingParams("health check"), internal=True))
    engine.run_until_idle()
    assert not [r for r in log.records if r.getMessage().startswith("Request probe-1")]
    assert progress_lines(log) == []


def test_no_log_record_or_png_holds_a_long_prompt_whole(engine, log) -> None:
    huge = "x" * 100_000
    submit(engine, "req-huge", huge)
    assert any(isinstance(m, msg.JobRejected) and m.param == "prompt" for m in engine.channel.sent)
    engine._handle(msg.GenerateJob("req-long", SamplingParams(LONG_PROMPT, negative_prompt=LONG_PROMPT)))
    engine.run_until_idle()
    (finished,) = [m for m in engine.channel.sent if isinstance(m, msg.JobFinished)]
    text = Image.open(io.BytesIO(finished.images[0].data)).text["parameters"]
    metadata = json.loads(text)
    assert len(metadata["prompt"]) == MAX_METADATA_TEXT_CHARS and metadata["prompt"].endswith("…")
    assert metadata["prompt_chars"] == metadata["negative_prompt_chars"] == len(LONG_PROMPT)
    assert LONG_PROMPT.startswith(metadata["prompt"][:-1])
    assert finished.params.prompt == LONG_PROMPT  # the client's own answer keeps what it sent
    assert lines(log, "req-long", "started")
    for record in log.records:
        message = record.getMessage()
        assert huge not in message and LONG_PROMPT[:1000] not in message, message[:200]


def test_a_url_image_file_holds_a_bounded_prompt(engine, tmp_path) -> None:
    engine._handle(msg.GenerateJob("req-url", SamplingParams(LONG_PROMPT), response_format="url"))
    engine.run_until_idle()
    (path,) = tmp_path.rglob("req-url-0.png")
    metadata = json.loads(Image.open(path).text["parameters"])
    assert len(metadata["prompt"]) == MAX_METADATA_TEXT_CHARS and metadata["prompt_chars"] == len(LONG_PROMPT)


def test_bounded_metadata_keeps_short_prompts_and_is_idempotent() -> None:
    short = {"prompt": "a fox", "negative_prompt": None, "seed": 1}
    assert bounded_metadata(short) == short
    once = bounded_metadata({"prompt": "y" * 5000})
    assert once == {"prompt": "y" * (MAX_METADATA_TEXT_CHARS - 1) + "…", "prompt_chars": 5000}
    assert bounded_metadata(once) == once


def test_shown_text_escapes_and_shortens() -> None:
    assert shown_text("a fox") == '"a fox"'
    assert shown_text('tab\there "q" back\\slash\u2028') == '"tab\\x09here \\"q\\" back\\\\slash\\u2028"'
    assert shown_text("z" * 100, limit=10) == '"zzzzzzzzzz"…(100 chars)'


def test_request_log_refuses_a_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval"):
        RequestLog(0)


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_warnings() -> Iterator[Captured]:
    """transformers' warnings, whatever level an earlier `configure_logging` left its logger at."""
    transformers_logger = logging.getLogger("transformers")
    handler, level = Captured(), transformers_logger.level
    transformers_logger.setLevel(logging.WARNING)
    transformers_logger.addHandler(handler)
    yield handler
    transformers_logger.removeHandler(handler)
    transformers_logger.setLevel(level)


def indexing_errors(handler: Captured) -> list[str]:
    return [m for m in handler.messages if "indexing errors" in m]


def test_tokenize_truncates_a_long_prompt_without_an_indexing_errors_warning(
    transformers_warnings, caplog
) -> None:
    import torch

    from diffserve.stages.text_encoding import tokenize
    from diffserve.testing.tokenizers import build_clip_tokenizer

    build_clip_tokenizer()(["x" * 200])  # the capture works: an untruncated long text does warn
    assert indexing_errors(transformers_warnings), "transformers' warning was not captured"
    transformers_warnings.messages.clear()
    caplog.clear()  # the control call's warning reaches caplog too where transformers' logger propagates
    tokenizer = build_clip_tokenizer()  # a fresh one: transformers warns once per tokenizer
    with caplog.at_level(logging.WARNING, logger="diffserve"):
        ids = tokenize(tokenizer, ["x" * 200, "short"], 77, torch.device("cpu"))
        assert tokenize(tokenizer, ["x" * 75], 77, torch.device("cpu")).shape == (1, 77)  # 75 + 2: fits
    assert ids.shape == (2, 77)
    assert indexing_errors(transformers_warnings) == []
    assert [r.getMessage() for r in caplog.records] == ["prompt truncated to 77 tokens for CLIPTokenizer"]


def test_warm_up_on_a_tiny_model_logs_no_indexing_errors_warning(
    tiny_flux_dir, tmp_path, transformers_warnings
) -> None:
    from diffserve.api import DiffGenerator
    from diffserve.runtime.compile import WARMUP_KINDS, compile_warmup_size, warmup_params

    generator = DiffGenerator(EngineArgs(model_path=str(tiny_flux_dir), output_path=str(tmp_path)), False)
    facts = generator.pipeline.facts
    height, width = compile_warmup_size(facts.pixel_multiple)
    probes = [SamplingParams("warm-up", height=height, width=width, num_inference_steps=1)]  # the server's
    probes += [
        warmup_params(height, width, kind, facts.cfg_mode, False) for kind in WARMUP_KINDS
    ]  # --compile's
    for params in probes:
        params.num_inference_steps = 1
        generator.generate_from_params(params)
    assert indexing_errors(transformers_warnings) == []
