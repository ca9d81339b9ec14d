"""The tensor table read on every GGUF load (minivllm/model/quantization/gguf/tensor_table.py)
is `GGUFReader.tensors`: the same names, GGML types, shapes and bytes, plain and quantized types,
and a file cut short is refused as the reader refuses it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from minivllm.model.quantization.gguf.tensor_table import read_tensor_table
from tests.utils.gguf_utils import tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q8_0 / Q4_0 / Q4_K / Q6_K blocks and F32 norms (tests/utils/gguf_utils.py)."""
    return tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def assert_same_tables(path: Path) -> None:
    expected = GGUFReader(str(path)).tensors
    got = read_tensor_table(path)
    assert [t.name for t in got] == [t.name for t in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_the_bundled_model_s_table_is_the_gguf_reader_s(smollm2_gguf: Path) -> None:
    """Q4_1 and Q6_K blocks, F32 norms; a 49,152-token vocabulary stepped over."""
    assert_same_tables(smollm2_gguf)


def test_a_tiny_file_s_table_is_the_gguf_reader_s(tiny_gguf: Path) -> None:
    assert_same_tables(tiny_gguf)


def test_a_file_cut_short_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    for size in (len(data) // 2, 64):  # inside the tensor data, inside the metadata
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError):
            read_tensor_table(cut)
