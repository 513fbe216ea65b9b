"""`tigon webui`: argument parsing over tigon.webui.app, and who may log in."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from pathlib import Path

from tigon.security import check_listen_address

DEFAULT_RUNS = "tigon-runs"
AUTH_ENV = "TIGON_WEBUI_AUTH"


def _credential(text: str, where: str) -> tuple[str, str]:
    user, sep, password = text.partition(":")
    if not (sep and user.strip() and password):
        raise ValueError(f"{where}: expected USER:PASSWORD")
    return user.strip(), password


def read_auth(auth_file: str | None, environ: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """The (user, password) pairs that may log in: ``USER:PASSWORD`` in $TIGON_WEBUI_AUTH and one
    per line of `auth_file` (blank lines and ``#`` comments left out). A malformed entry is a
    ValueError naming where it is, never echoing a password."""
    environ = os.environ if environ is None else environ
    pairs = []
    if environ.get(AUTH_ENV):
        pairs.append(_credential(environ[AUTH_ENV], f"${AUTH_ENV}"))
    if auth_file is not None:
        try:
            lines = Path(auth_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--auth-file {auth_file}: cannot read it ({getattr(err, 'strerror', None) or err})") \
                from None
        for number, line in enumerate(lines, 1):
            if line.strip() and not line.lstrip().startswith("#"):
                pairs.append(_credential(line.rstrip("\r\n"), f"--auth-file {auth_file} line {number}"))
        if not pairs:
            raise ValueError(f"--auth-file {auth_file}: no USER:PASSWORD line in it")
    return pairs


def _cmd_webui(args: argparse.Namespace) -> int:
    if args.max_running < 1:
        raise ValueError(f"--max-running must be >= 1, got {args.max_running}")
    auth = read_auth(args.auth_file)
    check_listen_address("webui", args.host, bool(auth), args.insecure, f"{AUTH_ENV}=USER:PASSWORD or --auth-file FILE")
    if importlib.util.find_spec("gradio") is None:
        raise ValueError("tigon webui needs gradio: pip install 'tigon[webui]'")
    # Before gradio is imported: no usage reports or update checks from a local tool.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from tigon.webui.app import build_app, launch

    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own requests to itself, one line each
    app = build_app(args.runs, args.max_running)
    try:
        launch(app, args.runs, args.host, args.port, auth)
    except OSError as err:  # gradio's "Cannot find empty port in range: ..."
        raise ValueError(f"--host {args.host} --port {args.port}: cannot listen there "
                         f"({str(err).split('. ')[0]})") from None
    login = f"; login required ({len(auth)} user{'s' if len(auth) > 1 else ''})" if auth else ""
    print(f"tigon webui: http://{args.host}:{args.port} (runs in {os.path.abspath(args.runs)}{login}; Ctrl-C quits, "
          "runs go on)", flush=True)
    app.block_thread()  # until Ctrl-C
    return 0


def add_webui_commands(sub: argparse._SubParsersAction) -> None:
    """Register `webui` on the `tigon` command's subparsers."""
    webui = sub.add_parser("webui", help="a browser UI (Gradio) to start, watch, compare, chat with and export "
                           "fine-tuning runs; needs pip install 'tigon[webui]'")
    webui.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; any other needs a login, "
                       "or --insecure)")
    webui.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    webui.add_argument("--runs", default=DEFAULT_RUNS, metavar="DIR",
                       help=f"where runs are written and listed, one directory each, and uploads kept; the UI reads "
                       f"and writes nothing outside it (default {DEFAULT_RUNS}/)")
    webui.add_argument("--max-running", type=int, default=4, metavar="N",
                       help="runs the UI keeps going at once; a start beyond them is refused (default 4)")
    webui.add_argument("--auth-file", metavar="FILE",
                       help=f"ask for a login: FILE holds USER:PASSWORD lines (also: ${AUTH_ENV}=USER:PASSWORD)")
    webui.add_argument("--insecure", action="store_true",
                       help="serve a --host other than loopback without a login")
    webui.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
    webui.set_defaults(run=_cmd_webui)
