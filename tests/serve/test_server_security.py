"""`tigon serve` as an attacker meets it (issue 37): a key on it, bodies and requests too large,
text that is not Unicode, and a burst of them, against the real server on 127.0.0.1 through the
official openai client and raw HTTP. The server's limits are set low here, and its model's context
is raised to 65536 tokens, so that a prompt within every limit still takes a while to tokenise."""

import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.test_server import NAME, httpx, openai, start_server
from tigon.cli import main
from tigon.serve.protocol import CompletionRequest
from tigon.security import is_loopback

# One worker sets up its server (module fixtures) once, rather than each worker its own.
pytestmark = pytest.mark.xdist_group("serve-server_security")

KEY = "sk-test-0123456789"
MAX_BODY = 1 << 20  # --max-body-mb 1
MAX_INFLIGHT = 12 << 20  # --max-inflight-mb 12
MAX_CHOICES = 8
CONTEXT = 65536
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("long-context")
    shutil.copytree(tiny_dir, model_dir, dirs_exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model_dir / "config.json").write_text(json.dumps(config))
    started = start_server(model_dir, "--api-key", KEY, "--max-body-mb", "1", "--max-inflight-mb", "12",
                           "--max-choices", str(MAX_CHOICES))
    started["port"] = int(started["base"].rsplit(":", 1)[1])
    yield started
    started["proc"].kill()
    started["proc"].wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def exchange(sock: socket.socket, method: str, path: str, body: bytes = b"", headers: dict | None = None,
             send_body: bool = True) -> tuple[int, bytes]:
    """One request on an open connection, as raw HTTP/1.1; its status and body."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in (headers or AUTH).items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + (body if send_body else b""))
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


# Asks a URL every 50 ms until its stdin closes; prints how long each answer took, as JSON.
PROBE = """
import json, sys, threading, time, urllib.request
latencies, done = [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.is_set():
    t0 = time.monotonic()
    urllib.request.urlopen(sys.argv[1], timeout=30).read()
    latencies.append(time.monotonic() - t0)
    time.sleep(0.05)
print(json.dumps(latencies))
"""


def server_rss_mb(server) -> float:
    with open(f"/proc/{server['proc'].pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_a_key_guards_everything_but_health_and_the_docs(server):
    base = server["base"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.get(base + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    # refused before its body is read: a body too large for the server gets 401, not 413
    r = httpx.post(base + "/v1/completions", content=b"x" * (2 * MAX_BODY), headers={"Authorization": "Bearer no"})
    assert r.status_code == 401
    assert httpx.get(base + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(base + "/health").status_code == 200
    schema = httpx.get(base + "/openapi.json")
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert httpx.get(base + "/docs").status_code == 200


def test_the_openai_client_with_a_wrong_key_and_the_right_one(server, client):
    wrong = openai.OpenAI(base_url=server["base"] + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert [m.id for m in client.models.list().data] == [NAME]
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices[0].finish_reason == "length"


def test_lone_surrogates_are_400s_and_the_connection_goes_on(server):
    bodies = {  # a lone surrogate, which JSON can escape (\\ud800) but no UTF-8 text can hold
        "messages.0.content": rb'{"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}',
        "messages.0.content.0.text":
            rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
        "prompt.1": rb'{"prompt": ["ok", "\udc00 bad"], "max_tokens": 2}',
        "model": rb'{"model": "\ud83d", "prompt": "hi"}',
        "body": rb'{"prompt": "hi", "\ud800": 1}',  # in a field's name: refused, and not echoed
    }
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=30) as sock:
        for param, body in bodies.items():
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            status, text = exchange(sock, "POST", path, body)
            error = json.loads(text)["error"]
            assert status == 400 and error["param"] == param and "surrogate" in error["message"], text
        # a pair of surrogate escapes is one character, as JSON means it
        status, text = exchange(sock, "POST", "/v1/completions", rb'{"prompt": "\ud83d\ude00", "max_tokens": 1}')
        assert status == 200, text
        assert exchange(sock, "GET", "/health") == (200, b'{"status":"ok","running":0}')


def test_bodies_over_the_limit_get_413_by_length_or_while_streamed(server, client):
    with socket.create_connection(("127.0.0.1", server["port"]), timeout=30) as sock:
        # only the headers are sent: the answer comes without the body being waited for
        status, text = exchange(sock, "POST", "/v1/completions", b"x" * (MAX_BODY + 1), send_body=False)
    assert status == 413 and json.loads(text)["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: sent chunked, counted as it arrives
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"a" * MAX_BODY
        yield b'"}'

    r = httpx.post(server["base"] + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "chunked" in r.request.headers.get("transfer-encoding", "")
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=NAME, prompt="word " * (MAX_BODY // 5 + 1), max_tokens=1)
    assert err.value.status_code == 413


def test_bodies_never_finished_fill_the_budget_and_then_get_503(server):
    # Each of 13 clients sends 950 kB of a 1 MB body and stops: 12.35 MB held, so a 14th body of
    # 1 MB would pass the 12 MiB all requests may hold together.
    body = json.dumps({"prompt": "w" * (1_000_000 - 14)}).encode()  # 1 MB, too long a prompt: a quick 400
    assert len(body) == 1_000_000
    stalled = [socket.create_connection(("127.0.0.1", server["port"]), timeout=30) for _ in range(13)]

    def declared_only() -> tuple[int, bytes] | None:
        """The answer to a request that declares the body and sends none of it: None once the
        server waits for the body (it has room for it)."""
        with socket.create_connection(("127.0.0.1", server["port"]), timeout=2) as probe:
            try:
                return exchange(probe, "POST", "/v1/completions", body, JSON, send_body=False)
            except TimeoutError:
                return None

    try:
        for sock in stalled:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n" \
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body[:950_000])
        deadline = time.monotonic() + 30  # until the server has read what they sent
        while (answer := declared_only()) is None:
            assert time.monotonic() < deadline
        status, text = answer
        assert status == 503 and json.loads(text)["error"]["code"] == "server_busy", text
        assert httpx.get(server["base"] + "/health").status_code == 200  # requests without a body still pass
    finally:
        for sock in stalled:
            sock.close()
    deadline = time.monotonic() + 30  # their bytes are let go as the server sees them leave
    while (r := httpx.post(server["base"] + "/v1/completions", content=body, headers=JSON)).status_code == 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_prompts_too_long_to_fit_are_refused_before_tokenising(client):
    # 13 characters per token at most in this vocabulary: 65536 tokens hold at most 851,968 of them
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="w" * 900_000, max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded" and "characters" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w" * 900_000}], max_tokens=1)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "messages"
    assert time.monotonic() - t0 < 5


def test_completions_per_request_are_capped(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt=["a", "b", "c"], n=3, max_tokens=1)
    assert err.value.body["param"] == "n" and "9 completions" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=9, max_tokens=1)
    answer = client.completions.create(model=NAME, prompt=["a", "b"], n=4, max_tokens=1)
    assert sorted(c.index for c in answer.choices) == list(range(MAX_CHOICES))


def test_lists_past_their_length_are_refused_by_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": ""}] * 5000, max_tokens=1)
    assert err.value.body["param"] == "messages" and "at most 4096 items" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt=["a"] * 5000, max_tokens=1)
    assert "at most 4096 items" in err.value.body["message"]


def test_a_million_bad_list_items_are_one_error():
    for prompt in ([1] * 1_000_000 + ["x"], [[1, 2]] * 500_000 + [["x"]]):
        t0 = time.monotonic()
        with pytest.raises(ValueError) as err:
            CompletionRequest.model_validate({"prompt": prompt})
        assert len(err.value.errors()) <= 4, time.monotonic() - t0


def test_a_burst_of_oversized_requests_leaves_memory_flat_and_health_quick(server):
    base = server["base"]
    # 170k tokens: under the character limit, so tokenised (for a while), then refused as too long
    fits = json.dumps({"model": NAME, "prompt": "word " * 170_000, "max_tokens": 1})
    too_long = json.dumps({"prompt": "w" * (MAX_BODY - 100)})  # under the body limit, over the character limit
    assert len(fits) < MAX_BODY and len(too_long) < MAX_BODY

    def chunked():
        for _ in range(8):
            yield b"a" * (MAX_BODY // 2)

    attacks = {
        "declared": (lambda: httpx.post(base + "/v1/completions", content=b"a" * 8 * MAX_BODY, headers=AUTH,
                                        timeout=60), 413),
        "chunked": (lambda: httpx.post(base + "/v1/completions", content=chunked(), headers=AUTH, timeout=60), 413),
        "long prompt": (lambda: httpx.post(base + "/v1/completions", content=too_long, headers=AUTH, timeout=60), 400),
        "tokenised": (lambda: httpx.post(base + "/v1/completions", content=fits, headers=AUTH, timeout=60), 400),
    }
    # Before the fix, prompts were tokenised on the event loop: eight of these at once held /health
    # up for 9 s on a 2-core host. And bodies were read whole: a 10 MB one grew the server by 0.9 GB.
    burst = list(attacks) * 4 + ["tokenised"] * 8

    def run_burst() -> list[float]:
        """The burst, 8 at a time, while /health is asked every 50 ms; how long each answer took.
        The asking runs in a process of its own: this one's threads, busy sending, would delay it."""
        prober = subprocess.Popen([sys.executable, "-c", PROBE, base + "/health"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            with ThreadPoolExecutor(8) as pool:
                statuses = list(pool.map(lambda name: attacks[name][0]().status_code, burst))
        finally:
            latencies = json.loads(prober.communicate("", timeout=60)[0])
        assert statuses == [attacks[name][1] for name in burst]
        return latencies

    run_burst()  # the first allocates what the server keeps for next time (worker threads, their heaps)
    before = server_rss_mb(server)
    latencies = run_burst()
    after = server_rss_mb(server)
    print(f"server RSS {before:.0f} -> {after:.0f} MB; /health at most {max(latencies):.2f} s, "
          f"median {sorted(latencies)[len(latencies) // 2]:.2f} s over {len(latencies)} probes")
    assert after - before < 100, (before, after)
    assert len(latencies) >= 3 and max(latencies) < 2.5, latencies


def test_listening_beyond_this_machine_needs_a_key_or_insecure(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TIGON_API_KEY", raising=False)
    path = str(tmp_path / "none")  # each run stops before the model is looked for, or anything listens

    def serve(*options: str) -> list[str]:
        assert main(["serve", path, *options]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        return err.strip().splitlines()

    for host in ("0.0.0.0", "::", "10.1.2.3"):
        assert serve("--host", host) == [
            f"tigon serve: error: --host {host} can be reached from other machines and no credential is set: "
            "set --api-key KEY (or TIGON_API_KEY), or pass --insecure to serve without one"]
    # with a key, or --insecure, the address passes, and the next check (vLLM has none of these limits) speaks
    vllm_refusal = ("tigon serve: error: --max-body-mb, --max-inflight-mb and --max-choices are limits of tigon's "
                    "own server; vLLM's server (--backend vllm) has its own and does not take these")
    limited_vllm = ("--host", "0.0.0.0", "--backend", "vllm", "--max-choices", "3")
    assert serve(*limited_vllm, "--api-key", KEY) == [vllm_refusal]
    assert serve(*limited_vllm, "--insecure") == [
        "tigon serve: warning: --insecure: anyone who can reach 0.0.0.0 can use this server without a credential",
        vllm_refusal]
    monkeypatch.setenv("TIGON_API_KEY", KEY)
    assert serve(*limited_vllm) == [vllm_refusal]
    assert serve("--api-key", "") == ["tigon serve: error: --api-key / TIGON_API_KEY must be printable ASCII "
                                      "without surrounding spaces (clients send it in an HTTP header)"]
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.1", "no-such-host.invalid"))
