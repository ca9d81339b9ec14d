"""A GGUF file's tensor table, read without building its metadata: what every load needs.

A GGUF file is a header, key-value metadata, a table of tensor infos (name, shape, GGML type,
offset) and the aligned tensor data (the GGUF specification, in ggml's repository). The `gguf` library's
`GGUFReader` turns every metadata value into numpy views, one per element of an array: for a
tokenizer of 49,152 tokens that is some 150,000 small views, made on every load although a load
reads only the tensors (the metadata is read once per file, when minivllm converts the file's
config and tokenizer: reader.py `convert_gguf`). `read_tensor_table` steps over the metadata,
keeping only `general.alignment`, and gives the tensors exactly as `GGUFReader.tensors` does:
same names, GGML types, shapes and views of the memory-mapped file (quantized types as their
bytes, [..., rows, bytes per row]); tests/model/test_gguf_tensor_table.py holds the two equal.

A file in the other byte order (big-endian GGUF) goes to `GGUFReader`, which swaps it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # general.alignment when the file names none
# Metadata values of a fixed size, in bytes (a string is u64 length + bytes; an array is
# u32 element type + u64 count + elements).
_SCALAR_BYTES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
# The plain types GGUFReader gives as their elements; every other type as its bytes.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, as `GGUFReader.tensors` gives it (the fields loads use)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the row's length first
    data: np.ndarray  # a view of the file: [..., rows, columns], or [..., rows, row bytes]


class _Cursor:
    """Little-endian reads at a moving offset of the file's bytes."""

    def __init__(self, buffer: Any) -> None:
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str) -> Any:
        values = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("Q")
        self.offset += length
        return bytes(self.buffer[self.offset - length : self.offset]).decode("utf-8")

    def skip_value(self, value_type: int) -> None:
        if value_type == GGUFValueType.STRING:
            length = self.unpack("Q")  # (not `offset += unpack()`: that adds to the old offset)
            self.offset += length
        elif value_type == GGUFValueType.ARRAY:
            element_type, count = self.unpack("IQ")
            if element_type in _SCALAR_BYTES:
                self.offset += count * _SCALAR_BYTES[GGUFValueType(element_type)]
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            self.offset += _SCALAR_BYTES[GGUFValueType(value_type)]


def read_tensor_table(path: Path) -> list[GGUFTensor]:
    """The file's tensors, in the file's order, as views of its memory map. Raises ValueError
    (as GGUFReader does) for a file that is not GGUF, or is cut short."""
    data = np.memmap(path, mode="r")
    cursor = _Cursor(data)
    if bytes(data[:4]) != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    cursor.offset = 4
    version = cursor.unpack("I")
    if version & 0xFFFF == 0:  # written in the other byte order
        return [
            GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data)
            for t in GGUFReader(str(path)).tensors
        ]
    try:
        tensor_count, kv_count = cursor.unpack("QQ")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key, value_type = cursor.string(), cursor.unpack("I")
            if key == "general.alignment" and value_type == GGUFValueType.UINT32:
                alignment = cursor.unpack("I")
            else:
                cursor.skip_value(value_type)
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = cursor.unpack("I")
            shape = tuple(cursor.unpack(f"{dims}Q")) if dims > 1 else (cursor.unpack("Q"),)
            infos.append(
                (name, shape, GGMLQuantizationType(cursor.unpack("I")), cursor.unpack("Q"))
            )
    except struct.error as exc:  # the header runs past the end of the file
        raise ValueError(f"the header is cut short: {exc}") from exc
    start = cursor.offset + (-cursor.offset) % alignment
    return [
        _tensor(data, start + offset, name, shape, qtype) for name, shape, qtype, offset in infos
    ]


def _tensor(
    data: np.memmap, offset: int, name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType
) -> GGUFTensor:
    dims = tuple(reversed(shape))  # numpy's order: rows before the row's length
    elements = int(np.prod(shape))
    if qtype in _ELEMENT_DTYPES:
        dtype, count = np.dtype(_ELEMENT_DTYPES[qtype]), elements
    else:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        dtype, count = np.dtype(np.uint8), elements * type_size // block_size
        dims = quant_shape_to_byte_shape(dims, qtype)
    end = offset + count * dtype.itemsize
    if end > len(data):
        raise ValueError(f"tensor {name} ends at byte {end}, past the file's {len(data)}")
    return GGUFTensor(name, qtype, shape, data[offset:end].view(dtype).reshape(dims))
