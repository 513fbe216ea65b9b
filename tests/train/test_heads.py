"""The fused losses' view of a model: its last hidden states through the model's own call."""

from __future__ import annotations

import torch

import tigon
from tests.patch.tiny import batch, tiny_model
from tigon.train.heads import HIDDEN, add_hidden_output


def test_hidden_states_of_whole_sequences_need_no_look_for_packed_sequences(monkeypatch):
    """The preference/policy losses call the backbone for hidden states with no attention mask
    when no row is padded: on the patched model HF's mask code is told there are no packed
    sequences (on a GPU its look is a device-to-host sync every step), with HF's hidden states."""
    from transformers import masking_utils

    looked = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda p: looked.append(1) or real(p))
    ids, _, _ = batch()
    model = tiny_model("llama").eval()
    with torch.no_grad():
        want = model.model(input_ids=ids, use_cache=False).last_hidden_state
    assert looked
    looked.clear()
    tigon.patch(model)
    add_hidden_output(model)
    try:
        with torch.no_grad():
            got = model(input_ids=ids, **{HIDDEN: True})
        assert not looked
        torch.testing.assert_close(got, want)
    finally:
        tigon.unpatch(model)
