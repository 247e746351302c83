"""Issue 17's security matrix on one real server (tiny FLUX, an API key, --allow-url-images):

- the auth matrix of every route (no key, wrong keys, another image's token): 401 in OpenAI's shape;
- path traversal in every `{id}` route: a 4xx, and nothing outside the output dir is read;
- SSRF: image URLs that name this host or a private network are refused before any connection;
- hostile payloads on the real server (test_hostile_inputs.py covers the parsers in-process): each a 4xx,
  nothing stored in the output dir, the server healthy, the front end's memory bounded;
- connection exhaustion (issue 31): slow headers are dropped within --header-timeout, floods from one
  client and from many are held to the connection caps while /health answers, and the log stays small;
- keys (issue 31): the admin routes need the admin key, client keys see no server path in /server_info;
- a second server on the same --output-path exits at once, naming the first (issue 31);
- hostile LoRA files and admin loads (issue 31 items 14, 15, 20; hostile_loras.py): each a 400 answered at
  once (a huge header, JSON nested 100,000 deep, NaN, int64, rank-0, a NUL byte, names and paths too
  long), a bad file named again refused at once, and --max-loras holding the adapters' count.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from server_process import ServerProcess, serving, start_server

API_KEY = "matrix-key-0123"
OTHER_KEY = "matrix-other-4567"  # a second client's key
ADMIN_KEY = "matrix-admin-89ab"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MAX_CONNECTIONS, PER_CLIENT, HEADER_TIMEOUT_S = 48, 16, 3.0
MAX_BODY = 65536
MAX_IMAGE = 65536
IMAGE_ID = "0123456789abcdef0123456789abcdef-0"  # well-formed, never generated
VIDEO_ID = "video_" + "0123456789abcdef" * 2
CANARY = b"CANARY-outside-the-output-dir"
SLOW_BODY_DEADLINE_S = 10.0  # a client trickling a body must get an answer (or be cut off) by then
RSS_GROWTH_BOUND = 64 << 20

#: (method, path) of every route, path parameters filled with well-formed ids.
ROUTES = [
    ("POST", "/v1/images/generations"),
    ("POST", "/v1/images/edits"),
    ("GET", f"/v1/images/{IMAGE_ID}/content"),
    ("POST", "/v1/videos"),
    ("GET", "/v1/videos"),
    ("GET", f"/v1/videos/{VIDEO_ID}"),
    ("DELETE", f"/v1/videos/{VIDEO_ID}"),
    ("GET", f"/v1/videos/{VIDEO_ID}/content"),
    ("GET", f"/v1/videos/{VIDEO_ID}/stream"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/tiny-flux"),
    ("GET", "/v1/loras"),
    ("POST", "/v1/loras"),
    ("DELETE", "/v1/loras/a"),
    ("GET", "/server_info"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/redoc"),
]
#: Public by design (middleware.OPEN_PATHS): load balancers' probes and Prometheus.
OPEN_ROUTES = [("GET", "/health"), ("HEAD", "/health"), ("GET", "/health_generate"), ("GET", "/metrics")]
#: `{id}` routes, with `{}` where the id goes.
ID_ROUTES = [
    ("GET", "/v1/images/{}/content"),
    ("GET", "/v1/videos/{}"),
    ("DELETE", "/v1/videos/{}"),
    ("GET", "/v1/videos/{}/content"),
    ("GET", "/v1/videos/{}/stream"),
    ("GET", "/v1/models/{}"),
    ("DELETE", "/v1/loras/{}"),
]
TRAVERSALS = [
    "..%2f..%2fsecret",
    "..%2F..%2Fetc%2Fpasswd",
    "%2e%2e%2f%2e%2e%2fsecret",
    "..%252f..%252fsecret",
    "..%5c..%5csecret",
    "....%2f%2f....%2f%2fsecret",
    "%2fetc%2fpasswd",
    "%2f%2fetc%2fpasswd",
    "..",
    "%2e%2e",
    f"{IMAGE_ID}%00.png",
    f"..%2f{IMAGE_ID}",
    "secret%00",
    "%c0%ae%c0%ae%c0%afsecret",
]


@pytest.fixture(scope="module")
def srv(tiny_flux_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("security")
    # Canaries one level above the output dir, under names a traversal would reach.
    (work / "secret").write_bytes(CANARY)
    (work / f"{IMAGE_ID}.png").write_bytes(CANARY)
    with serving(
        tiny_flux_dir, work, "--api-key", f"{API_KEY},{OTHER_KEY}", "--admin-api-key", ADMIN_KEY,
        "--allow-url-images", "--max-body-bytes", str(MAX_BODY), "--max-image-bytes", str(MAX_IMAGE),
        "--max-inference-steps", "2", "--no-warmup", "--max-connections", str(MAX_CONNECTIONS),
        "--max-connections-per-client", str(PER_CLIENT), "--header-timeout", str(HEADER_TIMEOUT_S),
    ) as server:  # fmt: skip
        server.api_key = API_KEY  # the one of the two keys the tests send
        yield server


def raw(srv: ServerProcess, method: str, target: str, headers: dict[str, str] | None = None,
        body: bytes | None = None) -> tuple[int, bytes, dict[str, str]]:  # fmt: skip
    """One request with `target` sent byte for byte (no client-side normalisation of `..` or `%2f`)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        for name, value in {**(headers or {}), "Content-Length": str(len(body or b""))}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def assert_openai_error(status: int, body: bytes, expected: int) -> dict:
    assert status == expected, (status, body[:500])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def stored(srv: ServerProcess) -> set[str]:
    return {str(p.relative_to(srv.output_dir)) for p in srv.output_dir.rglob("*")}


def assert_healthy(srv: ServerProcess) -> None:
    assert srv.process.poll() is None, srv.log()[-3000:]
    assert httpx.get(f"{srv.base_url}/health", timeout=10).status_code == 200


# --- the auth matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong",
        f"Bearer {API_KEY}x",
        f"Bearer {API_KEY[:-1]}",
        f"Basic {API_KEY}",
        API_KEY,
        "Bearer",
    ],
    ids=["none", "wrong", "longer", "prefix", "basic", "no-scheme", "empty-bearer"],
)
def test_every_route_needs_the_key(
    srv: ServerProcess, method: str, path: str, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    status, body, response_headers = raw(
        srv, method, path, {**headers, "Content-Type": "application/json"}, b"{}"
    )
    error = assert_openai_error(status, body, 401)
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", error
    assert response_headers.get("www-authenticate") == "Bearer"


def test_every_documented_route_is_in_the_matrix(srv: ServerProcess) -> None:
    document = httpx.get(f"{srv.base_url}/openapi.json", headers=AUTH, timeout=10).json()
    covered = {(m, p.replace(IMAGE_ID, "{image_id}").replace(VIDEO_ID, "{video_id}")) for m, p in ROUTES}
    covered |= {(m, p) for m, p in OPEN_ROUTES} | {
        ("GET", "/v1/models/{model_id}"),
        ("DELETE", "/v1/loras/{name}"),
    }
    documented = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    assert documented <= covered, documented - covered


@pytest.mark.parametrize(("method", "path"), OPEN_ROUTES, ids=[f"{m} {p}" for m, p in OPEN_ROUTES])
def test_open_routes_need_no_key(srv: ServerProcess, method: str, path: str) -> None:
    status, _, _ = raw(srv, method, path)
    assert status == 200


def test_an_image_token_opens_only_its_own_image(srv: ServerProcess) -> None:
    from diffserve.server.middleware import content_token

    other = "f" * 32 + "-0"
    for image_id, token in ((IMAGE_ID, content_token(API_KEY, other)), (IMAGE_ID, "0" * 32), (IMAGE_ID, "")):
        status, body, _ = raw(srv, "GET", f"/v1/images/{image_id}/content?token={token}")
        assert_openai_error(status, body, 401)
    # its own token passes the key check (and the unknown id is then a 404, not a 401)
    status, body, _ = raw(
        srv, "GET", f"/v1/images/{IMAGE_ID}/content?token={content_token(API_KEY, IMAGE_ID)}"
    )
    assert_openai_error(status, body, 404)


# --- path traversal -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "route"), ID_ROUTES, ids=[f"{m} {r}" for m, r in ID_ROUTES])
def test_traversal_in_ids_reads_nothing_outside_the_output_dir(
    srv: ServerProcess, method: str, route: str
) -> None:
    before = stored(srv)
    for traversal in TRAVERSALS:
        for headers in (AUTH, {}):  # with the key, and with an image token computed for the raw id
            target = route.format(traversal)
            if not headers:
                from diffserve.server.middleware import content_token

                target += f"?token={content_token(API_KEY, traversal)}"
            status, body, _ = raw(srv, method, target, headers)
            assert 400 <= status < 500, (target, status, body[:300])
            assert CANARY not in body and b"root:" not in body, (target, body[:300])
    assert stored(srv) == before
    assert_healthy(srv)


# --- SSRF ---------------------------------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[tuple[int, list[bytes]]]:
    """A local TCP server recording every connection: an SSRF that got through would show up here."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.2)
    hits: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    hits.append(conn.recv(4096))
                except OSError:
                    hits.append(b"")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1], hits
    stop.set()
    thread.join(5)
    sock.close()


def ssrf_urls(port: int) -> list[str]:
    return [
        f"http://127.0.0.1:{port}/a.png",
        f"http://localhost:{port}/a.png",
        f"http://127.1:{port}/a.png",
        f"http://0x7f000001:{port}/a.png",
        f"http://2130706433:{port}/a.png",
        f"http://017700000001:{port}/a.png",
        f"http://0.0.0.0:{port}/a.png",
        f"http://[::1]:{port}/a.png",
        f"http://[::ffff:127.0.0.1]:{port}/a.png",
        f"http://user:pass@127.0.0.1:{port}/a.png",
        f"http://public.example@127.0.0.1:{port}/a.png",
        f"HTTP://LOCALHOST:{port}/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00::1]/a.png",
        "http://10.0.0.1/a.png",
        "http://192.168.0.1/a.png",
        "http://100.64.0.1/a.png",
        "file:///etc/passwd",
        "gopher://127.0.0.1:6379/_INFO",
        "ftp://127.0.0.1/a.png",
        "/etc/passwd",
        "../secret",
    ]


def test_ssrf_variants_are_refused_before_any_connection(srv: ServerProcess, listener) -> None:
    port, hits = listener
    before = stored(srv)
    for url in ssrf_urls(port):
        for body in ({"prompt": "p", "image": url}, {"prompt": "p", "images": [{"image_url": url}]}):
            r = httpx.post(f"{srv.base_url}/v1/images/edits", json=body, headers=AUTH, timeout=60)
            error = assert_openai_error(r.status_code, r.content, 400)
            assert error["param"] in ("image", "images", "images[0]"), (url, error)
            assert "could not fetch" not in error["message"], (url, error)
        r = httpx.post(
            f"{srv.base_url}/v1/images/edits",
            data={"prompt": "p", "image": url},
            files={"mask": ("m.png", b"x", "image/png")},
            headers=AUTH,
            timeout=60,
        )
        assert 400 <= r.status_code < 500, (url, r.text)
    assert hits == [], hits
    assert stored(srv) == before
    assert_healthy(srv)


# --- hostile payloads ---------------------------------------------------------------------------------

DEEP = 100_000
JSON_ROUTES = ["/v1/images/generations", "/v1/images/edits", "/v1/videos"]


def post_bytes(
    srv: ServerProcess, path: str, body: bytes, content_type: str = "application/json"
) -> httpx.Response:
    return httpx.post(
        f"{srv.base_url}{path}", content=body, headers={**AUTH, "Content-Type": content_type}, timeout=60
    )


def payloads() -> list[tuple[str, str, bytes, str]]:
    """(name, path, body, content type) of each hostile payload on each route that takes it."""
    out = []
    for path in JSON_ROUTES:
        out += [
            ("surrogate", path, b'{"prompt": "a \\ud800 b"}', "application/json"),
            (
                "raw-surrogate",
                path,
                '{"prompt": "a \ud800 b"}'.encode("utf-8", "surrogatepass"),
                "application/json",
            ),
            ("nul", path, b'{"prompt": "a \\u0000 cat"}', "application/json"),
            ("nul-field-name", path, b'{"prompt\\u0000": "a cat"}', "application/json"),
            ("nested", path, b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}", "application/json"),
            ("nested-object", path, b'{"a":' * 5000 + b"1" + b"}" * 5000, "application/json"),
            ("not-utf8", path, b'{"prompt": "\xff\xfe"}', "application/json"),
            ("top-level-array", path, b"[" * 50 + b"]" * 50, "application/json"),
        ]
    return out


@pytest.mark.parametrize(("name", "path", "body", "content_type"), payloads(),
                         ids=[f"{n} {p}" for n, p, _, _ in payloads()])  # fmt: skip
def test_hostile_payloads_are_4xx_and_store_nothing(
    srv: ServerProcess, name: str, path: str, body: bytes, content_type: str
) -> None:
    before = stored(srv)
    r = post_bytes(srv, path, body, content_type)
    assert 400 <= r.status_code < 500, (name, path, r.status_code, r.text[:500])
    assert set(r.json()) == {"error"}, r.text[:500]
    assert stored(srv) == before
    assert_healthy(srv)


def many_parts(parts: int) -> tuple[bytes, str]:
    boundary = "xyzBOUNDARY"
    chunks = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nv\r\n' for i in range(parts)
    ]
    chunks.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\np\r\n--{boundary}--\r\n'
    )
    return "".join(chunks).encode(), f"multipart/form-data; boundary={boundary}"


def many_files(parts: int) -> tuple[bytes, str]:
    boundary = "xyzBOUNDARY"
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="image[]"; filename="a.png"\r\n\r\nx\r\n'
    tail = f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\np\r\n--{boundary}--\r\n'
    return (part * parts + tail).encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize("path", ["/v1/images/edits", "/v1/videos"])
@pytest.mark.parametrize("form", [many_parts, many_files], ids=["fields", "files"])
def test_a_thousand_part_form_is_a_400(srv: ServerProcess, path: str, form) -> None:
    before = stored(srv)
    body, content_type = form(1000)
    r = post_bytes(srv, path, body, content_type)
    assert 400 <= r.status_code < 500, r.text[:500]
    assert set(r.json()) == {"error"}
    assert stored(srv) == before


@pytest.mark.parametrize("path", ["/v1/images/generations", "/v1/models", "/v1/images/edits", "/v1/videos"])
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused(srv: ServerProcess, path: str, chunked: bool) -> None:
    """413 from Content-Length at once; a chunked body is a 413 once the route reads past the limit, or
    the route's own 4xx when it answers without reading it (405 on GET /v1/models, /v1/videos' 400 on
    an image model)."""
    limit = {
        "/v1/images/edits": 17 * -(-MAX_IMAGE * 4 // 3) + MAX_BODY,
        "/v1/videos": -(-MAX_IMAGE * 4 // 3) + MAX_BODY,
    }
    size = limit.get(path, MAX_BODY) + 1024
    body = b'{"prompt": "' + b"a" * size + b'"}'
    before = stored(srv)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 16384):
            yield body[i : i + 16384]

    content = chunks() if chunked else body
    r = httpx.post(
        f"{srv.base_url}{path}",
        content=content,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=60,
    )
    reads_body = not chunked or path in ("/v1/images/generations", "/v1/images/edits")
    expected = 413 if reads_body else {"/v1/models": 405, "/v1/videos": 400}[path]
    error = assert_openai_error(r.status_code, r.content, expected)
    assert error["code"] == ("request_too_large" if reads_body else error["code"])
    assert stored(srv) == before


def test_a_slow_body_is_cut_off(srv: ServerProcess) -> None:
    """A client that sends headers and a trickle of its body, then stalls, must not hold a connection (and
    the request's memory) forever: answered with a 4xx, or disconnected, within SLOW_BODY_DEADLINE_S."""
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.settimeout(SLOW_BODY_DEADLINE_S + 5)
    head = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    start = time.monotonic()
    try:
        sock.sendall(head.encode() + b'{"prompt": "')
        for _ in range(3):  # a trickle, then nothing
            time.sleep(0.5)
            sock.sendall(b"a")
        assert_healthy(srv)  # the stalled client blocks no one else
        try:
            answer = sock.recv(4096)
        except TimeoutError:
            answer = None
    finally:
        sock.close()
    waited = time.monotonic() - start
    assert answer is not None and waited <= SLOW_BODY_DEADLINE_S + 2, (
        f"no answer to a stalled body after {waited:.0f} s: the server has no body-read deadline"
    )
    if answer:
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:200]


def test_memory_stays_bounded_under_hostile_bodies(srv: ServerProcess) -> None:
    """Repeated hostile bodies at the limits leave the front end's RSS within a bound."""
    front = psutil.Process(srv.process.pid)
    big = b'{"prompt": "' + b"a" * (MAX_BODY - 20) + b'"}'
    parts, parts_type = many_parts(1000)

    def battery() -> None:
        for _ in range(10):
            post_bytes(srv, "/v1/images/generations", big)
            post_bytes(srv, "/v1/images/edits", parts, parts_type)
            post_bytes(srv, "/v1/videos", b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}")

    battery()  # warm-up: allocator pools, imports
    rss_before = front.memory_info().rss
    for _ in range(3):
        battery()
    growth = front.memory_info().rss - rss_before
    assert growth < RSS_GROWTH_BOUND, f"front-end RSS grew {growth >> 20} MiB over 90 hostile requests"
    assert_healthy(srv)


def test_nothing_was_left_in_the_output_dir(srv: ServerProcess) -> None:
    leftovers = [p for p in Path(srv.output_dir).rglob("*") if p.suffix in (".png", ".jpeg", ".webp", ".mp4")]
    assert leftovers == []


# --- connection exhaustion (issue 31 item 13) -----------------------------------------------------------


def connect_from(srv: ServerProcess, host: str) -> socket.socket:
    """A connection to the server from `host` (any 127.x.y.z is this machine: one client address each)."""
    sock = socket.socket()
    sock.bind((host, 0))
    sock.connect(("127.0.0.1", srv.port))
    return sock


def ended(socks: list[socket.socket], wait: float) -> dict[int, bytes]:
    """The connections (by index) the server answered or closed within `wait` s: what each received."""
    out: dict[int, bytes] = {}
    deadline = time.monotonic() + wait
    while len(out) < len(socks) and (left := deadline - time.monotonic()) > 0:
        pending = [s for i, s in enumerate(socks) if i not in out]
        readable, _, _ = select.select(pending, [], [], min(left, 0.2))
        for sock in readable:
            try:
                out[socks.index(sock)] = sock.recv(4096)
            except OSError:
                out[socks.index(sock)] = b""
    return out


def front_end_fds(srv: ServerProcess) -> int:
    return psutil.Process(srv.process.pid).num_fds()


def test_slow_headers_are_dropped_within_the_header_timeout(srv: ServerProcess) -> None:
    """Slowloris: connections that send a request's headers one byte at a time are closed (408) once
    --header-timeout has passed, though bytes keep arriving; others are served meanwhile."""
    socks = [connect_from(srv, "127.0.0.1") for _ in range(8)]
    request = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nX-Slow: ".encode()
    start = time.monotonic()
    closed_after: dict[int, float] = {}
    answers: dict[int, bytes] = {}
    try:
        for i in range(int((HEADER_TIMEOUT_S + 5) / 0.25)):
            for n, sock in enumerate(socks):  # one more byte on each connection still open
                if n not in closed_after:
                    try:
                        sock.send(request[i % len(request) : i % len(request) + 1])
                    except OSError:  # reset: closed
                        closed_after[n], answers[n] = time.monotonic() - start, b""
            still_open = [n for n in range(len(socks)) if n not in closed_after]
            for k, answer in ended([socks[n] for n in still_open], 0.25).items():
                closed_after[still_open[k]], answers[still_open[k]] = time.monotonic() - start, answer
            if len(closed_after) == len(socks):
                break
            if i == 4:
                assert_healthy(srv)  # the slow clients block no one
    finally:
        for sock in socks:
            sock.close()
    assert len(closed_after) == len(socks), f"{len(socks) - len(closed_after)} slow connection(s) still open"
    assert max(closed_after.values()) <= HEADER_TIMEOUT_S + 2, closed_after
    assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers.values()), answers
    assert any(answers.values()), answers  # the 408 reaches clients that read
    assert_healthy(srv)


def test_a_flood_from_one_client_is_refused_while_health_answers(srv: ServerProcess) -> None:
    """Past --max-connections-per-client, one address's connections are answered 503 at once; the server
    holds no more of them, and another client is served meanwhile."""
    log_before, fds_before = len(srv.log()), front_end_fds(srv)
    flood = []
    try:
        for _ in range(200):
            flood.append(connect_from(srv, "127.0.0.2"))
        answered = ended(flood, 3.0)
        still_open = len(flood) - len(answered)
        assert still_open <= PER_CLIENT, f"{still_open} flood connections held open (cap {PER_CLIENT})"
        refusals = [a for a in answered.values() if a]
        assert len(refusals) >= 200 - PER_CLIENT - 10, len(refusals)
        refused = [a.startswith(b"HTTP/1.1 503") and b"too_many_connections" in a for a in refusals]
        assert all(refused), refusals[:3]
        assert front_end_fds(srv) <= fds_before + PER_CLIENT + 8, (fds_before, front_end_fds(srv))
        assert_healthy(srv)  # another client, during the flood
    finally:
        for sock in flood:
            sock.close()
    grown = srv.log()[log_before:]
    assert len(grown) < 20_000 and "Traceback" not in grown, grown[-3000:]
    assert grown.count("Connections:") <= 3, grown


def test_a_flood_from_many_clients_is_held_to_the_total_cap(srv: ServerProcess) -> None:
    """From many addresses (each under its own cap), past --max-connections: newcomers displace the
    oldest idle connections; the open files stay bounded, and /health answers."""
    log_before, fds_before = len(srv.log()), front_end_fds(srv)
    flood = []
    try:
        for host in range(10, 20):
            for _ in range(PER_CLIENT - 2):
                flood.append(connect_from(srv, f"127.0.0.{host}"))
        time.sleep(0.5)
        assert front_end_fds(srv) <= fds_before + MAX_CONNECTIONS + 8, (fds_before, front_end_fds(srv))
        assert_healthy(srv)
        closed = ended(flood, 1.0)
        assert len(flood) - len(closed) <= MAX_CONNECTIONS, len(flood) - len(closed)
    finally:
        for sock in flood:
            sock.close()
    grown = srv.log()[log_before:]
    assert len(grown) < 20_000 and "Traceback" not in grown, grown[-3000:]
    assert "Too many open files" not in grown, grown[-3000:]


# --- keys (issue 31 item 19) ---------------------------------------------------------------------------


def test_admin_routes_need_the_admin_key(srv: ServerProcess) -> None:
    load = {"name": "ink", "path": "ink.safetensors"}
    for key in (API_KEY, OTHER_KEY):
        headers = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{srv.base_url}/v1/loras", json=load, headers=headers, timeout=30)
        error = assert_openai_error(r.status_code, r.content, 403)
        assert error["code"] == "admin_key_required", error
        r = httpx.delete(f"{srv.base_url}/v1/loras/ink", headers=headers, timeout=30)
        assert_openai_error(r.status_code, r.content, 403)
    # the admin key passes (this server has no --lora-dir: the engine's own refusal)
    r = httpx.post(f"{srv.base_url}/v1/loras", json=load, headers=ADMIN, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_dir_not_set", r.text


def test_server_paths_are_shown_to_the_admin_only(srv: ServerProcess, tiny_flux_dir: Path) -> None:
    secrets = [str(tiny_flux_dir), str(srv.output_dir), sys.executable, sys.prefix, os.getcwd()]
    for headers in (AUTH, {"Authorization": f"Bearer {OTHER_KEY}"}):
        for path in ("/server_info", "/v1/loras"):
            r = httpx.get(f"{srv.base_url}{path}", headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            for secret in secrets:
                assert secret not in r.text, (path, secret)
            assert re.search(r'"/(tmp|work|home|usr|root|opt|srv)/', r.text) is None, r.text
    info = httpx.get(f"{srv.base_url}/server_info", headers=AUTH, timeout=30).json()
    assert info["server_args"]["engine_args"]["model_path"] == tiny_flux_dir.name
    assert info["server_args"]["api_key"] == "set (2 keys)" and API_KEY not in json.dumps(info)
    admin = httpx.get(f"{srv.base_url}/server_info", headers=ADMIN, timeout=30).json()
    assert admin["server_args"]["engine_args"]["model_path"] == str(tiny_flux_dir)
    assert admin["python_executable"] == sys.executable


# --- two servers on one --output-path (issue 31 item 18) ------------------------------------------------


def test_a_second_server_on_the_same_output_path_exits_naming_the_first(
    srv: ServerProcess, tiny_flux_dir: Path, tmp_path: Path
) -> None:
    before = stored(srv)
    second = start_server(tiny_flux_dir, tmp_path, "--no-warmup", output_dir=srv.output_dir)
    try:
        code = second.process.wait(120)
    finally:
        second.stop()
    log = second.log()
    assert code == 2, log[-3000:]
    assert f"pid {srv.process.pid}" in log and "--output-path" in log, log[-3000:]
    assert "Traceback" not in log and "Engine" not in log, log[-3000:]  # refused before any engine started
    assert stored(srv) == before
    assert_healthy(srv)


# --- hostile LoRA files and admin loads (issue 31 items 14, 15, 20) ------------------------------------

MAX_LORAS = 4


@pytest.fixture(scope="module")
def lora_srv(tiny_flux_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """A server with a --lora-dir holding hostile files (hostile_loras.py), at most MAX_LORAS adapters."""
    from hostile_loras import serving_hostile_loras

    work = tmp_path_factory.mktemp("security-lora")
    limits = ("--max-loras", str(MAX_LORAS), "--max-inference-steps", "2")
    with serving_hostile_loras(tiny_flux_dir, work, *limits, api_key=API_KEY) as server:
        yield server


def lora_names(srv: ServerProcess) -> set[str]:
    r = httpx.get(f"{srv.base_url}/v1/loras", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return {card["name"] for card in r.json()["data"]}


def small_image(srv: ServerProcess, **fields) -> httpx.Response:
    body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 2, **fields}
    return httpx.post(f"{srv.base_url}/v1/images/generations", json=body, headers=AUTH, timeout=60)


def test_hostile_lora_loads_are_400s_answered_at_once(lora_srv: ServerProcess) -> None:
    """A NUL byte, a 5,000-character name, a 3,000-level path, a header of a million tensors or nested
    100,000 deep, a name ending in a newline, NaN, int64 and rank-0 weights: each a 400 naming what is
    wrong, within seconds (the million-tensor header took 48.6 s), nothing registered, the server serving."""
    from hostile_loras import HOSTILE_LOADS

    for what, body, param, words in HOSTILE_LOADS:
        start = time.monotonic()
        r = httpx.post(f"{lora_srv.base_url}/v1/loras", json=body, headers=AUTH, timeout=120)
        took = time.monotonic() - start
        error = assert_openai_error(r.status_code, r.content, 400)
        assert error["param"] == param and words in error["message"], (what, error)
        assert took < 10, f"{what}: answered after {took:.1f} s"
    assert lora_names(lora_srv) == set()
    assert small_image(lora_srv).status_code == 200
    assert_healthy(lora_srv)


def test_a_request_naming_a_bad_file_is_refused_at_once_every_time(lora_srv: ServerProcess) -> None:
    """Naming the huge-header file in a request's `loras` repeated the whole stall on every request (a
    failed read was not remembered); now the first is refused by the header's caps and the next ones by
    the remembered failure, each at once."""
    for _ in range(3):
        start = time.monotonic()
        r = small_image(lora_srv, loras=[{"name": "huge-header"}])
        error = assert_openai_error(r.status_code, r.content, 400)
        assert error["param"] == "loras" and "MAX_LORA_HEADER_BYTES" in error["message"], error
        assert time.monotonic() - start < 10
    r = small_image(lora_srv, loras=[{"name": "a\n"}])
    assert_openai_error(r.status_code, r.content, 400)
    assert "huge-header" not in lora_names(lora_srv)
    assert_healthy(lora_srv)


def test_the_adapter_count_is_capped_by_max_loras(lora_srv: ServerProcess) -> None:
    names = [f"cap{i}" for i in range(MAX_LORAS)]
    try:
        for name in names:
            r = httpx.post(
                f"{lora_srv.base_url}/v1/loras", json={"name": name, "path": "style.safetensors"},
                headers=AUTH, timeout=60,
            )  # fmt: skip
            assert r.status_code == 200, r.text
        r = httpx.post(
            f"{lora_srv.base_url}/v1/loras", json={"name": "more", "path": "other.safetensors"},
            headers=AUTH, timeout=60,
        )  # fmt: skip
        error = assert_openai_error(r.status_code, r.content, 409)
        assert error["code"] == "too_many_loras" and f"--max-loras {MAX_LORAS}" in error["message"], error
    finally:
        for name in names:
            httpx.delete(f"{lora_srv.base_url}/v1/loras/{name}", headers=AUTH, timeout=60)
    assert lora_names(lora_srv) == set()
