"""`tigon webui` as an attacker sees it: the real command (`python -m tigon.cli webui`, with a
login) on 127.0.0.1, driven with the real gradio_client and with raw HTTP (httpx), the way a
browser calls the handlers the API page does not list. Each attack of issue 37: a login
skipped or wrong; a Python file uploaded and then named as a dataset, an upload, or a reward
function; paths out of the runs folder (.., absolute, symbolic links) for the preview, a run's
model and data, the export and the chat; options smuggled into "more options"; Gradio's file
route asked for files of the runs folder and beyond. The runs folder is left as it was and
nothing outside it is written."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from tigon.cli import main
from tigon.security import is_loopback

from .conftest import _free_port

pytestmark = [pytest.mark.xdist_group("webui-security")]  # one server (a process of its own), one browser

USER, PASSWORD = "alice", "correct horse battery staple"
ROW = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "SECRET-ROW"}]}\n'
EVIL = ("import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"
        "def f(prompts, completions, **kw):\n    return [1.0]\n")
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A runs folder with one upload, a link out of it and a run folder that is a link out, in
    the folder Gradio is told to keep its cache in; and elsewhere a secret data file, a model
    folder and the login file."""
    top, outside, private = (tmp_path_factory.mktemp(name) for name in ("attack", "outside", "private"))
    runs = top / "runs"
    (runs / "uploads").mkdir(parents=True)
    (outside / "final").mkdir(parents=True)
    (outside / "secret.jsonl").write_text(ROW)
    (outside / "final" / "config.json").write_text("{}")
    (runs / "uploads" / "mine.jsonl").write_text(ROW.replace("SECRET-ROW", "my own row"))
    (runs / "link").symlink_to(outside)
    (runs / "uploads" / "linked.jsonl").symlink_to(outside / "secret.jsonl")
    auth = private / "auth"
    auth.write_text(f"# who may log in\n{USER}:{PASSWORD}\n")
    return {"top": top, "runs": runs, "outside": outside, "rel": os.path.relpath(outside, runs), "auth": auth,
            "marker": outside.parent / "evil-ran"}


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): (p.read_text() if p.is_file() else "")
            for p in sorted(folder.rglob("*")) if not p.is_symlink()}


@pytest.fixture(scope="module")
def server(place):
    """`tigon webui --auth-file` as a process of its own; its URL once it listens. Gradio's cache is
    the folder above the runs folder, whose files Gradio would serve but for the UI's blocked_paths."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False",
           "GRADIO_TEMP_DIR": str(place["top"])}
    env.pop("TRITON_INTERPRET", None)
    env.pop("TIGON_WEBUI_AUTH", None)
    proc = subprocess.Popen([sys.executable, "-m", "tigon.cli", "webui", "--port", str(port), "--runs",
                             str(place["runs"]), "--auth-file", str(place["auth"])], cwd=place["top"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()  # the UI says where it listens once it does
        assert first.startswith(f"tigon webui: http://127.0.0.1:{port} ") and "login required" in first, first
        yield f"http://127.0.0.1:{port}/"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return Client(server, auth=(USER, PASSWORD), verbose=False)


@pytest.fixture(scope="module")
def browser(server):
    """Raw HTTP with a logged-in session, as the page's own requests are."""
    with httpx.Client(base_url=server, timeout=60) as http:
        assert http.post("login", data={"username": USER, "password": PASSWORD}).json() == {"success": True}
        yield http


@pytest.fixture(scope="module")
def handlers(browser):
    """fn_index of each event handler, by its api_name or, for the handlers the API does not
    list, by what it reads: the page calls all of them by number."""
    config = browser.get("config").json()
    types = {c["id"]: c["type"] for c in config["components"]}
    found = {}
    for dep in config["dependencies"]:
        if dep.get("api_name") and dep.get("api_visibility", "public") == "public":
            found[dep["api_name"]] = dep["id"]
        elif [types[i] for i in dep["inputs"]] == ["file"]:
            found["upload"] = dep["id"]
        elif len(dep["inputs"]) == 14 and "show_command" not in found:  # the Train tab's fields
            found["show_command"] = dep["id"]
    assert {"upload", "show_command", "start", "preview", "export_merged", "chat"} <= set(found), found
    return found


def call(http: httpx.Client, fn_index: int, data: list) -> dict:
    """One handler called through the queue as the page calls it: its process_completed message."""
    session = uuid.uuid4().hex
    body = {"data": data, "fn_index": fn_index, "session_hash": session, "event_data": None, "trigger_id": None}
    # json.dumps writes NaN as Python reads it back: a value no widget sends, but a request can
    joined = http.post("gradio_api/queue/join", content=json.dumps(body), headers={"content-type": "application/json"})
    assert joined.status_code == 200, joined.text
    deadline = time.monotonic() + 60
    with http.stream("GET", "gradio_api/queue/data", params={"session_hash": session}) as events:
        for line in events.iter_lines():
            assert time.monotonic() < deadline
            if line.startswith("data:") and (msg := json.loads(line[5:]))["msg"] == "process_completed":
                return msg
    raise AssertionError("the queue closed without an answer")


def upload(http: httpx.Client, name: str, content: bytes) -> str:
    """A file sent to Gradio's generic upload route (which takes any file): the path it answers."""
    answer = http.post("gradio_api/upload", files={"files": (name, content)})
    assert answer.status_code == 200, answer.text
    return answer.json()[0]


def test_without_a_login_every_route_is_refused(server, place):
    with httpx.Client(base_url=server, timeout=30) as anyone:
        for method, route in [("GET", "config"), ("GET", "gradio_api/info"), ("POST", "gradio_api/upload"),
                              ("GET", f"gradio_api/file={place['runs']}/uploads/mine.jsonl"),
                              ("POST", "gradio_api/queue/join"), ("POST", "gradio_api/call/preview"),
                              ("POST", "gradio_api/run/preview")]:
            assert anyone.request(method, route, json={"data": []}).status_code == 401, route
        wrong = anyone.post("login", data={"username": USER, "password": "correct horse"})
        assert wrong.status_code == 400 and anyone.get("config").status_code == 401
    with pytest.raises(ValueError, match="credentials were not provided"):
        Client(server, verbose=False)
    with pytest.raises(ValueError, match="Could not login"):
        Client(server, auth=(USER, "wrong"), verbose=False)


def test_with_the_login_it_works(client, place):
    assert client.predict(api_name="/runs")["data"] == []
    summary, parts = client.predict("uploads/mine.jsonl", "", "sft", api_name="/preview")
    assert summary.startswith(f"{place['runs'] / 'uploads' / 'mine.jsonl'}: OpenAI messages, 1 rows"), summary
    assert "my own row" in json.dumps(parts)


def test_an_uploaded_python_file_goes_nowhere(browser, handlers, place):
    evil = upload(browser, "evil.py", EVIL.format(marker=str(place["marker"])).encode())
    before = _tree(place["runs"])
    # the upload handler takes data files only (Gradio's check of the File's types, then the UI's)
    done = call(browser, handlers["upload"], [{"path": evil, "orig_name": "evil.py",
                                               "meta": {"_type": "gradio.FileData"}}])
    assert not done["success"] and "Invalid file type" in json.dumps(done), done
    # ... and only files Gradio took as uploads: not one of the machine's
    done = call(browser, handlers["upload"], [{"path": str(place["outside"] / "secret.jsonl"),
                                               "meta": {"_type": "gradio.FileData"}}])
    assert not done["success"] and "SECRET-ROW" not in json.dumps(done), done
    # Gradio's copy is outside the runs folder: no dataset, no reward function
    for settings in ({"dataset": evil}, {"method": "grpo", "extra": f"--reward-funcs {evil}:f"},
                     {"method": "grpo", "extra": f"--reward-funcs=builtin:format,{evil}:f"}):
        done = call(browser, handlers["start"], _start_data(**settings))
        assert done["success"] and done["output"]["data"][2]["status"] == "error", done
    assert _tree(place["runs"]) == before and not place["marker"].exists()


def test_a_data_file_upload_lands_in_the_uploads_folder(browser, handlers, place):
    path = upload(browser, "my data.jsonl", ROW.encode())
    done = call(browser, handlers["upload"], [{"path": path, "orig_name": "my data.jsonl",
                                               "meta": {"_type": "gradio.FileData"}}])
    assert done["success"] and done["output"]["data"][0] == "uploads/my_data.jsonl", done
    assert (place["runs"] / "uploads" / "my_data.jsonl").read_text() == ROW
    done = call(browser, handlers["upload"], [{"path": path, "orig_name": "my data.jsonl",
                                               "meta": {"_type": "gradio.FileData"}}])
    assert done["output"]["data"][0] == "uploads/my_data-2.jsonl"  # the first one is kept


OUT_OF_THE_FOLDER = ["{rel}/secret.jsonl", "{outside}/secret.jsonl", "{runs}/{rel}/secret.jsonl",
                     "link/secret.jsonl", "uploads/linked.jsonl", "uploads/../{rel}/secret.jsonl"]


def _paths(templates: list[str], place: dict) -> list[str]:
    return [t.format(**place) for t in templates]


def test_the_preview_reads_nothing_outside_the_runs_folder(client, place):
    for path in _paths(OUT_OF_THE_FOLDER, place):
        summary, parts = client.predict(path, "", "sft", api_name="/preview")
        assert "outside the runs folder" in summary and "SECRET" not in summary and parts == [], (path, summary)
    huge = place["runs"] / "uploads" / "huge.jsonl"
    with huge.open("wb") as f:  # sparse: no disk taken
        f.truncate(3 * 2**30)
    summary, parts = client.predict("uploads/huge.jsonl", "", "sft", api_name="/preview")
    assert summary == f"{huge}: 3,072 MiB, more than the preview reads (256 MiB): the run reads it when it starts"
    huge.unlink()
    for model in _paths(["/etc", "{outside}/final", "{rel}/final", "link/final"], place):
        summary, parts = client.predict("uploads/mine.jsonl", model, "sft", api_name="/preview")
        assert "nor a hub id" in summary and parts == [], (model, summary)


def _start_data(**settings) -> list:
    fields = {"method": "sft", "model": "", "dataset": "", "tuner": "full", "lora_rank": 16, "lora_alpha": 0,
              "lr": 0, "max_steps": 3, "max_length": 0, "save_steps": 0, "packing": False, "kernels": True,
              "extra": "", "name": ""}
    return list({**fields, **settings}.values())


SMUGGLED = {
    "--reward-funcs x.py:f": "only the built-in rewards",
    "--output-dir /tmp/x": "--output-dir: the run's folder",
    "--output-dir={outside}": "--output-dir: the run's folder",
    "--model /etc": "set it in the form's field \"model\"",
    "--dataset ../../secret.jsonl": "set it in the form's field \"dataset\"",
    "--eval-dataset {rel}/secret.jsonl": "outside the runs folder",
    "--teacher {outside}/final": "nor a hub id",
    "--config {outside}/secret.jsonl": "--config: a settings file",
    "--resume {outside}/final": "--resume: the UI starts new runs",
    "--out /tmp/x": "unrecognized arguments",
    "--epochs 1 ; touch {top}/pwned": "unrecognized arguments",
}


def test_start_refuses_smuggled_options_and_paths(client, browser, handlers, place):
    before = _tree(place["runs"])
    attempts = [{"method": "grpo", "extra": extra.format(**place)} for extra in SMUGGLED]
    attempts += [{"model": m} for m in _paths(["/etc", "{outside}/final", "{rel}/final", "link/final"], place)]
    attempts += [{"dataset": d} for d in _paths(OUT_OF_THE_FOLDER, place)]
    attempts += [{"name": "{rel}".format(**place)}, {"name": "link"}]
    expected = list(SMUGGLED.values()) + ["nor a hub id"] * 4 + ["outside the runs folder"] * len(OUT_OF_THE_FOLDER)
    expected += ["run name '{rel}'".format(**place), "run 'link': outside the runs folder"]
    for settings, refusal in zip(attempts, expected):
        name, status, summary, *_ = client.predict(**settings, api_name="/start")
        assert name == "" and summary["status"] == "error" and refusal in summary["message"], (settings, summary)
        assert "\n" not in summary["message"]
    done = call(browser, handlers["start"], _start_data(lr=float("nan")))
    assert done["success"] and done["output"]["data"][2] == {"status": "error", "message": "nan is not a number"}, done
    with pytest.raises(AppError, match="evil is not in the list of choices"):  # Gradio's own check, then the UI's
        client.predict(method="evil", api_name="/start")
    assert _tree(place["runs"]) == before and not (place["top"] / "pwned").exists()
    assert sorted(p.name for p in place["outside"].iterdir()) == ["final", "secret.jsonl"]


def test_export_and_chat_stay_in_the_runs_folder(client, place):
    for path in _paths(["{rel}/final", "{outside}/final", "{runs}/{rel}/final", "link/final", "/etc",
                        "uploads", "."], place):
        result = client.predict(path, "auto", api_name="/export_merged")
        assert result.startswith("`model ") and ("outside the runs folder" in result or "no model directory" in result)
        history, _, status = client.predict(path, "hi", [], "", 8, 0.0, api_name="/chat")
        assert history == [] and ("outside the runs folder" in status or "no model directory" in status), status
    with pytest.raises(AppError, match="not in the list of choices"):  # Gradio's own check, then the UI's
        client.predict("link/final", "--output=/tmp/x", api_name="/export_merged")
    with pytest.raises(AppError, match="greater than maximum value 512"):  # the slider's range holds for the API
        client.predict("", "hi", [], "", 10**9, 0.0, api_name="/chat")
    assert sorted(p.name for p in place["outside"].iterdir()) == ["final", "secret.jsonl"]


def test_gradio_serves_no_file_of_the_runs_folder_or_beyond(browser, place):
    for path in [place["runs"] / "uploads" / "mine.jsonl", place["outside"] / "secret.jsonl", Path("/etc/passwd"),
                 place["auth"]]:
        answer = browser.get(f"gradio_api/file={path}")
        assert answer.status_code == 403 and "SECRET" not in answer.text and PASSWORD not in answer.text, path
    # what it does serve back, its own copies of uploads, comes as a download, never as a page
    html = upload(browser, "page.html", b"<script>alert(1)</script>")
    answer = browser.get(f"gradio_api/file={html}")
    assert answer.headers["content-type"] == "application/octet-stream"
    assert answer.headers["content-disposition"].startswith("attachment")


def test_a_non_loopback_host_needs_a_login(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TIGON_WEBUI_AUTH", raising=False)
    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]")))
    for host in ("0.0.0.0", "192.0.2.7", "::", "example.org"):
        assert main(["webui", "--host", host, "--runs", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tigon webui: error: --host {host} can be reached from other machines") and \
            "TIGON_WEBUI_AUTH=USER:PASSWORD" in err and "--insecure" in err and err.count("\n") == 1
    monkeypatch.setenv("TIGON_WEBUI_AUTH", "nocolon")
    assert main(["webui", "--runs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "tigon webui: error: $TIGON_WEBUI_AUTH: expected USER:PASSWORD\n"
    monkeypatch.delenv("TIGON_WEBUI_AUTH")
    bad = tmp_path / "auth"
    bad.write_text("alice:pw\nbob\n")
    assert main(["webui", "--host", "0.0.0.0", "--auth-file", str(bad), "--runs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"tigon webui: error: --auth-file {bad} line 2: expected USER:PASSWORD\n"
    assert list(tmp_path.iterdir()) == [bad]  # refused before anything was made
