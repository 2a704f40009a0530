"""Memory-mapped GGUF reading with strict bounds checks.

Built on ``gguf.GGUFReader``: a subclass makes every read bounds-checked (the base class silently
returns short slices of a truncated file), rejects impossible counts before looping over them, and
reads scalar arrays in one slice. :func:`open_gguf` turns whatever goes wrong into the project's
own :class:`~engine.errors.GGUFError` subclasses.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import ReaderField

from engine.errors import (
    GGUFError,
    HostMemoryError,
    MetadataError,
    NotGGUFError,
    TruncatedFileError,
    UnsupportedQuantTypeError,
    UnsupportedVersionError,
)
from engine.gguf import keys
from engine.quant.formats import WEIGHT_TYPES, QType, is_supported_weight_type

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

_SCALAR_SIZES = {
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


class _CheckedReader(GGUFReader):
    """``GGUFReader`` whose reads never run past the end of the file."""

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        itemsize = np.dtype(dtype).itemsize
        if offset < 0 or count < 0 or offset + itemsize * count > len(self.data):
            raise TruncatedFileError(
                f"header runs past the end of the file (needs {itemsize * count} bytes at offset "
                f"{offset}, file has {len(self.data)})"
            )
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        try:
            gtype = GGUFValueType(int(raw_type))
        except ValueError:
            raise MetadataError(f"unknown metadata value type {int(raw_type)} at offset {orig_offs}") from None
        if gtype != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        try:
            itype = GGUFValueType(int(raw_itype[0]))
        except ValueError:
            raise MetadataError(f"unknown array element type {int(raw_itype[0])} at offset {orig_offs}") from None
        n = int(alen[0])
        start = orig_offs + 12
        remaining = len(self.data) - start
        min_item = _SCALAR_SIZES.get(itype, 8)  # a string is at least its 8-byte length
        if itype == GGUFValueType.ARRAY:
            raise MetadataError(f"nested metadata arrays are not supported (offset {orig_offs})")
        if n * min_item > remaining:
            raise TruncatedFileError(f"metadata array of {n} items at offset {orig_offs} runs past the end")
        if itype in _SCALAR_SIZES:
            # One slice for the whole array instead of one per element.
            vals = self._get(start, self.gguf_scalar_to_np[itype], n)
            return 12 + int(vals.nbytes), [raw_itype, alen, vals], [2], [gtype, itype]
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs, count):
        if int(count) * 13 > len(self.data):  # key length (8) + type (4) + one byte, at least
            raise TruncatedFileError(f"header claims {int(count)} metadata entries, more than the file can hold")
        self.string_arrays: dict[str, list[str]] = {}
        for _ in range(int(count)):
            orig = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += 4
            name = str(bytes(kdata), encoding="utf-8")
            parts = [klen, kdata, raw_type]
            if int(raw_type[0]) == GGUFValueType.ARRAY and self._is_string_array(offs):
                # Vocabularies hold 150k strings: decode them in one pass instead of 2 slices each.
                size, values = self._string_array(offs)
                self.string_arrays[name] = values
                field = ReaderField(orig, name, parts, [], [GGUFValueType.ARRAY, GGUFValueType.STRING])
            else:
                size, fparts, idxs, types = self._get_field_parts(offs, raw_type[0])
                field = ReaderField(orig, name, parts + fparts, [i + len(parts) for i in idxs], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _is_string_array(self, offs: int) -> bool:
        return int(self._get(offs, np.uint32)[0]) == GGUFValueType.STRING

    def _string_array(self, offs: int) -> tuple[int, list[str]]:
        n = int(self._get(offs + 4, np.uint64)[0])
        start = pos = offs + 12
        end = len(self.data)
        if n * 8 > end - start:
            raise TruncatedFileError(f"metadata array of {n} strings at offset {offs} runs past the end")
        mv = memoryview(self.data)
        out = []
        for _ in range(n):
            if pos + 8 > end:
                raise TruncatedFileError(f"string array at offset {offs} runs past the end of the file")
            length = int.from_bytes(mv[pos : pos + 8], "little")
            pos += 8
            if pos + length > end:
                raise TruncatedFileError(f"a string at offset {pos - 8} runs past the end of the file")
            out.append(str(mv[pos : pos + length], "utf-8", errors="replace"))
            pos += length
        return pos - offs, out

    def _build_tensor_info(self, offs, count):
        if int(count) * 24 > len(self.data):  # name length, n_dims, type, offset, at least
            raise TruncatedFileError(f"header claims {int(count)} tensors, more than the file can hold")
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _nl, name_data, n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            if int(n_dims[0]) > MAX_DIMS or int(n_dims[0]) < 1:
                raise MetadataError(f"tensor {name!r} has {int(n_dims[0])} dimensions (1..{MAX_DIMS} allowed)")
            shape = [int(d) for d in dims]
            if any(d <= 0 or d > 1 << 40 for d in shape):
                raise MetadataError(f"tensor {name!r} has an impossible shape {shape}")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise UnsupportedQuantTypeError(
                    f"tensor {name!r} has unknown ggml type id {int(raw_dtype[0])}"
                ) from None
            if qtype not in GGML_QUANT_SIZES:
                raise UnsupportedQuantTypeError(f"tensor {name!r} has ggml type {qtype.name} of unknown size")
            block, type_size = GGML_QUANT_SIZES[qtype]
            if shape[0] % block:
                raise MetadataError(
                    f"tensor {name!r}: row length {shape[0]} is not a multiple of {qtype.name}'s block of {block}"
                )
            n_elem = int(np.prod(shape, dtype=np.float64))
            n_bytes = n_elem // block * type_size
            off = int(offset_tensor[0])
            if off % self.alignment:
                raise MetadataError(f"tensor {name!r} data offset {off} is not aligned to {self.alignment}")
            if start_offs + off + n_bytes > size:
                raise TruncatedFileError(
                    f"tensor {name!r} ({qtype.name}, {n_bytes} bytes at {start_offs + off}) runs past the end "
                    f"of the file ({size} bytes): the file is truncated"
                )
        return super()._build_tensors(start_offs, fields)


@dataclass(frozen=True)
class TensorRef:
    """A tensor in the file: metadata plus a zero-copy view of its bytes.

    ``shape`` is numpy order (innermost dimension last): a linear layer is ``(out, in)``, stacked
    experts ``(E, out, in)``. ``data`` is float32/float16 ``shape`` for F32/F16 and uint8
    ``(..., row_bytes)`` for every other type.
    """

    name: str
    qtype: QType
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute file offset of the first byte
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


def _field_value(field) -> Any:
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return field.parts[field.data[0]].tolist() if field.data else []
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]


class GGUFFile:
    """An open GGUF file: metadata dict, tensor table, and the memory map behind the views."""

    def __init__(self, path: str | os.PathLike, reader: GGUFReader):
        self.path = os.fspath(path)
        self._reader = reader
        self.version = int(reader.fields["GGUF.version"].parts[0][0])
        self.alignment = int(reader.alignment)
        self.data_offset = int(reader.data_offset)
        self.file_size = len(reader.data)
        strings = getattr(reader, "string_arrays", {})
        self.metadata: dict[str, Any] = {
            name: strings[name] if name in strings else _field_value(f)
            for name, f in reader.fields.items()
            if not name.startswith("GGUF.")
        }
        self.tensors: dict[str, TensorRef] = {
            t.name: TensorRef(
                name=t.name,
                qtype=QType(int(t.tensor_type)),
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                nbytes=int(t.n_bytes),
                offset=int(t.data_offset),
                data=t.data.view(np.ndarray),  # a plain view: np.memmap's per-slice bookkeeping is slow
            )
            for t in reader.tensors
        }

    # -- metadata -----------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get(keys.ARCHITECTURE)
        if not isinstance(arch, str) or not arch:
            raise MetadataError(f"missing or invalid {keys.ARCHITECTURE}", self.path)
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] = object) -> Any:
        """The value of ``key``; :class:`MetadataError` if absent or not of ``kind``."""
        if key not in self.metadata:
            raise MetadataError(f"missing metadata key {key!r}", self.path)
        value = self.metadata[key]
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise MetadataError(f"metadata {key!r} = {value!r} is not of type {kind}", self.path)
        return value

    # -- tensors ------------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorRef:
        from engine.errors import MissingTensorError

        try:
            return self.tensors[name]
        except KeyError:
            raise MissingTensorError(f"tensor {name!r} is missing", self.path) from None

    def check_weight_types(self) -> None:
        """Raise :class:`UnsupportedQuantTypeError` naming the first tensor we cannot compute on."""
        for t in self.tensors.values():
            if not is_supported_weight_type(t.qtype):
                raise UnsupportedQuantTypeError(
                    f"tensor {t.name!r} uses {t.qtype.name}, which SharpI does not support "
                    f"(supported: {', '.join(q.name for q in WEIGHT_TYPES)})",
                    self.path,
                )

    def close(self) -> None:
        mm = getattr(self._reader.data, "_mmap", None)
        self.tensors = {}
        self._reader = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still alive elsewhere; the map goes when they do

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file's container (header, metadata, tensor table).

    Architecture and tensor-level checks belong to the model loader. Every failure raises a
    :class:`~engine.errors.GGUFError` subclass with the path in its message.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise GGUFError("no such file", path)
    if os.path.isdir(path):
        raise GGUFError("is a directory, not a GGUF file", path)
    size = os.path.getsize(path)
    if size < 24:
        raise NotGGUFError(f"file is too small to be a GGUF ({size} bytes)", path)
    with open(path, "rb") as f:
        head = f.read(8)
    if int.from_bytes(head[:4], "little") != GGUF_MAGIC:
        raise NotGGUFError(f"not a GGUF file (magic {head[:4]!r}, expected b'GGUF')", path)
    version = int.from_bytes(head[4:8], "little")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"GGUF version {version} is not supported (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})",
            path,
        )
    try:
        reader = _CheckedReader(path, "r")
        return GGUFFile(path, reader)
    except GGUFError as e:
        if e.path is None:
            raise type(e)(str(e), path) from None
        raise
    except UnicodeDecodeError:
        raise GGUFError("a metadata key or tensor name is not valid UTF-8: the header is corrupted", path) from None
    except MemoryError:
        raise HostMemoryError(f"{path}: not enough memory to read the GGUF header") from None
    except OSError as e:  # np.memmap under an address-space limit, an unreadable file
        if e.errno == errno.ENOMEM:
            raise HostMemoryError(f"{path}: the system refused to map the file ({e.strerror})") from None
        raise GGUFError(f"cannot read the file: {e.strerror or e}", path) from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as e:
        raise GGUFError(f"malformed GGUF header: {e}", path) from None
