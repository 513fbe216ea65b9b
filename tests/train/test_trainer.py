"""TigonTrainer: tokens counted on the host, the collator's count kept from the model, and the
FLOP count cached, each equal to what the Trainer computes itself."""

import math
import random

import pytest
import torch
from transformers import Trainer, TrainingArguments

from tigon.train import tiny
from tigon.train.batching import Collator, TokenDataset
from tigon.train.data import load_samples
from tigon.train.trainer import TigonTrainer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(load_samples([str(tiny.BUNDLED_DATASET)], seed=0))


def rows(tokenizer, n, rng):
    """Rows of random lengths (so most batches are padded) without the pad token in them."""
    out = []
    for _ in range(n):
        ids = [rng.choice([i for i in range(5, 60) if i != tokenizer.pad_token_id]) for _ in range(rng.randint(3, 24))]
        out.append({"input_ids": ids, "labels": list(ids)})
    return TokenDataset(out)


def trainer(tokenizer, tmp_path, data, count: str) -> TigonTrainer:
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                             num_train_epochs=1, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                             report_to="none", use_cpu=True, remove_unused_columns=False, disable_tqdm=True,
                             include_num_input_tokens_seen=count, seed=0, data_seed=0)
    t = TigonTrainer(model=tiny.build_model(tokenizer, 0), args=args, train_dataset=data, eval_dataset=data,
                     data_collator=Collator(tokenizer.pad_token_id), processing_class=tokenizer)
    t.current_gradient_accumulation_steps = 1  # set by train(); these tests also call training_step alone
    return t


def test_host_token_count_equals_the_trainers(tokenizer, tmp_path):
    data = rows(tokenizer, 4 * random.randint(2, 4), random.Random())
    on_host = trainer(tokenizer, tmp_path / "host", data, "no")
    on_host.train()
    assert on_host.state.num_input_tokens_seen == data.num_tokens()  # every row once
    by_trainer = trainer(tokenizer, tmp_path / "trainer", data, "non_padding")
    by_trainer.train()
    assert by_trainer.state.num_input_tokens_seen == data.num_tokens()
    assert math.isfinite(on_host.evaluate()["eval_loss"])  # the count never reaches the model


def test_flop_count_is_cached_and_equals_the_trainers(tokenizer, tmp_path, monkeypatch):
    data = rows(tokenizer, 8, random.Random())
    t = trainer(tokenizer, tmp_path, data, "no")
    collate = Collator(tokenizer.pad_token_id)
    batches = [collate([data[i] for i in range(k)]) for k in (3, 8, 5)]
    expected = [Trainer.floating_point_ops(t, b) for b in batches]
    assert expected[0] > 0
    assert t.floating_point_ops(batches[0]) == pytest.approx(expected[0])
    monkeypatch.setattr(type(t.model), "num_parameters", lambda *a, **k: pytest.fail("parameters counted again"))
    for batch, flops in zip(batches[1:], expected[1:]):
        assert t.floating_point_ops(batch) == pytest.approx(flops)


def test_training_step_takes_the_count_out_of_the_batch(tokenizer, tmp_path, monkeypatch):
    seen = []
    t = trainer(tokenizer, tmp_path, rows(tokenizer, 4, random.Random()), "no")
    monkeypatch.setattr(Trainer, "training_step", lambda self, model, inputs, *a, **k: seen.append(set(inputs))
                        or torch.zeros(()))
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": [7, 8, 9], "labels": [7, 8, 9]}] * 2)
    t.training_step(t.model, batch)
    assert seen == [{"input_ids", "labels"}]
    assert t.state.num_input_tokens_seen == 6


def test_training_mode_is_set_only_when_the_model_is_not_in_it(tokenizer, tmp_path, monkeypatch):
    t = trainer(tokenizer, tmp_path, rows(tokenizer, 4, random.Random()), "no")
    walks = []
    real_train = torch.nn.Module.train
    monkeypatch.setattr(torch.nn.Module, "train", lambda self, mode=True: walks.append(mode) or real_train(self, mode))
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": [7, 8, 9], "labels": [7, 8, 9]}] * 2)
    t.model.eval()
    t.model.training = True  # as PEFT leaves it: a root in training mode around modules in eval mode
    walks.clear()
    t.training_step(t.model, dict(batch))
    assert walks and walks[0] is True and all(m.training for m in t.model.modules())
    walks.clear()
    t.training_step(t.model, dict(batch))
    assert walks == [] and "train" not in vars(t.model)  # already training: no walk, nothing left behind
    t.model.eval()  # as evaluation and sample generation do
    t.training_step(t.model, dict(batch))
    assert walks and all(m.training for m in t.model.modules())
    # Under a wrapper (DDP, DataParallel) evaluation switches the model inside, not the wrapper:
    # every step walks.
    wrapper = torch.nn.DataParallel(t.model)
    t.training_step(wrapper, dict(batch))
    t.model.eval()
    walks.clear()
    t.training_step(wrapper, dict(batch))
    assert walks and all(m.training for m in t.model.modules())


def test_clipping_uses_the_trainable_parameters_once_collected(tokenizer, tmp_path, monkeypatch):
    t = trainer(tokenizer, tmp_path, rows(tokenizer, 4, random.Random()), "no")
    t.create_optimizer_and_scheduler(num_training_steps=1)
    t.model.model.embed_tokens.weight.requires_grad_(False)  # a frozen parameter, as under LoRA
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": [7, 8, 9, 10], "labels": [7, 8, 9, 10]}] * 3)
    t.training_step(t.model, dict(batch))
    grads = [p.grad.clone() for p in t.model.parameters() if p.grad is not None]
    expected = torch.nn.utils.get_total_norm(grads)
    t.args.max_grad_norm = float(expected) / 3  # the clip scales every gradient
    monkeypatch.setattr(type(t.accelerator), "_clip_grad_norm_dtensor_aware",
                        lambda *a, **k: pytest.fail("a pass over every parameter for its DTensor mesh"))
    assert float(t._clip_grad_norm(t.model)) == pytest.approx(float(expected), rel=1e-6)
    clipped = [p.grad for p in t.model.parameters() if p.grad is not None]
    for got, grad in zip(clipped, grads, strict=True):
        torch.testing.assert_close(got, grad / 3, rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(type(t.model), "parameters", lambda *a, **k: pytest.fail("parameters walked again"))
    t._clip_grad_norm(t.model)


def test_cuda_graphs_steps_hand_their_metrics_and_loss_out_of_the_step(tokenizer, tmp_path, monkeypatch):
    """--cuda-graphs: what a micro-step gives ``_add`` is taken from the step's outputs (a replay
    runs no Python) into the metrics, and the loss and gradients are those of the plain step (off a
    GPU the steps run plainly, through the same path)."""
    batch = Collator(tokenizer.pad_token_id)([{"input_ids": [7, 8, 9, 10], "labels": [7, 8, 9, 10]}] * 3)
    results = []
    for graphs in (False, True):
        t = trainer(tokenizer, tmp_path / str(graphs), rows(tokenizer, 4, random.Random()), "no")
        t.cuda_graphs = graphs
        real = t.compute_loss

        def compute_loss(model, inputs, *args, t=t, real=real, **kwargs):
            loss = real(model, inputs, *args, **kwargs)
            t._add("train", "probe", 2 * loss, 1)
            return loss

        monkeypatch.setattr(t, "compute_loss", compute_loss)
        losses = [t.training_step(t.model, dict(batch), torch.tensor(9)) for _ in range(2)]
        assert t._recording is None
        probes = t._sums["train"]["probe"]
        assert len(probes) == 2
        for loss, probe in zip(losses, probes):
            torch.testing.assert_close(probe, torch.stack([2 * loss.float(), torch.tensor(1.0)]))
        results.append((losses, [p.grad.clone() for p in t.model.parameters()]))
    (plain_losses, plain_grads), (graph_losses, graph_grads) = results
    torch.testing.assert_close(graph_losses, plain_losses)
    for got, want in zip(graph_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want)  # two micro-batches accumulated


def test_right_padding_without_a_mask_trains_like_the_masked_batch(tokenizer):
    """--cuda-graphs' collator (a width) leaves right-padded rows unmasked: causal attention never
    lets a real token see the padding after it, and its labels are ignored, so the loss and the
    gradients are the masked batch's."""
    from tigon.train.batching import NUM_TOKENS

    model = tiny.build_model(tokenizer, 0)
    rows = [{"input_ids": ids, "labels": list(ids)} for ids in ([7, 8, 9, 10, 11], [12, 13, 14], list(range(20, 27)))]

    def step(collate):
        model.zero_grad(set_to_none=True)
        batch = collate(rows)
        batch.pop(NUM_TOKENS)
        loss = model(**batch).loss
        loss.backward()
        return batch, loss.detach(), [p.grad.clone() for p in model.parameters()]

    masked_batch, masked_loss, masked_grads = step(Collator(tokenizer.pad_token_id))
    batch, loss, grads = step(Collator(tokenizer.pad_token_id, width=12))
    assert "attention_mask" in masked_batch and "attention_mask" not in batch and batch["input_ids"].shape == (3, 12)
    torch.testing.assert_close(loss, masked_loss)
    for got, want in zip(grads, masked_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_unwrap_model_walks_each_model_once(tokenizer, tmp_path, monkeypatch):
    import accelerate.accelerator

    t = trainer(tokenizer, tmp_path, rows(tokenizer, 4, random.Random()), "no")
    walks = []
    real = accelerate.accelerator.extract_model_from_parallel
    monkeypatch.setattr(accelerate.accelerator, "extract_model_from_parallel",
                        lambda m, *a, **k: walks.append(m) or real(m, *a, **k))
    wrapper = torch.nn.DataParallel(t.model)
    for step in range(3):
        assert t.accelerator.unwrap_model(t.model) is t.model
        assert t.accelerator.unwrap_model(wrapper) is t.model
        assert t.accelerator.unwrap_model(wrapper, keep_fp32_wrapper=False) is t.model
        # Once per model and arguments (the Trainer asked for its model already): accelerate
        # walks every module each time.
        assert len(walks) == 2, step


def test_gradients_are_zeroed_without_walking_the_model(tokenizer, tmp_path, monkeypatch):
    """Between optimizer steps the trainable parameters' gradients go (the only ones there are),
    without model.zero_grad's walk over every module and parameter; nothing stays on the model."""
    data = rows(tokenizer, 12, random.Random())
    t = trainer(tokenizer, tmp_path, data, "no")
    walks = []
    real = torch.nn.Module.zero_grad
    monkeypatch.setattr(torch.nn.Module, "zero_grad", lambda self, *a, **k: walks.append(self) or real(self, *a, **k))
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        seen.append([p.grad is not None for p in t.model.parameters() if p.requires_grad])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    t.train()
    assert len(seen) == 3 and all(all(flags) for flags in seen)
    assert walks == []
    assert all(p.grad is None for p in t.model.parameters())
    assert "zero_grad" not in vars(t.model)


def test_unpatch_after_training_leaves_the_models_own_methods(tokenizer, tmp_path):
    """What the patch floor rebinds for training (the forwards, the hidden-state output of the
    fused losses, the trainer's lent ``train`` and ``zero_grad``) is undone by ``tigon.unpatch``:
    after a patched model trained with the trainer, its modules hold what they held before."""
    import tigon
    from tigon.train.heads import add_hidden_output

    t = trainer(tokenizer, tmp_path, rows(tokenizer, 8, random.Random(0)), "no")
    t.token_accuracy = True
    model = t.model
    before = {name: dict(vars(module)) for name, module in model.named_modules()}
    tigon.patch(model)
    add_hidden_output(model)
    t.train()
    assert "accuracy" in t.state.log_history[0], "the patched loss handed its accuracy to the trainer"
    tigon.unpatch(model)
    after = {name: dict(vars(module)) for name, module in model.named_modules()}
    assert after.keys() == before.keys()
    for name, attributes in before.items():
        added = after[name].keys() - attributes.keys() - {"_is_accelerate_prepared"}  # the Trainer's own mark
        assert not added and all(after[name][key] is value for key, value in attributes.items()), name
    assert model.forward.__func__ is type(model).forward
    assert model.train.__func__ is type(model).train and model.zero_grad.__func__ is type(model).zero_grad
