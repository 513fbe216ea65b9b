"""The generation engine behind `tigon serve`: transformers' continuous batching
(`ContinuousBatchingManager`: paged KV cache, a scheduler that admits requests into the running
batch, one background generation thread) with per-request sampling.

transformers' CB applies one `GenerationConfig` to every request (its serving layer takes the
first request's temperature for all) and samples with the process-wide RNG, so a seed depends on
what else is running. Here every request carries its own temperature, top-p and seed: the
temperature and top-p run through transformers' own per-request CB processors, and sampling is
the Gumbel-max trick (argmax of the processed logits plus Gumbel noise, an exact draw from their
softmax) with noise that is a hash of (request seed, token position). A seeded request therefore
draws the same tokens whatever shares its batch, and greedy requests (no noise) are plain argmax.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

import torch

log = logging.getLogger("tigon.serve")

_MASK32 = 0xFFFFFFFF


def _mix32(x: Any) -> Any:
    """A 32-bit integer hash (xorshift-multiply, "lowbias32") of a Python int or of an int64 tensor
    holding uint32 values. Tensor products pass 2**63 and wrap; only their low 32 bits are kept,
    which wrapping leaves exact, so both give the same numbers."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def noise_key(seed: int, position: int) -> int:
    """The nonzero 32-bit key of the noise for the token at `position` of a request seeded `seed`
    (0 is kept for "no noise", i.e. greedy), as the signed int32 the CB argument storage holds."""
    key = _mix32((seed * 0x9E3779B1 + position * 0x85EBCA77) & _MASK32) | 1
    return key - (1 << 32) if key >= 1 << 31 else key


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise of shape ``(len(keys), vocab_size)``, a pure function of each row's key."""
    index = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    bits = _mix32(_mix32((keys.to(torch.int64)[:, None] & _MASK32) ^ (index[None, :] * 0x9E3779B1 & _MASK32)))
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(uniform))


def _seeded_sampler_class() -> type:
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    class SeededSampling(ContinuousBatchingLogitsProcessor):
        """Adds each sampled request's Gumbel noise to its processed logits, so that the CB loop's
        argmax draws from their softmax; rows whose request has no seed (greedy) are left as they are."""

        supported_kwargs = {"seed": int}
        ignored_kwargs = ()

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
            # position_offset already counts the tokens of this step: it is the new token's position,
            # whatever way the prompt was split into prefill chunks.
            keys = [noise_key(r.state.logit_processor_kwargs["seed"], r.state.position_offset)
                    if r.state.logit_processor_kwargs.get("seed") is not None else 0
                    for r in requests_with_new_token]
            return torch.tensor(keys, dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            keys = tensor_arg[: scores.size(0)]
            return torch.where((keys != 0)[:, None], scores + gumbel_noise(keys, scores.size(1)), scores)

    return SeededSampling


@dataclass(frozen=True)
class Sampling:
    """One completion's settings: temperature 0 is greedy; `seed` None draws a fresh one."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Output:
    """What a completion has produced so far: all its token ids, and why it ended (None while running)."""

    token_ids: list[int]
    finish_reason: str | None = None


class Engine:
    """One model behind transformers' continuous batching; `generate` is called from the asyncio
    loop that the results are delivered on. `start`/`stop` own the background generation thread."""

    def __init__(self, model: Any, tokenizer: Any, cb_config: Any | None = None):
        from transformers import ContinuousBatchingConfig, GenerationConfig, LogitsProcessorList
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList)
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        # Its per-start INFO lines (cache sizes, seeds) describe transformers' internals, not the server.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids = eos = eos_token_ids(model, tokenizer)
        if cb_config is None:
            cb_config = ContinuousBatchingConfig(**default_cache_size(model))
        cb_config.per_request_processors = True
        if cb_config.max_memory_percent is None:
            # transformers leaves this headroom for vocabulary-sized temporaries when logits are
            # processed; it decides before the processors below are put in, so it is said here.
            cb_config.max_memory_percent = 0.8
        # do_sample=False: the CB loop takes the argmax, and SeededSampling's noise makes it a draw.
        config = GenerationConfig(do_sample=False, eos_token_id=eos or -1, pad_token_id=tokenizer.pad_token_id)
        self.manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
        # The values given here are only defaults: every request sets its own. Each CB processor
        # takes one row of the argument storage, which the list counts only for the ones it converts.
        processors = ContinuousBatchingLogitsProcessorList(
            LogitsProcessorList([TemperatureLogitsWarper(0.5), TopPLogitsWarper(0.5), _seeded_sampler_class()()]),
            per_request_processors=True)
        processors.tensors_required += 1
        self.manager.logit_processor = processors
        self._ids = itertools.count()
        self.running: set[str] = set()

    def start(self) -> None:
        self.manager.start()

    def stop(self) -> None:
        if self.manager.is_running():
            self.manager.stop(block=True, timeout=10)

    def alive(self) -> bool:
        return self.manager.background_thread_status.fatal_error is None

    async def generate(self, prompt_ids: list[int], sampling: Sampling) -> AsyncIterator[Output]:
        """The completion of `prompt_ids`, one `Output` per step until it finishes. Closing the
        iterator early (a stop string, a client that went away) cancels the request and frees its
        cache blocks."""
        request_id = f"tigon-{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        greedy = sampling.temperature == 0.0
        # Greedy rows get temperature 1, top-p 1 and no seed (so no noise): the plain argmax.
        knobs: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0}
        if not greedy:
            knobs = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                     "seed": sampling.seed if sampling.seed is not None else secrets.randbits(31)}
        self.manager.register_result_handler(request_id, queue.put_nowait)
        self.running.add(request_id)
        finished = False
        try:
            accepted = self.manager.add_request(
                list(prompt_ids), request_id=request_id, max_new_tokens=sampling.max_tokens, streaming=True,
                eos_token_id=self.eos_token_ids or -1, **knobs)
            if accepted is None:
                raise RuntimeError("the generation engine is not accepting requests (it is stopping)")
            while not finished:
                result = await queue.get()
                if result.error is not None:
                    raise RuntimeError(f"generation failed: {result.error}")
                finished = result.is_finished()
                tokens = list(result.generated_tokens)
                reason = None
                if finished:
                    reason = "stop" if tokens and tokens[-1] in self.eos_token_ids else "length"
                    if reason == "stop":
                        tokens = tokens[:-1]
                yield Output(tokens, reason)
        finally:
            self.running.discard(request_id)
            if not finished:
                self.manager.cancel_request(request_id)
                with self.manager.output_router._lock:  # a cancelled request gets no last output to clear it
                    self.manager.output_router.result_handlers.pop(request_id, None)


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: the generation config's and the tokenizer's EOS."""
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


class VisionEngine:
    """A vision-language model generating one request at a time with `generate` (transformers'
    continuous batching takes no images), in a worker thread, each new token handed to the asyncio
    loop as it comes. Sampling is the same seeded Gumbel-max draw as `Engine`'s: a seeded request
    gets the same tokens from both. The interface is `Engine`'s, with the processor's image
    tensors (`pixels`) beside the prompt's token ids. Requests wait their turn holding their
    images' tensors: past `max_waiting` of them (running included), `full` says to refuse more."""

    def __init__(self, model: Any, tokenizer: Any, max_waiting: int = 16):
        self.model, self.tokenizer, self.max_waiting = model, tokenizer, max_waiting
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.running: set[int] = set()
        self._one_at_a_time = threading.Lock()  # the model is not shared between threads
        self._ids = itertools.count()

    def start(self) -> None:
        """Nothing runs between requests."""

    def stop(self) -> None:
        """Nothing runs between requests."""

    def alive(self) -> bool:
        return True  # a failed generation fails its own request only

    def full(self) -> bool:
        return len(self.running) >= self.max_waiting

    def _processors(self, sampling: Sampling) -> Any:
        from transformers import LogitsProcessor, LogitsProcessorList
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        if sampling.temperature == 0.0:
            return LogitsProcessorList()
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(31)

        class Noise(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                keys = torch.tensor([noise_key(seed, input_ids.shape[1])] * scores.shape[0], device=scores.device)
                return scores.float() + gumbel_noise(keys, scores.shape[1])

        return LogitsProcessorList([TemperatureLogitsWarper(float(sampling.temperature)),
                                    TopPLogitsWarper(float(sampling.top_p)), Noise()])

    async def generate(self, prompt_ids: list[int], sampling: Sampling,
                       pixels: dict[str, Any] | None = None) -> AsyncIterator[Output]:
        """The completion of `prompt_ids` with the image tensors `pixels`, one `Output` per new
        token until it finishes. Closing the iterator early stops the generation at its next token."""
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        left = threading.Event()
        tokens: list[int] = []

        class Stream(BaseStreamer):
            prompt_seen = False

            def put(self, value: torch.Tensor) -> None:
                if not self.prompt_seen:  # generate hands over the prompt first
                    self.prompt_seen = True
                    return
                loop.call_soon_threadsafe(queue.put_nowait, ("token", value.reshape(-1).tolist()))

            def end(self) -> None:
                pass

        class Left(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                return torch.full((input_ids.shape[0],), left.is_set(), dtype=torch.bool, device=input_ids.device)

        device = next(self.model.parameters()).device
        inputs = {k: v.to(device) for k, v in (pixels or {}).items()}

        def work() -> None:
            try:
                with self._one_at_a_time, torch.no_grad():
                    if left.is_set():
                        return
                    ids = torch.tensor([prompt_ids], device=device)
                    self.model.generate(
                        input_ids=ids, attention_mask=torch.ones_like(ids), **inputs, do_sample=False,
                        max_new_tokens=sampling.max_tokens, eos_token_id=self.eos_token_ids or None,
                        pad_token_id=self.tokenizer.pad_token_id, logits_processor=self._processors(sampling),
                        stopping_criteria=StoppingCriteriaList([Left()]), streamer=Stream(), use_cache=True)
                loop.call_soon_threadsafe(queue.put_nowait, ("done", None))
            except Exception as err:  # reported to the request, whose handler answers it
                loop.call_soon_threadsafe(queue.put_nowait, ("error", err))

        request_id = next(self._ids)
        self.running.add(request_id)
        threading.Thread(target=work, name=f"tigon-vision-{request_id}", daemon=True).start()
        try:
            while True:
                kind, value = await queue.get()
                if kind == "error":
                    raise RuntimeError(f"generation failed: {value}")
                if kind == "done":
                    stop = bool(tokens) and tokens[-1] in self.eos_token_ids
                    yield Output(tokens[:-1] if stop else list(tokens), "stop" if stop else "length")
                    return
                tokens += value
                if tokens[-1] not in self.eos_token_ids:
                    yield Output(list(tokens))
        finally:
            left.set()
            self.running.discard(request_id)


def default_cache_size(model: Any) -> dict[str, int]:
    """CB cache settings where transformers' defaults do not fit: on a CPU it sizes the cache from
    the host's free memory (gigabytes, slow to allocate), so there it gets room for 32 sequences of
    up to 2048 tokens (a single longer one fits as long as the whole cache holds it). On a GPU
    transformers sizes it from the free GPU memory."""
    if model.device.type != "cpu":
        return {}
    context = min(getattr(model.config, "max_position_embeddings", None) or 2048, 2048)
    page = 256
    return {"page_size": page, "num_blocks": 32 * math.ceil(context / page), "max_batch_tokens": 2048}
