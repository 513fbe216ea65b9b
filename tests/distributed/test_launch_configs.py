"""The accelerate config files shipped in examples/accelerate/ are ones `accelerate launch` accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "accelerate"


def _launch_options() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {action.dest for action in launch_command_parser()._actions}


@pytest.mark.parametrize(
    "name, kind, section, expected",
    [
        ("fsdp2.yaml", "FSDP", "fsdp_config", {"fsdp_version": 2}),
        ("deepspeed_zero3.yaml", "DEEPSPEED", "deepspeed_config", {"zero_stage": 3}),
    ],
)
def test_accelerate_config(name, kind, section, expected):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file

    # Unknown top-level keys raise here; the nested ones become `accelerate launch` options.
    config = load_config_from_file(str(EXAMPLES / name))
    assert config.distributed_type.value == kind
    options = getattr(config, section)
    assert expected.items() <= options.items(), options
    unknown = set(options) - _launch_options()
    assert not unknown, f"{name}: {sorted(unknown)} are not accelerate launch options"
