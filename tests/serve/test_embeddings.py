"""`tigon serve` of an embedding model: /v1/embeddings through the official openai client against
the real server on 127.0.0.1, its answers equal to the model's own embeddings in process."""

import base64
import json
import shutil

import numpy as np
import pytest
import torch

from tests.serve.test_server import NAME, httpx, openai, start_server


# One worker sets up its server (module fixtures) once, rather than each worker its own.
pytestmark = pytest.mark.xdist_group("serve-embeddings")


@pytest.fixture(scope="module")
def embed_dir(tiny_dir, tmp_path_factory):
    """The tiny Llama as a `tigon embed` output: its embedding.json says last-token pooling."""
    path = tmp_path_factory.mktemp("embedder")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    (path / "embedding.json").write_text(json.dumps({"pooling": "last", "normalize": True, "append_eos": True,
                                                     "max_length": 64}))
    return path


@pytest.fixture(scope="module")
def server(embed_dir):
    started = start_server(embed_dir)
    yield started
    if started["proc"].poll() is None:
        started["proc"].kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0)


def _in_process(embed_dir, texts):
    from tigon.train.embed import embed_texts, load_embedder

    decoder, tokenizer, settings = load_embedder(str(embed_dir))
    return embed_texts(decoder, tokenizer, texts, settings)


TEXTS = ["Where does Anna live?", "Anna lives in Paris.", "a much longer text than the others, with more words in it",
         "x"]


def test_embeddings_equal_the_models_own(client, embed_dir):
    want = _in_process(embed_dir, TEXTS)
    got = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 by default
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    vectors = torch.tensor([d.embedding for d in got.data])
    assert vectors.shape == want.shape and torch.allclose(vectors, want, atol=1e-5)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    floats = client.embeddings.create(model=NAME, input=TEXTS[0], encoding_format="float")
    assert torch.allclose(torch.tensor(floats.data[0].embedding), want[0], atol=1e-5)


def test_dimensions_token_ids_and_base64(client, server, embed_dir):
    from transformers import AutoTokenizer

    want = _in_process(embed_dir, TEXTS[:2])
    short = client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=16, encoding_format="float")
    assert torch.allclose(torch.tensor([d.embedding for d in short.data]),
                          torch.nn.functional.normalize(want[:, :16], dim=-1), atol=1e-5)
    ids = AutoTokenizer.from_pretrained(embed_dir)(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model=NAME, input=[ids], encoding_format="float")
    assert torch.allclose(torch.tensor(by_ids.data[0].embedding), want[0], atol=1e-5)
    raw = httpx.post(server["base"] + "/v1/embeddings",
                     json={"model": NAME, "input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert torch.allclose(torch.from_numpy(decoded.copy()), want[1], atol=1e-5)


def test_bad_embedding_requests_get_openai_errors(client, server):
    def refused(**kwargs):
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(**{"model": NAME, **kwargs})
        assert err.value.status_code == 400
        return err.value.body

    assert refused(input="")["param"] == "input"
    assert refused(input=["fine", ""])["message"].startswith("input[1] is empty")
    assert refused(input="word " * 2000)["code"] == "context_length_exceeded"
    assert refused(input=[[10 ** 9]])["param"] == "input"
    assert refused(input=["a"] * 2049)["param"].startswith("input")
    assert refused(input="hi", dimensions=100000)["param"] == "dimensions"
    assert refused(input="hi", extra_body={"truncate": True})["message"].startswith("unrecognized request argument")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    # An embedding model generates nothing.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "/v1/embeddings" in err.value.body["message"]
    r = httpx.post(server["base"] + "/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
