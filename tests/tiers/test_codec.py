"""The frame codec: exact round trips, and every damaged or foreign frame is rejected."""

from __future__ import annotations

import pytest
import torch

from kvtier.tiers.codec import (
    MAGIC,
    CorruptEntryError,
    WrongEntryError,
    decode,
    encode,
    header_nbytes,
    payload_nbytes_estimate,
)

from .conftest import FINGERPRINT, OTHER_FINGERPRINT, make_keys

KEY, OTHER_KEY = make_keys(2)
COMPRESSIONS = [None, "lz4", "zstd"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def _sample(dtype: torch.dtype, shape=(2, 4, 2, 16), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.uint8, torch.int8):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise identity (NaN-safe): the raw bytes."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class XorCipher:
    """A trivial stand-in for a tenant cipher: XOR with a key byte; records the AAD it saw."""

    def __init__(self, key_byte: int = 0x5A) -> None:
        self.key_byte = key_byte
        self.aads: list[bytes] = []

    def _xor(self, data: bytes) -> bytes:
        return bytes(b ^ self.key_byte for b in bytes(data))

    def encrypt(self, plaintext: bytes, aad: bytes) -> bytes:
        self.aads.append(bytes(aad))
        return self._xor(plaintext)

    def decrypt(self, ciphertext: bytes, aad: bytes) -> bytes:
        self.aads.append(bytes(aad))
        return self._xor(ciphertext)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bit_exact(dtype: torch.dtype, compression: str | None) -> None:
    kv = _sample(dtype)
    frame = encode(kv, fingerprint=FINGERPRINT, key=KEY, compression=compression)
    out = decode(frame, fingerprint=FINGERPRINT, key=KEY)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(_bits(out), _bits(kv))


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5, 7)])
def test_edge_shapes(shape: tuple[int, ...]) -> None:
    kv = _sample(torch.float32, shape)
    out = decode(encode(kv, fingerprint=FINGERPRINT, key=KEY), fingerprint=FINGERPRINT, key=KEY)
    assert out.shape == kv.shape and torch.equal(out, kv)


def test_non_contiguous_input_and_fresh_output() -> None:
    kv = _sample(torch.bfloat16, (4, 8, 16)).transpose(0, 2)
    frame = encode(kv, fingerprint=FINGERPRINT, key=KEY)
    out = decode(frame, fingerprint=FINGERPRINT, key=KEY, device="cpu")
    assert torch.equal(_bits(out), _bits(kv))
    out.add_(1)  # writable, owns its memory: the frame is untouched
    assert torch.equal(_bits(decode(frame, fingerprint=FINGERPRINT, key=KEY)), _bits(kv))


def test_compression_shrinks_compressible_blocks_and_falls_back_otherwise() -> None:
    zeros = torch.zeros(64, 1024, dtype=torch.bfloat16)
    raw_len = len(encode(zeros, fingerprint=FINGERPRINT, key=KEY))
    assert raw_len == payload_nbytes_estimate(zeros.shape, zeros.dtype)
    for compression in ("lz4", "zstd"):
        frame = encode(zeros, fingerprint=FINGERPRINT, key=KEY, compression=compression)
        assert len(frame) < raw_len // 10
    noise = torch.randint(0, 256, (64 * 1024,), dtype=torch.uint8)  # incompressible
    frame = encode(noise, fingerprint=FINGERPRINT, key=KEY, compression="lz4")
    assert len(frame) == payload_nbytes_estimate(noise.shape, noise.dtype, "lz4")
    assert frame[6] == 0  # compression id records that the block was stored raw


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("encrypted", [False, True])
def test_any_flipped_bit_is_corrupt(compression: str | None, encrypted: bool) -> None:
    kv = torch.zeros(3, 8, dtype=torch.float16) if compression else _sample(torch.float16, (3, 8))
    cipher = XorCipher() if encrypted else None
    frame = encode(kv, fingerprint=FINGERPRINT, key=KEY, compression=compression, cipher=cipher)
    for pos in range(len(frame)):
        for bit in (0, 7):
            damaged = bytearray(frame)
            damaged[pos] ^= 1 << bit
            with pytest.raises(CorruptEntryError):
                decode(bytes(damaged), fingerprint=FINGERPRINT, key=KEY, cipher=cipher)


def test_truncated_or_extended_frames_are_corrupt() -> None:
    frame = encode(_sample(torch.bfloat16, (4, 4)), fingerprint=FINGERPRINT, key=KEY)
    for length in range(len(frame)):
        with pytest.raises(CorruptEntryError):
            decode(frame[:length], fingerprint=FINGERPRINT, key=KEY)
    with pytest.raises(CorruptEntryError):
        decode(frame + b"\0", fingerprint=FINGERPRINT, key=KEY)
    with pytest.raises(CorruptEntryError, match="magic"):
        decode(b"garbage" * 20, fingerprint=FINGERPRINT, key=KEY)


def test_wrong_fingerprint_or_key_is_a_wrong_entry() -> None:
    frame = encode(_sample(torch.bfloat16), fingerprint=FINGERPRINT, key=KEY)
    with pytest.raises(WrongEntryError, match="fingerprint"):
        decode(frame, fingerprint=OTHER_FINGERPRINT, key=KEY)
    with pytest.raises(WrongEntryError, match="key"):
        decode(frame, fingerprint=FINGERPRINT, key=OTHER_KEY)


def test_cipher_hook_encrypts_payload_with_header_as_aad() -> None:
    kv = torch.arange(256, dtype=torch.uint8)
    cipher = XorCipher()
    frame = encode(kv, fingerprint=FINGERPRINT, key=KEY, cipher=cipher)
    assert bytes(kv.numpy()) not in frame  # the plaintext is not stored
    aad = cipher.aads[0]
    assert aad.startswith(MAGIC) and FINGERPRINT in aad and KEY in aad
    assert frame.startswith(aad) and len(aad) == header_nbytes(kv.dim()) - 16
    out = decode(frame, fingerprint=FINGERPRINT, key=KEY, cipher=cipher)
    assert torch.equal(out, kv) and cipher.aads[1] == aad
    # an encrypted entry needs a cipher, and a tenant with a cipher accepts no plaintext entry
    with pytest.raises(WrongEntryError, match="encrypted"):
        decode(frame, fingerprint=FINGERPRINT, key=KEY)
    plain = encode(kv, fingerprint=FINGERPRINT, key=KEY)
    with pytest.raises(WrongEntryError, match="not encrypted"):
        decode(plain, fingerprint=FINGERPRINT, key=KEY, cipher=cipher)


def test_aes_gcm_cipher_wrong_tenant_key_is_corrupt() -> None:
    aead = pytest.importorskip("cryptography.hazmat.primitives.ciphers.aead")
    import os

    class AesGcm:
        def __init__(self, key: bytes) -> None:
            self.aead = aead.AESGCM(key)

        def encrypt(self, plaintext: bytes, aad: bytes) -> bytes:
            nonce = os.urandom(12)
            return nonce + self.aead.encrypt(nonce, bytes(plaintext), aad)

        def decrypt(self, ciphertext: bytes, aad: bytes) -> bytes:
            ciphertext = bytes(ciphertext)
            return self.aead.decrypt(ciphertext[:12], ciphertext[12:], aad)

    kv = _sample(torch.bfloat16)
    tenant_a, tenant_b = AesGcm(bytes(16)), AesGcm(bytes([1] * 16))
    frame = encode(kv, fingerprint=FINGERPRINT, key=KEY, compression="zstd", cipher=tenant_a)
    assert len(frame) <= payload_nbytes_estimate(kv.shape, kv.dtype, "zstd", cipher_overhead_bytes=28)
    assert torch.equal(_bits(decode(frame, fingerprint=FINGERPRINT, key=KEY, cipher=tenant_a)), _bits(kv))
    with pytest.raises(CorruptEntryError, match="decryption"):
        decode(frame, fingerprint=FINGERPRINT, key=KEY, cipher=tenant_b)


def test_bad_arguments_raise_value_errors() -> None:
    kv = _sample(torch.float32)
    with pytest.raises(ValueError, match="not supported"):
        encode(torch.zeros(2, dtype=torch.complex64), fingerprint=FINGERPRINT, key=KEY)
    with pytest.raises(ValueError, match="fingerprint"):
        encode(kv, fingerprint=b"short", key=KEY)
    with pytest.raises(ValueError, match="compression"):
        encode(kv, fingerprint=FINGERPRINT, key=KEY, compression="gzip")


def test_192kib_block_round_trips_bit_exactly() -> None:
    """A realistic block size. Speed is a benchmark's job: benchmarks/tiers_bench.py times restores,
    decode and checksum included."""
    kv = _sample(torch.bfloat16, (2, 16, 8, 384))  # K and V of 16 tokens x 8 heads x 384: 192 KiB
    assert kv.numel() * 2 == 192 * 1024
    frame = encode(kv, fingerprint=FINGERPRINT, key=KEY)
    assert torch.equal(_bits(decode(frame, fingerprint=FINGERPRINT, key=KEY)), _bits(kv))
