"""Tensor files written and read one tensor at a time, so that files larger
than RAM can be written and consolidated with a bounded buffer.

- safetensors: 8-byte little-endian header length, a JSON header
  {name: {dtype, shape, data_offsets}} (optional "__metadata__": str -> str),
  then the bytes. The safetensors package writes whole dicts only, hence this
  writer; the tests read its files with the package.
- torch.save's zip format: the skeleton is saved with
  torch.serialization.skip_data (storages reserved, not written) from
  placeholder tensors that are never touched, then each storage is written
  in place at its record's offset.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
DTYPE_OF = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a file: its name, shape and dtype (the bytes come later)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


Fill = Callable[[TensorSpec], torch.Tensor]  # the values of one spec, asked for once, in spec order


def fsync_dir(path: str) -> None:
    """Makes a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(f, spec: TensorSpec, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise ValueError(f"tensorfile: {spec.name}: got shape {tuple(tensor.shape)} {tensor.dtype}, "
                         f"expected {spec.shape} {spec.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    f.write(memoryview(flat.view(torch.uint8).numpy()))


def write_safetensors(path: str, specs: Sequence[TensorSpec], fill: Fill, metadata: dict[str, str] | None = None) -> None:
    """Writes `specs` to a safetensors file, asking `fill` for one tensor at a time; fsyncs."""
    header: dict[str, object] = {}
    offset = 0
    for spec in specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"write_safetensors: {spec.name}: dtype {spec.dtype} has no safetensors code")
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; 8-byte alignment of the data
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            _write_bytes(f, spec, fill(spec))
        f.flush()
        os.fsync(f.fileno())


class SafetensorsReader:
    """Reads element ranges of a safetensors file's tensors into given tensors
    (no mapping of the file, so only the destination is resident)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "rb")
        (length,) = struct.unpack("<Q", self.file.read(8))
        header = json.loads(self.file.read(length))
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + length
        self.specs: dict[str, TensorSpec] = {}
        self.offsets: dict[str, int] = {}
        for name, entry in header.items():
            self.specs[name] = TensorSpec(name, tuple(entry["shape"]), DTYPE_OF[entry["dtype"]])
            self.offsets[name] = entry["data_offsets"][0]

    def read(self, name: str, out: torch.Tensor, begin: int = 0) -> torch.Tensor:
        """Elements [begin, begin + out.numel()) of tensor `name`, flattened, into `out`."""
        spec = self.specs[name]
        if out.dtype != spec.dtype or begin < 0 or begin + out.numel() > spec.numel:
            raise ValueError(f"SafetensorsReader({self.path}): {name} {spec.shape} {spec.dtype}: cannot read "
                             f"[{begin}, {begin + out.numel()}) into {out.dtype}")
        direct = out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(out.shape, dtype=out.dtype)
        self.file.seek(self.data_start + self.offsets[name] + begin * spec.dtype.itemsize)
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
        if self.file.readinto(view) != len(view):
            raise ValueError(f"SafetensorsReader({self.path}): {name} is truncated")
        if not direct:
            out.copy_(target)
        return out

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_torch(path: str, specs: Sequence[TensorSpec], fill: Fill, aliases: dict[str, str] | None = None) -> None:
    """Writes a torch.save file of {name: tensor} in the order of `specs`, with
    `aliases` (name -> a spec's name, placed right after it) sharing that
    tensor's storage as tied parameters do in a state_dict; fsyncs."""
    aliases = aliases or {}
    after: dict[str, list[str]] = {}
    for alias, target in aliases.items():
        after.setdefault(target, []).append(alias)
    skeleton: dict[str, torch.Tensor] = {}
    for spec in specs:  # never written to, never read (skip_data): untouched pages take no memory
        skeleton[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
        for alias in after.get(spec.name, ()):
            skeleton[alias] = skeleton[spec.name]
    with torch.serialization.skip_data():
        torch.save(skeleton, path)
    del skeleton
    # torch.save numbers storages in the order the pickler meets them: the specs' order
    reader = torch._C.PyTorchFileReader(path)
    offsets = [reader.get_record_offset(f"data/{key}") for key in range(len(specs))]
    sizes = [reader.get_record_size(f"data/{key}") for key in range(len(specs))]
    del reader
    with open(path, "r+b") as f:
        for spec, offset, nbytes in zip(specs, offsets, sizes):
            assert nbytes == spec.nbytes, f"write_torch: record of {spec.name} holds {nbytes} bytes, not {spec.nbytes}"
            f.seek(offset)
            _write_bytes(f, spec, fill(spec))
        f.flush()
        os.fsync(f.fileno())
