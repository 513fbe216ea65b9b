"""The OpenAI request bodies `tigon serve` accepts (pydantic models, checked by FastAPI) and its
OpenAI-style errors. Unknown fields are refused, as OpenAI refuses them, rather than ignored: a
setting that silently does nothing gives a client numbers it did not ask for."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Lists are validated up to their first bad item: pydantic otherwise reports every bad item, and a
# request of a million of them took seconds and gigabytes to refuse. Those other than a prompt's
# token ids are also short: each item is validated on the event loop, and the ~120,000 empty
# messages a request body can hold took seconds.
MAX_ITEMS = 4096
T = TypeVar("T")
Items = Annotated[list[T], Field(fail_fast=True, max_length=MAX_ITEMS)]
TokenIds = Annotated[list[int], Field(fail_fast=True)]


class APIError(Exception):
    """An error answered as OpenAI answers it: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def lone_surrogate(data: Any) -> str | None:
    """Where in parsed JSON `data` a string (a value or a key) holds a lone UTF-16 surrogate, which
    JSON's ``\\ud800`` escapes can express but which is not text: its field's path, such as
    ``messages.0.content``, or None when there is none."""
    try:  # at C speed, the common answer: JSON without one encodes as UTF-8
        json.dumps(data, ensure_ascii=False, default=repr).encode()
        return None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return ".".join(str(part) for part in path) or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                # The key goes on top, so it is looked at before anything under it: a bad key is
                # reported by where it sits, and never printed as part of a path.
                stack += [(path + (key,), item), (path, key)]
        elif isinstance(value, list):
            stack += [(path + (i,), item) for i, item in enumerate(value) if isinstance(item, (str, dict, list))]
    return None


class _Body(BaseModel):
    """A request body: unknown fields refused, no lone surrogate in any string."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        where = lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError("invalid_unicode", "{param} holds a lone UTF-16 surrogate (an unpaired "
                                      "\\ud800-\\udfff escape), which is not valid Unicode text", {"param": where})
        return data


class _Request(_Body):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: Union[str, Items[str], None] = Field(None, validate_default=True)
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[Annotated[dict[str, bool], Field(fail_fast=True)]] = None
    user: Optional[str] = None  # an end-user id: accepted, as OpenAI does, and not used
    # Accepted at their neutral values only, which clients often send explicitly.
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def check_supported(self) -> None:
        """Refuse the accepted fields at values this server cannot honour."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (only 0)", param=name)
        if self.logprobs not in (None, False):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        if self.stream_options and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None  # accepted; the processor sizes images itself


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "name": harmless, and passed to the template

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, Items[Part]]

    @property
    def role_in_template(self) -> str:
        return "system" if self.role == "developer" else self.role  # OpenAI's "developer" is the system prompt

    def image_urls(self) -> list[str]:
        return [] if isinstance(self.content, str) else [p.image_url.url for p in self.content
                                                         if isinstance(p, ImagePart)]

    def as_chat(self) -> dict[str, str]:
        """The message as text chat templates take it (its image parts are the caller's to refuse)."""
        text = self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, TextPart))
        return {"role": self.role_in_template, "content": text}

    def as_vision_chat(self) -> dict[str, Any]:
        """The message as processors' chat templates take it: text and ``{"type": "image"}`` parts."""
        parts = ([{"type": "text", "text": self.content}] if isinstance(self.content, str) else
                 [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                  for p in self.content])
        return {"role": self.role_in_template, "content": parts}


class ChatRequest(_Request):
    messages: Items[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: Union[str, Items[str], TokenIds, Items[TokenIds]]
    max_tokens: Optional[int] = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported by this server", param="suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of other than n is not supported by this server", param="best_of")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a text or a list of token ids."""
        return texts_or_ids(self.prompt, "prompt")


def texts_or_ids(value: Any, param: str) -> list[str | list[int]]:
    """A text, a list of token ids, or a list of either, as a list of texts and id lists; empty refused."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    if not value:
        raise APIError(400, f"{param} is empty", param=param)
    return list(value)


# OpenAI's own bound on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
Inputs = Annotated[list[T], Field(fail_fast=True, max_length=MAX_EMBEDDING_INPUTS)]


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: texts or token-id lists, floats or base64 (what the openai client asks
    for by default: little-endian float32), optionally truncated to the first `dimensions`
    (renormalised: a Matryoshka model's smaller embedding)."""

    model: Optional[str] = None
    input: Union[str, Inputs[str], TokenIds, Inputs[TokenIds]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None  # an end-user id: accepted, as OpenAI does, and not used

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list: each a text or a list of token ids."""
        return texts_or_ids(self.input, "input")
