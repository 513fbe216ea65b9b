"""The serving benchmark's command line (its measurement runs on the GPU machine)."""

from __future__ import annotations

import pytest

from tigon.serve import bench


@pytest.mark.parametrize("flag", ["--clients", "--rounds", "--sequential", "--max-tokens", "--prompt-tokens"])
def test_a_count_below_one_is_refused_in_one_line(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([flag, "0"])
    assert exit_info.value.code == 2
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err
