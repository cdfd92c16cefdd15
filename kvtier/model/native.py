"""Native CPU kernels (kvtier/model/csrc), built with the machine's C compiler on first use.

    lib = native.kv_quant_lib()          # a ctypes.CDLL, or None: then callers run their torch ops
    lib = native.paged_attention_lib()
    lib = native.linear_lib()
    lib = native.layer_ops_lib()
    lib = native.quant_linear_lib()
    lib = native.layer_ops_f32_lib()
    lib = native.decode_attention_f32_lib()
    lib = native.decode_model_f32_lib()

Each library is compiled once per source, compiler and CPU (`-O3 -march=native -fopenmp`) into
`$KVTIER_CACHE_DIR/native` (default `~/.cache/kvtier/native`) and loaded with ctypes, which releases the GIL during a call. Its OpenMP runtime is the one torch
already loaded (same soname), so the kernels share torch's thread pool and thread count.

Loading native code is trusted code execution, so the cache folder must be private: it is
created 0700, one that belongs to another user is refused (there is no shared-temp fallback), a
looser mode on our own folder is tightened, and a library is loaded only when it is a regular
file owned by this user and writable by no one else (anything else is rebuilt over). Builds of
one folder take a file lock, so concurrent processes compile once and never load half a file.

Nothing depends on them for correctness: every kernel has a torch twin, used when there is no
compiler, the build fails, the tensors are not on the CPU, or `KVTIER_NO_NATIVE=1`; `disabled()`
switches them off for a block of code (tests compare the two). The KV quantization kernels
(csrc/kv_quant.c) give the same bytes as their twins; the paged decode attention
(csrc/paged_attention.c, AVX-512) computes the same attention in float32 in another order, so
it agrees with torch's SDPA to float32 rounding, not bit for bit; the small-batch bf16 GEMM
(csrc/gemm.c) and the fused layer ops (csrc/layer_ops.c) round to bfloat16 where their torch twins
do, so they agree with them except where a float32 sum of another order lands next to a bf16
rounding boundary (within one bf16 ulp).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NO_NATIVE_ENV = "KVTIER_NO_NATIVE"
"""Set to 1 to run every kernel with torch ops only."""
CSRC = Path(__file__).resolve().with_name("csrc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c11")
BUILD_TIMEOUT_S = 120

_enabled = os.environ.get(NO_NATIVE_ENV, "") in ("", "0")
_disabled_libs: set[str] = set()

_i64, _int, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "kv_quant": {
        # data, scales, heads, num_blocks, block_elems, storage, ids, n, out_kind, out
        "kvt_gather": ([_ptr, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _int, _ptr], _int),
        # data, scales, heads, num_blocks, block_size, dim, storage, static, k, k_stride, v, v_stride,
        # in_kind, slots, num_tokens
        "kvt_write": ([_ptr, _ptr, _i64, _i64, _i64, _i64, _int, _int, _ptr, _i64, _ptr, _i64, _int, _ptr, _i64], _int),
        # pool, scales (or NULL), scale bytes per row and block, rows, num_blocks, row_bytes, ids,
        # packed (void*[n]), n, into_pool
        "kvt_move_blocks": ([_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _int], _int),
    },
    "paged_attention": {
        "kvt_has_decode_attention": ([], _int),
        "kvt_has_chunk_attention": ([], _int),
        # q, out, pool, block_table, table_len, start, num_tokens, num_heads, num_kv_heads, num_blocks,
        # block_size, dim, sm_scale, variant (CHUNK_DPBF16 / CHUNK_FMA)
        "kvt_chunk_attention": (
            [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _int],
            _int,
        ),
        # q, out, pool, block_tables [S, max_blocks], max_blocks, starts [S], row_starts [S],
        # num_tokens [S], S, num_heads, num_kv_heads, num_blocks, block_size, dim, sm_scale, variant
        "kvt_chunk_attention_batch": (
            [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _int],
            _int,
        ),
        # q, q_kind, out, pool, kv_kind, scales (or NULL), scale_mode (SCALE_BLOCK / SCALE_TOKEN),
        # block_tables, max_blocks, seq_lens, batch, num_heads, num_kv_heads, num_blocks, block_size, dim,
        # sm_scale
        "kvt_decode_attention": (
            [_ptr, _int, _ptr, _ptr, _int, _ptr, _int, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32],
            _int,
        ),
    },
    "layer_ops": {
        "kvt_has_layer_ops": ([], _int),
        # x, ldx, residual (in/out, or NULL), weight, out, rows, hidden, eps
        "kvt_add_rms_norm_bf16": ([_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32], _int),
        # x, tokens, heads, dim, ld, cos, sin
        "kvt_rope_bf16": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], _int),
        # gate_up, rows, inter, out
        "kvt_silu_mul_bf16": ([_ptr, _i64, _i64, _ptr], _int),
    },
    "gemm": {
        "kvt_has_linear_bf16": ([], _int),
        # x, M, ldx, w, N, K, bias (or NULL), out, ldo, variant (GEMM_DPBF16 / GEMM_FMA)
        "kvt_linear_bf16": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int], _int),
    },
    "layer_ops_f32": {
        "kvt_has_layer_ops_f32": ([], _int),
        # x, ldx, residual (in/out, or NULL), weight, out, rows, hidden, eps
        "kvt_add_rms_norm_f32": ([_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _f32], _int),
        # x, tokens, heads, dim, ld, cos, sin
        "kvt_rope_f32": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr], _int),
        # gate_up, rows, inter, out
        "kvt_silu_mul_f32": ([_ptr, _i64, _i64, _ptr], _int),
    },
    "decode_attention_f32": {
        # q, out, pool, block_tables, max_blocks, seq_lens, batch, num_heads, num_kv_heads, num_blocks,
        # block_size, dim, sm_scale
        "kvt_decode_attention_f32": (
            [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32],
            _int,
        ),
    },
    "decode_model_f32": {
        "kvt_has_decode_model_f32": ([], _int),
        # layers (kvt_layer[L]), L, h (in/out), T, hidden, num_heads, num_kv_heads, dim, inter, eps, cos,
        # sin, slots, block_tables, max_blocks, seq_lens, num_blocks, block_size, sm_scale
        "kvt_decode_model_f32": (
            [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64]
            + [_i64, _f32],
            _int,
        ),
    },
    "quant_gemm": {
        "kvt_has_quant_linear": ([], _int),
        # x, M, ldx, x_kind, q (interleaved), fmt, d, m (or NULL), N, K, bias (float32 or NULL), out, ldo
        "kvt_quant_linear": (
            [_ptr, _i64, _i64, _int, _ptr, _int, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64],
            _int,
        ),
        # q (interleaved), fmt, d, m (or NULL), N, K, out, out_kind
        "kvt_quant_dequant": ([_ptr, _int, _ptr, _ptr, _i64, _i64, _ptr, _int], _int),
    },
}
ABI_VERSION = 1

# The kernels' codes for dtypes and errors (the enums of csrc/kv_common.h).
FLOAT_KIND = {torch.float32: 0, torch.bfloat16: 1}
"""Float formats the kernels read and write (KVT_F32, KVT_BF16)."""
KV_STORAGE = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.int8: 2, torch.float32: 3, torch.bfloat16: 4}
"""KV storage dtypes (KVS_* of csrc/kv_common.h; the first three carry scales)."""
SCALED_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
SCALE_BLOCK, SCALE_TOKEN = 0, 1
"""KV scale layouts (KVT_SCALE_* of csrc/kv_common.h): one float32 per block, one float16 per token."""
BAD_INDEX = -1
"""A block id, slot or length outside the pool (the caller raises IndexError)."""


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Run the enclosed code on the torch ops (for comparisons and experiments): every native
    library, or only those named ("kv_quant", "paged_attention", "gemm", "layer_ops", "layer_ops_f32",
    "decode_attention_f32", "quant_gemm", "decode_model_f32")."""
    global _enabled
    before = _enabled, set(_disabled_libs)
    if names:
        _disabled_libs.update(names)
    else:
        _enabled = False
    try:
        yield
    finally:
        _enabled = before[0]
        _disabled_libs.clear()
        _disabled_libs.update(before[1])


def kv_quant_lib() -> ctypes.CDLL | None:
    """The quantized-KV kernels (csrc/kv_quant.c), or None (disabled, or no working build here)."""
    return _load("kv_quant") if _active("kv_quant") else None


def paged_attention_lib() -> ctypes.CDLL | None:
    """The paged decode attention kernel (csrc/paged_attention.c), or None: disabled, no working
    build, or a CPU without AVX-512 (the kernel's only implementation)."""
    if not _active("paged_attention"):
        return None
    lib = _load("paged_attention")
    return lib if lib is not None and _has_decode_attention(lib) else None


def chunk_attention_lib() -> ctypes.CDLL | None:
    """The paged chunk attention kernel (kvt_chunk_attention of csrc/paged_attention.c: many query
    tokens of one sequence, bfloat16), or None: disabled, no working build, or a CPU without
    AVX512-BF16."""
    lib = paged_attention_lib()
    return lib if lib is not None and _has_chunk_attention(lib) else None


def linear_lib() -> ctypes.CDLL | None:
    """The small-batch bfloat16 projection kernel (kvt_linear_bf16 of csrc/gemm.c), or None:
    disabled, no working build, or a CPU without AVX512-BF16."""
    if not _active("gemm"):
        return None
    lib = _load("gemm")
    return lib if lib is not None and _has_linear(lib) else None


def layer_ops_f32_lib() -> ctypes.CDLL | None:
    """The fused per-layer ops of a float32 decoder (csrc/layer_ops_f32.c, plain C for any CPU),
    or None: disabled or no working build. Only models with quantized weights use them."""
    return _load("layer_ops_f32") if _active("layer_ops_f32") else None


def decode_attention_f32_lib() -> ctypes.CDLL | None:
    """The float32 paged decode attention in plain C (csrc/decode_attention_f32.c), or None:
    disabled or no working build. Only models with quantized weights use it."""
    return _load("decode_attention_f32") if _active("decode_attention_f32") else None


def decode_model_f32_lib() -> ctypes.CDLL | None:
    """A whole decode step of a float32 model with quantized projections in one call
    (csrc/decode_model_f32.c, which includes quant_gemm.c, layer_ops_f32.c and
    decode_attention_f32.c), or None: disabled (by its name, or by any of those three), no working
    build, or a CPU without AVX2, FMA and F16C."""
    parts = ("decode_model_f32", "quant_gemm", "layer_ops_f32", "decode_attention_f32")
    if not all(_active(name) for name in parts):
        return None
    lib = _load("decode_model_f32")
    return lib if lib is not None and bool(lib.kvt_has_decode_model_f32()) else None


def quant_linear_lib() -> ctypes.CDLL | None:
    """The projections on quantized weights (csrc/quant_gemm.c), or None: disabled, no working
    build, or a CPU without AVX2, FMA and F16C."""
    if not _active("quant_gemm"):
        return None
    lib = _load("quant_gemm")
    return lib if lib is not None and bool(lib.kvt_has_quant_linear()) else None


def layer_ops_lib() -> ctypes.CDLL | None:
    """The fused per-layer ops of a bfloat16 decoder (csrc/layer_ops.c: residual add + RMSNorm,
    rotary embedding, SiLU * up), or None: disabled, no working build, or a CPU without AVX-512."""
    if not _active("layer_ops"):
        return None
    lib = _load("layer_ops")
    return lib if lib is not None and _has_layer_ops(lib) else None


@functools.cache
def _has_layer_ops(lib: ctypes.CDLL) -> bool:
    return bool(lib.kvt_has_layer_ops())


@functools.cache
def _has_linear(lib: ctypes.CDLL) -> bool:
    return bool(lib.kvt_has_linear_bf16())


@functools.cache
def _has_chunk_attention(lib: ctypes.CDLL) -> bool:
    return bool(lib.kvt_has_chunk_attention())


def _active(name: str) -> bool:
    return _enabled and name not in _disabled_libs


@functools.cache
def _has_decode_attention(lib: ctypes.CDLL) -> bool:
    return bool(lib.kvt_has_decode_attention())


@functools.cache
def _load(name: str) -> ctypes.CDLL | None:
    source = CSRC / f"{name}.c"
    try:
        path = _build(source)
        lib = ctypes.CDLL(str(path))
        for fn, (argtypes, restype) in _SIGNATURES[name].items():
            getattr(lib, fn).argtypes = argtypes
            getattr(lib, fn).restype = restype
        lib.kvt_abi_version.restype = _int
        if lib.kvt_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI version {lib.kvt_abi_version()}, expected {ABI_VERSION}")
        return lib
    except Exception as e:  # noqa: BLE001 - any failure means: use the torch ops
        logger.warning("native kernels %s unavailable (%s); using torch ops", name, e)
        return None


def _build(source: Path) -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    key = hashlib.sha256()
    # every source of the folder: a file may include another (decode_model_f32.c includes three)
    others = [p.read_bytes() for p in sorted(source.parent.iterdir()) if p.suffix in (".c", ".h") and p != source]
    for part in (source.read_bytes(), *others, " ".join(FLAGS).encode(), version.encode(), _cpu_id().encode()):
        key.update(part)
    out_dir = _cache_dir()
    target = out_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if _trusted(target):
        return target
    with _build_lock(out_dir):
        if _trusted(target):  # another process built it while we waited
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            proc = subprocess.run(
                [compiler, *FLAGS, str(source), "-o", tmp, "-lm"],
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
            os.chmod(tmp, 0o700)
            os.replace(tmp, target)  # atomic: replaces an untrusted file of that name, if any
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    if not _trusted(target):
        raise RuntimeError(f"{target} changed under the build lock; not loading it")
    return target


def _trusted(path: Path) -> bool:
    """A library we may load: a regular file (not a link) owned by this user, writable by no one
    else. A file that exists but fails this is logged and rebuilt over."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"owned by uid {st.st_uid}, not {os.getuid()}"
    elif st.st_mode & 0o022:
        problem = f"mode {stat.S_IMODE(st.st_mode):o} lets others write it"
    if problem is not None:
        logger.warning("native kernels: refusing to load %s (%s); rebuilding it", path, problem)
        return False
    return True


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """An exclusive lock on the cache folder's build (fcntl.flock; released on exit or death)."""
    import fcntl

    fd = os.open(out_dir / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _cache_dir() -> Path:
    """The private build folder: created 0700; refused when another user owns it or it is a link
    (no fallback: the torch ops run instead); tightened to 0700 when it is ours but looser."""
    base = Path(os.environ.get("KVTIER_CACHE_DIR", Path.home() / ".cache" / "kvtier"))
    folder = base / "native"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        folder.mkdir(exist_ok=True, mode=0o700)
        st = os.lstat(folder)
    except OSError as e:
        raise RuntimeError(f"cannot create the native build folder {folder}: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"the native build folder {folder} is not a directory (a link?); refusing it")
    if st.st_uid != os.getuid():
        raise RuntimeError(
            f"the native build folder {folder} belongs to uid {st.st_uid}, not "
            f"{os.getuid()}; refusing it (set KVTIER_CACHE_DIR to a folder of your own)"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    if not os.access(folder, os.W_OK):
        raise RuntimeError(f"the native build folder {folder} is not writable")
    return folder


def _cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
                    if line.startswith(("flags", "Features")):
                        break
    except OSError:
        pass
    return platform.machine() + platform.processor() + flags
