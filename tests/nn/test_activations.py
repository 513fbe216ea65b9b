"""The activation table: names and modules agree, and each is the function its kernel computes."""

import pytest
import torch

from tests.helpers import assert_close
from tigon.nn import activations


@pytest.mark.parametrize("name", list(activations.ACTIVATIONS))
def test_the_module_built_for_a_name_is_recognised_as_that_names_kernel(name, device):
    from transformers.activations import ACT2FN

    module = ACT2FN[name]
    activation = activations.ACTIVATIONS[name]
    assert activations.module_activation(module) == activation
    gate = torch.randn(5, 37, device=device, dtype=torch.float64) * 3
    up = torch.randn(5, 37, device=device, dtype=torch.float64)
    assert_close(activations.glu(activation, gate, up), module(gate) * up, name=name)


def test_torch_modules_and_unknown_activations():
    assert activations.module_activation(torch.nn.SiLU()) == "silu"
    assert activations.module_activation(torch.nn.GELU()) == "gelu"
    assert activations.module_activation(torch.nn.GELU(approximate="tanh")) == "gelu_tanh"
    from transformers.activations import ACT2FN

    for name in ("relu", "gelu_10", "quick_gelu"):
        assert activations.module_activation(ACT2FN[name]) is None, name

