"""Sequence classifiers: a decoder's backbone (tigon's kernels patched in) with a head of
``num_labels`` outputs on each row's last token, as ``AutoModelForSequenceClassification`` builds
it for every family. The base of `tigon sft --task classification` (here), of the reward model of
`tigon rlhf --method rm` (`tigon.train.reward`: one output) and of anything else that scores whole
sequences (a reranker: a query and a document in one row).

Training reads the head at the last token alone (:func:`pooled_scores`): Hugging Face's class runs
its head over every position and then picks the last one, so its backward writes a gradient for
every position's hidden state through the head. The row's last token is found as transformers
finds it (the rightmost token that is not padding), so training, ``tigon infer`` and a reward
model's scoring in ``tigon rlhf --method grpo`` (the model's own forward) agree.

`tigon sft --task classification` reads rows ``{text, label}``; the labels are names (or numbers)
mapped to ids in the order of ``--labels`` or sorted, saved in the config's ``id2label`` /
``label2id`` (and beside a LoRA adapter, `LABELS_FILE`). Its metrics: accuracy in training and
evaluation, and macro F1 on the evaluation rows.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tigon.train.batching import NUM_TOKENS, TokenDataset
from tigon.train.config import SFTConfig, SFTError, resolve
from tigon.train.data import Format, RowError, _text, load_samples
from tigon.train.fused import FusedTrainer
from tigon.train.heads import HIDDEN
from tigon.train.modeling import classifier_options, load_tokenizer
from tigon.train.trainer import TigonTrainer

log = logging.getLogger("tigon.train")

BUNDLED_CLASSIFICATION = Path(__file__).parent / "data" / "topics.jsonl"
ACCURACY, F1 = "accuracy", "f1"


# --- the head at each row's last token ------------------------------------------------------------

def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The classification head of a sequence classifier (plain, or PEFT's around one: then the
    trained copy PEFT keeps of it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(base, "score", None)
    if head is None:
        raise SFTError(f"{type(base).__name__} has no classification head (score): not a sequence classifier")
    return head


def last_tokens(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Each row's last token that is not `pad_token_id` (the last one where there is no padding
    token), as transformers' sequence classifiers pick it: padding on either side."""
    if pad_token_id is None:
        return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, device=input_ids.device)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


def pooled_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  pad_token_id: int | None) -> torch.Tensor:
    """``(rows, num_labels)``: the head of `model` (made to return its hidden states, see
    :func:`tigon.train.heads.add_hidden_output`) on each row's last token alone."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, **{HIDDEN: True})
    last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_tokens(input_ids, pad_token_id)]
    head = score_head(model)
    return head(last.to(next(head.parameters()).dtype))


class ScoringTrainer(FusedTrainer):
    """Mixed in before a Trainer of a sequence classifier: the scores of a batch's rows
    (:func:`pooled_scores`) through the model's own call."""

    _HIDDEN_MODELS = ("model",)

    def _scores(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        pad = self.accelerator.unwrap_model(model).config.pad_token_id
        return pooled_scores(model, inputs["input_ids"], inputs.get("attention_mask"), pad)


# --- tigon sft --task classification: data ------------------------------------------------------

@dataclass(frozen=True)
class Labeled:
    """One row: a text and its label's name."""

    where: str
    text: str
    label: str


def _label_name(value: Any) -> str:
    if value is None:
        raise RowError("label is missing (null)")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(f"label must be a name or an integer, got {value!r}")
    if isinstance(value, str) and not value.strip():
        raise RowError("label is empty")
    return str(value).strip()


def _from_text_label(row: dict) -> Labeled:
    return Labeled("", _text(row["text"], "text"), _label_name(row["label"]))


# A reranker is a classifier of (query, document) pairs, read as one text in this layout (its last
# token's state sees both); `label` says whether (or how well) the document answers the query.
RERANK_TEXT = "Query: {query}\nDocument: {document}"


def _from_query_document_label(row: dict) -> Labeled:
    text = RERANK_TEXT.format(query=_text(row["query"], "query"), document=_text(row["document"], "document"))
    return Labeled("", text, _label_name(row["label"]))


FORMATS: list[Format] = [
    ("text/label", ("text", "label"), _from_text_label),
    ("query/document/label (a reranker)", ("query", "document", "label"), _from_query_document_label),
]


def load_labeled(specs: list[str], seed: int) -> list[Labeled]:
    """The rows of every file in `specs`; a bad row is an SFTError naming its file and row."""
    return load_samples(specs, seed, FORMATS)


def label_names(rows: list[Labeled], given: list[str] | None) -> list[str]:
    """The labels in id order: `given` (--labels), which every row's label must be one of; else
    those of `rows`, sorted (numerically where every one is an integer)."""
    if given is not None:
        if len(set(given)) != len(given) or len(given) < 2:
            raise SFTError(f"--labels {','.join(given)}: give two or more distinct labels")
        known = set(given)
        stray = next((r for r in rows if r.label not in known), None)
        if stray is not None:
            raise SFTError(f"{stray.where}: label {stray.label!r} is not one of --labels {','.join(given)}")
        return list(given)
    names = sorted({r.label for r in rows})
    if all(n.lstrip("-").isdigit() for n in names):
        names.sort(key=int)
    if len(names) < 2:
        raise SFTError(f"the data has one label ({names[0]!r}): a classifier needs two or more")
    return names


def check_labels(rows: list[Labeled], names: list[str], what: str) -> None:
    """An SFTError for the first row of `rows` whose label is not among `names` (the training
    data's, for evaluation rows)."""
    stray = next((r for r in rows if r.label not in names), None)
    if stray is not None:
        raise SFTError(f"{stray.where}: label {stray.label!r} ({what}) is not among the training data's labels "
                       f"{', '.join(names)}")


def encode(tokenizer: Any, rows: list[Labeled], label2id: dict[str, int], max_length: int) -> list[dict[str, Any]]:
    """Token rows: the text's first `max_length` tokens and the label's id."""
    ids = tokenizer([r.text for r in rows], add_special_tokens=True)["input_ids"]
    return [{"input_ids": t[:max_length], "labels": label2id[r.label]} for t, r in zip(ids, rows)]


class ClassificationCollator:
    """Right-pads a batch with `pad_token_id` (an attention mask only where a row is padded), the
    labels as one tensor, and the batch's token count (`NUM_TOKENS`) for the progress bar."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, f in enumerate(features):
            ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
            mask[i, :len(f["input_ids"])] = 1
        batch = {"input_ids": ids, "labels": torch.tensor([f["labels"] for f in features])}
        if not bool(mask.all()):
            batch["attention_mask"] = mask
        batch[NUM_TOKENS] = int(mask.sum())
        return batch


# --- tigon sft --task classification: the Trainer -----------------------------------------------

def macro_f1(confusion: torch.Tensor) -> float:
    """The mean over labels of F1 (2 TP / (2 TP + FP + FN)) from a (true x predicted) count
    matrix; a label that is neither true nor predicted anywhere is left out."""
    hits = confusion.diagonal()
    denominator = confusion.sum(0) + confusion.sum(1)
    seen = denominator > 0
    return float((2 * hits[seen] / denominator[seen]).mean()) if bool(seen.any()) else 0.0


class TigonClassifierTrainer(ScoringTrainer, TigonTrainer):
    """tigon's Trainer for a sequence classifier: cross-entropy of the head at each row's last
    token; accuracy in training and evaluation and macro F1 over the evaluation rows, summed on
    the device and read at each log."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._confusion: torch.Tensor | None = None  # evaluation's (true x predicted) counts since the last log
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        mode = "train" if model.training else "eval"
        logits = self._scores(model, inputs)
        labels = inputs["labels"]
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        predicted = logits.detach().argmax(-1)
        self._add(mode, ACCURACY, (predicted == labels).sum(), labels.numel())
        if mode == "eval":
            n = logits.shape[-1]
            counts = torch.bincount(labels * n + predicted, minlength=n * n).view(n, n)
            self._confusion = counts if self._confusion is None else self._confusion + counts
        return (loss, SequenceClassifierOutput(loss=loss, logits=logits)) if return_outputs else loss

    def _averages(self, mode: str) -> dict[str, float]:
        values = super()._averages(mode)
        if mode == "eval" and self._confusion is not None:
            confusion, self._confusion = self._confusion, None
            if self.accelerator.num_processes > 1:
                confusion = self.accelerator.reduce(confusion, "sum")
            values[F1] = macro_f1(confusion)
        return values


# --- the run ------------------------------------------------------------------------------------

def resolve_classification(cfg: SFTConfig, given: set[str] = frozenset()) -> SFTConfig:
    """`resolve` for --task classification: the embedded default holds out a tenth of its rows
    (to show its evaluation) and trains 3 epochs; packing is refused (one text is one row)."""
    for flag, on in (("--packing", cfg.packing), ("--cuda-graphs", cfg.cuda_graphs)):
        if on:  # one text is one row, scored at its last token; batches are padded to their longest
            raise SFTError(f"{flag}: not for --task classification")
    if cfg.model is None and cfg.dataset is None:
        cfg = dataclasses.replace(cfg, eval_split=cfg.eval_split if "eval_split" in given else 0.1,
                                  epochs=cfg.epochs if cfg.epochs is not None else 3.0)
    return resolve(cfg, given)


def run(cfg: SFTConfig) -> Path:
    """`tigon sft --task classification` for a resolved `cfg`; returns the final model's directory."""
    from tigon.train import tiny
    from tigon.train.data import Sample
    from tigon.train.run import Job, split_off, start, train, training_arguments

    resume_from = start(cfg)
    rows = load_labeled(cfg.dataset or [str(BUNDLED_CLASSIFICATION)], cfg.seed)
    names = label_names(rows, cfg.labels)
    eval_rows: list[Labeled] = []
    if cfg.eval_dataset:
        eval_rows = load_labeled(cfg.eval_dataset, cfg.seed)
        check_labels(eval_rows, names, "evaluation data")
    elif cfg.eval_split:
        rows, eval_rows = split_off(rows, cfg.eval_split, cfg.seed)
    options = classifier_options(names)
    if cfg.model is None:
        tokenizer = tiny.build_tokenizer([Sample(r.where, text=r.text) for r in rows])
    else:
        tokenizer = load_tokenizer(cfg.model)
        if tokenizer.pad_token is None:  # a row's end is found past its last token that is not padding
            tokenizer.pad_token = tokenizer.eos_token
    train_rows = encode(tokenizer, rows, options["label2id"], cfg.max_length)
    eval_data = encode(tokenizer, eval_rows, options["label2id"], cfg.max_length) if eval_rows else None
    tokens = sum(len(r["input_ids"]) for r in train_rows)
    log.info("tokens: %d training texts, %d tokens, max length %d; labels: %s", len(train_rows), tokens,
             cfg.max_length, ", ".join(names))

    def trainer(built: Any, args: Any) -> TigonClassifierTrainer:
        return TigonClassifierTrainer(model=built.model, args=args, train_dataset=TokenDataset(train_rows),
                                      eval_dataset=TokenDataset(eval_data) if eval_data else None,
                                      data_collator=ClassificationCollator(tokenizer.pad_token_id),
                                      processing_class=tokenizer, save_limit=cfg.save_limit)

    job = Job("sft", train_rows, tokens, len(train_rows),
              arguments=lambda dtype: training_arguments(cfg, dtype, eval_data is not None), trainer=trainer,
              prompts=lambda: [], metrics={ACCURACY: "acc", F1: "f1"}, classifier=options)
    return train(cfg, resume_from, tokenizer, job)


# --- using a classifier ---------------------------------------------------------------------------

@torch.no_grad()
def classify(model: Any, tokenizer: Any, texts: list[str]) -> list[tuple[str, float]]:
    """Each text's most probable label and its probability (a one-output model, a reward model:
    its score, under the name of its one label)."""
    labels = model.config.id2label
    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"].to(next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0].float()
        if logits.numel() == 1:
            out.append((labels.get(0, "score"), float(logits[0])))
            continue
        probs = logits.softmax(-1)
        best = int(probs.argmax())
        out.append((labels.get(best, str(best)), float(probs[best])))
    return out
