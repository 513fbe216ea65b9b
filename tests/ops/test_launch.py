"""Host-side launch-shape helpers agree with Triton's own (which cost microseconds per call)."""

import triton

from tigon.ops._launch import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    for n in list(range(1, 2100)) + [65535, 65536, 65537, 128256, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 3, 16, 1000, 4096):
            assert cdiv(n, block) == triton.cdiv(n, block), (n, block)
    assert cdiv(0, 7) == 0
