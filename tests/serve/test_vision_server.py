"""`tigon serve` on the built-in tiny vision-language model (random weights, saved with its
processor), driven by the official openai client: images as data: URLs and files get the answer
the model gives in process; every hostile image is a 400 naming the problem, and the server lives on."""

import base64
import io
import struct
import zlib

import pytest
import torch

from tests.helpers import save_tiny_vlm
from tests.serve.test_server import NAME, start_server
from tigon.train import tiny_vlm
from tigon.train.vision import VisionPrompt, load_vision_for_inference, user_turn, vision_generate

openai = pytest.importorskip("openai")
try:  # the HTTP client under openai: httpx, renamed httpx2 from openai 3
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

# One worker sets up its models and server (module fixtures) once, rather than each worker its own.
pytestmark = pytest.mark.xdist_group("serve-vision_server")

QUESTION = tiny_vlm.QUESTION
MAX_IMAGES = 2


def png(size=(56, 56), colour=(220, 40, 40), mode="RGB") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, format="PNG")
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels, with a few bytes of pixel data: a
    decompression bomb's shape, refused before anything is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """The model's folder; an image folder (--image-root) with a picture, a link out of it and a
    secret picture beside it, outside."""
    root = tmp_path_factory.mktemp("vision-serve")
    model = save_tiny_vlm(root / "model")
    images = root / "images"
    images.mkdir()
    picture = tiny_vlm.shapes_task(1, seed=3)[0].images[0]
    (images / "shape.png").write_bytes(picture)
    (root / "secret.png").write_bytes(png(colour=(1, 2, 3)))
    (images / "link.png").symlink_to(root / "secret.png")
    return {"root": root, "model": model, "images": images, "picture": picture}


def stop(started):
    started["proc"].kill()
    started["proc"].wait()


def openai_client(started):
    return openai.OpenAI(base_url=started["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(place):
    started = start_server(place["model"], "--image-root", str(place["images"]), "--max-images", str(MAX_IMAGES),
                           "--dtype", "fp32")
    yield started
    stop(started)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def ask(client, *urls, text=QUESTION, max_tokens=6, **options):
    content = [*({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": text}]
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, **options)


def in_process(place, image: bytes, max_tokens: int) -> str:
    torch.manual_seed(0)
    model, encoder = load_vision_for_inference(str(place["model"]), torch.float32)
    prompt = VisionPrompt((user_turn(QUESTION, 1),), (image,), QUESTION)
    return vision_generate(model, encoder, prompt, max_tokens)


def test_an_image_gets_the_models_answer_about_it(client, place):
    """A data: URL, a file of the image folder by relative path, by file:// URL: the answer the
    model gives in process (greedy), its prompt counting the image's tokens; streamed alike."""
    want = in_process(place, place["picture"], 6)
    assert want and want != in_process(place, tiny_vlm.shapes_task(2, seed=3)[1].images[0], 6)  # it reads the image
    reply = ask(client, data_url(place["picture"]))
    assert reply.choices[0].message.content.strip() == want
    assert reply.choices[0].finish_reason in ("stop", "length")
    text_only = ask(client)
    assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens  # the image's tokens are in the prompt
    for url in ("shape.png", f"file://{place['images'] / 'shape.png'}"):
        assert ask(client, url).choices[0].message.content.strip() == want, url
    stream = ask(client, data_url(place["picture"]), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip() == want


@pytest.mark.parametrize("url, reason", [
    ("https://example.com/cat.png", "a remote URL: this server fetches nothing"),
    ("http://127.0.0.1:9/cat.png", "a remote URL: this server fetches nothing"),
    ("../secret.png", "outside the folders this server reads images from"),
    ("{root}/secret.png", "outside the folders this server reads images from"),
    ("file://{root}/secret.png", "outside the folders this server reads images from"),
    ("/etc/passwd", "outside the folders this server reads images from"),
    ("link.png", "outside the folders this server reads images from"),
    ("missing.png", "no such image file"),
    ("ftp://example.com/cat.png", "the URL scheme 'ftp' is not taken"),
    ("data:image/png;base64,iVBORw0KGgo@@@", "its base64 payload is not valid"),
    ("data:image/png,rawbytes", "must be base64"),
    ("text", "no such image file"),
])
def test_hostile_image_sources_are_a_400_naming_the_reason(client, server, place, url, reason):
    url = url.format(root=place["root"])
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, url)
    error = refused.value.body
    assert refused.value.status_code == 400 and reason in error["message"], error
    assert error["param"] == "messages[0].content[0].image_url.url"
    assert "SECRET" not in error["message"] and str(place["root"]) not in error["message"]
    assert httpx.get(server["base"] + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("image, reason", [
    (png_header_only(100_000, 100_000), "too large to decode"),  # past Pillow's own bomb bound
    (png_header_only(5000, 5000), "5000x5000 pixels, more than the 16777216 allowed"),
    (png(size=(4097, 4097), colour=0, mode="1"), "4097x4097 pixels, more than the 16777216 allowed"),  # a real one, 6 KB
    (b"GIF89a" + b"\0" * 32, "not a readable PNG, JPEG or WebP image"),
    (b"%PDF-1.4 not a picture", "not a readable PNG, JPEG or WebP image"),
    (png()[:40], "not a readable PNG, JPEG or WebP image"),  # cut short
])
def test_bombs_and_broken_images_are_refused_before_decoding(client, server, image, reason):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, data_url(image))
    assert refused.value.status_code == 400 and reason in refused.value.body["message"], refused.value.body
    assert httpx.get(server["base"] + "/health", timeout=5).status_code == 200


def test_too_many_images_and_an_oversized_data_url_are_refused(client, server, place):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, *[data_url(place["picture"])] * (MAX_IMAGES + 1))
    assert f"holds {MAX_IMAGES + 1} images; this server takes at most {MAX_IMAGES}" in refused.value.body["message"]
    assert ask(client, *[data_url(place["picture"])] * MAX_IMAGES).choices[0].message.content is not None


def test_the_server_answers_after_every_refusal(client, place):
    """Run last in this module: after all the refusals above, an image still gets its answer."""
    assert ask(client, data_url(place["picture"])).choices[0].message.content.strip() == in_process(
        place, place["picture"], 6)


def test_an_image_to_a_text_only_model_is_a_400(tiny_dir, place):
    started = start_server(tiny_dir)
    try:
        client = openai_client(started)
        with pytest.raises(openai.BadRequestError) as refused:
            ask(client, data_url(place["picture"]))
        assert "an image, but this server's model is text-only" in refused.value.body["message"]
        assert refused.value.body["param"] == "messages[0].content[0].image_url.url"
        assert ask(client, text="Hi").choices[0].message.content is not None  # text still answered
    finally:
        stop(started)


def test_image_flags_on_a_text_model_are_one_line(tiny_dir, place, capsys):
    from tests.serve.test_server import _free_port
    from tigon.cli import main

    assert main(["serve", str(tiny_dir), "--image-root", str(place["images"]), "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert "--image-root: only for a vision-language model" in err and err.count("\n") == 1, err


def test_requests_past_the_waiting_bound_are_a_503(place):
    """In process: with as many requests waiting as the engine takes, one more is refused before
    its image is decoded; once they are done, it is answered."""
    from fastapi.testclient import TestClient

    from tigon.serve.engine import VisionEngine
    from tigon.serve.server import ServedModel, build_app

    model, encoder = load_vision_for_inference(str(place["model"]), torch.float32)
    engine = VisionEngine(model, encoder.processor.tokenizer, max_waiting=1)
    served = ServedModel(engine, encoder.processor.tokenizer, NAME, 512, vision=encoder)
    content = [{"type": "image_url", "image_url": {"url": data_url(place["picture"])}}, {"type": "text", "text": QUESTION}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    with TestClient(build_app(served)) as http:
        engine.running.add(-1)  # one request already there
        busy = http.post("/v1/chat/completions", json=body)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy", busy.text
        engine.running.discard(-1)
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"].strip() == in_process(
            place, place["picture"], 6)
