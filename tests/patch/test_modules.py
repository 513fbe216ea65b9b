"""Activation modules: the class transformers builds for each name of the activation table is
recognised as that name's kernel, and the kernel computes what the module does."""

import pytest
import torch

from tests.helpers import assert_close
from tigon.nn.activations import ACTIVATIONS, glu
from tigon.patch.modules import module_activation


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_the_module_built_for_a_name_is_recognised_as_that_names_kernel(name, device):
    from transformers.activations import ACT2FN

    module = ACT2FN[name]
    activation = ACTIVATIONS[name]
    assert module_activation(module) == activation
    gate = torch.randn(5, 37, device=device, dtype=torch.float64) * 3
    up = torch.randn(5, 37, device=device, dtype=torch.float64)
    assert_close(glu(activation, gate, up), module(gate) * up, name=name)


def test_torch_modules_and_unknown_activations():
    assert module_activation(torch.nn.SiLU()) == "silu"
    assert module_activation(torch.nn.GELU()) == "gelu"
    assert module_activation(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    from transformers.activations import ACT2FN

    for name in ("relu", "gelu_10", "quick_gelu"):
        assert module_activation(ACT2FN[name]) is None, name
