"""Using what `tigon sft` wrote: load a model or a LoRA adapter, generate replies (`tigon infer`,
`tigon chat`), and fold an adapter into its base model (`tigon merge`)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Sequence, TextIO

import torch

from tigon.train.checkpoint import check_output, damage, written_atomically
from tigon.train.config import SFTError
from tigon.train.modeling import (DTYPES, LABELS_FILE, Fp8Quantization, check_bitsandbytes, classifier_options,
                                  dequantize_fp8_linears, load_model, load_tokenizer, pick_dtype, quantization_name, recorded_quantization, source_kwargs)
from tigon.train.template import ensure_chat_template, render
from tigon.train.vision import (VisionPrompt, image_files, load_processor, load_vision_model, user_turn, vision_config,
                                vision_generate)

log = logging.getLogger("tigon.train")
# torch's load_state_dict names each tensor whose shape differs, the first one first; PEFT loads an
# adapter through it, as adapter "default", whose name is not part of the tensor's in the file.
_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\(\[([^\]]*)\]\) "
                            r"from checkpoint, the shape in current model is torch\.Size\(\[([^\]]*)\]\)")


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def check_intact(path: str | Path) -> None:
    """An SFTError naming the file, if `path` is a directory tigon wrote and it was damaged since
    (see `damage`): loading it would fail with a loader's traceback, or load something else."""
    wrong = damage(Path(path)) if Path(path).is_dir() else None
    if wrong is not None:
        raise SFTError(f"{wrong}: {path} is not as tigon wrote it; write it again (--resume the run that wrote "
                       "it, or repeat the merge or export with --overwrite)")


def _adapter_base(adapter: str | Path) -> str:
    from peft import PeftConfig

    base = PeftConfig.from_pretrained(str(adapter)).base_model_name_or_path
    if not base:
        raise SFTError(f"{adapter}: adapter_config.json names no base model; pass --base")
    return base


def _inference_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _adapter_model(adapter: str, base: str, dtype: torch.dtype, dequantize: bool) -> Any:
    """PEFT's model of `adapter` on `base`. A base the adapter was trained quantised (QLoRA, see
    QUANT_FILE) is quantised the same way again, so that the adapter meets the weights it learned
    against, not the originals; with `dequantize` those weights are then unpacked into plain
    `dtype` linears (for merging)."""
    from peft import PeftModel

    quantization = recorded_quantization(adapter)
    labels = Path(adapter) / LABELS_FILE
    classifier = (classifier_options(list(json.loads(labels.read_text()).values())) if labels.is_file()
                  else None)
    if quantization is None:
        vision = vision_config(base)
        model = load_vision_model(base, dtype) if vision is not None else load_model(base, dtype, classifier=classifier)
    elif isinstance(quantization, Fp8Quantization):
        # Quantised again as in training (the same bits on any device); merging needs no FP8 GPU.
        model = load_model(base, quantization.dtype, quantization, _inference_device(), classifier)
        if dequantize:
            model = dequantize_fp8_linears(model, dtype)
    else:
        device = _inference_device()
        check_bitsandbytes(quantization_name(quantization), device)
        # 4-bit training loaded the weights in its compute dtype before quantising them
        loaded = quantization.bnb_4bit_compute_dtype if quantization.load_in_4bit else dtype
        model = load_model(base, loaded, quantization, device, classifier)
        if dequantize:
            model = model.dequantize(dtype=dtype).to(dtype)  # the unquantised layers too
    try:
        return PeftModel.from_pretrained(model, adapter)
    except RuntimeError as err:
        mismatch = _SIZE_MISMATCH.search(str(err))
        if mismatch is None:
            raise
        name, in_adapter, in_base = mismatch.groups()
        raise SFTError(f"{adapter}: does not fit the base model {base}: {name.replace('.default.', '.')} is "
                       f"[{in_adapter}] in the adapter and [{in_base}] on this base (pass the --base it was "
                       "trained on)") from None


def load_for_inference(path: str, dtype: torch.dtype, base: str | None = None,
                       dequantize: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) from a model directory / hub id, or from a LoRA adapter directory on
    top of its base (from adapter_config.json unless `base` is given; quantised as it was in
    training, and with `dequantize` unpacked to `dtype` again), in eval mode."""
    check_intact(path)
    if is_adapter(path):
        base = base or _adapter_base(path)
        check_intact(base)
        model = _adapter_model(path, base, dtype, dequantize)
        has_tokenizer = (Path(path) / "tokenizer_config.json").is_file()
        tokenizer = load_tokenizer(path if has_tokenizer else base)
    else:
        if base is not None:
            raise SFTError(f"--base only applies to a LoRA adapter, and {path} is not one (no adapter_config.json)")
        model, tokenizer = load_model(path, dtype), load_tokenizer(path)
    ensure_chat_template(tokenizer)
    if is_adapter(path) and recorded_quantization(path) is not None:
        return model.eval(), tokenizer  # placed on its device as it was quantised; it moves no further
    return model.to(_inference_device()).eval(), tokenizer


@torch.no_grad()
def generate(model: Any, tokenizer: Any, prompt: Sequence[dict[str, str]] | str,
             max_new_tokens: int = 128, temperature: float = 0.0) -> str:
    """The model's reply to a chat (a list of messages: rendered with the chat template and a
    generation prompt) or its continuation of a plain string. Greedy when `temperature` is 0."""
    if isinstance(prompt, str):
        text, special = prompt, True
    else:
        text, special = render(tokenizer, prompt, True), False
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=special).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    try:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, use_cache=True, **sampling)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def chat(model: Any, tokenizer: Any, max_new_tokens: int, temperature: float, system: str | None,
         stdin: TextIO, stdout: TextIO, encoder: Any = None, images: Sequence[Any] = ()) -> None:
    """A conversation on the terminal: each line is a user turn; /reset forgets, /exit (or EOF) ends.
    With `encoder` (a vision-language model's `VisionEncoder`), `images` go with the first message
    and ``/image PATH`` attaches an image to the next one."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    start = list(history)
    shown: list[Any] = []  # the images of the turns in `history`, in order
    pending = list(images)
    stdout.write("tigon chat: type a message; " + ("/image PATH attaches an image, " if encoder else "")
                 + "/reset starts over, /exit quits\n")
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            history, shown, pending = list(start), [], []
            continue
        if encoder is not None and line.startswith("/image "):
            try:
                pending += image_files([line[len("/image "):].strip()], "/image")
            except SFTError as err:  # the conversation goes on without it
                stdout.write(f"{err}\n")
            continue
        if not line.strip():
            continue
        text = line.rstrip("\n")
        if encoder is None:
            history.append({"role": "user", "content": text})
            reply = generate(model, tokenizer, history, max_new_tokens, temperature)
        else:
            history.append(user_turn(text, len(pending)))
            shown, pending = shown + pending, []
            reply = vision_generate(model, encoder, VisionPrompt(tuple(history), tuple(shown), text), max_new_tokens,
                                    temperature)
        history.append({"role": "assistant", "content": reply if encoder is None else [{"type": "text", "text": reply}]})
        stdout.write(f"model> {reply}\n")


def merge(adapter: str, output: str, base: str | None = None, dtype: str = "auto", overwrite: bool = False) -> Path:
    """Fold a LoRA adapter into its base model and write a standalone Hugging Face model
    (safetensors, config, tokenizer) to `output`, atomically. The sum is formed in fp32 and stored
    in `dtype` (auto: the base model's own dtype). An adapter trained on a quantised base (QLoRA)
    is added to that base's dequantised weights, and auto stores bf16. An existing `output` is
    replaced only with `overwrite` (see `check_output`)."""
    check_intact(adapter)
    if not is_adapter(adapter):
        raise SFTError(f"{adapter} is not a LoRA adapter directory (no adapter_config.json)")
    from transformers import AutoConfig

    base = base or _adapter_base(adapter)
    check_intact(base)
    out = Path(output)
    check_output(out, overwrite, [adapter, base])
    quantization = recorded_quantization(adapter)
    model, tokenizer = load_for_inference(adapter, torch.float32, base, dequantize=True)
    if quantization is not None:
        log.info("dequantised the %s base (%s) %s was trained on", quantization_name(quantization),
                 "tigon" if isinstance(quantization, Fp8Quantization) else "bitsandbytes", adapter)
    if dtype == "auto" and quantization is not None:
        target = torch.bfloat16
    elif dtype == "auto":
        saved = getattr(AutoConfig.from_pretrained(base, **source_kwargs(base)), "dtype", None)
        target = getattr(torch, saved) if isinstance(saved, str) else saved or pick_dtype("auto")
    else:
        target = DTYPES[dtype]
    merged = model.merge_and_unload().to(device="cpu", dtype=target)
    vision = vision_config(base)
    with written_atomically(out) as staging:
        merged.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if vision is not None:  # a vision-language model's images need its processor beside it
            load_processor(adapter if (Path(adapter) / "preprocessor_config.json").is_file() else base,
                           vision).save_pretrained(staging)
    log.info("merged %s into %s -> %s (%s)", adapter, base, out, str(target).replace("torch.", ""))
    return out
