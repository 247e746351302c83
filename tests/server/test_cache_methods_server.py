"""Cache methods through a real `diffserve serve` (tiny FLUX, 3 blocks) with `--cache-default`: the request's
typed `cache` field (object or "method:key=value" text) wins over the default, "none" turns it off, the
response reports what ran, bad settings are 400s naming `cache`, /metrics counts the DiT blocks reused,
and the OpenAPI document lists every method's settings."""

from __future__ import annotations

import httpx
import pytest
from server_process import start_server

SIZE = "32x32"


@pytest.fixture(scope="module")
def cache_server(tiny_flux_dir, tmp_path_factory):
    srv = start_server(
        tiny_flux_dir,
        tmp_path_factory.mktemp("cache-methods"),
        "--cache-default",
        "scm:steps_computation_mask=fast",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def post(srv, body: dict) -> httpx.Response:
    payload = {"prompt": "a red fox", "size": SIZE, "num_inference_steps": 12, "seed": 3, **body}
    return httpx.post(f"{srv.base_url}/v1/images/generations", json=payload, timeout=120)


def test_default_request_and_off(cache_server) -> None:
    default = post(cache_server, {}).json()
    assert default["cache"]["method"] == "scm" and default["cache"]["steps_reused"] > 0
    assert default["steps_computed_in_full"] == default["cache"]["steps_computed"] < 12
    chosen = post(
        cache_server, {"cache": {"method": "dbcache", "Fn_compute_blocks": 1, "max_warmup_steps": 2}}
    )
    report = chosen.json()["cache"]
    assert report["method"] == "dbcache" and report["settings"]["Fn_compute_blocks"] == 1
    assert report["blocks_computed"] + report["blocks_reused"] == 12 * 3
    text = post(cache_server, {"cache": "teacache:rel_l1_thresh=0.5"}).json()["cache"]
    assert text["method"] == "teacache" and text["settings"]["rel_l1_thresh"] == 0.5
    off = post(cache_server, {"cache": "none"}).json()
    assert off["cache"] is None and off["steps_computed_in_full"] == 12


@pytest.mark.parametrize(
    ("cache", "message"),
    [
        (
            {"method": "fbcache"},
            "set method to one of none, dbcache, taylorseer, teacache, magcache, scm, easycache, seacache, pab, "
            "fastercache",
        ),
        (
            {"method": "dbcache", "threshold": 0.1},
            "dbcache has no setting 'threshold'; its settings: Fn_compute_blocks",
        ),
        (
            {"method": "dbcache", "Fn_compute_blocks": 3, "Bn_compute_blocks": 1},
            "exceed FluxPipeline's 3 DiT blocks",
        ),
        ({"method": "scm", "steps_computation_mask": [1, 2]}, "must hold 1 (compute) and 0 (reuse) only"),
    ],
)
def test_bad_settings_are_400s_naming_cache(cache_server, cache, message) -> None:
    response = post(cache_server, {"cache": cache})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache" and message in error["message"], error


def test_attention_reuse_runs_and_a_refusal_of_the_engine_is_a_400(cache_server) -> None:
    """The engine decides CFG (a family's guider may): fastercache skips the negative branch of a request
    with CFG, and its refusal of `is_guidance_distilled` false without CFG reaches the client as the front
    end's refusals do."""
    pab = post(cache_server, {"cache": "pab"})
    assert pab.status_code == 200, pab.text
    assert pab.json()["cache"]["attention_reused"] > 0
    cfg = {"negative_prompt": "blurry", "true_cfg_scale": 2.0}
    approximated = post(cache_server, {"cache": "fastercache", **cfg})
    assert approximated.status_code == 200, approximated.text
    assert approximated.json()["cache"]["unconditional_skipped"] > 0
    refused = post(cache_server, {"cache": {"method": "fastercache", "is_guidance_distilled": False}})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "cache" and "runs no classifier-free guidance" in error["message"], error


def test_a_named_schedule_needs_a_step_count_it_has(cache_server) -> None:
    """The default's "fast" schedule has no 5-step form (cache-dit's neither): a 400 that says what to do."""
    response = post(cache_server, {"num_inference_steps": 5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (
        error["param"] == "cache" and "need 4, 6 or at least 8 steps, the request has 5" in error["message"]
    )
    assert "pass cache 'none'" in error["message"]
    assert post(cache_server, {"num_inference_steps": 5, "cache": "none"}).status_code == 200


def test_metrics_count_the_blocks_reused(cache_server) -> None:
    post(cache_server, {})
    text = httpx.get(f"{cache_server.base_url}/metrics", timeout=30).text
    reused = [
        line for line in text.splitlines() if line.startswith('diffserve_dit_blocks_total{outcome="reused"}')
    ]
    assert reused and float(reused[0].rpartition(" ")[2]) > 0


def test_the_openapi_document_lists_every_method_and_its_settings(cache_server) -> None:
    document = httpx.get(f"{cache_server.base_url}/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    assert {
        "CacheDbcache",
        "CacheTeacache",
        "CacheMagcache",
        "CacheTaylorseer",
        "CacheScm",
        "CacheNone",
    } <= set(schemas)
    fn = schemas["CacheDbcache"]["properties"]["Fn_compute_blocks"]
    assert fn["default"] == 8 and fn["minimum"] == 1 and fn["description"]
