"""The OpenAI request bodies `tigon serve` accepts (pydantic models, checked by FastAPI) and its
OpenAI-style errors. Unknown fields are refused, as OpenAI refuses them, rather than ignored: a
setting that silently does nothing gives a client numbers it did not ask for."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """An error answered as OpenAI answers it: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: Union[str, list[str], None] = Field(None, validate_default=True)
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict[str, bool]] = None
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


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. "name": harmless, and passed to the template

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def as_chat(self) -> dict[str, str]:
        """The message as chat templates take it: OpenAI's "developer" role is the system prompt."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
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
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return list(prompt)
