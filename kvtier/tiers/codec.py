"""Frames one KV block for storage: header, checksum, optional compression and encryption.

    offset  size   field
    0       4      magic b"KVT1"
    4       1      format version (1)
    5       1      flags                      bit 0: payload encrypted by the cipher hook
    6       1      compression id             0 none, 1 lz4 (block), 2 zstd
    7       1      dtype code                 _DTYPE_CODES
    8       1      ndim
    9       3      reserved (zero)
    12      16     model fingerprint
    28      16     block key
    44      8*n    shape, uint64 each
    44+8n   8      stored payload length
    52+8n   8      xxh3_64 of bytes [0, 52+8n) and the stored payload
    60+8n   ...    stored payload: tensor bytes (C order, little-endian), then compressed,
                   then encrypted; each step optional and in that order

    AAD for the cipher = bytes [0, 44+8n): everything that names and shapes the entry.

The checksum covers the header as well as the payload, so a flipped bit anywhere is a
CorruptEntryError, and only an intact frame can answer WrongEntryError (another model or key).
Compression that does not shrink a block is dropped for that block (the id records what was
done), so a frame is never larger than payload_nbytes_estimate() plus the cipher's overhead.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import lz4.block
import numpy as np
import torch
import xxhash
import zstandard

if TYPE_CHECKING:
    from kvtier.tiers.base import Tier

MAGIC = b"KVT1"
FORMAT_VERSION = 1
ID_BYTES = 16
FLAG_ENCRYPTED = 0x01
_KNOWN_FLAGS = FLAG_ENCRYPTED

_FIXED = struct.Struct("<4sBBBBB3x16s16s")  # magic .. key: 44 bytes
_U64 = struct.Struct("<Q")
_TAIL = struct.Struct("<QQ")  # stored payload length, checksum

COMPRESSIONS = {None: 0, "lz4": 1, "zstd": 2}
_COMPRESSION_NAMES = {v: k for k, v in COMPRESSIONS.items()}
ZSTD_LEVEL = 3
"""zstd level 3: higher levels cost more time and gain little on KV values."""


def _dtype_codes() -> dict[torch.dtype, int]:
    names = [
        "float32",
        "float16",
        "bfloat16",
        "uint8",
        "int8",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "int16",
        "int32",
        "int64",
        "float64",
        "bool",
    ]
    # codes are part of the format: append new dtypes, never renumber
    return {getattr(torch, n): code for code, n in enumerate(names, start=1) if hasattr(torch, n)}


_DTYPE_CODES = _dtype_codes()
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class CodecError(Exception):
    pass


class CorruptEntryError(CodecError):
    """The frame is damaged: bad magic, version, length, checksum, decompression or decryption."""


class WrongEntryError(CodecError):
    """An intact frame for another model configuration or block key (or another cipher setting)."""


class Cipher(Protocol):
    """Per-tenant encryption hook. Both methods take bytes-like data and return bytes; `aad`
    is authenticated, not encrypted. decrypt must raise when authentication fails."""

    def encrypt(self, plaintext: bytes | memoryview, aad: bytes) -> bytes: ...

    def decrypt(self, ciphertext: bytes | memoryview, aad: bytes) -> bytes: ...


# -- compression (compressor objects are not thread-safe: one per thread) ----------------------------

_local = threading.local()


def _zstd_compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "zc", None)
    if c is None:
        c = _local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def _compress(comp_id: int, data: memoryview) -> bytes:
    if comp_id == 1:
        return lz4.block.compress(data, store_size=False)
    return _zstd_compressor().compress(data)


def _decompress(comp_id: int, data: bytes | memoryview, nbytes: int) -> bytes:
    if comp_id == 1:
        return lz4.block.decompress(data, uncompressed_size=nbytes)
    return _zstd_decompressor().decompress(data, max_output_size=nbytes)


# -- frames ------------------------------------------------------------------------------------------


def _check_id(name: str, value: bytes) -> None:
    if not isinstance(value, (bytes, bytearray)) or len(value) != ID_BYTES:
        raise ValueError(f"{name} must be {ID_BYTES} bytes, got {value!r:.60}")


def header_nbytes(ndim: int) -> int:
    return _FIXED.size + 8 * ndim + _TAIL.size


def payload_nbytes_estimate(
    shape: Sequence[int], dtype: torch.dtype, compression: str | None = None, cipher_overhead_bytes: int = 0
) -> int:
    """Bytes of one encoded frame: exact without compression, an upper bound with it
    (a block compression does not shrink is stored raw). Add the cipher's overhead (e.g. 28 for
    AES-GCM with a 12-byte nonce and 16-byte tag). For capacity planning and admission."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r}; use one of {list(COMPRESSIONS)}")
    return header_nbytes(len(shape)) + math.prod(shape) * dtype.itemsize + cipher_overhead_bytes


def encode(
    kv: torch.Tensor, *, fingerprint: bytes, key: bytes, compression: str | None = None, cipher: Cipher | None = None
) -> bytes:
    """Frame one tensor. One copy of the tensor bytes when uncompressed (into the frame)."""
    _check_id("fingerprint", fingerprint)
    _check_id("key", key)
    dtype_code = _DTYPE_CODES.get(kv.dtype)
    if dtype_code is None:
        raise ValueError(
            f"dtype {kv.dtype} is not supported by the tier codec; supported: {sorted(str(d) for d in _DTYPE_CODES)}"
        )
    comp_id = COMPRESSIONS.get(compression if compression != "none" else None)
    if comp_id is None:
        raise ValueError(f"unknown compression {compression!r}; use one of {list(COMPRESSIONS)}")
    if kv.dim() > 255:
        raise ValueError(f"at most 255 dimensions, got {kv.dim()}")

    t = kv.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # [numel * itemsize] uint8 view of the same memory: numpy has no bf16/fp8, bytes have no dtype
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().data

    payload: bytes | memoryview = raw
    if comp_id:
        packed = _compress(comp_id, raw)
        if len(packed) < len(raw):
            payload = packed
        else:
            comp_id = 0
    flags = 0
    aad = _FIXED.pack(
        MAGIC, FORMAT_VERSION, 0, comp_id, dtype_code, t.dim(), bytes(fingerprint), bytes(key)
    ) + struct.pack(f"<{t.dim()}Q", *t.shape)
    if cipher is not None:
        flags |= FLAG_ENCRYPTED
        aad = aad[:5] + bytes((flags,)) + aad[6:]
        payload = cipher.encrypt(payload, aad)

    length = _U64.pack(len(payload))
    h = xxhash.xxh3_64(aad)
    h.update(length)
    h.update(payload)
    return b"".join((aad, length, _U64.pack(h.intdigest()), payload))


def decode(
    data: bytes,
    *,
    fingerprint: bytes,
    key: bytes,
    cipher: Cipher | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The tensor in a frame, checked against the expected fingerprint and key.

    Raises CorruptEntryError or WrongEntryError; the result owns its memory (a fresh tensor).
    """
    _check_id("fingerprint", fingerprint)
    _check_id("key", key)
    mv = memoryview(data)
    if len(mv) < header_nbytes(0):
        raise CorruptEntryError(f"truncated: {len(mv)} bytes is shorter than any header")
    magic, version, flags, comp_id, dtype_code, ndim, fp, k = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptEntryError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"unsupported format version {version}")
    aad_end = _FIXED.size + 8 * ndim
    hdr_end = aad_end + _TAIL.size
    if len(mv) < hdr_end:
        raise CorruptEntryError(f"truncated header: {len(mv)} < {hdr_end} bytes")
    stored_len, checksum = _TAIL.unpack_from(mv, aad_end)
    if len(mv) != hdr_end + stored_len:
        raise CorruptEntryError(
            f"length mismatch: header says {stored_len} payload bytes, frame has {len(mv) - hdr_end}"
        )
    h = xxhash.xxh3_64(mv[: aad_end + 8])
    h.update(mv[hdr_end:])
    if h.intdigest() != checksum:
        raise CorruptEntryError("checksum mismatch")
    # the frame is intact from here on: any remaining mismatch is a wrong entry, or a bug
    if fp != fingerprint:
        raise WrongEntryError(f"entry belongs to model fingerprint {fp.hex()}, expected {bytes(fingerprint).hex()}")
    if k != key:
        raise WrongEntryError(f"entry is for key {k.hex()}, expected {bytes(key).hex()}")
    dtype = _CODE_DTYPES.get(dtype_code)
    if dtype is None or comp_id not in _COMPRESSION_NAMES or flags & ~_KNOWN_FLAGS:
        raise CorruptEntryError(f"unknown dtype code {dtype_code}, compression {comp_id} or flags {flags:#x}")
    encrypted = bool(flags & FLAG_ENCRYPTED)
    if encrypted != (cipher is not None):
        raise WrongEntryError(
            "entry is encrypted and no cipher was given"
            if encrypted
            else "entry is not encrypted but a cipher was given"
        )

    shape = struct.unpack_from(f"<{ndim}Q", mv, _FIXED.size)
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    payload: bytes | memoryview = mv[hdr_end:]
    if encrypted:
        assert cipher is not None  # checked above: encrypted == (cipher is not None)
        try:
            payload = cipher.decrypt(payload, bytes(mv[:aad_end]))
        except Exception as exc:
            raise CorruptEntryError(f"decryption failed: {type(exc).__name__}: {exc}") from exc
    if comp_id:
        try:
            payload = _decompress(comp_id, payload, nbytes)
        except Exception as exc:
            raise CorruptEntryError(f"{_COMPRESSION_NAMES[comp_id]} decompression failed: {exc}") from exc
    if len(payload) != nbytes:
        raise CorruptEntryError(f"payload is {len(payload)} bytes, shape {list(shape)} of {dtype} needs {nbytes}")
    if nbytes:
        out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    if device is not None:
        out = out.to(device)
    return out


# -- tier helpers ------------------------------------------------------------------------------------


def store_tensor(
    tier: Tier,
    key: bytes,
    kv: torch.Tensor,
    *,
    fingerprint: bytes,
    compression: str | None = None,
    cipher: Cipher | None = None,
    ttl_s: float | None = None,
) -> bool:
    """encode + tier.put."""
    frame = encode(kv, fingerprint=fingerprint, key=key, compression=compression, cipher=cipher)
    return tier.put(key, frame, ttl_s=ttl_s)


def load_tensor(
    tier: Tier,
    key: bytes,
    *,
    fingerprint: bytes,
    cipher: Cipher | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """tier.get + decode. A frame that does not decode is a miss: reported to the tier, which
    counts and deletes it."""
    data = tier.get(key)
    if data is None:
        return None
    try:
        return decode(data, fingerprint=fingerprint, key=key, cipher=cipher, device=device)
    except CodecError:
        tier.report_corrupt(key)
        return None
