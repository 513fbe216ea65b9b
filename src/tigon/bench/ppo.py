"""PPO's training step (`tigon rlhf --method ppo` without the sampling): PyTorch eager vs
torch.compile vs tigon, on the 1B Llama shape of :mod:`tigon.bench.e2e` (random weights, bf16,
SDPA) with a value head (``hidden -> 1``, fp32) on the policy.

One step over a rollout batch of ``--prompts`` prompts of ``--prompt-len`` tokens, each with a
completion of up to ``--new-tokens`` tokens (random lengths from half of that up, right-padded,
the attention mask given), is:

* scoring, without gradient: the policy's log-prob of every completion token and its values,
  the reference's log-probs (LoRA: the adapter switched off; full: a frozen copy), the per-token
  KL-penalised rewards, GAE and the whitened advantages (`tigon.train.advantages`);
* ``--ppo-epochs`` updates: forward and backward of the PPO loss (clipped policy term, clipped
  value term) over the whole batch, then AdamW.

Nothing is sampled: the rollout is random tokens, so the step is the training part of PPO alone,
which a last line per mode sets against eager. ``torch.compile`` of the 1B model takes longer
than the rest together, so it runs last; `tigon bench --ppo` runs all three (about two minutes on
an H100), and eager against tigon alone is

    python -m tigon.bench.ppo --impls eager tigon

``eager`` is the unpatched model called as TRL's PPO trainers call it: the logits of every
position, their log-softmax in fp32, and the last hidden states (``output_hidden_states``) for
the value head. ``compile`` is that under ``torch.compile``. ``tigon`` is the patched model
returning its last hidden states, the log-probs from `linear_log_probs` and the policy loss
from `linear_policy_loss`: the ``(tokens x vocab)`` logits never exist. Each implementation
starts from the same weights and rollout; the table gives the step's median time (scoring and
updates apart), the peak memory and the first update's loss against eager's.

    python -m tigon.bench.ppo --modes lora full --out bench-out/ppo
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

import tigon
import tigon.functional as TF
from tigon.bench.e2e import LLAMA_1B, build_model, current_cuda_device, release_memory
from tigon.bench.harness import environment
from tigon.patch import HIDDEN, add_hidden_output
from tigon.train.advantages import gae, token_rewards, value_loss, whiten

MODES = ("lora", "full")
IMPLS = ("eager", "tigon", "compile")
BETA, GAMMA, LAM, EPSILON, CLIP_VALUE, VF_COEF = 0.05, 1.0, 0.95, 0.2, 0.2, 0.1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_rollout(prompts: int, prompt_len: int, new_tokens: int, vocab: int, device: torch.device) -> dict[str, Any]:
    """Random prompts and completions (the same for every implementation), their masks and scores."""
    gen = torch.Generator(device).manual_seed(1234)
    ids = torch.randint(0, vocab, (prompts, prompt_len + new_tokens), device=device, generator=gen)
    lengths = torch.randint(new_tokens // 2, new_tokens + 1, (prompts,), device=device, generator=gen)
    completion_mask = (torch.arange(new_tokens, device=device) < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(prompts, prompt_len, dtype=torch.long, device=device), completion_mask], 1)
    return dict(input_ids=ids, attention_mask=attention_mask, completion_ids=ids[:, prompt_len:],
                mask=completion_mask, scores=torch.randn(prompts, device=device, generator=gen), prompt_len=prompt_len)


@contextlib.contextmanager
def as_reference(model: torch.nn.Module, frozen: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The reference: the frozen copy, or the PEFT policy with its adapter off."""
    if frozen is not None:
        yield frozen
    else:
        with model.disable_adapter():
            yield model


class Eager:
    """PPO over the materialised logits (the unpatched model, or the same under torch.compile)."""

    def __init__(self, model: torch.nn.Module, compiled: bool):
        self.policy = torch.compile(model) if compiled else model

    @staticmethod
    def log_probs(call: Callable[..., Any], rollout: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        out = call(input_ids=rollout["input_ids"], attention_mask=rollout["attention_mask"], output_hidden_states=True)
        start = rollout["prompt_len"] - 1
        logits = out.logits[:, start:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, rollout["completion_ids"][..., None])[..., 0]
        return logp, out.hidden_states[-1][:, start:-1]

    def score(self, model, frozen, rollout):
        logp, hidden = self.log_probs(self.policy, rollout)
        with as_reference(model, frozen) as ref_model:
            ref = self.log_probs(self.policy if frozen is None else ref_model, rollout)[0]
        return logp, hidden, ref

    def loss_terms(self, model, rollout):
        logp, hidden = self.log_probs(self.policy, rollout)
        ratio = torch.exp(logp - rollout["old"])
        adv = rollout["advantages"]
        per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - EPSILON, 1 + EPSILON))
        mask = rollout["mask"].bool()
        return torch.where(mask, per_token, 0.0).sum() / mask.sum(), hidden


class Tigon:
    """PPO from the last hidden states through tigon's fused log-prob and policy-loss ops."""

    def __init__(self, model: torch.nn.Module, frozen: torch.nn.Module | None):
        for m in (model, frozen):
            if m is not None:
                add_hidden_output(m)
        self.head = model.get_output_embeddings()

    def hidden(self, model: torch.nn.Module, rollout: dict[str, Any]) -> torch.Tensor:
        start = rollout["prompt_len"] - 1
        return model(input_ids=rollout["input_ids"], attention_mask=rollout["attention_mask"], **{HIDDEN: True})[:, start:-1]

    def log_probs(self, model: torch.nn.Module, rollout: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.hidden(model, rollout)
        head = model.get_output_embeddings()
        target = rollout["completion_ids"].masked_fill(rollout["mask"] == 0, -100)
        return TF.linear_log_probs(hidden, head.weight, target, head.bias), hidden

    def score(self, model, frozen, rollout):
        logp, hidden = self.log_probs(model, rollout)
        with as_reference(model, frozen) as ref_model:
            ref = self.log_probs(ref_model, rollout)[0]
        return logp, hidden, ref

    def loss_terms(self, model, rollout):
        hidden = self.hidden(model, rollout)
        loss, _ = TF.linear_policy_loss(hidden, self.head.weight, rollout["completion_ids"], rollout["old"],
                                        rollout["advantages"], epsilon=EPSILON, loss_type="bnpo", mask=rollout["mask"],
                                        bias=self.head.bias)
        return loss, hidden


def ppo_step(impl: Any, model: torch.nn.Module, frozen: torch.nn.Module | None, value_head: torch.nn.Module,
             optimizer: torch.optim.Optimizer, rollout: dict[str, Any], epochs: int, device: torch.device
             ) -> tuple[float, float, list[float]]:
    """One PPO step; (scoring seconds, update seconds, the updates' losses)."""
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        logp, hidden, ref = impl.score(model, frozen, rollout)
        values = value_head(hidden.float()).squeeze(-1)
        rewards, _ = token_rewards(rollout["scores"], logp, ref, rollout["mask"], BETA)
        advantages, returns = gae(rewards, values, rollout["mask"], GAMMA, LAM)
    batch = {**rollout, "old": logp, "values": values, "returns": returns,
             "advantages": whiten(advantages, rollout["mask"])}
    _sync(device)
    scored = time.perf_counter()
    losses = []
    for _ in range(epochs):
        policy, hidden = impl.loss_terms(model, batch)
        value, _ = value_loss(value_head(hidden.float()).squeeze(-1), batch["values"], batch["returns"],
                              batch["mask"], CLIP_VALUE)
        loss = policy + VF_COEF * value
        loss.backward()
        losses.append(loss.item())  # where the Trainer reads it
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(device)
    return scored - start, time.perf_counter() - scored, losses


def run_case(mode: str, impl_name: str, device: torch.device, *, prompts: int, prompt_len: int, new_tokens: int,
             epochs: int, steps: int, warmup: int, shape: dict, lora_rank: int,
             log: Callable[[str], None]) -> dict[str, Any]:
    """`warmup` + `steps` PPO steps of one implementation on a fresh model; times, peak, losses."""
    release_memory(device)
    record: dict[str, Any] = {"mode": mode, "impl": impl_name}
    model = frozen = None
    try:
        seq = prompt_len + new_tokens
        model = build_model(mode, seq, device, shape=shape, lora_rank=lora_rank, checkpointing=False)
        if mode == "full":
            frozen = build_model("full", seq, device, shape=shape, lora_rank=lora_rank,
                                 checkpointing=False).eval().requires_grad_(False)
        model.train()
        if impl_name == "tigon":
            record["applied"] = str(tigon.patch(model))
            log(record["applied"])
            if frozen is not None:
                tigon.patch(frozen, role="the frozen reference", linear_cross_entropy=False, cross_entropy=False)
        impl = Tigon(model, frozen) if impl_name == "tigon" else Eager(model, impl_name == "compile")
        torch.manual_seed(0)
        value_head = torch.nn.Linear(shape["hidden_size"], 1, device=device)
        params = [p for p in model.parameters() if p.requires_grad] + list(value_head.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-6, fused=device.type == "cuda")
        rollout = make_rollout(prompts, prompt_len, new_tokens, shape["vocab_size"], device)
        scoring, updates, losses = [], [], []
        for i in range(warmup + steps):
            score_s, update_s, step_losses = ppo_step(impl, model, frozen, value_head, optimizer, rollout, epochs, device)
            losses += step_losses
            if i >= warmup:
                scoring.append(score_s)
                updates.append(update_s)
        record.update(score_ms=1e3 * statistics.median(scoring), update_ms=1e3 * statistics.median(updates),
                      step_ms=1e3 * statistics.median(s + u for s, u in zip(scoring, updates)), losses=losses,
                      peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"))
    except Exception as err:  # one failing case must not hide the others' numbers
        record["error"] = f"{type(err).__name__}: {err}"
    finally:
        for m in (model, frozen):
            if m is not None:
                tigon.unpatch(m)
        del model, frozen
        release_memory(device)
    return record


def format_table(records: list[dict[str, Any]]) -> str:
    eager = {r["mode"]: r for r in records if r["impl"] == "eager" and "error" not in r}
    lines = [f"{'mode':<6}{'impl':<9}{'step ms':>9}{'score ms':>10}{'update ms':>11}{'peak GiB':>10}{'speed-up':>10}"
             f"{'peak/eager':>11}{'first loss':>12}{'|dloss| 1st':>12}"]
    for r in records:
        if "error" in r:
            lines.append(f"{r['mode']:<6}{r['impl']:<9}  {r['error']}")
            continue
        base = eager.get(r["mode"])
        speed = base["step_ms"] / r["step_ms"] if base else float("nan")
        peak = r["peak_gib"] / base["peak_gib"] if base else float("nan")
        diff = abs(r["losses"][0] - base["losses"][0]) if base else float("nan")
        r.update(vs_eager_speed=speed, vs_eager_peak=peak)
        lines.append(f"{r['mode']:<6}{r['impl']:<9}{r['step_ms']:>9.1f}{r['score_ms']:>10.1f}{r['update_ms']:>11.1f}"
                     f"{r['peak_gib']:>10.2f}{speed:>9.2f}x{peak:>11.2f}{r['losses'][0]:>12.5f}{diff:>12.2e}")
    return "\n".join(lines)


def training_part(records: list[dict[str, Any]]) -> list[str]:
    """One line per mode: the training part of the step (scoring + updates; the rollout is made up,
    nothing is sampled) of tigon against eager, beside issue 41's target."""
    lines = []
    for r in records:
        if r["impl"] == "tigon" and "error" not in r and r.get("vs_eager_speed") == r.get("vs_eager_speed"):
            lines.append(f"{r['mode']}: the training part of the PPO step (no generation) takes {r['step_ms']:.1f} ms "
                         f"with tigon, {r['vs_eager_speed']:.2f}x eager's speed at {r['vs_eager_peak']:.2f}x its peak "
                         "(target >= 1.5x)")
    return lines


def run_ppo_bench(modes: Sequence[str] = ("lora",), impls: Sequence[str] = IMPLS, *, prompts: int = 8,
                  prompt_len: int = 128, new_tokens: int = 256, epochs: int = 1, steps: int = 5, warmup: int = 2,
                  shape: dict = LLAMA_1B, lora_rank: int = 16, out_dir: Path | None = None,
                  log: Callable[[str], None] = print, device: torch.device | None = None) -> list[dict[str, Any]]:
    """Every (mode, impl) pair on the current CUDA device (or `device`: a CPU run of a small
    `shape` checks the pipeline, not speed); a table, ``ppo.json`` in `out_dir`, the records."""
    device = device or current_cuda_device("the PPO step benchmark")
    settings = dict(prompts=prompts, prompt_len=prompt_len, new_tokens=new_tokens, epochs=epochs, steps=steps,
                    warmup=warmup, lora_rank=lora_rank)
    log(f"PPO step bench: {prompts} prompts x ({prompt_len} + up to {new_tokens}) tokens, {epochs} update(s) a step, "
        f"{steps} timed steps after {warmup}")
    records = [run_case(mode, impl, device, shape=shape, log=log, **settings) for mode in modes for impl in impls]
    log(format_table(records))
    for line in training_part(records):
        log(line)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "ppo.json").write_text(json.dumps({"environment": environment(device), "settings": settings,
                                                      "records": records}, indent=1))
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tigon.bench.ppo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["lora"])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--ppo-epochs", type=int, default=1, help="updates per step over the rollout batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", metavar="DIR", help="write ppo.json here")
    args = parser.parse_args(argv)
    records = run_ppo_bench(args.modes, args.impls, prompts=args.prompts, prompt_len=args.prompt_len,
                            new_tokens=args.new_tokens, epochs=args.ppo_epochs, steps=args.steps, warmup=args.warmup,
                            lora_rank=args.lora_rank, out_dir=Path(args.out) if args.out else None)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    from tigon.bench.e2e import exit_status

    raise SystemExit(exit_status(main, "python -m tigon.bench.ppo"))
