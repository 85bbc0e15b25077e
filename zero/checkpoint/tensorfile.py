"""Tensor files written and read one tensor at a time, so that files larger
than RAM can be written and consolidated with a bounded buffer.

- safetensors: 8-byte little-endian header length, a JSON header
  {name: {dtype, shape, data_offsets}} (optional "__metadata__": str -> str),
  then the bytes. The safetensors package writes whole dicts only, hence this
  writer; the tests read its files with the package. With checksums=True the
  metadata also holds each tensor's crc32 ([Note: checksums in the header]);
  MappedSafetensors' files (the in-memory snapshots) hold word sums instead
  ([Note: word sums] in csrc/cpu/checksum.h), which the optimizer step
  computes as it writes the values.
- torch.save's zip format: the skeleton is saved with
  torch.serialization.skip_data (storages reserved, not written) from
  placeholder tensors that are never touched, then each storage is written
  in place at its record's offset.
"""
from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ringcomm import _C
from ringcomm.core import compat

try:  # zlib-ng's crc32: the same values as zlib's, ~4x faster (PCLMULQDQ folding) on x86-64
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover (a dependency; zlib's is the fallback)
    from zlib import crc32

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
DTYPE_OF = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
CRC_KEY = "crc32"  # metadata key: JSON {tensor name: 8 hex digits}
WORD_SUM_KEY = "word_sum"  # metadata key: JSON {tensor name: 16 hex digits}
HEX_DIGITS = {CRC_KEY: 8, WORD_SUM_KEY: 16}  # each checksum's fixed width in the header
CHUNK_NBYTES = 1 << 20  # checksums stream through a buffer of this size
LINE = 64  # bytes: MappedSafetensors starts its tensors on cache lines (the fused step streams whole lines there)


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


def _write_bytes(f, spec: TensorSpec, tensor: torch.Tensor) -> int:
    """Writes the tensor's bytes; returns their crc32."""
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise ValueError(f"tensorfile: {spec.name}: got shape {tuple(tensor.shape)} {tensor.dtype}, "
                         f"expected {spec.shape} {spec.dtype}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = memoryview(flat.view(torch.uint8).numpy())
    f.write(data)
    return crc32(data)


def word_sum(data: memoryview | torch.Tensor, first: int = 0) -> int:
    """The word sum of the bytes ([Note: word sums] in csrc/cpu/checksum.h),
    their first word being word `first` of what is summed."""
    if isinstance(data, torch.Tensor):
        return _C.word_sum(data.data_ptr(), data.numel() * data.element_size(), first)
    return _C.word_sum(np.frombuffer(data, dtype=np.uint8).ctypes.data, len(data), first) if len(data) else 0


def add_word_sums(a: int, b: int) -> int:
    """The word sum of two consecutive pieces' bytes (the second's summed from its first word's index)."""
    low = (1 << 32) - 1
    return ((((a >> 32) + (b >> 32)) & low) << 32) | ((a + b) & low)


def _header_bytes(header: dict[str, object], metadata: dict[str, str], crcs: dict[str, int] | None,
                  key: str = CRC_KEY, align: int = 8) -> bytes:
    if crcs is not None:
        metadata = {**metadata, key: json.dumps({name: f"{crc:0{HEX_DIGITS[key]}x}" for name, crc in crcs.items()},
                                                separators=(",", ":"))}
    if metadata:
        header = {**header, "__metadata__": metadata}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-(8 + len(raw)) % align)  # the format allows trailing spaces: the data starts aligned


def _plan_header(specs: Sequence[TensorSpec], what: str, *, lines: bool = False) -> tuple[dict[str, object], int]:
    """safetensors' header entries for `specs`, laid out in order, and the data's
    byte count. lines=True lays out first the tensors of whole cache lines, so
    that each of them starts on one when the data does (the format allows no
    gaps between tensors, but any order)."""
    header: dict[str, object] = {}
    offset = 0
    for spec in sorted(specs, key=lambda s: s.nbytes % LINE != 0) if lines else specs:
        if spec.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{what}: {spec.name}: dtype {spec.dtype} has no safetensors code")
        header[spec.name] = {"dtype": SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    return header, offset


@functools.lru_cache(maxsize=4)
def _mapped_layout(specs: tuple[TensorSpec, ...], metadata: tuple[tuple[str, str], ...]) -> tuple[dict, int, bytes]:
    """MappedSafetensors' header entries (read only), data byte count and first
    header (sums 0): the same for each snapshot of a run (its own piece's file
    and its copy's, every step), so planned once."""
    header, nbytes = _plan_header(specs, "MappedSafetensors", lines=True)
    raw = _header_bytes(header, dict(metadata), {spec.name: 0 for spec in specs}, WORD_SUM_KEY, align=LINE)
    return header, nbytes, raw


def write_safetensors(path: str, specs: Sequence[TensorSpec], fill: Fill, metadata: dict[str, str] | None = None,
                      *, checksums: bool = False) -> None:
    """Writes `specs` to a safetensors file, asking `fill` for one tensor at a
    time (with checksums=True, each tensor's crc32 goes into the metadata); fsyncs.

    [Note: checksums in the header]
    The header precedes the data, but a tensor's crc32 is known only once
    `fill` produced it. The header is first written with every crc32 as
    00000000 and rewritten in place at the end: the values are 8 hex digits
    each, so the header's length (and every data offset) stays the same."""
    header, offset = _plan_header(specs, "write_safetensors")
    crcs = {spec.name: 0 for spec in specs} if checksums else None
    raw = _header_bytes(header, metadata or {}, crcs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            crc = _write_bytes(f, spec, fill(spec))
            if crcs is not None:
                crcs[spec.name] = crc
        if crcs is not None:
            final = _header_bytes(header, metadata or {}, crcs)
            assert len(final) == len(raw), f"write_safetensors({path}): the header changed length"
            f.seek(8)
            f.write(final)
        f.flush()
        os.fsync(f.fileno())


def map_file(path: str, nbytes: int) -> torch.Tensor:
    """The file's bytes as a uint8 tensor mapping it (shared: writes land in
    the file), the file first sized to nbytes (an existing one keeps its pages)."""
    with open(path, "r+b" if os.path.isfile(path) else "wb") as f:
        f.truncate(nbytes)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class MappedSafetensors:
    """A safetensors file written through a shared mapping, with a word sum per
    tensor, in phases: its tensors' bytes go in by copy() (one memcpy each; an
    existing file is overwritten in place, so a tmpfs file of the same size
    allocates no page), copy_from() or straight at address() (the fused
    optimizer step writes there); later, on any thread, sums() completes the
    word sums and finish() writes the final header. Until then the header's
    sums are 0: a reader refuses the file ([Note: checksums in the header]).
    The in-memory snapshots write these (zero/checkpoint/snapshot.py)."""

    def __init__(self, path: str, specs: Sequence[TensorSpec], metadata: dict[str, str],
                 mapping: Callable[[str, int], torch.Tensor] | None = None) -> None:
        """mapping(path, nbytes): the file's bytes mapped (shared), sized to
        nbytes; default a new mapping (a caller may keep them: its pages are
        then not faulted in again)."""
        self.path, self.specs, self.metadata = path, list(specs), metadata
        self.header, nbytes, raw = _mapped_layout(tuple(self.specs), tuple(metadata.items()))
        self.data_start, total = 8 + len(raw), 8 + len(raw) + nbytes
        self.mapped: torch.Tensor | None = (mapping or map_file)(path, total)
        self.mapped[:8].copy_(torch.frombuffer(bytearray(struct.pack("<Q", len(raw))), dtype=torch.uint8))
        self.mapped[8:self.data_start].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def _header(self, sums: dict[str, int]) -> bytes:
        return _header_bytes(self.header, self.metadata, sums, WORD_SUM_KEY, align=LINE)

    def _bytes(self, name: str) -> torch.Tensor:
        begin, end = self.header[name]["data_offsets"]
        return self.mapped[self.data_start + begin:self.data_start + end]

    def address(self, name: str) -> int:
        """Where tensor `name`'s bytes start in memory (while the file is mapped)."""
        return self.mapped.data_ptr() + self.data_start + self.header[name]["data_offsets"][0]

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as a view of the mapped file (it keeps the mapping alive)."""
        spec = next(s for s in self.specs if s.name == name)
        return self._bytes(name).view(spec.dtype).view(spec.shape)

    def copy(self, fill: Fill, skip: Collection[str] = ()) -> None:
        """Each spec's tensor but those named in `skip` (asked for once, in order)
        into the file; a tensor that is its view already (tensor()) stays."""
        for spec in self.specs:
            if spec.name in skip:
                continue
            tensor = fill(spec)
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise ValueError(f"MappedSafetensors: {spec.name}: got shape {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {spec.shape} {spec.dtype}")
            if tensor.device.type == "cpu" and tensor.data_ptr() == self.address(spec.name):
                continue
            self._bytes(spec.name).copy_(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))

    def copy_from(self, other: MappedSafetensors, names: Collection[str]) -> None:
        """The bytes of the tensors `names` from `other`, a file of the same specs."""
        for name in names:
            self._bytes(name).copy_(other._bytes(name))

    def sums(self, known: dict[str, int]) -> dict[str, int]:
        """Every tensor's word sum: those `known` (by name), the others computed from the file."""
        return {spec.name: known[spec.name] if spec.name in known else word_sum(self._bytes(spec.name))
                for spec in self.specs}

    def final_header(self, sums: dict[str, int]) -> bytes:
        """The header with the word sums (sums()): what finish() writes (the same for a file of the same specs)."""
        raw = self._header(sums)
        assert 8 + len(raw) == self.data_start, f"MappedSafetensors({self.path}): the header changed length"
        return raw

    def finish(self, header: bytes) -> None:
        """Writes the final header (final_header()); unmaps the file."""
        self.mapped[8:self.data_start].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        self.mapped = None


class SafetensorsReader:
    """Reads element ranges of a safetensors file's tensors into given tensors
    (no mapping of the file, so only the destination is resident). Opening
    checks the header against the file (every entry well formed, the data
    offsets tile exactly the bytes after the header): a malformed, truncated
    or empty file is a ValueError naming it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "rb")
        try:
            self._parse()
        except BaseException:
            self.file.close()
            raise

    def _parse(self) -> None:
        nbytes = os.fstat(self.file.fileno()).st_size
        if nbytes < 8:
            raise ValueError(f"{self.path}: {nbytes} bytes: empty or truncated (a safetensors file starts with "
                             f"an 8-byte header length)")
        (length,) = struct.unpack("<Q", self.file.read(8))
        if length > nbytes - 8:
            raise ValueError(f"{self.path}: header length {length} exceeds the {nbytes - 8} bytes after it: "
                             f"corrupt header or truncated file")
        self.header_bytes = self.file.read(length)
        try:
            header = json.loads(self.header_bytes)
            if not isinstance(header, dict):
                raise ValueError(f"a JSON {type(header).__name__}, not an object")
            metadata = header.pop("__metadata__", None) or {}
            if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
                raise ValueError("__metadata__ is not a str -> str object")
            self.checksums = {k: int(v, 16) for k, v in json.loads(metadata.get(CRC_KEY, "{}")).items()}
            self.word_sums = {k: int(v, 16) for k, v in json.loads(metadata.get(WORD_SUM_KEY, "{}")).items()}
        except (UnicodeDecodeError, ValueError, TypeError, AttributeError) as error:
            raise ValueError(f"{self.path}: corrupt header: {error}") from None
        self.metadata: dict[str, str] = metadata
        self.data_start = 8 + length
        self.specs: dict[str, TensorSpec] = {}
        self.offsets: dict[str, int] = {}
        end = 0
        for name, entry in header.items():
            try:
                spec = TensorSpec(name, tuple(int(d) for d in entry["shape"]), DTYPE_OF[entry["dtype"]])
                begin, stop = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"{self.path}: corrupt header entry {name!r}: {error!r}") from None
            if min(spec.shape, default=0) < 0 or begin < 0 or stop - begin != spec.nbytes:
                raise ValueError(f"{self.path}: corrupt header entry {name!r}: data_offsets [{begin}, {stop}) "
                                 f"cannot hold {spec.shape} {spec.dtype} ({spec.nbytes} bytes)")
            self.specs[name], self.offsets[name] = spec, begin
            end = max(end, stop)
        if end != nbytes - self.data_start:
            raise ValueError(f"{self.path}: the header describes {end} bytes of data, the file holds "
                             f"{nbytes - self.data_start}: truncated or corrupt")

    def verify(self, name: str) -> None:
        """Recomputes tensor `name`'s crc32 or word sum (streamed) and compares it with the one written."""
        if name not in self.checksums and name not in self.word_sums:
            raise ValueError(f"{self.path}: tensor {name} has no checksum in the header")
        words = name not in self.checksums
        spec, value, left = self.specs[name], 0, self.specs[name].nbytes
        buffer = memoryview(bytearray(min(CHUNK_NBYTES, max(left, 1))))  # a multiple of 4 bytes: whole words
        self.file.seek(self.data_start + self.offsets[name])
        while left:
            got = self.file.readinto(buffer[:min(left, len(buffer))])
            if not got:
                raise ValueError(f"{self.path}: tensor {name} is truncated")
            done = spec.nbytes - left
            value = add_word_sums(value, word_sum(buffer[:got], done // 4)) if words else crc32(buffer[:got], value)
            left -= got
        written, what = (self.word_sums[name], "word sum") if words else (self.checksums[name], "crc32")
        if value != written:
            raise ValueError(f"{self.path}: tensor {name} ({spec.shape} {spec.dtype}): {what} {value:08x}, "
                             f"{written:08x} written at save: the data is corrupt")

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
    reader = compat.zip_file_reader(path)
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
