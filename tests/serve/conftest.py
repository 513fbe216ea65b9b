"""A tiny Llama (the built-in model's shape, random weights) saved once per test session; the
serve, export and eval tests all read it."""

import pytest
import torch

from tigon.train import tiny
from tigon.train.data import load_samples


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matrices gain nothing from threads, and on a busy machine OpenMP's spinning
    threads made its forward passes many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bundled_samples():
    return load_samples([str(tiny.BUNDLED_DATASET)], seed=0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, bundled_samples):
    """The built-in tokenizer and a seeded random tiny Llama. Larger initial weights than the
    default spread its logits, so greedy answers have clear winners (the server's paged attention
    and `generate` agree on them despite rounding)."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = tiny.build_tokenizer(bundled_samples)
    model = tiny.build_model(tokenizer, seed=0, initializer_range=0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir)
