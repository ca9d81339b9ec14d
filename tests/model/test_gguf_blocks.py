"""The plain-PyTorch dequantization of GGUF's blocks equals the `gguf` library's, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.model.quantization.gguf.blocks import (
    BLOCK_LAYOUTS,
    TYPE_NAMES,
    cols_of,
    dequantize,
    row_bytes,
)
from tests.utils.gguf_utils import QUANTIZABLE, random_blocks, reference_dequantize

TYPES = sorted(BLOCK_LAYOUTS)


@pytest.mark.parametrize("qtype", TYPES, ids=[TYPE_NAMES[t] for t in TYPES])
def test_random_blocks_dequantize_as_gguf_does(qtype: int) -> None:
    data = random_blocks(qtype, rows=6, cols=512, seed=qtype)
    got = dequantize(torch.from_numpy(data), qtype)
    assert got.shape == (6, 512) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference_dequantize(data, qtype), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=[TYPE_NAMES[t] for t in QUANTIZABLE])
def test_quantized_weights_round_trip_close_to_the_original(qtype: int) -> None:
    import gguf

    weight = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType(qtype))
    got = dequantize(torch.from_numpy(data), qtype)
    torch.testing.assert_close(got, reference_dequantize(data, qtype), rtol=0, atol=0)
    # 4 bits over a block's range of ~5 standard deviations: within ~0.2 of each weight
    assert (got - torch.from_numpy(weight)).abs().max() < 0.4


def test_row_sizes_and_an_unknown_type() -> None:
    assert row_bytes(3, 576) == 18 * 20 and cols_of(3, 360) == 576
    assert row_bytes(14, 512) == 2 * 210
    with pytest.raises(ValueError, match="GGUF type 10 is not one of"):
        dequantize(torch.zeros(1, 84, dtype=torch.uint8), 10)
