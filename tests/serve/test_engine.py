import math

import torch

from tigon.serve.engine import gumbel_noise, noise_key
from tigon.serve.server import TextStream


def test_seeded_gumbel_argmax_samples_the_softmax():
    # Gumbel-max: argmax(logits + noise) over many keys must be distributed as softmax(logits).
    logits = torch.tensor([1.3, -0.4, 0.0, 2.1, 0.7])
    keys = torch.tensor([noise_key(seed, 5) for seed in range(20000)], dtype=torch.int32)
    draws = (logits + gumbel_noise(keys, logits.numel())).argmax(-1)
    freq = torch.bincount(draws, minlength=5).float() / len(keys)
    assert torch.allclose(freq, logits.softmax(-1), atol=0.012), (freq, logits.softmax(-1))


def test_noise_is_a_function_of_seed_and_position_only():
    a = gumbel_noise(torch.tensor([noise_key(7, 11), noise_key(7, 12)], dtype=torch.int32), 50)
    b = gumbel_noise(torch.tensor([noise_key(9, 3), noise_key(7, 11)], dtype=torch.int32), 50)
    assert torch.equal(a[0], b[1])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], b[0])
    assert all(noise_key(s, p) != 0 for s in range(50) for p in range(50))  # 0 means greedy


def test_hash_gives_the_same_numbers_on_ints_and_tensors():
    from tigon.serve.engine import _mix32

    values = [0, 1, 12345, 2**31 + 5, 2**32 - 1]
    assert [int(v) for v in _mix32(torch.tensor(values, dtype=torch.int64))] == [_mix32(v) for v in values]
    uniform_mean = ((_mix32(torch.arange(4096, dtype=torch.int64)) >> 8).float() / 2**24).mean()
    assert math.isclose(float(uniform_mean), 0.5, abs_tol=0.02)


def test_text_stream_holds_back_a_possible_stop_and_cuts_at_it(tiny_model):
    _, tokenizer = tiny_model
    ids = tokenizer("the cat sat on the mat", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ["on t"])
    pieces, stopped = [], False
    for n in range(1, len(ids) + 1):
        stopped = stream.feed(ids[:n])
        pieces.append(stream.take(final=stopped))
        if stopped:
            break
    assert stopped and "".join(pieces) == "the cat sat "
    assert all("o" not in p for p in pieces[:-1])  # "o" might have begun the stop: held back until known

    plain = TextStream(tokenizer, [])
    plain.feed(ids)
    assert plain.take(final=False) == "the cat sat on the mat" and plain.tokens == len(ids)
