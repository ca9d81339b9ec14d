"""The encoder-only attention kernel of minivllm/cpu/csrc/cpu_encoder_attention.cpp against the math.

tests/attention/test_attention_encoder.py holds the CPU backend (which calls this kernel) to
block-diagonal softmax attention in float32 and bfloat16, MHA and GQA, at head_dim 16: one
register tile of the kernel wide, with prompts that end mid-block (7, 1, 33 rows) and cross key
tiles (70). Here what that grid does not reach: a head_dim that is not a whole number of tiles
(40 = 2 x 16 + 8, the plain loop's last 8 dimensions), float16, a prompt of 0 rows, a prompt's
rows bit for bit the same alone and in a step, every dtype at a head_dim past whole vectors on
two threads (the same bits as one), and a malformed `query_start_loc`, refused by name.

Like the other kernel tests these build the library and fail rather than skip where it cannot be
built.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.cpu.ops import encoder_attention
from tests.attention.test_attention_encoder import block_diagonal_attention, encoder_step
from tests.attention.test_attention_reference import TOLERANCES

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_dims_past_the_register_tile_and_an_empty_prompt(dtype: torch.dtype) -> None:
    lens = [9, 0, 21]
    q, k, v, meta = encoder_step(lens, 4, 2, 40, dtype, seed=11)
    out = encoder_attention(q, k, v, meta.query_start_loc, 0.2)
    assert out.shape == q.shape and out.dtype == dtype
    expected = block_diagonal_attention(q, k, v, lens, 0.2)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


def test_a_query_start_loc_that_does_not_cover_the_rows_is_refused() -> None:
    q, k, v, meta = encoder_step([4, 5], 2, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0 to T = 9"):
        encoder_attention(q, k, v, torch.tensor([0, 4, 8], dtype=torch.int32), 0.5)
    with pytest.raises(RuntimeError, match="query_start_loc must not decrease"):
        encoder_attention(q, k, v, torch.tensor([0, 6, 4, 9], dtype=torch.int32), 0.5)
    with pytest.raises(RuntimeError, match="query_start_loc must be a contiguous int32"):
        encoder_attention(q, k, v, meta.query_start_loc.long(), 0.5)


def test_a_prompt_s_rows_do_not_depend_on_the_rest_of_the_step() -> None:
    """Bit for bit, whatever else the step holds: a pooling request's vector may not depend on
    its batch (the engine promises it, tests/pooling/test_pooling_bert.py checks it end to end)."""
    lens = [70, 37, 5]
    q, k, v, meta = encoder_step(lens, 4, 4, 32, torch.float32, seed=12)
    together = encoder_attention(q, k, v, meta.query_start_loc, 0.3)
    rows = slice(70, 107)  # the middle prompt's
    alone = encoder_attention(
        q[rows], k[rows], v[rows], torch.tensor([0, 37], dtype=torch.int32), 0.3
    )
    torch.testing.assert_close(alone, together[rows], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_dtype_on_two_threads_equals_one_thread_and_the_math(dtype: torch.dtype) -> None:
    """The vector widening of each dtype (head_dim 36: 32 values in whole vectors, 4 past them)
    and the step split into runs of equal work over two threads: the same bits as one thread, and
    the math within the dtype's tolerance."""
    lens = [3, 70, 17, 1, 40, 9]
    q, k, v, meta = encoder_step(lens, 4, 2, 36, dtype, seed=13)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = encoder_attention(q, k, v, meta.query_start_loc, 0.25)
        torch.set_num_threads(2)
        two = encoder_attention(q, k, v, meta.query_start_loc, 0.25)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(two, one, atol=0, rtol=0)
    expected = block_diagonal_attention(q, k, v, lens, 0.25)
    torch.testing.assert_close(one.double(), expected, **TOLERANCES[dtype])
