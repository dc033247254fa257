"""The DiT body's GEMMs on CUTLASS (Hopper, sm_90a): the ctypes front end of ``libtcfm_cutlass.so``.

``out = epilogue(a @ w.T + bias)`` with a (M, K), w (N, K) (an nn.Linear weight), bias (N,) or None,
out (M, N); fp16 or bf16 operands of one dtype, fp32 accumulation and epilogue math, one rounding to
the output dtype. Epilogue: the bias alone, or GELU (tanh form) of the biased sum (``gelu=True``,
the body's fc1). The kernels are CUTLASS 3.x warp-specialized persistent GEMMs (TMA loads, wgmma),
one per *config* (CTA tile x cluster x schedule: cooperative, ping-pong, stream-K), built by
``bash csrc/cutlass/build.sh`` into a plain C library (``csrc/cutlass/tcfm_cutlass.h``) that needs no
torch headers: this module loads it with ctypes.

The library is found at ``$TORCH_CFM_CUTLASS_SO``, else ``<repo>/build_cutlass/libtcfm_cutlass.so``.
Where it is absent or cannot load, :func:`load_library` and :func:`cutlass_linear` return None and
:func:`unavailable_reason` says why.

Launches go to the current CUDA stream of the operands' device, with no synchronisation and no
allocation beyond the output (when ``out`` is None) and the stream-K configs' workspace (when
``workspace`` is None): graph-capturable. Run one call per config and device eagerly before a
capture (the library opts each kernel into its shared memory on its first launch).

Shape legend: M token rows, K input channels, N output channels.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
from typing import Optional, Union

import torch

from .. import policy

ENV_VAR = "TORCH_CFM_CUTLASS_SO"
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "build_cutlass", "libtcfm_cutlass.so")
ABI_VERSION = 1  # TCFM_CUTLASS_ABI_VERSION of csrc/cutlass/tcfm_cutlass.h
DTYPES = {torch.float16: 0, torch.bfloat16: 1}
EPI_BIAS, EPI_BIAS_GELU = 0, 1
SCHEDULES = ("cooperative", "pingpong", "streamk")
ERR_ARGUMENT = -2
OP = "cutlass_linear"


@dataclasses.dataclass(frozen=True)
class CutlassConfig:
    """One kernel family of the library: CTA tile (tile_m x tile_n, K step 64), cluster, schedule, and
    whether it has the GELU epilogue (every config has the bias one)."""

    index: int
    name: str
    tile_m: int
    tile_n: int
    cluster_m: int
    cluster_n: int
    schedule: str
    gelu: bool


@dataclasses.dataclass(frozen=True)
class Role:
    """One GEMM of a DiT block at a body of ``rows`` rows: out (M, N) = a (M, K) @ w (N, K).T (+ bias)."""

    name: str
    m: int
    n: int
    k: int
    bias: bool
    gelu: bool

    @property
    def flop(self) -> float:
        return 2.0 * self.m * self.n * self.k


def body_roles(rows: int, t_len: int = 50, channels: int = 512, mlp: int = 2048,
               history: int = 2) -> tuple[Role, ...]:
    """The block GEMMs of a fused body call (:func:`torch_cfm.kernels.dit_body.dit_body_triton`) over
    ``rows`` rows of ``t_len`` frames: qkv, proj, the conv taps (rows x (t_len + history) frames, no
    bias: the row-norm behind adds it), fc1 (+ GELU), fc2."""
    m, mc, c = rows * t_len, rows * (t_len + history), channels
    return (Role("qkv", m, 3 * c, c, True, False), Role("proj", m, c, c, True, False),
            Role("conv", mc, 3 * c, c, False, False), Role("fc1", m, mlp, c, True, True),
            Role("fc2", m, c, mlp, True, False))


_LOCK = threading.Lock()
_LOADED: dict[str, tuple[Optional[ctypes.CDLL], Optional[str]]] = {}  # path -> (library, why not)


def library_path(path: Optional[str] = None) -> str:
    """``path``, else ``$TORCH_CFM_CUTLASS_SO``, else :data:`DEFAULT_PATH`."""
    return os.path.abspath(path or os.environ.get(ENV_VAR) or DEFAULT_PATH)


def _declare(lib: ctypes.CDLL) -> None:
    i, ll, p = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
    ip = ctypes.POINTER(ctypes.c_int)
    for name, res, args in (
            ("tcfm_cutlass_abi_version", i, []), ("tcfm_cutlass_num_configs", i, []),
            ("tcfm_cutlass_config_name", ctypes.c_char_p, [i]),
            ("tcfm_cutlass_config_info", i, [i, ip, ip, ip, ip, ip]),
            ("tcfm_cutlass_config_supports", i, [i, i, i]),
            ("tcfm_cutlass_workspace_size", ll, [i, i, i, i, i, i, i]),
            ("tcfm_cutlass_gemm", i, [i, i, i, p, ll, p, ll, p, p, ll, i, i, i, p, ctypes.c_size_t, i, i, p]),
            ("tcfm_cutlass_last_error", ctypes.c_char_p, [])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args


def _load(path: str) -> tuple[Optional[ctypes.CDLL], Optional[str]]:
    if not os.path.isfile(path):
        return None, (f"{path} is not built (bash csrc/cutlass/build.sh builds it; set ${ENV_VAR} to use "
                      "another copy)")
    try:
        lib = ctypes.CDLL(path)
        _declare(lib)
    except (OSError, AttributeError) as exc:
        return None, f"{path} does not load: {exc}"
    if lib.tcfm_cutlass_abi_version() != ABI_VERSION:
        return None, (f"{path} has C ABI version {lib.tcfm_cutlass_abi_version()}, this module expects "
                      f"{ABI_VERSION} (rebuild it)")
    return lib, None


def load_library(path: Optional[str] = None) -> Optional[ctypes.CDLL]:
    """The loaded library (once per path), or None where it is absent or unusable
    (:func:`unavailable_reason` says why)."""
    where = library_path(path)
    with _LOCK:
        if where not in _LOADED:
            _LOADED[where] = _load(where)
        return _LOADED[where][0]


def unavailable_reason(path: Optional[str] = None) -> Optional[str]:
    """Why the library cannot be used (None: it loads)."""
    load_library(path)
    return _LOADED[library_path(path)][1]


@functools.lru_cache(maxsize=None)
def _configs(where: str) -> tuple[CutlassConfig, ...]:
    lib = load_library(where)
    if lib is None:
        return ()
    out = []
    for idx in range(lib.tcfm_cutlass_num_configs()):
        vals = [ctypes.c_int() for _ in range(5)]
        lib.tcfm_cutlass_config_info(idx, *[ctypes.byref(v) for v in vals])
        tm, tn, cm, cn, sched = (v.value for v in vals)
        out.append(CutlassConfig(idx, lib.tcfm_cutlass_config_name(idx).decode(), tm, tn, cm, cn, SCHEDULES[sched],
                                 bool(lib.tcfm_cutlass_config_supports(idx, EPI_BIAS_GELU, 0))))
    return tuple(out)


def configs(path: Optional[str] = None) -> tuple[CutlassConfig, ...]:
    """The library's configs in index order (empty where it is not available)."""
    return _configs(library_path(path))


def _fail(arg: str, expectation: str, got: str) -> None:
    raise ValueError(f"{OP}: {arg} must {expectation}, got {got}")


def _resolve_config(config: Union[CutlassConfig, str, int], gelu: bool, path: Optional[str]) -> CutlassConfig:
    known = configs(path)
    for cfg in known:
        if config in (cfg, cfg.name, cfg.index):
            if gelu and not cfg.gelu:
                _fail("config", "have the GELU epilogue with gelu=True (one of "
                      f"{[c.name for c in known if c.gelu]})", cfg.name)
            return cfg
    _fail("config", f"be a CutlassConfig, name or index of one of {[c.name for c in known]}", repr(config))
    raise AssertionError  # unreachable


def _check_matrix(arg: str, t: object, rows: Optional[int], cols: Optional[int], dtype: Optional[torch.dtype]) -> None:
    """A 2-D tensor of ``dtype`` and shape (rows, cols) where given (metadata only)."""
    if not isinstance(t, torch.Tensor):
        _fail(arg, "be a torch.Tensor", type(t).__name__)
    if t.dim() != 2:
        _fail(arg, "be 2-D", f"shape {tuple(t.shape)}")
    if dtype is None and t.dtype not in DTYPES:
        _fail(arg, "be float16 or bfloat16", str(t.dtype))
    if dtype is not None and t.dtype != dtype:
        _fail(arg, f"have a's dtype {dtype}", str(t.dtype))
    if (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
        _fail(arg, f"have shape ({rows if rows is not None else '*'}, {cols if cols is not None else '*'})",
              str(tuple(t.shape)))


def _check_layout(arg: str, t: torch.Tensor, device: torch.device) -> None:
    """On ``device`` with unit column stride, a row stride of a multiple of 8 elements and a 16-byte
    aligned start (the TMA loads and stores)."""
    if t.device != device:
        _fail(arg, f"be on a's device {device}", str(t.device))
    if t.stride(1) != 1 or t.stride(0) % 8 or t.stride(0) < t.shape[1] or t.data_ptr() % 16:
        _fail(arg, "have unit column stride, a row stride that is a multiple of 8 elements (and >= its columns) "
              "and a 16-byte aligned start", f"strides {t.stride()} at address {t.data_ptr():#x}")


def _check_operands(a, w, bias, out) -> None:
    _check_matrix("a", a, None, None, None)
    m, k = a.shape
    _check_matrix("w", w, None, k, a.dtype)
    n = w.shape[0]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != n or bias.dtype != a.dtype:
            got = (f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__)
            _fail("bias", f"be None or a ({n},) tensor of a's dtype {a.dtype}", got)
    if out is not None:
        _check_matrix("out", out, m, n, a.dtype)
    if m < 1 or n % 8 or k % 8 or n < 8 or k < 8:
        _fail("a / w", "give M >= 1 and N, K positive multiples of 8", f"M={m}, N={n}, K={k}")
    if a.device.type != "cuda":
        _fail("a", "be on a CUDA device", str(a.device))
    for arg, t in (("a", a), ("w", w)) + ((("out", out),) if out is not None else ()):
        _check_layout(arg, t, a.device)
    if bias is not None and (bias.device != a.device or bias.stride(0) != 1):
        _fail("bias", f"be contiguous on a's device {a.device}", f"{bias.device}, stride {bias.stride()}")


def workspace_bytes(config: Union[CutlassConfig, str, int], m: int, n: int, k: int, dtype: torch.dtype,
                    gelu: bool = False, device: Optional[torch.device] = None,
                    path: Optional[str] = None) -> Optional[int]:
    """Bytes of device workspace a call needs (0 except stream-K); None where the library is absent."""
    lib = load_library(path)
    if lib is None:
        return None
    cfg = _resolve_config(config, gelu, path)
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _workspace(library_path(path), cfg.index, EPI_BIAS_GELU if gelu else EPI_BIAS, DTYPES[dtype], m, n, k, index)


@functools.lru_cache(maxsize=4096)
def _workspace(where: str, config: int, epilogue: int, dtype: int, m: int, n: int, k: int, device: int) -> int:
    lib = load_library(where)
    size = lib.tcfm_cutlass_workspace_size(config, epilogue, dtype, m, n, k, device)
    if size < 0:
        raise RuntimeError(f"{OP}: workspace query failed ({size}): {lib.tcfm_cutlass_last_error().decode()}")
    return size


def cutlass_linear(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                   config: Union[CutlassConfig, str, int], gelu: bool = False, out: Optional[torch.Tensor] = None,
                   workspace: Optional[torch.Tensor] = None, pdl: bool = False,
                   path: Optional[str] = None) -> Optional[torch.Tensor]:
    """``out = a @ w.T + bias`` (GELU, tanh form, of it with ``gelu``) on one CUTLASS config.

    Args:
        a: (M, K) float16 or bfloat16 on an SM90 GPU; unit column stride, row stride a multiple of 8,
            16-byte aligned (as are w and out).
        w: (N, K), a's dtype (an nn.Linear weight). N and K multiples of 8.
        bias: (N,) of a's dtype, or None.
        config: a :class:`CutlassConfig`, its name or its index (:func:`configs`).
        out: (M, N) of a's dtype, written; None: a new contiguous tensor.
        workspace: uint8 CUDA tensor of at least :func:`workspace_bytes` (stream-K configs); None: a
            new one from torch's allocator when the config needs one.
        pdl: launch with programmatic dependent launch.
        path: the library (default: :func:`library_path`).

    Returns:
        ``out``, or None where the library is not available (:func:`unavailable_reason`).

    Raises:
        ValueError naming the argument for bad operands or config; RuntimeError when the launch fails.
    """
    _check_operands(a, w, bias, out)
    lib = load_library(path)
    if lib is None:
        return None
    return _launch(lib, _resolve_config(config, gelu, path), a, w, bias, gelu, out, workspace, pdl, path)


def _launch(lib: ctypes.CDLL, cfg: CutlassConfig, a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
            gelu: bool, out: Optional[torch.Tensor], workspace: Optional[torch.Tensor], pdl: bool,
            path: Optional[str]) -> torch.Tensor:
    """:func:`cutlass_linear` after its operand checks: the workspace, the output and the launch."""
    m, k = a.shape
    n = w.shape[0]
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    epilogue, dtype = (EPI_BIAS_GELU if gelu else EPI_BIAS), DTYPES[a.dtype]
    need = _workspace(library_path(path), cfg.index, epilogue, dtype, m, n, k, device)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=a.device) if need else None
    elif (not isinstance(workspace, torch.Tensor) or workspace.device != a.device
          or workspace.dtype != torch.uint8 or not workspace.is_contiguous() or workspace.numel() < need):
        got = (f"{workspace.dtype} {tuple(workspace.shape)} on {workspace.device}"
               if isinstance(workspace, torch.Tensor) else type(workspace).__name__)
        _fail("workspace", f"be a contiguous uint8 tensor of >= {need} bytes on {a.device}", got)
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    rc = lib.tcfm_cutlass_gemm(cfg.index, epilogue, dtype, a.data_ptr(), a.stride(0), w.data_ptr(), w.stride(0),
                               None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), m, n, k,
                               None if workspace is None else workspace.data_ptr(),
                               0 if workspace is None else workspace.numel(), int(pdl), device, stream)
    if rc != 0:
        msg = f"{OP}: {cfg.name} ({rc}): {lib.tcfm_cutlass_last_error().decode()}"
        raise ValueError(msg) if rc == ERR_ARGUMENT else RuntimeError(msg)
    return out


def not_supported_reasons(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                          config: Union[str, int], path: Optional[str] = None) -> list[str]:
    """Why :func:`linear_into` would leave this call to its caller (empty: it runs it): the library
    absent or unusable, operands :func:`cutlass_linear` refuses (not on a CUDA device included), a GPU
    other than SM90 (the kernels are sm_90a), or ``config`` not in the library."""
    reasons = []
    why = unavailable_reason(path)
    if why is not None:
        reasons.append(why)
    try:
        _check_operands(a, w, bias, out)
    except ValueError as exc:
        reasons.append(str(exc))
    else:
        cap = policy.device_capability(a.device)
        if cap != (9, 0):
            reasons.append(f"the library's kernels are sm_90a, {a.device} is "
                           + ("not an NVIDIA GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"))
    if why is None and not any(config in (c.name, c.index) for c in configs(path)):
        reasons.append(f"config {config!r} is not one of the library's {[c.name for c in configs(path)]}")
    return reasons


def linear_into(a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor,
                config: Union[str, int], *, path: Optional[str] = None) -> bool:
    """``out = a @ w.T (+ bias)`` on ``config`` (:func:`cutlass_linear`, no GELU); False, nothing
    launched, where :func:`not_supported_reasons` is not empty, for the caller's cuBLAS fallback.
    Shapes and dtypes: :func:`cutlass_linear`'s, with ``out`` given."""
    lib = load_library(path)
    if lib is None or not_supported_reasons(a, w, bias, out, config, path):
        return False
    cfg = next(c for c in configs(path) if config in (c.name, c.index))
    _launch(lib, cfg, a, w, bias, False, out, None, False, path)
    return True


__all__ = ["CutlassConfig", "DEFAULT_PATH", "ENV_VAR", "Role", "body_roles", "configs", "cutlass_linear",
           "library_path", "linear_into", "load_library", "not_supported_reasons", "unavailable_reason",
           "workspace_bytes"]
