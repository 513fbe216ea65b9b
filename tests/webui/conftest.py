"""A `tigon webui` server on a free port for the tests of this folder, its runs in a temporary
directory, and the Chromium that takes the screenshots."""

import os
import shutil
import signal
import socket
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported

from gradio_client import Client  # noqa: E402

from tigon.webui.app import build_app, launch  # noqa: E402
from tigon.webui.runs import RUNNING, RunStore  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "webui"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def ui(runs_dir):
    """The server's URL. Its training processes run tigon's PyTorch references on the CPU, as a
    user's CPU run does: under Triton's interpreter 40 steps of the tiny model take minutes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        mp.setenv("HF_HUB_OFFLINE", "1")  # no network here: a hub id fails at once
        app = build_app(runs_dir)
        port = _free_port()
        launch(app, runs_dir, "127.0.0.1", port)
        try:
            yield f"http://127.0.0.1:{port}/"
        finally:
            app.close()
            store = RunStore(runs_dir)
            for name in store.names():  # a failed test may leave a run going: end it
                pid = store._record(name).get("pid")
                if pid and store.info(name).status == RUNNING:
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(ui):
    return Client(ui, verbose=False)


def find_chromium() -> str | None:
    for candidate in (os.environ.get("TIGON_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser"),
                      "/usr/bin/chromium"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.fixture(scope="module")
def browser_page(tmp_path_factory):
    """A page of a headless Debian Chromium driven by Playwright (which downloads no browser
    here: it is given Chromium's path). Skips, saying why, only when no Chromium is installed."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set TIGON_CHROMIUM): no screenshots taken")
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh one: no first-run or sync traffic
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=chromium, args=CHROMIUM_FLAGS,
                                                       headless=True, viewport={"width": 1280, "height": 1000})
        try:
            yield context.new_page()
        finally:
            context.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Where screenshots go: a pytest temporary directory, copied to test-artifacts/webui/ (git-ignored)."""
    here = tmp_path_factory.mktemp("screenshots")
    yield here
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for png in here.glob("*.png"):
        shutil.copy2(png, ARTIFACTS / png.name)
