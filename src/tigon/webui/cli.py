"""`tigon webui`: argument parsing over tigon.webui.app."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os

DEFAULT_RUNS = "tigon-runs"


def _cmd_webui(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("gradio") is None:
        raise ValueError("tigon webui needs gradio: pip install 'tigon[webui]'")
    # Before gradio is imported: no usage reports or update checks from a local tool.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from tigon.webui.app import build_app, launch

    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own requests to itself, one line each
    app = build_app(args.runs)
    try:
        launch(app, args.host, args.port)
    except OSError as err:  # gradio's "Cannot find empty port in range: ..."
        raise ValueError(f"--host {args.host} --port {args.port}: cannot listen there "
                         f"({str(err).split('. ')[0]})") from None
    print(f"tigon webui: http://{args.host}:{args.port} (runs in {os.path.abspath(args.runs)}; Ctrl-C quits, "
          "runs go on)", flush=True)
    app.block_thread()  # until Ctrl-C
    return 0


def add_webui_commands(sub: argparse._SubParsersAction) -> None:
    """Register `webui` on the `tigon` command's subparsers."""
    webui = sub.add_parser("webui", help="a browser UI (Gradio) to start, watch, compare, chat with and export "
                           "fine-tuning runs; needs pip install 'tigon[webui]'")
    webui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    webui.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    webui.add_argument("--runs", default=DEFAULT_RUNS, metavar="DIR",
                       help=f"where runs are written and listed, one directory each (default {DEFAULT_RUNS}/)")
    webui.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    webui.set_defaults(run=_cmd_webui)
