"""`tigon serve` in a subprocess on a free local port, driven by the official openai client."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
try:  # the HTTP client under openai: httpx, renamed httpx2 from openai 3
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

# One worker sets up its server (module fixtures) once, rather than each worker its own.
pytestmark = pytest.mark.xdist_group("serve-server")

NAME = "tiny"
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, *options):
    """`tigon serve MODEL_DIR` on a free port; returns once /health answers."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tigon.cli", "serve", str(model_dir), "--port", str(port),
         "--served-model-name", NAME, *options], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"tigon serve exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return {"base": base, "proc": proc}
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("tigon serve did not come up in 120 s")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def server(tiny_dir):
    started = start_server(tiny_dir)
    yield started
    if started["proc"].poll() is None:
        started["proc"].kill()
        started["proc"].wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy_in_process(tiny_model, messages, max_new_tokens):
    model, tokenizer = tiny_model
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = torch.tensor([ids["input_ids"]], device=model.device)
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def _sixteen_concurrent_clients(client, tiny_model, bundled_samples):
    chats = [[dict(m) for m in s.messages[:1]] for s in bundled_samples[:16]]
    assert all(c[0]["role"] == "user" for c in chats)
    expected = [_greedy_in_process(tiny_model, chat, 12) for chat in chats]

    def ask(chat):
        r = client.chat.completions.create(model=NAME, messages=chat, max_tokens=12, temperature=0)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, chats))
    assert [a[0] for a in answers] == expected
    assert all(reason == "length" and tokens == 12 for _, reason, tokens in answers)


def test_sixteen_concurrent_clients_get_the_in_process_greedy_answers(client, tiny_model, bundled_samples):
    _sixteen_concurrent_clients(client, tiny_model, bundled_samples)


@pytest.mark.gpu
def test_on_the_gpu_concurrent_answers_and_seeds_hold(tiny_dir, tiny_model, bundled_samples):
    # CUDA: paged attention, CUDA graphs and async batching as transformers picks them, with the
    # seeded sampler inside the captured step.
    model, tokenizer = tiny_model
    started = start_server(tiny_dir, "--dtype", "fp32")
    try:
        client = openai.OpenAI(base_url=started["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        _sixteen_concurrent_clients(client, (model.cuda(), tokenizer), bundled_samples)

        def draw(seed):
            return client.completions.create(model=NAME, prompt="Tell me", max_tokens=16, temperature=1.0,
                                             seed=seed, n=4).choices

        with ThreadPoolExecutor(4) as pool:
            draws = list(pool.map(draw, [3, 3, 4, 3]))
        texts = [sorted((c.index, c.text) for c in d) for d in draws]
        assert texts[0] == texts[1] == texts[3] != texts[2]
    finally:
        model.cpu()
        started["proc"].send_signal(signal.SIGINT)
        started["proc"].communicate(timeout=60)


def test_streaming_gives_the_non_streamed_text_and_usage(client):
    chat = [{"role": "user", "content": "Who are you?"}]
    whole = client.chat.completions.create(model=NAME, messages=chat, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=chat, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices]) > 3  # token by token, not one block
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_n_choices_and_seed_reproducibility(client):
    def sample(seed, n=3, stream=False):
        return client.completions.create(model=NAME, prompt="Tell me about", max_tokens=16, n=n,
                                         temperature=1.0, top_p=0.95, seed=seed, stream=stream)

    first, again, other = sample(5), sample(5), sample(6)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3  # n different draws
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts != [c.text for c in sorted(other.choices, key=lambda c: c.index)]
    assert first.usage.completion_tokens == 3 * 16
    # the same seed streamed, each choice's chunks joined, is the same draw
    streamed = {}
    for chunk in sample(5, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts


def test_stop_strings_cut_the_text_streamed_or_not(client):
    prompt = "Who are you?"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = full[9:12]
    assert len(stop) == 3 and full.find(stop) >= 3
    cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\u2603"])
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors(client, server):
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=chat, max_tokens=4)
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 1100}])
    assert err.value.status_code == 400 and err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="hi", max_tokens=1024)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=chat, extra_body={"best_of_all": 3})
    assert "best_of_all" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=chat, temperature=3.5)
    assert err.value.body["param"] == "temperature"
    url = server["base"] + "/v1/chat/completions"
    for body in (b"{not json", json.dumps({"model": NAME}).encode(), json.dumps({"model": NAME, "messages": "hi"}).encode()):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    assert httpx.get(server["base"] + "/v1/nothing-here").json()["error"]["message"]


def test_a_client_leaving_mid_stream_frees_its_slot(client, server):
    body = {"model": NAME, "prompt": "Once", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", server["base"] + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert json.loads(httpx.get(server["base"] + "/health").text)["running"] == 1
    deadline = time.monotonic() + 10  # generating the 1000 tokens would take far longer on this CPU
    while json.loads(httpx.get(server["base"] + "/health").text)["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(httpx.get(server["base"] + "/health").text)["running"] == 0
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length"


def test_a_client_giving_up_on_a_whole_answer_frees_its_slot(server):
    body = {"model": NAME, "prompt": "Once", "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server["base"] + "/v1/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 10
    while json.loads(httpx.get(server["base"] + "/health").text)["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(httpx.get(server["base"] + "/health").text)["running"] == 0


def test_ctrl_c_shuts_down_cleanly(server):  # last: it stops the module's server
    proc = server["proc"]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert err.rstrip().splitlines()[-1] == "tigon serve: stopped (Ctrl-C)"
