"""The OpenAI-compatible HTTP API of `tigon serve`: a FastAPI app run by uvicorn over the
continuous-batching `Engine`.

transformers ships the same stack as `transformers serve` (FastAPI handlers over its CB
manager), but its handlers cannot be reused for this API: they ignore `n`, give every continuous-
batching request the sampling settings of the first one, ignore `stop` under continuous
batching, answer an unknown model with 400 and errors as ``{"detail": ...}``, and do not check
prompt lengths. So the routes are written here, on the pieces those handlers are built on
(FastAPI, uvicorn, the CB manager, tokenizers' incremental `DecodeStream`).

Everything a client sends is bounded before it costs much: a key (when set) is checked before the
body is read, the body's size while it is read, the number of completions before any prompt is
tokenised, and a prompt's length in characters before it is tokenised (in a worker thread, so a
long one does not hold up other requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
# At module level: FastAPI resolves the routes' annotations (strings, by the __future__ import) here.
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tigon.serve.engine import Engine, Sampling
from tigon.serve.images import ImagePolicy, request_images
from tigon.serve.protocol import APIError, ChatRequest, CompletionRequest, EmbeddingRequest, ImagePart
from tigon.train.template import render

log = logging.getLogger("tigon.serve")


class TextStream:
    """One completion's text, decoded token by token, cut at the first stop string. While it
    runs, the last ``len(longest stop) - 1`` characters are held back: they may begin a stop."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.tokens = 0
        self._sent = 0

    def feed(self, token_ids: list[int], final: bool = False) -> bool:
        """Take the completion's tokens so far (all of them when `final`); True once a stop string
        has appeared (the text then ends before it)."""
        start = max(0, len(self.text) - self._hold)
        for token in token_ids[self.tokens:]:
            piece = self._decoder.step(self._backend, token)
            if piece:
                self.text += piece
        self.tokens = len(token_ids)
        if final:  # the decoder keeps back bytes that are not yet a whole character: the full decode has them
            whole = self._backend.decode(token_ids, skip_special_tokens=True)
            if whole.startswith(self.text):
                self.text = whole
        hits = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)

    def take(self, final: bool) -> str:
        """The text not yet handed out (all of it when `final`)."""
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        piece, self._sent = self.text[self._sent:end], end
        return piece


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    sampling: Sampling
    pixels: dict[str, Any] | None = None  # a vision-language model's image tensors for this prompt
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0


async def run_choice(engine: Engine, tokenizer: Any, choice: Choice, stops: list[str],
                     emit: Callable[[Choice, str, str | None], Awaitable[None]]) -> None:
    """Generate one choice, handing each new piece of text to `emit` (and the finish reason with
    the last one). Leaving early, by a stop string or by cancellation, cancels the request."""
    stream = TextStream(tokenizer, stops)
    reason = None
    images = {} if choice.pixels is None else {"pixels": choice.pixels}
    async with contextlib.aclosing(engine.generate(choice.prompt_ids, choice.sampling, **images)) as outputs:
        async for output in outputs:
            if stream.feed(output.token_ids, final=output.finish_reason is not None):
                reason = "stop"
                break
            reason = output.finish_reason
            if reason is None:
                piece = stream.take(final=False)
                if piece:
                    await emit(choice, piece, None)
    choice.completion_tokens = stream.tokens
    choice.finish_reason = reason
    await emit(choice, stream.take(final=True), reason)


@dataclass
class ServedModel:
    """What the app serves: the engine (None for an embedding model, which `embedder` serves
    instead), its tokenizer, the model's name and context length; for a vision-language model,
    `vision` (the `VisionEncoder` over its processor) and the `images` requests may send.
    `max_prompt_chars` follows from them: a token of a causal LM's tokenizer (byte-level BPE or
    SentencePiece, which keep every character) stands for no more characters than the longest entry
    of its vocabulary, so a text longer than the context times that length cannot fit, and is
    refused without being tokenised."""

    engine: Engine | None
    tokenizer: Any
    name: str
    max_model_len: int
    embedder: Any = None  # tigon.serve.embeddings.Embedder
    vision: Any = None  # tigon.train.vision.VisionEncoder
    images: ImagePolicy = ImagePolicy()
    max_prompt_chars: int = field(init=False)

    def __post_init__(self) -> None:
        longest = max(len(token) for token in self.tokenizer.backend_tokenizer.get_vocab())
        self.max_prompt_chars = self.max_model_len * longest


@dataclass(frozen=True)
class Limits:
    """What requests may ask of the server: the size in bytes of one's body and of all the bodies
    held at once (being read, or their requests being answered), and how many completions (prompts
    times `n`) one generates."""

    max_body_bytes: int = 4 << 20  # a 128k-token prompt, as text or as token ids, is under 1 MiB
    max_inflight_bytes: int = 64 << 20
    max_choices: int = 128
    max_embedding_tokens: int = 1 << 18  # the tokens of one /v1/embeddings request, all inputs together


# Prompts tokenised at once, each in a worker thread (the tokenizer lets go of the GIL, so the
# event loop answers meanwhile). Tokenising holds some hundred times the text's size; more at once
# would multiply that and gain nothing on a busy CPU.
TOKENISING_THREADS = 2

# Paths answered without the key: they tell nothing about the model (the schema is every tigon
# server's), and a browser opening the docs page cannot send a key.
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs"})


async def send_error(send: Any, error: APIError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer `error` at the ASGI level, from a middleware that has not passed the request on."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class RequireAPIKey:
    """ASGI middleware: a request outside `OPEN_PATHS` must carry ``Authorization: Bearer KEY``,
    else it is answered 401 before its body is read. The comparison is of SHA-256 digests, in
    constant time: neither the key's characters nor its length can be probed by timing it."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            given = hashlib.sha256(token.strip()).digest()
            if not (hmac.compare_digest(given, self._digest) and scheme.lower() == b"bearer"):
                error = APIError(401, "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
                                 code="invalid_api_key")
                await send_error(send, error, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class LimitBody:
    """ASGI middleware bounding the request bodies held in memory. One over `max_bytes` is answered
    413, by its Content-Length before any of it is read, or (sent chunked) as soon as what has been
    read passes the limit. All held at once, from the first byte read until the request has been
    answered, add up to at most `max_inflight_bytes`: past that, requests are answered 503, so that
    many clients sending bodies slowly, and never finishing them, cannot fill the memory. The app
    gets the body whole; uvicorn drops the rest of a refused one as it arrives."""

    def __init__(self, app: Any, max_bytes: int, max_inflight_bytes: int):
        self.app, self.max_bytes, self.max_inflight_bytes = app, max_bytes, max_inflight_bytes
        self.inflight = 0  # changed only between awaits, on the event loop: no lock needed

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
                             code="request_too_large")
        busy = APIError(503, "the server holds as many request bodies as it may; retry shortly", kind="server_error",
                        code="server_busy")
        declared = dict(scope["headers"]).get(b"content-length")
        size = 0 if declared is None else int(declared)  # uvicorn has checked it is a number
        if size > self.max_bytes:
            await send_error(send, too_large)
            return
        if self.inflight + size > self.max_inflight_bytes:
            await send_error(send, busy, [(b"retry-after", b"1")])
            return
        body, held = bytearray(), 0
        try:
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client left before sending it all
                    return
                chunk = message.get("body", b"")
                if held + len(chunk) > self.max_bytes:
                    await send_error(send, too_large)
                    return
                if self.inflight + len(chunk) > self.max_inflight_bytes:
                    await send_error(send, busy, [(b"retry-after", b"1")])
                    return
                body += chunk
                held += len(chunk)
                self.inflight += len(chunk)
                more = message.get("more_body", False)
            whole: dict | None = {"type": "http.request", "body": bytes(body), "more_body": False}
            del body  # the app's copy is the one kept

            async def replay() -> dict:
                # The body once, then the client's own messages: the app waits on them for a disconnect.
                nonlocal whole
                if whole is not None:
                    message, whole = whole, None
                    return message
                return await receive()

            await self.app(scope, replay, send)
        finally:
            self.inflight -= held


def build_app(served: ServedModel, api_key: str | None = None, limits: Limits = Limits()) -> Any:
    """The FastAPI app: /v1/models, /v1/chat/completions, /v1/completions (or, for an embedding
    model, /v1/embeddings), /health (and the API's /docs). With an `api_key`, everything but /health and the docs needs it. The engine's
    generation thread runs between the app's startup and shutdown."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if served.engine is None:
            yield
            return
        served.engine.start()
        try:
            yield
        finally:
            served.engine.stop()

    app = FastAPI(title="tigon serve", lifespan=lifespan)
    app.add_middleware(LimitBody, max_bytes=limits.max_body_bytes, max_inflight_bytes=limits.max_inflight_bytes)
    if api_key is not None:  # added last, so it runs first: a request without the key is not read
        app.add_middleware(RequireAPIKey, api_key=api_key)
    created = int(time.time())
    tokenising = anyio.CapacityLimiter(TOKENISING_THREADS)
    embedding = anyio.CapacityLimiter(1)  # one forward pass at a time

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(err.errors()).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, err: Exception) -> JSONResponse:
        log.exception("tigon serve: request failed")
        return JSONResponse(APIError(500, f"{type(err).__name__}: {err}", kind="server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if served.engine is None:
            return JSONResponse({"status": "ok", "running": 0})
        if not served.engine.alive():
            return JSONResponse({"status": "error", "running": len(served.engine.running)}, status_code=503)
        return JSONResponse({"status": "ok", "running": len(served.engine.running)})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(served, created)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        check_model(served, name)
        return model_card(served, created)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        check_generates(served)
        body.check_supported()
        check_model(served, body.model)
        check_choices(limits, 1, body.n)
        if served.vision is not None:
            if served.engine.full():  # before its images are decoded: each waiting request holds its own
                raise APIError(503, f"the server has {served.engine.max_waiting} requests with images running or "
                                    "waiting, as many as it takes; retry shortly", kind="server_error",
                               code="server_busy")
            prompt, pixels = await anyio.to_thread.run_sync(partial(vision_chat_prompt, served, body),
                                                            limiter=tokenising)
            return await respond(request, body, [prompt], chat=True, pixels=pixels)
        prompt = await anyio.to_thread.run_sync(partial(chat_prompt, served, body), limiter=tokenising)
        return await respond(request, body, [prompt], chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_generates(served)
        body.check_supported()
        check_model(served, body.model)
        texts = body.prompts()
        check_choices(limits, len(texts), body.n)
        prompts = await anyio.to_thread.run_sync(lambda: [encode_prompt(served, p) for p in texts], limiter=tokenising)
        return await respond(request, body, prompts, chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> Any:
        from tigon.serve.embeddings import check_dimensions, encoded, truncated

        if served.embedder is None:
            raise APIError(400, "this server serves a generative model: /v1/embeddings needs a model that "
                                "`tigon embed` trained", param="model")
        check_model(served, body.model)
        check_dimensions(served.embedder, body.dimensions)
        items = body.inputs()
        rows = await anyio.to_thread.run_sync(
            lambda: [embedding_input(served, item, i, len(items)) for i, item in enumerate(items)], limiter=tokenising)
        tokens = sum(map(len, rows))
        if tokens > limits.max_embedding_tokens:
            raise APIError(400, f"this request holds {tokens} tokens; this server embeds at most "
                                f"{limits.max_embedding_tokens} per request", param="input")
        vectors = truncated(await anyio.to_thread.run_sync(served.embedder.embed, rows, limiter=embedding),
                            body.dimensions)
        data = [{"object": "embedding", "index": i, "embedding": encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def respond(request: Request, body: ChatRequest | CompletionRequest, prompts: list[list[int]],
                      chat: bool, pixels: dict[str, Any] | None = None) -> Any:
        if not served.engine.alive():
            raise APIError(503, "the generation engine has stopped after an error; restart the server",
                           kind="server_error")
        choices = []
        for p, prompt in enumerate(prompts):
            limit = check_length(served, prompt, body.token_limit)
            for i in range(body.n):
                # n choices of one seeded request are n different draws, each reproducible.
                seed = None if body.seed is None else body.seed + i
                sampling = Sampling(limit, body.temperature, body.top_p, seed)
                choices.append(Choice(p * body.n + i, prompt, sampling, pixels))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.stream:
            events = stream_events(served, body, choices, ident, chat)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(await complete(served, body, choices, ident, chat, request.is_disconnected))

    return app


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's validation errors as one OpenAI-style 400 naming the first bad field."""
    # A list too long is the problem to name, rather than the other shapes of a union it does not fit.
    first = next((e for e in errors if e.get("type") == "too_long"), errors[0] if errors else
                 {"loc": (), "msg": "invalid request", "type": ""})
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    if first.get("type") == "invalid_unicode":  # its message names the field: the location is the body's
        return APIError(400, first["msg"], param=first["ctx"]["param"])
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param=param)
    if first.get("type") == "missing" and not loc:
        return APIError(400, "the request body is missing")
    return APIError(400, f"{param or 'body'}: {first.get('msg')}", param=param)


def model_card(served: ServedModel, created: int) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": created, "owned_by": "tigon",
            "max_model_len": served.max_model_len}


def check_model(served: ServedModel, name: str | None) -> None:
    if name is not None and name != served.name:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{served.name}'",
                       param="model", code="model_not_found")


def check_generates(served: ServedModel) -> None:
    if served.engine is None:
        raise APIError(400, "this server serves an embedding model: it answers /v1/embeddings, not completions",
                       param="model")


def embedding_input(served: ServedModel, item: str | list[int], index: int, count: int) -> list[int]:
    """One /v1/embeddings input's token ids (EOS last), refused when empty, out of the vocabulary
    or longer than the context."""
    param = "input" if count == 1 else f"input[{index}]"
    if isinstance(item, str):
        if not item:
            raise APIError(400, f"{param} is empty", param="input")
        ids = encode_text(served, item, add_special_tokens=True, param=param)
    else:
        vocab = len(served.tokenizer)
        if not item or any(not 0 <= t < vocab for t in item):
            raise APIError(400, f"{param} must hold token ids in [0, {vocab}), at least one", param="input")
        ids = list(item)
    ids = served.embedder.ids(ids)
    if len(ids) > served.max_model_len:
        raise APIError(400, f"this model's maximum context length is {served.max_model_len} tokens, but {param} "
                            f"holds {len(ids)} (its EOS included)", param="input", code="context_length_exceeded")
    return ids


def check_choices(limits: Limits, prompts: int, n: int) -> None:
    """Refuse a request for more completions than `limits` allow."""
    if prompts * n > limits.max_choices:
        raise APIError(400, f"this request asks for {prompts * n} completions ({prompts} prompts times n={n}); this "
                            f"server generates at most {limits.max_choices} per request", param="n")


def check_chars(served: ServedModel, text: str, param: str) -> None:
    """Refuse `text` unread when it is too long for any tokenisation of it to fit."""
    if len(text) > served.max_prompt_chars:
        raise APIError(400, f"{param} is {len(text)} characters long, more than this model's context of "
                            f"{served.max_model_len} tokens can hold (at most {served.max_prompt_chars} characters)",
                       param=param, code="context_length_exceeded")


def encode_text(served: ServedModel, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """The token ids of `text`, refused unread when it is too long for any tokenisation of it to fit."""
    check_chars(served, text, param)
    return served.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def image_parts(body: ChatRequest) -> list[tuple[str, str]]:
    """The ``(param, url)`` of every image part of a chat, in order."""
    return [(f"messages[{i}].content[{j}].image_url.url", part.image_url.url)
            for i, message in enumerate(body.messages) if not isinstance(message.content, str)
            for j, part in enumerate(message.content) if isinstance(part, ImagePart)]


def vision_chat_prompt(served: ServedModel, body: ChatRequest) -> tuple[list[int], dict[str, Any]]:
    """A chat with images through a vision-language model's processor: its token ids (each
    image's placeholder expanded) and the image tensors that go with them."""
    images = request_images(image_parts(body), served.images)
    messages = [m.as_vision_chat() for m in body.messages]
    try:
        check_chars(served, served.vision.render(messages, True), "messages")
        batch = served.vision.prompt(messages, images)
    except APIError:
        raise
    except Exception as err:  # a template or processor raises whatever its author chose
        raise APIError(400, f"the processor failed on these messages: {err}", param="messages") from None
    return batch["input_ids"][0].tolist(), {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}


def chat_prompt(served: ServedModel, body: ChatRequest) -> list[int]:
    """The token ids of a chat's messages through the model's chat template."""
    parts = image_parts(body)
    if parts:
        raise APIError(400, f"{parts[0][0]}: an image, but this server's model is text-only (not a vision-language "
                            "model): send text only", param=parts[0][0], code="images_not_supported")
    try:
        text = render(served.tokenizer, [m.as_chat() for m in body.messages], True)
    except Exception as err:  # a template raises whatever its author chose
        raise APIError(400, f"the chat template failed on these messages: {err}", param="messages") from None
    return encode_text(served, text, add_special_tokens=False, param="messages")


def encode_prompt(served: ServedModel, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = encode_text(served, prompt, add_special_tokens=True, param="prompt")
    else:
        vocab = len(served.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt holds token ids outside the vocabulary [0, {vocab})", param="prompt")
        ids = list(prompt)
    if not ids:
        raise APIError(400, "prompt is empty", param="prompt")
    return ids


def check_length(served: ServedModel, prompt: list[int], max_tokens: int | None) -> int:
    """The number of tokens this prompt may be given (max_tokens, or by default the rest of the
    context); a prompt that leaves no room for them is refused."""
    room = served.max_model_len - len(prompt)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        wanted = len(prompt) + (max_tokens or 1)
        raise APIError(400, f"this model's maximum context length is {served.max_model_len} tokens, but "
                            f"{wanted} were requested ({len(prompt)} in the prompt, {max_tokens or 1} for the "
                            "completion); shorten the prompt or lower max_tokens",
                       param="messages" if max_tokens is None else "max_tokens", code="context_length_exceeded")
    return max_tokens if max_tokens is not None else room


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _distinct_prompts(choices: list[Choice], n: int) -> list[list[int]]:
    return [c.prompt_ids for c in choices[::n]]


async def complete(served: ServedModel, body: Any, choices: list[Choice], ident: str, chat: bool,
                   disconnected: Callable[[], Awaitable[bool]]) -> dict:
    """The whole answer at once. A client that leaves before it is ready (a timeout) cancels the
    generation: nothing would read it."""
    async def collect(choice: Choice, piece: str, reason: str | None) -> None:
        choice.text.append(piece)

    tasks = [asyncio.ensure_future(run_choice(served.engine, served.tokenizer, c, body.stop, collect))
             for c in choices]
    everything = asyncio.gather(*tasks)
    # Cancelled below when the client has left; nobody is then waiting for its outcome.
    everything.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        while not everything.done():
            await asyncio.wait([everything], timeout=0.5)
            if not everything.done() and await disconnected():
                raise APIError(499, "the client closed the request")
        everything.result()
    finally:
        for task in tasks:
            task.cancel()
    if chat:
        rendered = [{"index": c.index, "message": {"role": "assistant", "content": "".join(c.text)},
                     "logprobs": None, "finish_reason": c.finish_reason} for c in choices]
    else:
        rendered = [{"index": c.index, "text": "".join(c.text), "logprobs": None,
                     "finish_reason": c.finish_reason} for c in choices]
    return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": served.name, "choices": rendered,
            "usage": usage(choices, _distinct_prompts(choices, body.n))}


async def stream_events(served: ServedModel, body: Any, choices: list[Choice], ident: str,
                        chat: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per piece of text of any choice, then the finish reasons,
    the usage if asked for (`stream_options.include_usage`) and ``[DONE]``."""
    queue: asyncio.Queue = asyncio.Queue()
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    async def push(choice: Choice, piece: str, reason: str | None) -> None:
        await queue.put((choice, piece, reason))

    def chunk(choice_fields: list[dict[str, Any]], **extra: Any) -> str:
        payload = {"id": ident, "object": kind, "created": created, "model": served.name,
                   "choices": choice_fields, **extra}
        return f"data: {json.dumps(payload)}\n\n"

    async def run(choice: Choice) -> None:
        try:
            await run_choice(served.engine, served.tokenizer, choice, body.stop, push)
        except Exception as err:  # reported in the stream: its 200 status is already sent
            await queue.put((choice, err, None))

    tasks = [asyncio.ensure_future(run(c)) for c in choices]
    try:
        if chat:
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for c in choices])
        open_choices = len(choices)
        while open_choices:
            choice, piece, reason = await queue.get()
            if isinstance(piece, Exception):
                error = APIError(500, f"generation failed: {piece}", kind="server_error")
                yield f"data: {json.dumps(error.body())}\n\n"
                return
            if reason is not None:
                open_choices -= 1
            if not piece and reason is None:
                continue
            if chat:
                delta = {"content": piece} if piece else {}
                yield chunk([{"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": reason}])
            else:
                yield chunk([{"index": choice.index, "text": piece, "logprobs": None, "finish_reason": reason}])
        if body.include_usage:
            yield chunk([], usage=usage(choices, _distinct_prompts(choices, body.n)))
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away: its requests stop and free their cache
        for task in tasks:
            task.cancel()


def serve_forever(served: ServedModel, host: str, port: int, api_key: str | None = None,
                  limits: Limits = Limits()) -> None:
    """Run the app with uvicorn until Ctrl-C / SIGTERM (then it finishes open requests for up to
    5 s, stops the engine and returns; uvicorn re-raises Ctrl-C as KeyboardInterrupt)."""
    import uvicorn

    app = build_app(served, api_key, limits)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
