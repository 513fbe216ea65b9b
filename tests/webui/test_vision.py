"""The web UI with images: the Chat tab takes an uploaded image for a vision-language model (the
built-in tiny one, random weights, saved in the runs folder) and answers as the model does in
process; the Train tab's preview shows thumbnails of an image data file's first images, bounded in
count and size, and reads no image outside the runs folder. Through the API and the real browser."""

import base64
import io
import json
import re

import pytest
import torch
from gradio_client import handle_file

from tests.helpers import save_tiny_vlm
from tigon.train import tiny, tiny_vlm
from tigon.train.data import load_samples
from tigon.train.vision import VisionPrompt, load_vision_for_inference, user_turn, vision_generate
from tigon.webui.models import THUMBNAIL_SIDE, THUMBNAILS

QUESTION = tiny_vlm.QUESTION
TOKENS = 5
UI_TOKENS = 64  # the page's default

# One worker sets up the server, its models and the browser once, rather than each worker its own.
pytestmark = [pytest.mark.xdist_group("webui-vision")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The UI answers in this process: the tiny model gains nothing from threads, and on a busy
    machine OpenMP's spinning threads made its answers many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def place(runs_dir, tmp_path_factory):
    """A vision-language model and a text-only one in the runs folder, a picture to upload, and an
    image data file of 12 rows in uploads/ (its images beside it, one row's image a data: URL and
    one's a path out of the runs folder)."""
    save_tiny_vlm(runs_dir / "vlm" / "final")
    samples = load_samples([str(tiny.BUNDLED_DATASET)], seed=0)
    tokenizer = tiny.build_tokenizer(samples)
    tiny.build_model(tokenizer, seed=0).save_pretrained(runs_dir / "text" / "final")
    tokenizer.save_pretrained(runs_dir / "text" / "final")

    outside = tmp_path_factory.mktemp("outside")
    (outside / "secret.png").write_bytes(_png((300, 300)))
    data = runs_dir / "uploads"
    (data / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, sample in enumerate(tiny_vlm.shapes_task(12, seed=4)):
        (data / "img" / f"{i}.png").write_bytes(sample.images[0])
        image = f"img/{i}.png"
        if i == 1:
            image = "data:image/png;base64," + base64.b64encode(_png((400, 200))).decode()
        if i == 2:
            image = str(outside / "secret.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                               {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": f"answer {i}"}]})
    (data / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    picture = tmp_path_factory.mktemp("upload") / "shape.png"
    picture.write_bytes(tiny_vlm.shapes_task(1, seed=9)[0].images[0])
    return {"vlm": runs_dir / "vlm" / "final", "text": runs_dir / "text" / "final", "picture": picture}


def _png(size):
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (30, 120, 200)).save(out, format="PNG")
    return out.getvalue()


def _in_process(place, turns, images, tokens=TOKENS):
    model, encoder = load_vision_for_inference(str(place["vlm"]), torch.float32)
    return vision_generate(model, encoder, VisionPrompt(tuple(turns), tuple(images), ""), tokens)


def _letters(text):
    """The letters of a random model's answer: its control characters and stray bytes the page shows otherwise."""
    return re.sub(r"[^A-Za-z]", "", text)


def test_chat_answers_about_an_uploaded_image(client, place):
    picture = place["picture"].read_bytes()
    history, message, status = client.predict(str(place["vlm"]), QUESTION, [], "", TOKENS, 0.0,
                                              handle_file(str(place["picture"])), api_name="/chat")
    assert message == "" and status.startswith("answered by"), status
    reply = history[-1]
    assert reply["role"] == "assistant"
    answer = "".join(part["text"] for part in reply["content"])
    assert answer and answer == _in_process(place, [user_turn(QUESTION, 1)], [picture])
    assert any(part.get("type") == "file" for m in history if m["role"] == "user" for part in m["content"])
    # a follow-up in the same session: the model still sees the image, from the session's state (the
    # client sends the history's files back as uploads; the UI reads none of them)
    for m in history:
        for part in m["content"]:
            if part.get("type") == "file":
                part["file"] = handle_file(part["file"])
    history, _, status = client.predict(str(place["vlm"]), "And?", history, "", TOKENS, 0.0, None, api_name="/chat")
    follow = "".join(part["text"] for part in history[-1]["content"])
    want = _in_process(place, [user_turn(QUESTION, 1), {"role": "assistant", "content": [{"type": "text",
                                                                                             "text": answer}]},
                               user_turn("And?", 0)], [picture])
    assert follow == want, status


def test_an_image_to_a_text_model_or_a_broken_image_is_one_line(client, place, tmp_path):
    history, message, status = client.predict(str(place["text"]), "Hi", [], "", 4, 0.0,
                                              handle_file(str(place["picture"])), api_name="/chat")
    assert history == [] and message == "Hi" and "is a text-only model: it takes no images" in status, status
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n and then nothing")
    history, _, status = client.predict(str(place["vlm"]), "Hi", [], "", 4, 0.0, handle_file(str(broken)),
                                        api_name="/chat")
    assert history == [] and "not a readable PNG, JPEG or WebP image" in status, status
    # text alone still goes to a text model as before
    history, _, status = client.predict(str(place["text"]), "Hi", [], "", 4, 0.0, api_name="/chat")
    assert history[-1]["role"] == "assistant", status


def test_the_preview_shows_bounded_thumbnails_from_the_runs_folder_only(client, place):
    update = client.predict("uploads/shapes.jsonl", api_name="/preview_images")
    gallery = update["value"]
    assert "line 3, image 1: outside the runs folder" in update["label"] and update["visible"]
    assert len(gallery) == THUMBNAILS - 1  # the first 8 images, less the one outside the runs folder
    captions = [item["caption"] for item in gallery]
    assert "line 1, image 1" in captions and "line 3, image 1" not in captions
    from PIL import Image

    sizes = [Image.open(item["image"] if isinstance(item["image"], str) else item["image"]["path"]).size
             for item in gallery]
    assert all(max(size) <= THUMBNAIL_SIDE for size in sizes), sizes
    assert (THUMBNAIL_SIDE, THUMBNAIL_SIDE // 2) in sizes  # the 400x200 data: URL image, scaled down
    summary, parts = client.predict("uploads/shapes.jsonl", "", "sft", api_name="/preview")
    assert "12 rows, 12 images" in summary and "<image>" in json.dumps(parts), summary
    for elsewhere in ("uploads/../../etc/passwd", "/etc/passwd", ""):
        assert client.predict(elsewhere, api_name="/preview_images")["value"] == [], elsewhere


def test_the_browser_uploads_an_image_to_the_chat_and_sees_thumbnails(ui, client, place, browser_page, artifacts):
    # loaded before the page asks the UI to load it: two loads at once in one process clash in transformers
    want = _letters(_in_process(place, [user_turn(QUESTION, 1)], [place["picture"].read_bytes()], UI_TOKENS))
    assert want
    page = browser_page
    page.goto(ui, wait_until="load", timeout=60_000)
    # The load-time preview has drawn: the app is mounted and its listeners take the Enter below (one
    # pressed before, on a loaded machine, reached no listener and nothing ever came).
    page.wait_for_selector("#preview-sample .textfield", timeout=120_000)
    dataset = page.locator("#train-dataset textarea, #train-dataset input").first
    dataset.fill("uploads/shapes.jsonl")
    dataset.press("Enter")
    # generous: CI's other worker keeps both cores busy while the UI reads and shrinks twelve images
    page.wait_for_function(f"() => document.querySelectorAll('#preview-images img').length === {THUMBNAILS - 1}",
                           timeout=180_000)
    page.wait_for_function("() => document.querySelector('#preview-summary')?.innerText.includes('12 images')",
                           timeout=180_000)
    widths = page.locator("#preview-images img").evaluate_all("imgs => imgs.map(i => i.naturalWidth)")
    assert widths and max(widths) <= THUMBNAIL_SIDE, widths
    page.screenshot(path=artifacts / "train-image-preview.png", full_page=True)

    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.get_by_role("tab", name="Chat").click()
    chosen = page.locator("#chat-model input")
    # the tab fills in the newest model when it opens: the choice is made after that
    page.wait_for_function("() => document.querySelector('#chat-model input')?.value.length > 0", timeout=30_000)
    for attempt in range(3):  # a refresh of the choices landing after the click can put the newest back
        chosen.fill("vlm/final")
        page.get_by_role("option", name="vlm/final", exact=True).click()
        try:
            page.wait_for_function("() => document.querySelector('#chat-model input')?.value === 'vlm/final'",
                                   timeout=20_000)
            break
        except PlaywrightTimeout:
            if attempt == 2:
                raise
    for attempt in range(3):  # on a loaded machine an upload has once vanished without a trace: send it again
        page.locator("#chat-image input[type=file]").set_input_files(str(place["picture"]))
        try:
            page.wait_for_function("() => document.querySelector('#chat-image')?.innerText.includes('shape.png')",
                                   timeout=60_000)
            break
        except PlaywrightTimeout:
            page.screenshot(path=artifacts / f"chat-image-upload-{attempt}.png", full_page=True)
            if attempt == 2:
                raise
    page.locator("#chat-message textarea").fill(QUESTION)
    page.locator("#chat-message textarea").press("Enter")
    try:
        page.wait_for_function("() => document.querySelector('#chat-status')?.innerText.includes('answered by')",
                               timeout=120_000)
    finally:
        page.screenshot(path=artifacts / "chat-image.png", full_page=True)
    assert _letters(page.locator("#chatbot .bot").first.inner_text()) == want
    assert page.locator("#chatbot .user img").count() == 1  # the uploaded image, shown in the chat
    page.wait_for_function("() => !document.querySelector('#chat-image')?.innerText.includes('shape.png')",
                           timeout=30_000)  # sent with the message: the upload box is empty again
    page.screenshot(path=artifacts / "chat-image.png", full_page=True)
