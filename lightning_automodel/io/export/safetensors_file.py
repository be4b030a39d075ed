"""A safetensors file written tensor by tensor: its header, which holds every tensor's dtype, shape and place in the
file, is known before any tensor is read, so each tensor is written at its place as it comes and freed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# The format's names of torch's dtypes (https://github.com/huggingface/safetensors, "format" in its README).
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsFile:
    """A safetensors file of the tensors ``specs`` describes (name -> a meta tensor: dtype and shape), each written
    once by :meth:`write` in any order; the file is complete once every tensor is written."""

    def __init__(self, path: Path, specs: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        unknown = sorted({str(spec.dtype) for spec in specs.values() if spec.dtype not in _DTYPES})
        if unknown:
            raise ValueError(f"{path.name}: safetensors has no dtype for {unknown}.")
        # As safetensors orders tensors (wider dtypes first, then by name), so that each starts aligned to its size.
        order = sorted(specs, key=lambda name: (-specs[name].element_size(), name))
        header: dict[str, object] = {"__metadata__": metadata}
        self.places: dict[str, tuple[int, int]] = {}
        offset = 0
        for name in order:
            spec = specs[name]
            size = spec.numel() * spec.element_size()
            self.places[name] = (offset, size)
            header[name] = {
                "dtype": _DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.specs, self.data_start = specs, 8 + len(encoded)
        self.file = path.open("wb")
        self.file.write(struct.pack("<Q", len(encoded)) + encoded)
        self.file.truncate(self.data_start + offset)
        self.unwritten = set(specs)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs[name]
        if tensor.dtype != spec.dtype or tensor.shape != spec.shape:
            raise ValueError(
                f"{name}: planned as {spec.dtype} {list(spec.shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        offset, size = self.places[name]
        self.file.seek(self.data_start + offset)
        if size:
            self.file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.unwritten.discard(name)

    def close(self) -> None:
        self.file.close()
        if self.unwritten:
            raise ValueError(f"{self.file.name}: never written: {sorted(self.unwritten)[:5]}")
