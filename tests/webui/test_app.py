"""`tigon webui` end to end on CPU: gradio_client drives runs of the built-in model through the
UI's API (to completion, into a CLI error, stopped), and a headless Chromium takes a screenshot
of each tab. The tests share one server and one finished run, so they stay on one xdist worker."""

import json
import socket
import time
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from tigon.cli import main
from tigon.train.checkpoint import list_checkpoints
from tigon.train.config import SFTError
from tigon.train.data import read_file
from tigon.webui.runs import LOG_FILE, METRICS_FILE, RunStore, log_tail

pytestmark = [
    pytest.mark.xdist_group("webui-app"),
    # gradio's queue, on pandas 3
    pytest.mark.filterwarnings("ignore:'future.no_silent_downcasting' is deprecated"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]

STEPS = 40  # enough for the tiny model's answers to be words rather than one "."
PROMPT = "Who are you?"


def wait_until_ended(client, name, timeout=240.0, seen=None):
    """/run_status until the run is no longer running; `seen` collects the summaries on the way."""
    deadline = time.monotonic() + timeout
    while True:
        status, summary, plot, log = client.predict(name, api_name="/run_status")[:4]
        if seen is not None:
            seen.append(summary)
        if summary["status"] != "running":
            return status, summary, plot, log
        assert time.monotonic() < deadline, f"run {name} still running after {timeout} s: {log[-500:]}"
        time.sleep(0.5)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    records = map(json.loads, (run_dir / METRICS_FILE).read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


BAD_ROW = '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}\n'
GOOD_ROW = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


@pytest.fixture(scope="module")
def started(client, runs_dir):
    """Every run the tests look at, started at once from the Train tab's API, so that their
    start-ups (imports, mostly) overlap: the built-in default (no model, bundled data), one on a
    file with a bad line 12 (in the runs folder, where the UI reads data) and one on a hub model that
    does not exist (the hub is offline here). (The run the stop test stops starts there: until then
    it would train beside these.)"""
    bad = runs_dir / "uploads" / "data.jsonl"
    bad.parent.mkdir(exist_ok=True)
    bad.write_text(GOOD_ROW * 11 + BAD_ROW)
    runs = {
        "default": client.predict(max_steps=STEPS, api_name="/start"),
        "bad data": client.predict(dataset=str(bad), max_steps=3, api_name="/start"),
        "no model": client.predict(model="no-such-org/no-such-model", tuner="lora", max_steps=3, api_name="/start"),
    }
    for what, (name, status, summary, *_) in runs.items():
        assert name and summary["status"] == "running", (what, status)
    return {what: out[0] for what, out in runs.items()} | {"bad file": bad}


@pytest.fixture(scope="module")
def default_run(client, runs_dir, started):
    """The built-in default run, polled from its start to its end."""
    name, seen = started["default"], []
    status, summary, plot, log = wait_until_ended(client, name, seen=seen)
    return {"name": name, "dir": runs_dir / name, "status": status, "summary": summary, "plot": plot, "log": log,
            "seen": seen}


def test_default_run_completes_and_reports_its_final_loss(default_run):
    summary, run_dir = default_run["summary"], default_run["dir"]
    assert summary["status"] == "finished" and summary["exit_code"] == 0, summary
    assert summary["command"] == f"tigon sft --tuner full --max-steps {STEPS} --output-dir {run_dir}"
    logged = losses(run_dir)
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    assert summary["final_loss"] == logged[-1][1] and (summary["step"], summary["total_steps"]) == (STEPS, STEPS)
    assert logged[-1][1] < 0.8 * logged[0][1]
    assert summary["tokens_per_s"] > 0 and summary["peak_memory"].endswith(("GiB host", "GiB GPU"))
    # the curve the UI draws is the run's metrics.jsonl
    drawn = [(row[1], row[2]) for row in default_run["plot"]["data"]]
    assert [s for s, _ in drawn] == [s for s, _ in logged]
    assert [loss for _, loss in drawn] == pytest.approx([loss for _, loss in logged], rel=1e-9)  # sent to 10 digits
    # streamed while it ran: progress went up through the polls
    steps = [s["step"] for s in default_run["seen"] if s["status"] == "running" and s["step"]]
    assert steps and steps == sorted(steps) and steps[0] < STEPS
    last = log_tail(run_dir / LOG_FILE)[-1]
    assert summary["message"] == last and str(run_dir / "final") in last  # sft's closing line: where the model is
    assert default_run["log"].splitlines()[-1] == last
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_bad_data_and_missing_model_show_the_cli_line(client, started):
    bad = started["bad file"]
    with pytest.raises(SFTError) as reader:
        read_file(str(bad), 0)
    assert "line 12" in str(reader.value)
    summary_line, _ = client.predict(str(bad), "", "sft", api_name="/preview")
    assert summary_line == f"`{reader.value}`"  # the preview reads the file as tigon sft does

    for what, line in {"bad data": f"tigon sft: error: {reader.value}", "no model": None}.items():
        status, summary, _, log = wait_until_ended(client, started[what])
        last = log.splitlines()[-1]  # the process's own last line
        assert summary["status"] == "failed" and summary["exit_code"] == 2
        assert summary["message"] == last and status.endswith(f"`{last}`") and "Traceback" not in log
        if line is not None:
            assert last == line
        else:
            assert last.startswith("tigon sft: error: ") and "no-such-org/no-such-model" in last


def test_stop_ends_the_run_and_keeps_its_last_checkpoint(client, runs_dir):
    name, _, summary, *_ = client.predict(max_steps=5000, save_steps=5, extra="--samples 0 --save-limit 2",
                                          api_name="/start")
    assert name and summary["status"] == "running", summary
    deadline = time.monotonic() + 240
    while (summary := client.predict(name, api_name="/run_status")[1])["status"] == "running" and \
            (summary["step"] or 0) <= 6:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert summary["status"] == "running", summary
    assert "stopping (SIGINT)" in client.predict(name, api_name="/stop")
    _, summary, _, _ = wait_until_ended(client, name)
    run_dir = runs_dir / name
    assert summary["status"] == "stopped" and summary["step"] < 5000, summary
    kept = list_checkpoints(run_dir)
    assert kept and (kept[-1] / "trainer_state.json").is_file() and summary["checkpoint"] == kept[-1].name
    lines = log_tail(run_dir / LOG_FILE)
    # tigon sft saves a checkpoint on SIGINT and says so
    assert summary["exit_code"] == 130 and summary["message"] in lines and summary["message"].startswith("tigon sft:")
    state = json.loads((kept[-1] / "trainer_state.json").read_text())
    assert state["global_step"] == summary["step"]


def test_export_merged_calls_tigon_export(client, default_run):
    final = default_run["dir"] / "final"
    result = client.predict(str(final), "auto", api_name="/export_merged")
    out = default_run["dir"] / "export-merged"
    assert result == f"done: `tigon export: {final} -> {out} (float32)`"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    # Again: the UI's own export folder is replaced, not refused as a folder that holds files.
    assert client.predict(str(final), "auto", api_name="/export_merged") == result


def _not_blank(path: Path, min_colours: int = 8) -> None:
    image = Image.open(path).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) >= min_colours, f"{path.name}: {len(colours or [])} colours"
    assert max(ImageStat.Stat(image).stddev) > 5, f"{path.name} is nearly uniform"


def _line_drawn(page, plot_id: str) -> None:
    """The Vega plot in `plot_id` has drawn a line mark with points."""
    page.wait_for_function(f"""() => [...document.querySelectorAll('#{plot_id} .mark-line path')]
                                    .some(p => (p.getAttribute('d') || '').length > 20)""", timeout=60_000)


def test_screenshots_of_each_tab(ui, client, default_run, browser_page, artifacts):
    page, name = browser_page, default_run["name"]
    # The page's load event, then the waits below for what each check needs: "networkidle" (no
    # request for 500 ms) timed out at 60 s on a loaded two-core CI machine, where Gradio's
    # requests overlap.
    page.goto(f"{ui}?run={name}", wait_until="load", timeout=60_000)

    # Train: the finished run, its loss curve, the preview of the bundled data
    page.wait_for_function("document.querySelector('#train-run textarea, #train-run input')?.value.length > 0",
                           timeout=60_000)
    assert page.locator("#train-run textarea, #train-run input").first.input_value() == name
    _line_drawn(page, "train-loss-plot")
    page.wait_for_selector("#preview-sample .textfield", timeout=60_000)
    assert "I am Tigon" in page.locator("#preview-sample").inner_text()
    assert f"{name}: finished" in page.locator("#train-status").inner_text()
    page.screenshot(path=artifacts / "train.png", full_page=True)
    page.locator("#train-loss-plot").screenshot(path=artifacts / "train-loss-plot.png")

    # Runs: the table and the overlaid curves
    page.get_by_role("tab", name="Runs").click()
    page.wait_for_function("n => document.querySelector('#runs-table')?.innerText.includes(n)", arg=name,
                           timeout=30_000)
    _line_drawn(page, "runs-loss-plot")
    page.screenshot(path=artifacts / "runs.png", full_page=True)

    # Chat: the default run's final model answers; the page shows what the API answers
    reply = client.predict(str(default_run["dir"] / "final"), PROMPT, [], "", 64, 0.0, api_name="/chat")[0][-1]
    answer = "".join(part["text"] for part in reply["content"])
    assert reply["role"] == "assistant" and answer.strip()
    page.get_by_role("tab", name="Chat").click()
    assert page.locator("#chat-model input").input_value() == f"{name}/final"
    page.locator("#chat-message textarea").fill(PROMPT)
    page.locator("#chat-message textarea").press("Enter")
    page.wait_for_selector("#chatbot .bot", timeout=60_000)
    page.wait_for_function("t => document.querySelector('#chatbot .bot')?.innerText.trim() === t", arg=answer.strip(),
                           timeout=60_000)
    page.screenshot(path=artifacts / "chat.png", full_page=True)

    for png in ("train.png", "train-loss-plot.png", "runs.png", "chat.png"):
        _not_blank(artifacts / png)


def test_the_live_chart_draws_a_run_started_from_the_page(ui, client, default_run, browser_page):
    """A run started with the page's Start button, on a page that opened with no curve to show:
    while it trains, the chart draws its points on number axes (it drew no line until a reload,
    its axes reading steps and losses as categories), and Stop is enabled while the run runs,
    and only then."""
    page = browser_page
    page.goto(f"{ui}?run=not-started-yet", wait_until="load", timeout=60_000)
    page.wait_for_function("() => document.querySelector('#train-status')?.innerText.includes('not-started-yet')",
                           timeout=60_000)
    assert page.locator("#stop").is_disabled()
    page.get_by_label("steps").first.fill("2000")
    page.get_by_label("more options").first.fill("--samples 0")
    page.locator("#start").click()
    page.wait_for_function("""() => { const m = document.querySelector('#train-status')?.innerText
                                          .match(/running · step (\\d+)/); return m && +m[1] >= 4; }""",
                           timeout=180_000)
    name = page.locator("#train-run textarea, #train-run input").first.input_value()
    assert name != default_run["name"] and page.locator("#stop").is_enabled()
    _line_drawn(page, "train-loss-plot")
    line = page.locator("#train-loss-plot .mark-line path").first.get_attribute("aria-label")
    assert "undefined" not in line, line  # the line's points have their losses
    ticks = page.locator("#train-loss-plot .role-axis-label text").evaluate_all("ts => ts.map(t => t.textContent)")
    assert ticks and all(len(t) <= 5 and float(t) >= 0 for t in ticks), ticks  # numbers, not 6.3040752411
    page.locator("#stop").click()
    page.wait_for_function("() => !document.querySelector('#train-status')?.innerText.includes('running')",
                           timeout=120_000)
    page.wait_for_function("() => document.querySelector('#stop')?.disabled", timeout=30_000)
    # The Runs tab's stop button follows the run it shows the same way.
    page.get_by_role("tab", name="Runs").click()
    page.locator("#runs-selected input").fill(name)
    page.get_by_role("option", name=name, exact=True).click()
    page.wait_for_function("n => document.querySelector('#runs-details')?.innerText.startsWith(n + ': ')", arg=name,
                           timeout=30_000)
    page.wait_for_function("() => document.querySelector('#runs-stop')?.disabled", timeout=30_000)


def test_an_embedding_run_started_from_the_page_finishes(ui, runs_dir, browser_page):
    """Issue 41's tasks start from the Train tab with nothing filled in: the method "embed" picked
    on the page, Start runs `tigon embed`'s embedded default (the built-in model, the bundled
    pairs) to its end, and what it saved is an embedding model."""
    page = browser_page
    page.goto(f"{ui}?run=not-started-embed", wait_until="load", timeout=60_000)
    page.wait_for_function("() => document.querySelector('#train-status')?.innerText.includes('not-started-embed')",
                           timeout=60_000)
    page.get_by_label("method").first.fill("embed")
    page.get_by_role("option", name="embed", exact=True).click()
    page.get_by_label("steps").first.fill("12")  # the default's own length is an epoch: not what this looks at
    page.locator("#start").click()
    page.wait_for_function("() => /: running/.test(document.querySelector('#train-status')?.innerText)",
                           timeout=60_000)
    name = page.locator("#train-run textarea, #train-run input").first.input_value()
    assert name.endswith("-embed"), name
    page.wait_for_function("n => document.querySelector('#train-status')?.innerText.includes(n + ': finished')",
                           arg=name, timeout=300_000)
    assert (runs_dir / name / "final" / "embedding.json").is_file()
    command = (runs_dir / name / LOG_FILE).read_text().splitlines()[0]
    assert command.startswith("$ tigon embed "), command


def test_the_page_keeps_an_uploaded_data_file_in_the_runs_folder(ui, runs_dir, browser_page, tmp_path):
    """The page's upload (Gradio's upload route, then the UI's handler): a data file lands in
    RUNS/uploads under a name of its own and is previewed; a Python file is refused."""
    page = browser_page
    page.goto(ui, wait_until="load", timeout=60_000)
    dataset = page.locator("#train-dataset textarea, #train-dataset input").first
    upload_input = page.locator("input[type=file]").first
    evil = tmp_path / "evil.py"
    evil.write_text("raise SystemExit('ran')\n")
    upload_input.set_input_files(str(evil))  # past the file picker's filter, as a script would
    page.get_by_text("Invalid file type").first.wait_for(timeout=30_000)
    assert dataset.input_value() == "" and not list(runs_dir.rglob("evil*"))
    mine = tmp_path / "my rows.jsonl"
    mine.write_text(GOOD_ROW * 3)
    page.reload(wait_until="load")
    page.locator("input[type=file]").first.set_input_files(str(mine))
    page.wait_for_function("() => document.querySelector('#train-dataset textarea, #train-dataset input')?.value "
                           "=== 'uploads/my_rows.jsonl'", timeout=30_000)
    assert (runs_dir / "uploads" / "my_rows.jsonl").read_text() == GOOD_ROW * 3
    page.wait_for_function("() => document.querySelector('#preview-summary')?.innerText.includes('3 rows')",
                           timeout=60_000)


def test_without_gradio_it_says_how_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gradio" else real(name, *a))
    assert main(["webui"]) == 2
    assert capsys.readouterr().err == "tigon webui: error: tigon webui needs gradio: pip install 'tigon[webui]'\n"


def test_a_port_in_use_is_one_line(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["webui", "--port", str(port), "--runs", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"tigon webui: error: --host 127.0.0.1 --port {port}: cannot listen there "
                                       f"(Cannot find empty port in range: {port}-{port})\n")


def test_store_sees_what_the_ui_started(default_run, runs_dir):
    """A second store on the same directory (a restarted UI) reads the same run back."""
    info = RunStore(runs_dir).info(default_run["name"])
    assert (info.status, info.final_loss) == ("finished", default_run["summary"]["final_loss"])
