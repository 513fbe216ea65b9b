"""The Gradio app of `tigon webui`: a Train tab (settings, data preview, start/stop, live loss
curve and log), a Runs tab (every run under --runs, their loss curves overlaid, exports) and a
Chat tab (a finished run or checkpoint, loaded in this process as `tigon chat` loads it).

Every event is also an API endpoint (``api_name``), which is how gradio_client and the tests
drive it: /start, /run_status, /stop, /preview, /runs, /export_merged, /export_gguf, /chat.
"""

from __future__ import annotations

import functools
import math
import shlex
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from tigon.webui.models import ChatModel, preview_dataset, preview_images
from tigon.webui.runs import (DATASET_SUFFIXES, EXPORT_DTYPES, FINISHED, RUNNING, UPLOADS_DIR, RunInfo, RunStore,
                              TrainSettings, WebUIError, task_command)

TABLE_HEADERS = ["run", "method", "status", "step", "final loss", "tok/s", "peak memory", "started", "last line"]
COMPARED_RUNS = 5  # runs whose curves the Runs tab overlays when it opens
LOG_LINES = 20  # of a run's log, on the Train tab
CSS = ".tigon-log textarea { font-family: ui-monospace, monospace; font-size: 12px; }"
MAX_UPLOAD = "2gb"  # Gradio takes any upload this size or smaller into its cache before a handler sees it
# Gradio's copies of uploads (the data files the UI keeps are copied to RUNS/uploads at once):
# checked every hour, deleted once a day old.
GRADIO_CACHE_EXPIRY = (3600, 86400)


def _theme() -> gr.themes.Base:
    # System fonts: Gradio's default theme fetches web fonts, which a machine without internet
    # access waits for.
    return gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])


def _loss_frame(points: list[tuple[str, int, float]]) -> pd.DataFrame:
    # Typed even when empty: Gradio reads an empty (object) column as categories, and the page's
    # chart then kept a category axis, with no curve, through the first points of a live run.
    return pd.DataFrame(points, columns=["run", "step", "loss"]).astype({"run": str, "step": "int64", "loss": "float64"})


def _status_line(info: RunInfo) -> str:
    parts = [f"**{info.name}: {info.status}**"]
    if info.step is not None:
        parts.append(f"step {info.step}" + (f"/{info.total_steps} ({100 * info.step // max(1, info.total_steps)}%)"
                                            if info.total_steps else ""))
    if info.final_loss is not None:
        parts.append(f"loss {info.final_loss:.4f}")
    if info.tokens_per_s is not None:
        parts.append(f"{info.tokens_per_s:,.0f} tok/s")
    if info.peak_memory:
        parts.append(f"peak {info.peak_memory}")
    if info.checkpoint:
        parts.append(f"last checkpoint {info.checkpoint}")
    line = " · ".join(parts)
    if info.message and info.status != FINISHED:
        line += f"\n\n`{info.message}`"
    return line


def _summary(info: RunInfo) -> dict[str, Any]:
    # No "path" key: gradio_client takes a dict with one for a file to download.
    keep = ("name", "status", "step", "total_steps", "final_loss", "tokens_per_s", "peak_memory",
            "checkpoint", "exit_code", "message", "command")
    return {k: v for k, v in info.as_dict().items() if k in keep}


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") == "file" or "path" in part or "file" in part)


def _messages(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chatbot history as role/content text messages (Gradio keeps content as a list of parts);
    the images shown in the chat before a user's text counted on it as ``images``."""
    out: list[dict[str, Any]] = []
    images = 0
    for m in history or []:
        content = m.get("content")
        parts = content if isinstance(content, list) else [content]
        if m.get("role") == "user":
            images += sum(map(_is_image, parts))
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and not _is_image(p))
        if isinstance(content, str) and content:
            out.append({"role": m["role"], "content": content, **({"images": images} if m["role"] == "user" else {})})
            images = 0 if m["role"] == "user" else images
    return out


# An image uploaded to the chat: read whole into the UI's memory, so bounded (Gradio bounds the upload itself
# by MAX_UPLOAD only).
CHAT_IMAGE_BYTES = 16 << 20


def build_app(runs_dir: str | Path, max_running: int = 4) -> gr.Blocks:
    """The UI over the runs in `runs_dir` (created when the first run starts), starting at most
    `max_running` at once."""
    store = RunStore(runs_dir, max_running)
    methods = store.methods
    chat_model = ChatModel()

    def watch(name: str) -> tuple:
        """The Train tab's view of run `name`: status, summary, curve, log, the timer that keeps it
        fresh while the run is running, and its stop button, which only a running run enables."""
        if not name:
            return "", {}, _loss_frame([]), "", gr.Timer(active=False), gr.Button(interactive=False)
        try:
            info = store.info(name, log_lines=LOG_LINES)
        except WebUIError as err:
            return (f"`{err}`", {"status": "error", "message": str(err)}, _loss_frame([]), "", gr.Timer(active=False),
                    gr.Button(interactive=False))
        running = info.status == RUNNING
        return (_status_line(info), _summary(info), _loss_frame(store.loss_points([name])), "\n".join(info.log),
                gr.Timer(active=running), gr.Button(interactive=running))

    def settings_of(method: str, model: str | None, dataset: str | None, tuner: str, lora_rank: float | None,
                    lora_alpha: float | None, lr: float | None, max_steps: float | None, max_length: float | None,
                    save_steps: float | None, packing: bool, kernels: bool, extra: str | None,
                    name: str | None) -> TrainSettings:
        """The Train tab's fields as settings; also the parameters of the /start endpoint."""
        # A browser's number field cannot be empty: 0 there means "the command's default".
        def number(value: float | None, kind: type) -> Any:
            if value and not math.isfinite(value):
                raise WebUIError(f"{value} is not a number")
            return kind(value) if value else None

        return TrainSettings(
            method=method, model=model or "", dataset=dataset or "", tuner=tuner,
            lora_rank=number(lora_rank, int), lora_alpha=number(lora_alpha, float), lr=number(lr, float),
            max_steps=number(max_steps, int), max_length=number(max_length, int),
            save_steps=number(save_steps, int), packing=bool(packing), kernels=bool(kernels),
            extra=extra or "", name=name or "")

    def show_command(*values: Any) -> str:
        try:
            settings = settings_of(*values)
            return "tigon " + shlex.join(store.command_arguments(settings, store.root / (settings.name or "NAME")))
        except (ValueError, OSError) as err:
            return f"# {err}"

    # The signature of settings_of (inspect follows __wrapped__), so that /start's parameters
    # have the fields' names and defaults: client.predict(max_steps=40, api_name="/start").
    @functools.wraps(settings_of)
    def start(*values: Any) -> tuple:
        try:
            name = store.start(settings_of(*values))
        except (WebUIError, OSError) as err:
            return ("", f"`{err}`", {"status": "error", "message": str(err)}, _loss_frame([]), "",
                    gr.Timer(active=False), gr.Button(interactive=False))
        return (name, *watch(name))

    def stop(name: str) -> str:
        try:
            return store.stop(name)
        except WebUIError as err:
            return str(err)

    def preview(dataset: str, model: str, method: str = "sft") -> tuple:
        try:
            result = preview_dataset(store.data_files(dataset or ""), store.model_source(model or ""))
        except (WebUIError, OSError) as err:
            return f"`{err}`", []
        if not result.error:
            return result.summary, result.parts
        if method != "sft":  # preference, pair and labelled rows are their commands' to read
            command = shlex.join(task_command(method))
            return f"`{result.summary}` (sft's reader; `tigon {command}` reads its own data when it starts)", []
        return f"`{result.summary}`", []

    def upload(file: str | None) -> str:
        if not file:
            return gr.skip()
        try:
            return store.keep_upload(file)
        except (WebUIError, OSError) as err:
            raise gr.Error(str(err)) from None

    def runs_table() -> list[list[Any]]:
        rows = []
        for name in store.names():
            i = store.info(name)
            rows.append([i.name, i.method, i.status, i.step, None if i.final_loss is None else round(i.final_loss, 4),
                         i.tokens_per_s, i.peak_memory, i.started, i.message])
        return rows

    def compare(names: list[str]) -> pd.DataFrame:
        return _loss_frame(store.loss_points([n for n in names or [] if n in store.names()]))

    def refresh_runs(ticked: list[str] | None, shown: str | None, to_export: str | None) -> tuple:
        """The Runs tab anew, keeping what is ticked and chosen while it still exists."""
        names, models = store.names(), store.model_paths()
        ticked = [n for n in ticked or [] if n in names] or [n for n in names if store.loss_points([n])][:COMPARED_RUNS]
        return (runs_table(), gr.CheckboxGroup(choices=names, value=ticked), compare(ticked),
                gr.Dropdown(choices=names, value=shown if shown in names else (names[0] if names else None)),
                model_choices(to_export))

    def model_choices(current: str | None) -> gr.Dropdown:
        """The models to chat with or export, newest final model first; `current` kept if it is one."""
        models = store.model_paths()
        paths = [path for _, path in models]
        return gr.Dropdown(choices=models, value=current if current in paths else (paths[0] if paths else None))

    def run_details(name: str | None) -> tuple:
        """The Runs tab's status and log of run `name`, and its stop button (enabled while it runs)."""
        if not name:
            return "", "", gr.Button(interactive=False)
        try:
            info = store.info(name, log_lines=25)
        except WebUIError as err:
            return f"`{err}`", "", gr.Button(interactive=False)
        return (_status_line(info) + (f"\n\n`{info.command}`" if info.command else ""), "\n".join(info.log),
                gr.Button(interactive=info.status == RUNNING))

    def export(path: str | None, to: str, dtype: str) -> str:
        try:
            ok, line = store.export(path or "", to, dtype)
        except (WebUIError, OSError) as err:
            return f"`{err}`"
        return ("done: " if ok else "failed: ") + f"`{line}`"

    def export_merged(path: str | None, dtype: str) -> str:
        return export(path, "merged", dtype)

    def export_gguf(path: str | None, dtype: str) -> str:
        return export(path, "gguf", dtype)

    def chat(path: str | None, message: str, history: list[dict[str, Any]], system: str, max_new_tokens: float,
             temperature: float, image: str | None = None, shown: list[bytes] | None = None) -> tuple:
        """The model's answer, with the uploaded `image` (a file in Gradio's cache) shown before
        the message. `shown` (the session's state, never the client's) holds the bytes of the
        images of this conversation: the history a client sends names no file the UI reads."""
        from tigon.train.vision_data import open_untrusted

        shown = list(shown or [])
        if not (message or "").strip():
            return history, message, "", shown
        try:
            new = []
            if image:
                with open(image, "rb") as f:
                    data = f.read(CHAT_IMAGE_BYTES + 1)
                open_untrusted(data, CHAT_IMAGE_BYTES)  # bounded before the model sees it
                new = [data]
            turns = _messages(history)
            if sum(t.get("images", 0) for t in turns) != len(shown):  # a history not this session's
                turns, shown = [{**t, "images": 0} for t in turns], []
            turns.append({"role": "user", "content": message, "images": len(new)})
            prompt = ([{"role": "system", "content": system}] if (system or "").strip() else []) + turns
            # Gradio holds max_new_tokens and temperature to their sliders' ranges
            reply = chat_model.reply(str(store.model_dir(path or "")), prompt, int(max_new_tokens), float(temperature),
                                     shown + new)
        except (ValueError, OSError) as err:
            return history, message, f"`{str(err).splitlines()[0] if str(err) else type(err).__name__}`", shown
        shown_turn = [{"role": "user", "content": {"path": image}}] if image else []
        return (list(history or []) + shown_turn + [{"role": "user", "content": message},
                                                     {"role": "assistant", "content": reply}],
                "", f"answered by `{path}`", shown + new)

    def thumbnails(dataset: str) -> gr.Gallery:
        """The first images of an image + text data file, small; none for any other file."""
        try:
            files = store.data_files(dataset or "")
        except (WebUIError, OSError):
            files = []
        shown, line = preview_images(files[0], store.root) if files else ([], "")
        return gr.Gallery(value=shown, label=f"images: {line}" if line else "images", visible=bool(shown))

    def on_load(request: gr.Request) -> tuple:
        """The run a page opens on: ``?run=NAME``, else the newest (a reopened page keeps watching)."""
        names = store.names()
        name = request.query_params.get("run") or (names[0] if names else "")
        return (name, *watch(name))

    with gr.Blocks(title="tigon webui", analytics_enabled=False, delete_cache=GRADIO_CACHE_EXPIRY) as app:
        gr.Markdown(f"## tigon webui\nRuns in `{store.root}`; every run is a `tigon` command-line process.")
        with gr.Tab("Train", id="train"):
            with gr.Row():
                method = gr.Dropdown(methods, value="sft", label="method",
                                     info="sft, classification (or a reranker), embed" +
                                     (", rlhf methods (rm: a reward model; ppo, rloo)" if "dpo" in methods else
                                      " (rlhf methods appear when TRL is installed)") +
                                     "; empty model and dataset: the task's built-in default")
                model = gr.Textbox("", label="model", placeholder="empty: the built-in tiny Llama (trained from scratch)",
                                   info="hub id, or a model in the runs folder (RUN/final)")
                name = gr.Textbox("", label="run name", placeholder="empty: date-time-method")
            with gr.Row():
                dataset = gr.Textbox("", label="dataset", scale=3, placeholder="empty: the bundled instructions",
                                     elem_id="train-dataset",
                                     info=f"files in the runs folder ({' '.join(DATASET_SUFFIXES)}), such as "
                                     f"{UPLOADS_DIR}/data.jsonl; PATH#N for N random rows; Enter to preview")
                upload_file = gr.File(label="or upload", file_types=list(DATASET_SUFFIXES), scale=1, height=110)
            preview_summary = gr.Markdown(elem_id="preview-summary")
            preview_text = gr.HighlightedText(label="first sample, as the model sees it", color_map={"trained": "green"},
                                              show_legend=True, elem_id="preview-sample")
            preview_gallery = gr.Gallery(label="images", columns=8, height=190, visible=False, elem_id="preview-images",
                                         object_fit="contain")
            with gr.Row():
                tuner = gr.Radio(["lora", "full"], value="full", label="tuner",
                                 info="full: every weight; lora: adapters (rank and alpha below)")
                lora_rank = gr.Number(16, precision=0, label="LoRA rank")
                lora_alpha = gr.Number(0, label="LoRA alpha", info="0: 2 x rank")
                lr = gr.Number(0, label="learning rate", info="0: the command's default for this model and tuner")
            with gr.Row():
                max_steps = gr.Number(0, precision=0, label="steps", info="0: by epochs (--epochs)")
                max_length = gr.Number(0, precision=0, label="max length", info="tokens per sample (0: default)")
                save_steps = gr.Number(0, precision=0, label="checkpoint every", info="steps (0: default, 500)")
                with gr.Column():
                    packing = gr.Checkbox(False, label="packing")
                    kernels = gr.Checkbox(True, label="tigon kernels")
            extra = gr.Textbox("", label="more options", placeholder="--batch-size 8 --epochs 2 --dtype bf16",
                               info="further options of tigon sft / rlhf; files only from the runs folder, rewards "
                               "only built-in")
            settings_inputs = [method, model, dataset, tuner, lora_rank, lora_alpha, lr, max_steps, max_length,
                               save_steps, packing, kernels, extra, name]
            command = gr.Textbox(label="command", interactive=False, elem_id="train-command")
            with gr.Row():
                start_button = gr.Button("Start", variant="primary", elem_id="start")
                stop_button = gr.Button("Stop (saves a checkpoint)", variant="stop", elem_id="stop", interactive=False)
            notice = gr.Markdown(elem_id="train-notice")
            run = gr.Textbox(label="run", info="the run shown below (type a run's name and press Enter to watch it)",
                             elem_id="train-run")
            status = gr.Markdown(elem_id="train-status")
            with gr.Row():
                plot = gr.LinePlot(x="step", y="loss", title="training loss", height=300,
                                   elem_id="train-loss-plot", scale=3)
                summary = gr.JSON(label="summary", elem_id="train-summary", scale=2)
            log = gr.Textbox(label="log (last lines)", lines=LOG_LINES, max_lines=LOG_LINES, autoscroll=True,
                             elem_classes="tigon-log", elem_id="train-log")
            timer = gr.Timer(1.0, active=False)

        with gr.Tab("Runs", id="runs") as runs_tab:
            refresh_button = gr.Button("Refresh", size="sm")
            table = gr.Dataframe(headers=TABLE_HEADERS, interactive=False, wrap=True, elem_id="runs-table",
                                 column_widths=["16%", "6%", "8%", "6%", "7%", "7%", "10%", "12%", "28%"])
            compared = gr.CheckboxGroup(label="overlay the loss curves of", elem_id="runs-compare")
            overlay = gr.LinePlot(x="step", y="loss", color="run", title="training loss", height=320,
                                  elem_id="runs-loss-plot")
            with gr.Row():
                with gr.Column():
                    selected = gr.Dropdown(label="run", allow_custom_value=True, elem_id="runs-selected")
                    details = gr.Markdown(elem_id="runs-details")
                    run_stop = gr.Button("Stop this run", variant="stop", size="sm", elem_id="runs-stop", interactive=False)
                    run_log = gr.Textbox(label="log", lines=8, max_lines=8, elem_classes="tigon-log")
                with gr.Column():
                    export_model = gr.Dropdown(label="model to export", allow_custom_value=True,
                                               info="final model, merged export or checkpoint")
                    with gr.Row():
                        export_dtype = gr.Dropdown(list(EXPORT_DTYPES), value="auto",
                                                   label="dtype", info="q8_0: GGUF only")
                    with gr.Row():
                        merged_button = gr.Button("Export merged (HF safetensors)")
                        gguf_button = gr.Button("Export GGUF (+ Ollama Modelfile)")
                    export_result = gr.Markdown(elem_id="export-result")
            runs_timer = gr.Timer(5.0)

        with gr.Tab("Chat", id="chat") as chat_tab:
            with gr.Row():
                chat_path = gr.Dropdown(label="model", allow_custom_value=True, scale=3, elem_id="chat-model",
                                        info="a finished run, a checkpoint or a merged export (or its path in the "
                                        "runs folder)")
                system = gr.Textbox("", label="system message", scale=2)
            with gr.Row():
                max_new = gr.Slider(1, 512, value=64, step=1, label="max new tokens")
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature", info="0: greedy")
            chatbot = gr.Chatbot(label="chat", height=320, elem_id="chatbot")
            with gr.Row():
                # A file, not gr.Image: Gradio would decode an image before the handler bounds it.
                chat_image = gr.File(label="image (vision-language models)", file_types=[".png", ".jpg", ".jpeg",
                                                                                         ".webp"],
                                     type="filepath", height=110, scale=1, elem_id="chat-image")
                message = gr.Textbox("", placeholder="Who are you?", show_label=False, scale=4, elem_id="chat-message")
                send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                clear = gr.Button("Clear", scale=1)
            chat_status = gr.Markdown(elem_id="chat-status")
            chat_images = gr.State([])  # the bytes of the images shown in this conversation

        view = [status, summary, plot, log, timer, stop_button]
        preview_outputs = [preview_summary, preview_text]
        runs_inputs, runs_outputs = [compared, selected, export_model], [table, compared, overlay, selected, export_model]
        # Separate loads, so the fast parts show without waiting for the preview's first imports.
        app.load(on_load, None, [run, *view], api_name=False)
        app.load(lambda: preview("", ""), None, preview_outputs, api_name=False)
        app.load(show_command, settings_inputs, command, api_name=False)
        gr.on([app.load, refresh_button.click, runs_tab.select], refresh_runs, runs_inputs, runs_outputs,
              api_name=False)
        gr.on([app.load, chat_tab.select], model_choices, chat_path, chat_path, api_name=False)
        gr.on([c.change for c in settings_inputs], show_command, settings_inputs, command, api_name=False,
              show_progress="hidden")
        gr.on([dataset.submit, dataset.blur, model.submit, model.blur, method.change], preview,
              [dataset, model, method], preview_outputs, api_name="preview")
        gr.on([dataset.submit, dataset.blur], thumbnails, dataset, preview_gallery, api_name="preview_images")
        upload_file.upload(upload, upload_file, dataset, api_name=False).then(
            preview, [dataset, model, method], preview_outputs, api_name=False).then(
            thumbnails, dataset, preview_gallery, api_name=False)
        model.change(lambda m: "lora" if m.strip() else "full", model, tuner, api_name=False, show_progress="hidden")
        start_button.click(start, settings_inputs, [run, *view], api_name="start")
        gr.on([timer.tick, run.submit], watch, run, view, api_name="run_status", concurrency_limit=None,
              show_progress="hidden")
        stop_button.click(stop, run, notice, api_name="stop", concurrency_limit=None)

        runs_timer.tick(runs_table, None, table, api_name="runs", show_progress="hidden")
        # Not an API endpoint: a client's new session knows only the choices the page was built with.
        compared.change(compare, compared, overlay, api_name=False, show_progress="hidden")
        selected.change(run_details, selected, [details, run_log, run_stop], api_name=False)
        run_stop.click(stop, selected, details, api_name=False, concurrency_limit=None)
        merged_button.click(export_merged, [export_model, export_dtype], export_result, api_name="export_merged")
        gguf_button.click(export_gguf, [export_model, export_dtype], export_result, api_name="export_gguf")

        chat_inputs = [chat_path, message, chatbot, system, max_new, temperature, chat_image, chat_images]
        gr.on([message.submit, send.click], chat, chat_inputs, [chatbot, message, chat_status, chat_images],
              api_name="chat").then(lambda text, image: None if not text else gr.skip(), [message, chat_image],
                                    chat_image, api_name=False)  # an answered message takes its image along
        clear.click(lambda: ([], "", []), None, [chatbot, chat_status, chat_images], api_name=False)
        chat_path.change(lambda _: ([], "", []), chat_path, [chatbot, chat_status, chat_images], api_name=False)
    return app


def launch(app: gr.Blocks, runs_dir: str | Path, host: str, port: int,
           auth: list[tuple[str, str]] | None = None) -> None:
    """Serve `app` (built over `runs_dir`) from a thread; returns once it listens (OSError when it
    cannot). With `auth` (user, password pairs), every page and route asks for a login first."""
    # Gradio's file route serves its own cache and allowed_paths (none here); the runs folder is
    # blocked besides, for when Gradio's cache (GRADIO_TEMP_DIR) is a folder above it.
    app.launch(server_name=host, server_port=port, prevent_thread_lock=True, theme=_theme(), css=CSS, quiet=True,
               auth=auth or None, max_file_size=MAX_UPLOAD, blocked_paths=[str(Path(runs_dir).resolve())])
