"""mHC, DeepSeek's manifold-constrained hyper-connections (spec §4 of
docs/spec.md): mhc_pre and its stages, mhc_post, the boundaries mhc_post_pre and
mhc_post_head, mhc_head, mhc_expand, the
projection kernel choice -- each function with its torch custom op and shape
function beside it.

X is bf16 ``[B, n, C]`` or ``[B, n*C]``; phi ``[N, n*C]`` float32 or bf16; alpha
float32 ``[3]``; bias float32 ``[N]``; N = n*n + 2n.

Keyword defaults are the library's (the Args initialisers of
include/flashmix/mhc.h, MhcParams among them, read through
``_C.mhc_defaults()``); the binding (python/src/mhc.cpp) takes every argument
explicitly.
"""
import collections

from ._common import _C, arg, defaults, empty, stream_of, torch

__all__ = [
    "mhc_pre", "mhc_pre_kernel_choice", "mhc_post", "mhc_post_pre", "mhc_post_head", "mhc_project", "mhc_activate", "mhc_pre_mix", "mhc_head",
    "mhc_expand", "mhc_workspace_bytes", "mhc_epilogue_workspace_bytes", "mhc_post_head_workspace_bytes",
    "mhc_num_coefficients",
    "MHC_MAX_STREAMS", "MHC_SEED_PARAMS", "MHC_PRE_KERNELS", "MHC_BOUNDARY_PATHS", "MhcPreOutput", "MhcActivateOutput",
    "MhcPostPreOutput", "MhcPostPreFp8Output", "MhcPostPreFp8xOutput", "MhcPreFp8Output", "MhcPostFp8Output",
    "MhcExpandFp8Output", "MhcPostHeadOutput",
]

if torch is not None:
    from ._torch_ops import Optional, Tensor, Tuple, custom_op

_DEFAULTS = defaults(_C.mhc_defaults())
_PRE = _DEFAULTS["mhc_pre"]
_POST = _DEFAULTS["mhc_post"]
_PROJECT = _DEFAULTS["mhc_project"]
_ACTIVATE = _DEFAULTS["mhc_activate"]
_PRE_MIX = _DEFAULTS["mhc_pre_mix"]
_HEAD = _DEFAULTS["mhc_head"]
_EXPAND = _DEFAULTS["mhc_expand"]
_POST_PRE = _DEFAULTS["mhc_post_pre"]
_POST_HEAD = _DEFAULTS["mhc_post_head"]

MHC_MAX_STREAMS = _C.MHC_MAX_STREAMS
#: The ``kernel`` values of mhc_pre, mhc_project and mhc_head (``MhcPreKernel``; docs/spec.md §4.6).
MHC_PRE_KERNELS = _C.MHC_PRE_KERNELS
#: mhc_post_pre's ``path`` values (spec §4.7 MhcBoundaryPath).
MHC_BOUNDARY_PATHS = _C.MHC_BOUNDARY_PATHS
#: MhcParams::seed(): the seed document's setting (all eps 0), as keyword arguments.
MHC_SEED_PARAMS = _C.mhc_seed_params()
mhc_num_coefficients = _C.mhc_num_coefficients
mhc_workspace_bytes = _C.mhc_workspace_bytes
mhc_epilogue_workspace_bytes = _C.mhc_epilogue_workspace_bytes
mhc_post_head_workspace_bytes = _C.mhc_post_head_workspace_bytes

MhcPreOutput = collections.namedtuple("MhcPreOutput", ["f_pre", "h_post", "h_res"])
#: mhc_pre with ``fp8=True`` (spec §4.8): f_pre is None with ``bf16_f_pre=False``.
MhcPreFp8Output = collections.namedtuple("MhcPreFp8Output", ["f_pre", "h_post", "h_res", "f_pre_fp8", "f_pre_scales"])
MhcActivateOutput = collections.namedtuple("MhcActivateOutput", ["h_pre", "h_post", "h_res"])
#: mhc_post on the FP8 residual stream (spec §4.9): e4m3 codes and their scales.
MhcPostFp8Output = collections.namedtuple("MhcPostFp8Output", ["x_next", "x_next_scales"])
#: mhc_expand onto the FP8 residual stream (spec §4.9).
MhcExpandFp8Output = collections.namedtuple("MhcExpandFp8Output", ["x", "x_scales"])
MhcPostPreOutput = collections.namedtuple("MhcPostPreOutput", ["x_next", "f_pre", "h_post", "h_res"])
#: mhc_post_head keeping X_next: x_next_scales is None on the bf16 stream.
MhcPostHeadOutput = collections.namedtuple("MhcPostHeadOutput", ["out", "x_next", "x_next_scales"])
#: mhc_post_pre with ``fp8=True`` (spec §4.8): f_pre is None with ``bf16_f_pre=False``.
MhcPostPreFp8Output = collections.namedtuple(
    "MhcPostPreFp8Output", ["x_next", "f_pre", "h_post", "h_res", "f_pre_fp8", "f_pre_scales"])
#: mhc_post_pre on the FP8 residual stream (spec §4.9): X_next as e4m3 codes and their scales;
#: f_pre_fp8 and f_pre_scales are None without ``fp8`` (f_pre is None with ``bf16_f_pre=False``).
MhcPostPreFp8xOutput = collections.namedtuple(
    "MhcPostPreFp8xOutput", ["x_next", "x_next_scales", "f_pre", "h_post", "h_res", "f_pre_fp8", "f_pre_scales"])


def _streams_from_coefficients(N, op, name):
    """n from N = n*n + 2n (the rows of phi, the columns of h); a ValueError naming `name` otherwise."""
    for n in range(1, MHC_MAX_STREAMS + 1):
        if mhc_num_coefficients(n) == N:
            return n
    raise ValueError(f"{op}: {name}: has {N} coefficients, not N = n*n + 2n for an n in [1, {MHC_MAX_STREAMS}]")


def _hidden(x, n, op):
    """C for X [B, n, C] or [B, n*C]."""
    if len(x.shape) == 3:
        return x.shape[2]
    if len(x.shape) == 2:
        return x.shape[1] // n
    raise ValueError(f"{op}: x: must be [B, n, C] or [B, n*C] (got shape {tuple(x.shape)})")


def _new_mix(x, n, op):
    """A bf16 ``[B, C]`` output (F_pre, the head's out)."""
    return empty(x, (x.shape[0], _hidden(x, n, op)), "bfloat16")


def _coef_outputs(x, phi, op, h_post=None, h_res=None):
    """h_post fp32 ``[B, n]`` and h_res fp32 ``[B, n, n]`` (n from phi): those given, fresh ones
    for the others."""
    n = _streams_from_coefficients(phi.shape[0], op, "phi")
    B = x.shape[0]
    return (empty(x, (B, n), "float32") if h_post is None else h_post,
            empty(x, (B, n, n), "float32") if h_res is None else h_res)


def _pre_outputs(x, phi, op, f_pre=None, h_post=None, h_res=None):
    """mhc_pre's outputs (f_pre bf16 ``[B, C]``, h_post fp32 ``[B, n]``, h_res fp32 ``[B, n, n]``;
    n from phi): those given, fresh ones for the others."""
    n = _streams_from_coefficients(phi.shape[0], op, "phi")
    return (_new_mix(x, n, op) if f_pre is None else f_pre, *_coef_outputs(x, phi, op, h_post, h_res))


# ---------------------------------------------------------------------------
# mhc_pre and its projection kernel
# ---------------------------------------------------------------------------

def _epilogue(x, phi, op, fp8, f_pre_scale_format, f_pre, f_pre_fp8, f_pre_scales, bf16_f_pre):
    """F_pre's epilogue outputs (spec §4.8): (fp8 on?, f_pre, f_pre_fp8, f_pre_scales), those
    given, fresh ones for the others. With ``fp8`` and not ``bf16_f_pre`` f_pre is a fresh
    scratch the caller does not return: with it the library keeps the plain F_pre there and runs
    the epilogue as a pass after the resident or split kernel (not on the cluster tiles), so the
    FP8 bytes are those of the call with the bf16 f_pre."""
    fp8 = bool(fp8) or f_pre_fp8 is not None or f_pre_scales is not None
    n = _streams_from_coefficients(phi.shape[0], op, "phi")
    if (fp8 and not bf16_f_pre) or f_pre is None:
        f_pre = _new_mix(x, n, op)
    if fp8:
        f_pre_fp8, f_pre_scales = _fp8_outputs(x, phi, f_pre_scale_format, f_pre_fp8, f_pre_scales, op)
    return fp8, f_pre, f_pre_fp8, f_pre_scales


def _fp8_outputs(x, phi, scale_format, f_pre_fp8=None, f_pre_scales=None, op="mhc_post_pre"):
    """The FP8 copy of F_pre (e4m3 ``[B, C]``) and its 1 x 128 scales ``[B, C/128]``: those given,
    fresh ones for the others."""
    from .fp8 import _e4m3_dtype, _scale_dtype
    n = _streams_from_coefficients(phi.shape[0], op, "phi")
    B, C = x.shape[0], _hidden(x, n, op)
    return (empty(x, (B, C), _e4m3_dtype(x)) if f_pre_fp8 is None else f_pre_fp8,
            empty(x, (B, C // 128), _scale_dtype(x, scale_format)) if f_pre_scales is None else f_pre_scales)


def _epilogue_args(norm_weight, norm_eps, f_pre_fp8, f_pre_scales, f_pre_scale_format):
    from .fp8 import _as_bytes
    return dict(norm_weight=arg(norm_weight), norm_eps=norm_eps, f_pre_fp8=arg(_as_bytes(f_pre_fp8)),
                f_pre_scales=arg(_as_bytes(f_pre_scales)), f_pre_scale_format=f_pre_scale_format)


def _residual_args(x, x_scales):
    """x and x_scales for the binding: on the FP8 residual stream (x_scales given, spec §4.9) the
    e4m3 codes as uint8 and the scales' bytes; the bf16 X with no scales otherwise."""
    from .fp8 import _as_bytes
    if x_scales is None:
        return arg(x), None
    return arg(_as_bytes(x)), arg(_as_bytes(x_scales))


def mhc_pre(x, phi, alpha, bias, *, f_pre=None, h_post=None, h_res=None, eps_norm=_PRE.eps_norm,
            eps_pre=_PRE.eps_pre, post_mult=_PRE.post_mult, eps_sinkhorn=_PRE.eps_sinkhorn,
            sinkhorn_iters=_PRE.sinkhorn_iters, res_layout=_PRE.res_layout, enable_pdl=_PRE.enable_pdl,
            prefetch_weights=_PRE.prefetch_weights, workspace=None, kernel=_PRE.kernel, norm_weight=None,
            norm_eps=_PRE.norm_eps, fp8=False, f_pre_scale_format=_PRE.f_pre_scale_format, f_pre_fp8=None,
            f_pre_scales=None, bf16_f_pre=True, x_scales=None, x_scale_format=_PRE.x_scale_format, stream=None):
    """spec §4 mhc_pre: X -> (F_pre, H_post, H_res) in one pass over X.

    n comes from phi (N = n*n + 2n rows). Returns MhcPreOutput(f_pre bf16 ``[B, C]``,
    h_post float32 ``[B, n]``, h_res float32 ``[B, n, n]``, row-major, before any transpose);
    outputs not passed are allocated. Parameters default to spec §4 (DeepSeek's);
    ``**MHC_SEED_PARAMS`` gives the seed's. ``res_layout`` is an MhcParams field that only
    mhc_post uses. ``prefetch_weights`` (with enable_pdl): phi, alpha and bias are read before
    the previous kernel on the stream finishes; only when that kernel does not write them.
    ``workspace`` (optional): a uint8 device buffer of ``mhc_workspace_bytes(B, n, C)`` bytes,
    zeroed once by the caller (every launch leaves it ready for the next; one launch at a time
    per buffer). With it, small batches spread the projection over every SM: B <= 16, and
    B <= 32 for shapes without the resident kernel (n != 4, ...). On an H100 at decode:
    n = 4, B = 16: 11.35 -> 10.15 us; n = 8: 108.6 -> 27.5 us.
    ``kernel``: the projection kernel, one of MHC_PRE_KERNELS: "auto" (the first that takes the
    shape: docs/spec.md §4.6) or a pinned one, which runs or raises NotImplementedError saying
    why (nothing launched). CPU arrays run the one reference whatever ``kernel`` names.
    ``norm_weight``, ``norm_eps``, ``fp8``, ``f_pre_scale_format``, ``f_pre_fp8``,
    ``f_pre_scales``, ``bf16_f_pre``: F_pre's epilogue (spec §4.8), as in mhc_post_pre (in the
    cluster-tile kernel, or as a pass after the resident or split kernel); with ``fp8`` returns MhcPreFp8Output(f_pre, h_post, h_res,
    f_pre_fp8, f_pre_scales).
    ``x_scales``, ``x_scale_format``: the FP8 residual stream (spec §4.9), as in mhc_post: ``x``
    holds e4m3 codes (float8_e4m3fn or uint8) and ``x_scales`` one scale per (token, stream, 128
    channels); each element is read as fp32(code * scale). The cluster-tile and portable kernels
    take it.
    """
    fp8, f_pre, f_pre_fp8, f_pre_scales = _epilogue(x, phi, "mhc_pre", fp8, f_pre_scale_format, f_pre, f_pre_fp8,
                                                    f_pre_scales, bf16_f_pre)
    h_post, h_res = _coef_outputs(x, phi, "mhc_pre", h_post, h_res)
    xa, sa = _residual_args(x, x_scales)
    _C.mhc_pre(xa, arg(phi), arg(alpha), arg(bias), arg(f_pre), arg(h_post), arg(h_res),
               eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult, eps_sinkhorn=eps_sinkhorn,
               sinkhorn_iters=sinkhorn_iters, res_layout=res_layout, enable_pdl=enable_pdl,
               prefetch_weights=prefetch_weights, kernel=kernel, workspace=arg(workspace),
               **_epilogue_args(norm_weight, norm_eps, f_pre_fp8, f_pre_scales, f_pre_scale_format),
               x_scales=sa, x_scale_format=x_scale_format, stream=stream_of(stream, x))
    if fp8:
        return MhcPreFp8Output(f_pre if bf16_f_pre else None, h_post, h_res, f_pre_fp8, f_pre_scales)
    return MhcPreOutput(f_pre, h_post, h_res)


def mhc_pre_kernel_choice(x, phi, alpha, bias, *, f_pre=None, h_post=None, h_res=None, eps_norm=_PRE.eps_norm,
                          eps_pre=_PRE.eps_pre, post_mult=_PRE.post_mult, eps_sinkhorn=_PRE.eps_sinkhorn,
                          sinkhorn_iters=_PRE.sinkhorn_iters, res_layout=_PRE.res_layout,
                          enable_pdl=_PRE.enable_pdl, prefetch_weights=_PRE.prefetch_weights, workspace=None,
                          kernel=_PRE.kernel, norm_weight=None, norm_eps=_PRE.norm_eps, fp8=False,
                          f_pre_scale_format=_PRE.f_pre_scale_format, f_pre_fp8=None, f_pre_scales=None,
                          bf16_f_pre=True, x_scales=None, x_scale_format=_PRE.x_scale_format, stream=None):
    """``(kernel, reason)``: the projection kernel mhc_pre would run with these arguments (CUDA
    arrays) on their device, one of MHC_PRE_KERNELS other than "auto", and why. Launches nothing
    and reads no array. It takes mhc_pre's arguments (outputs not passed are allocated, as there;
    ``stream`` is not used). A pinned ``kernel`` that cannot take the call raises
    NotImplementedError saying why; CPU arrays raise ValueError."""
    del stream  # the choice does not depend on the stream
    _, f_pre, f_pre_fp8, f_pre_scales = _epilogue(x, phi, "mhc_pre_kernel_choice", fp8, f_pre_scale_format, f_pre,
                                                  f_pre_fp8, f_pre_scales, bf16_f_pre)
    h_post, h_res = _coef_outputs(x, phi, "mhc_pre_kernel_choice", h_post, h_res)
    xa, sa = _residual_args(x, x_scales)
    return tuple(_C.mhc_pre_kernel_choice(
        xa, arg(phi), arg(alpha), arg(bias), arg(f_pre), arg(h_post), arg(h_res), eps_norm=eps_norm,
        eps_pre=eps_pre, post_mult=post_mult, eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters,
        res_layout=res_layout, enable_pdl=enable_pdl, prefetch_weights=prefetch_weights, kernel=kernel,
        workspace=arg(workspace), **_epilogue_args(norm_weight, norm_eps, f_pre_fp8, f_pre_scales,
                                                   f_pre_scale_format),
        x_scales=sa, x_scale_format=x_scale_format))


if torch is not None:
    def _pre_fake(x, phi, **_):
        return _pre_outputs(x, phi, "mhc_pre")

    @custom_op("mhc_pre", fake=_pre_fake)
    def _mhc_pre_op(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, eps_norm: float = _PRE.eps_norm,
                    eps_pre: float = _PRE.eps_pre, post_mult: float = _PRE.post_mult,
                    eps_sinkhorn: float = _PRE.eps_sinkhorn, sinkhorn_iters: int = _PRE.sinkhorn_iters,
                    enable_pdl: bool = _PRE.enable_pdl, prefetch_weights: bool = _PRE.prefetch_weights,
                    projection_kernel: str = _PRE.kernel) -> Tuple[Tensor, Tensor, Tensor]:
        """flashmix.mhc_pre as a custom op: (f_pre bf16 [B, C], h_post fp32 [B, n], h_res fp32 [B, n, n]).
        ``projection_kernel`` is mhc_pre's ``kernel``: an op argument named ``kernel`` breaks
        Inductor, whose fallback lowering calls ``FallbackKernel.create(kernel, *args, **kwargs)``."""
        return tuple(mhc_pre(x, phi, alpha, bias, eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult,
                             eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                             prefetch_weights=prefetch_weights, kernel=projection_kernel))

    # A separate op rather than an optional argument of mhc_pre: torch 2.11's
    # functionalization fails (IndexError under torch.compile) on an Optional
    # tensor in mutates_args when the caller leaves it None.
    @custom_op("mhc_pre_with_workspace", fake=_pre_fake, mutates_args=("workspace",))
    def _mhc_pre_with_workspace_op(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, workspace: Tensor,
                                   eps_norm: float = _PRE.eps_norm, eps_pre: float = _PRE.eps_pre,
                                   post_mult: float = _PRE.post_mult, eps_sinkhorn: float = _PRE.eps_sinkhorn,
                                   sinkhorn_iters: int = _PRE.sinkhorn_iters, enable_pdl: bool = _PRE.enable_pdl,
                                   prefetch_weights: bool = _PRE.prefetch_weights,
                                   projection_kernel: str = _PRE.kernel) -> Tuple[Tensor, Tensor, Tensor]:
        """flashmix.mhc_pre with the small-batch workspace (uint8 ``[mhc_workspace_bytes(B, n, C)]``,
        zeroed once by the caller) as a custom op; outputs as mhc_pre."""
        return tuple(mhc_pre(x, phi, alpha, bias, eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult,
                             eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                             prefetch_weights=prefetch_weights, kernel=projection_kernel, workspace=workspace))


# ---------------------------------------------------------------------------
# mhc_post
# ---------------------------------------------------------------------------

def _new_x_next(x):
    return empty(x, tuple(x.shape), "bfloat16")


def _fp8x_next(x, x_scales, x_scale_format, x_next, x_next_scales):
    """X_next on the FP8 residual stream (spec §4.9): e4m3 codes of x's shape and, where x_scales
    is given, scales of its shape; those not passed are allocated."""
    from .fp8 import _e4m3_dtype, _scale_dtype
    if x_next is None:
        x_next = empty(x, tuple(x.shape), _e4m3_dtype(x))
    if x_next_scales is None and x_scales is not None:
        x_next_scales = empty(x, tuple(x_scales.shape), _scale_dtype(x, x_scale_format))
    return x_next, x_next_scales


def mhc_post(x, f_out, h_post, h_res, *, x_next=None, x_scales=None, x_next_scales=None,
             x_scale_format=_POST.x_scale_format, res_layout=_POST.res_layout, enable_pdl=_POST.enable_pdl,
             stream=None):
    """spec §4 mhc_post: ``X_next[b, i] = sum_j R[b, i, j] X[b, j] + H_post[b, i] F_out[b]`` with
    R = H_res^T ("deepseek") or H_res ("row_mix"). n from h_post ``[B, n]``. ``x_next`` (X's
    shape, must not overlap X) is allocated when None. Returns ``x_next``.

    The FP8 residual stream (spec §4.9), with ``x_scales`` given: ``x`` holds e4m3 codes
    (float8_e4m3fn or uint8, ``[B, n, C]`` or ``[B, n*C]``, C a multiple of 128) and ``x_scales``
    one scale per (token, stream, 128 channels), x's shape with the last dimension divided by
    128, float32 or ue8m0 (``x_scale_format``: float8_e8m0fnu / uint8). X_next comes back the
    same way, its fp32 values quantised in the same pass (bitwise the CPU reference);
    ``x_next`` and ``x_next_scales`` are allocated when None. Returns MhcPostFp8Output(x_next,
    x_next_scales)."""
    if x_scales is None and x_next_scales is None:
        x_next = _new_x_next(x) if x_next is None else x_next
        _C.mhc_post(arg(x), arg(f_out), arg(h_post), arg(h_res), arg(x_next), x_scales=None, x_next_scales=None,
                    x_scale_format=x_scale_format, res_layout=res_layout, enable_pdl=enable_pdl,
                    stream=stream_of(stream, x))
        return x_next
    from .fp8 import _as_bytes
    x_next, x_next_scales = _fp8x_next(x, x_scales, x_scale_format, x_next, x_next_scales)
    _C.mhc_post(arg(_as_bytes(x)), arg(f_out), arg(h_post), arg(h_res), arg(_as_bytes(x_next)),
                x_scales=arg(_as_bytes(x_scales)), x_next_scales=arg(_as_bytes(x_next_scales)),
                x_scale_format=x_scale_format, res_layout=res_layout, enable_pdl=enable_pdl,
                stream=stream_of(stream, x))
    return MhcPostFp8Output(x_next, x_next_scales)


if torch is not None:
    @custom_op("mhc_post", fake=lambda x, **_: _new_x_next(x))
    def _mhc_post_op(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, res_layout: str = _POST.res_layout,
                     enable_pdl: bool = _POST.enable_pdl) -> Tensor:
        """flashmix.mhc_post as a custom op: a fresh X_next of X's shape."""
        return mhc_post(x, f_out, h_post, h_res, res_layout=res_layout, enable_pdl=enable_pdl)


# ---------------------------------------------------------------------------
# mhc_post_pre: the layer boundary
# ---------------------------------------------------------------------------

def _post_pre_outputs(x, phi, x_next=None, f_pre=None, h_post_next=None, h_res_next=None, bf16_f_pre=True):
    """mhc_post_pre's outputs: those given, fresh ones for the others (f_pre None when not
    bf16_f_pre)."""
    n = _streams_from_coefficients(phi.shape[0], "mhc_post_pre", "phi")
    if bf16_f_pre and f_pre is None:
        f_pre = _new_mix(x, n, "mhc_post_pre")
    return ((_new_x_next(x) if x_next is None else x_next), f_pre if bf16_f_pre else None,
            *_coef_outputs(x, phi, "mhc_post_pre", h_post_next, h_res_next))


def mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, *, x_next=None, f_pre=None, h_post_next=None,
                 h_res_next=None, res_layout=_POST_PRE.res_layout, eps_norm=_POST_PRE.eps_norm,
                 eps_pre=_POST_PRE.eps_pre, post_mult=_POST_PRE.post_mult, eps_sinkhorn=_POST_PRE.eps_sinkhorn,
                 sinkhorn_iters=_POST_PRE.sinkhorn_iters, enable_pdl=_POST_PRE.enable_pdl,
                 prefetch_weights=_POST_PRE.prefetch_weights, kernel=_POST_PRE.kernel, path=_POST_PRE.path,
                 workspace=None,
                 norm_weight=None, norm_eps=_POST_PRE.norm_eps, fp8=False, f_pre_scale_format=_POST_PRE.f_pre_scale_format,
                 f_pre_fp8=None, f_pre_scales=None, bf16_f_pre=True, x_scales=None, x_next_scales=None,
                 x_scale_format=_POST_PRE.x_scale_format, stream=None):
    """spec §4.7 mhc_post_pre: a layer boundary in one op, this layer's mhc_post (x, f_out,
    h_post, h_res; ``res_layout``) followed by the next sublayer's mhc_pre (phi, alpha, bias and
    the activation parameters). ``path`` (spec §4.7; the custom ops' ``boundary_path``):
    "fused" (X read once, X_next written once, the pre using X_next as it is made),
    "post_then_pre" (mhc_post then mhc_pre, X_next read back once) or "auto": fused on the
    split kernel, with F_pre's epilogue or with a pinned ``kernel``, else post then pre (the
    fused kernels measured slower there). Returns MhcPostPreOutput(x_next bf16 of x's shape,
    f_pre bf16 ``[B, C]``, h_post float32 ``[B, n]``, h_res float32 ``[B, n, n]``); outputs
    not passed are allocated and must not overlap any input (double-buffer the coefficients).
    Bitwise equal to mhc_post then mhc_pre pinned to the projection kernel that runs.
    ``kernel``: "auto", "resident", "split" or "cluster_tile" (fused; "portable" raises
    NotImplementedError there), or the pre's with "post_then_pre"; CPU arrays run the
    reference.
    ``workspace``: as in mhc_pre (uint8 ``[mhc_workspace_bytes(B, n, C)]``, zeroed once): with
    it, small batches may run on the split kernel (every SM makes X_next for its column slice).

    F_pre's epilogue (spec §4.8): inside the cluster-tile kernel, or as a pass over the stored
    bf16 F_pre after the resident or split kernel where the call without it runs there (kernel
    "auto" or pinned; several times faster at prefill: docs/mhc.md). The pass needs the plain
    F_pre stored: this wrapper always gives the library a bf16 f_pre (with ``bf16_f_pre=False`` a
    scratch it does not return), so the FP8 bytes do not depend on ``bf16_f_pre``:
      norm_weight: bf16 or float32 ``[C]``: f_pre is then the next sublayer's input RMSNorm of
        F_pre (F_pre rounded to bf16, normed in fp32 with ``norm_eps``, rounded once).
      fp8: also an e4m3 copy of f_pre with 1 x 128 scales (``f_pre_scale_format`` "float32" or
        "ue8m0"), bitwise flashmix.quantize_fp8 of the bf16 f_pre; C a multiple of 128.
        ``f_pre_fp8`` (float8_e4m3fn / uint8 ``[B, C]``) and ``f_pre_scales`` (``[B, C/128]``) are
        allocated when None. ``bf16_f_pre=False``: the bf16 f_pre is not returned (None; it goes
        to a scratch). Returns MhcPostPreFp8Output(x_next, f_pre, h_post, h_res, f_pre_fp8, f_pre_scales).

    The FP8 residual stream (spec §4.9), with ``x_scales``: x holds e4m3 codes as in mhc_post,
    and X_next comes back the same way (``x_next``, ``x_next_scales`` allocated when None), its
    codes and scales bitwise mhc_post's; the pre reads them as stored. Returns
    MhcPostPreFp8xOutput(x_next, x_next_scales, f_pre, h_post, h_res, f_pre_fp8, f_pre_scales)."""
    fp8, f_pre, f_pre_fp8, f_pre_scales = _epilogue(x, phi, "mhc_post_pre", fp8, f_pre_scale_format, f_pre,
                                                    f_pre_fp8, f_pre_scales, bf16_f_pre)
    fp8x = x_scales is not None or x_next_scales is not None
    if fp8x:
        x_next, x_next_scales = _fp8x_next(x, x_scales, x_scale_format, x_next, x_next_scales)
    x_next, _, h_post_next, h_res_next = _post_pre_outputs(x, phi, x_next, None, h_post_next, h_res_next,
                                                           bf16_f_pre=False)
    xa, sa = _residual_args(x, x_scales)
    xna, sna = _residual_args(x_next, x_next_scales)
    _C.mhc_post_pre(xa, arg(f_out), arg(h_post), arg(h_res), arg(phi), arg(alpha), arg(bias), xna,
                    arg(f_pre), arg(h_post_next), arg(h_res_next), res_layout=res_layout, eps_norm=eps_norm,
                    eps_pre=eps_pre, post_mult=post_mult, eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters,
                    enable_pdl=enable_pdl, prefetch_weights=prefetch_weights, kernel=kernel, path=path,
                    workspace=arg(workspace),
                    **_epilogue_args(norm_weight, norm_eps, f_pre_fp8, f_pre_scales, f_pre_scale_format),
                    x_scales=sa, x_next_scales=sna, x_scale_format=x_scale_format, stream=stream_of(stream, x))
    f_pre = f_pre if bf16_f_pre or not fp8 else None  # (else the scratch of _epilogue)
    if fp8x:
        return MhcPostPreFp8xOutput(x_next, x_next_scales, f_pre, h_post_next, h_res_next,
                                    f_pre_fp8 if fp8 else None, f_pre_scales if fp8 else None)
    if fp8:
        return MhcPostPreFp8Output(x_next, f_pre, h_post_next, h_res_next, f_pre_fp8, f_pre_scales)
    return MhcPostPreOutput(x_next, f_pre, h_post_next, h_res_next)


if torch is not None:
    @custom_op("mhc_post_pre", fake=lambda x, phi, **_: _post_pre_outputs(x, phi))
    def _mhc_post_pre_op(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, alpha: Tensor,
                         bias: Tensor, res_layout: str = _POST_PRE.res_layout, eps_norm: float = _POST_PRE.eps_norm,
                         eps_pre: float = _POST_PRE.eps_pre, post_mult: float = _POST_PRE.post_mult,
                         eps_sinkhorn: float = _POST_PRE.eps_sinkhorn, sinkhorn_iters: int = _POST_PRE.sinkhorn_iters,
                         enable_pdl: bool = _POST_PRE.enable_pdl, prefetch_weights: bool = _POST_PRE.prefetch_weights,
                         projection_kernel: str = _POST_PRE.kernel,
                         boundary_path: str = _POST_PRE.path) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """flashmix.mhc_post_pre as a custom op: fresh (x_next, f_pre, h_post, h_res);
        ``projection_kernel`` is its ``kernel`` (as in the mhc_pre op)."""
        return tuple(mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, res_layout=res_layout,
                                  eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult,
                                  eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                                  prefetch_weights=prefetch_weights, kernel=projection_kernel, path=boundary_path))

    # A separate op, as mhc_pre_with_workspace (an Optional tensor in mutates_args breaks
    # torch.compile's functionalization when left None).
    @custom_op("mhc_post_pre_with_workspace", fake=lambda x, phi, **_: _post_pre_outputs(x, phi),
               mutates_args=("workspace",))
    def _mhc_post_pre_with_workspace_op(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor,
                                        alpha: Tensor, bias: Tensor, workspace: Tensor,
                                        res_layout: str = _POST_PRE.res_layout, eps_norm: float = _POST_PRE.eps_norm,
                                        eps_pre: float = _POST_PRE.eps_pre, post_mult: float = _POST_PRE.post_mult,
                                        eps_sinkhorn: float = _POST_PRE.eps_sinkhorn,
                                        sinkhorn_iters: int = _POST_PRE.sinkhorn_iters,
                                        enable_pdl: bool = _POST_PRE.enable_pdl,
                                        prefetch_weights: bool = _POST_PRE.prefetch_weights,
                                        projection_kernel: str = _POST_PRE.kernel, boundary_path: str = _POST_PRE.path
                                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """flashmix.mhc_post_pre with the small-batch workspace (uint8
        ``[mhc_workspace_bytes(B, n, C)]``, zeroed once by the caller) as a custom op; outputs as
        the mhc_post_pre op."""
        return tuple(mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, res_layout=res_layout,
                                  eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult,
                                  eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                                  prefetch_weights=prefetch_weights, kernel=projection_kernel, path=boundary_path,
                                  workspace=workspace))

    @custom_op("mhc_post_pre_norm", fake=lambda x, phi, **_: _post_pre_outputs(x, phi))
    def _mhc_post_pre_norm_op(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, alpha: Tensor,
                              bias: Tensor, norm_weight: Tensor, norm_eps: float = _POST_PRE.norm_eps,
                              res_layout: str = _POST_PRE.res_layout, eps_norm: float = _POST_PRE.eps_norm,
                              eps_pre: float = _POST_PRE.eps_pre, post_mult: float = _POST_PRE.post_mult,
                              eps_sinkhorn: float = _POST_PRE.eps_sinkhorn,
                              sinkhorn_iters: int = _POST_PRE.sinkhorn_iters, enable_pdl: bool = _POST_PRE.enable_pdl,
                              prefetch_weights: bool = _POST_PRE.prefetch_weights,
                              projection_kernel: str = _POST_PRE.kernel,
                              boundary_path: str = _POST_PRE.path) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """flashmix.mhc_post_pre with the next sublayer's input RMSNorm (spec §4.8) as a custom op:
        fresh (x_next, normed f_pre bf16, h_post, h_res)."""
        return tuple(mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, res_layout=res_layout,
                                  eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult,
                                  eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                                  prefetch_weights=prefetch_weights, kernel=projection_kernel, path=boundary_path,
                                  norm_weight=norm_weight, norm_eps=norm_eps))

    def _post_pre_fp8_fake(x, phi, f_pre_scale_format, **_):
        x_next, _, h_post_next, h_res_next = _post_pre_outputs(x, phi, bf16_f_pre=False)
        return (x_next, *_fp8_outputs(x, phi, f_pre_scale_format), h_post_next, h_res_next)

    @custom_op("mhc_post_pre_fp8", fake=_post_pre_fp8_fake)
    def _mhc_post_pre_fp8_op(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, alpha: Tensor,
                             bias: Tensor, norm_weight: Optional[Tensor] = None, norm_eps: float = _POST_PRE.norm_eps,
                             f_pre_scale_format: str = _POST_PRE.f_pre_scale_format,
                             res_layout: str = _POST_PRE.res_layout, eps_norm: float = _POST_PRE.eps_norm,
                             eps_pre: float = _POST_PRE.eps_pre, post_mult: float = _POST_PRE.post_mult,
                             eps_sinkhorn: float = _POST_PRE.eps_sinkhorn,
                             sinkhorn_iters: int = _POST_PRE.sinkhorn_iters, enable_pdl: bool = _POST_PRE.enable_pdl,
                             prefetch_weights: bool = _POST_PRE.prefetch_weights,
                             projection_kernel: str = _POST_PRE.kernel,
                             boundary_path: str = _POST_PRE.path) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """flashmix.mhc_post_pre for an FP8 sublayer (spec §4.8) as a custom op: fresh (x_next,
        f_pre e4m3 ``[B, C]``, its 1 x 128 scales ``[B, C/128]``, h_post, h_res); the (optionally
        normed) F_pre is not written in bf16."""
        o = mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, res_layout=res_layout, eps_norm=eps_norm,
                         eps_pre=eps_pre, post_mult=post_mult, eps_sinkhorn=eps_sinkhorn,
                         sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl, prefetch_weights=prefetch_weights,
                         kernel=projection_kernel, path=boundary_path, norm_weight=norm_weight,
                         norm_eps=norm_eps, fp8=True,
                         f_pre_scale_format=f_pre_scale_format, bf16_f_pre=False)
        return o.x_next, o.f_pre_fp8, o.f_pre_scales, o.h_post, o.h_res


# ---------------------------------------------------------------------------
# The stages of mhc_pre: project, activate, pre mix
# ---------------------------------------------------------------------------

def mhc_project(x, phi, alpha, bias, *, h=None, r=None, eps_norm=_PROJECT.eps_norm, enable_pdl=_PROJECT.enable_pdl,
                prefetch_weights=_PROJECT.prefetch_weights, workspace=None, kernel=_PROJECT.kernel, stream=None):
    """mhc_pre's stage 1: h float32 ``[B, N]`` (alpha, 1/r and bias applied, before the
    activations) and r float32 ``[B]``. Returns (h, r). ``workspace`` and ``kernel`` as in
    mhc_pre."""
    n = _streams_from_coefficients(phi.shape[0], "mhc_project", "phi")
    B = x.shape[0]
    h = empty(x, (B, phi.shape[0]), "float32") if h is None else h
    r = empty(x, (B,), "float32") if r is None else r
    _hidden(x, n, "mhc_project")
    _C.mhc_project(arg(x), arg(phi), arg(alpha), arg(bias), arg(h), arg(r), eps_norm=eps_norm,
                   enable_pdl=enable_pdl, prefetch_weights=prefetch_weights, kernel=kernel, workspace=arg(workspace),
                   stream=stream_of(stream, x))
    return h, r


def mhc_activate(h, *, h_pre=None, h_post=None, h_res=None, eps_pre=_ACTIVATE.eps_pre,
                 post_mult=_ACTIVATE.post_mult, eps_sinkhorn=_ACTIVATE.eps_sinkhorn,
                 sinkhorn_iters=_ACTIVATE.sinkhorn_iters, enable_pdl=_ACTIVATE.enable_pdl, stream=None):
    """mhc_pre's stage 2: the sigmoids and Sinkhorn, h ``[B, N]`` -> MhcActivateOutput(h_pre
    ``[B, n]``, h_post ``[B, n]``, h_res ``[B, n, n]``), all float32."""
    n = _streams_from_coefficients(h.shape[1], "mhc_activate", "h")
    B = h.shape[0]
    h_pre = empty(h, (B, n), "float32") if h_pre is None else h_pre
    h_post = empty(h, (B, n), "float32") if h_post is None else h_post
    h_res = empty(h, (B, n, n), "float32") if h_res is None else h_res
    _C.mhc_activate(arg(h), arg(h_pre), arg(h_post), arg(h_res), eps_pre=eps_pre, post_mult=post_mult,
                    eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                    stream=stream_of(stream, h))
    return MhcActivateOutput(h_pre, h_post, h_res)


def mhc_pre_mix(x, h_pre, *, f_pre=None, enable_pdl=_PRE_MIX.enable_pdl, stream=None):
    """mhc_pre's stage 3: ``F_pre[b, c] = sum_i H_pre[b, i] X[b, i, c]`` (bf16 ``[B, C]``)."""
    f_pre = _new_mix(x, h_pre.shape[1], "mhc_pre_mix") if f_pre is None else f_pre
    _C.mhc_pre_mix(arg(x), arg(h_pre), arg(f_pre), enable_pdl=enable_pdl, stream=stream_of(stream, x))
    return f_pre


# ---------------------------------------------------------------------------
# mhc_post_head: the last boundary
# ---------------------------------------------------------------------------

def mhc_post_head(x, f_out, h_post, h_res, phi, alpha, bias, *, out=None, x_next=None, keep_x_next=False,
                  res_layout=_POST_HEAD.res_layout, eps_norm=_POST_HEAD.eps_norm, eps_pre=_POST_HEAD.eps_pre,
                  enable_pdl=_POST_HEAD.enable_pdl, kernel=_POST_HEAD.kernel, workspace=None, x_scales=None,
                  x_next_scales=None, x_scale_format=_POST_HEAD.x_scale_format, stream=None):
    """spec §4.10 mhc_post_head: the last layer boundary in one op, the last layer's mhc_post
    (x, f_out, h_post, h_res; ``res_layout``) followed by mhc_head (phi ``[n, n*C]``, alpha
    ``[1]``, bias ``[n]``, ``eps_norm``, ``eps_pre``). X is read once; the head uses X_next as
    it is made. Returns out bf16 ``[B, C]``: X_next is not stored, since nothing reads the last
    residual after the head. With ``x_next`` given or ``keep_x_next``: X_next is also written
    once (allocated when None) and the result is MhcPostHeadOutput(out, x_next, x_next_scales).
    Bitwise equal to mhc_post then mhc_head pinned to the same kernel. ``kernel``: "auto",
    "split" (with ``workspace``, B <= 32, bf16 stream) or "cluster_tile"; "resident" and
    "portable" raise NotImplementedError; CPU arrays run the reference. With "auto" and X_next
    kept (or a ``workspace`` of ``mhc_post_head_workspace_bytes(B, n, C)`` bytes for its
    scratch), the op may run mhc_post then the head on the resident kernel (n = 4, C a
    multiple of 1024): about 1.8x faster at B = 8192 on an H100 (spec §4.10).

    The FP8 residual stream (spec §4.9), with ``x_scales``: x holds e4m3 codes as in mhc_post;
    a kept X_next comes back the same way (``x_next_scales`` allocated when None), its codes and
    scales bitwise mhc_post's."""
    n = phi.shape[0]
    out = _new_mix(x, n, "mhc_post_head") if out is None else out
    fp8x = x_scales is not None
    keep = keep_x_next or x_next is not None or x_next_scales is not None
    if keep and fp8x:
        x_next, x_next_scales = _fp8x_next(x, x_scales, x_scale_format, x_next, x_next_scales)
    elif keep and x_next is None:
        x_next = _new_x_next(x)
    xa, sa = _residual_args(x, x_scales)
    xna, sna = _residual_args(x_next, x_next_scales) if keep else (None, None)
    _C.mhc_post_head(xa, arg(f_out), arg(h_post), arg(h_res), arg(phi), arg(alpha), arg(bias), arg(out), xna,
                     res_layout=res_layout, eps_norm=eps_norm, eps_pre=eps_pre, enable_pdl=enable_pdl,
                     kernel=kernel, workspace=arg(workspace), x_scales=sa, x_next_scales=sna,
                     x_scale_format=x_scale_format, stream=stream_of(stream, x))
    if keep:
        return MhcPostHeadOutput(out, x_next, x_next_scales)
    return out


if torch is not None:
    def _post_head_fake(x, phi, **_):
        return _new_mix(x, phi.shape[0], "mhc_post_head")

    @custom_op("mhc_post_head", fake=_post_head_fake)
    def _mhc_post_head_op(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor, alpha: Tensor,
                          bias: Tensor, res_layout: str = _POST_HEAD.res_layout,
                          eps_norm: float = _POST_HEAD.eps_norm, eps_pre: float = _POST_HEAD.eps_pre,
                          enable_pdl: bool = _POST_HEAD.enable_pdl,
                          projection_kernel: str = _POST_HEAD.kernel) -> Tensor:
        """flashmix.mhc_post_head as a custom op: a fresh bf16 out ``[B, C]`` (X_next not stored);
        ``projection_kernel`` is its ``kernel`` (as in the mhc_pre op)."""
        return mhc_post_head(x, f_out, h_post, h_res, phi, alpha, bias, res_layout=res_layout, eps_norm=eps_norm,
                             eps_pre=eps_pre, enable_pdl=enable_pdl, kernel=projection_kernel)

    # A separate op, as mhc_pre_with_workspace (an Optional tensor in mutates_args breaks
    # torch.compile's functionalization when left None).
    @custom_op("mhc_post_head_with_workspace", fake=_post_head_fake, mutates_args=("workspace",))
    def _mhc_post_head_with_workspace_op(x: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor, phi: Tensor,
                                         alpha: Tensor, bias: Tensor, workspace: Tensor,
                                         res_layout: str = _POST_HEAD.res_layout,
                                         eps_norm: float = _POST_HEAD.eps_norm, eps_pre: float = _POST_HEAD.eps_pre,
                                         enable_pdl: bool = _POST_HEAD.enable_pdl,
                                         projection_kernel: str = _POST_HEAD.kernel) -> Tensor:
        """flashmix.mhc_post_head with the small-batch workspace as a custom op (the workspace is
        mutated: its epoch word counts the split kernel's launches)."""
        return mhc_post_head(x, f_out, h_post, h_res, phi, alpha, bias, res_layout=res_layout, eps_norm=eps_norm,
                             eps_pre=eps_pre, enable_pdl=enable_pdl, kernel=projection_kernel, workspace=workspace)

    @custom_op("mhc_post_head_fp8x", fake=_post_head_fake)
    def _mhc_post_head_fp8x_op(x: Tensor, x_scales: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor,
                               phi: Tensor, alpha: Tensor, bias: Tensor, res_layout: str = _POST_HEAD.res_layout,
                               x_scale_format: str = _POST_HEAD.x_scale_format,
                               eps_norm: float = _POST_HEAD.eps_norm, eps_pre: float = _POST_HEAD.eps_pre,
                               enable_pdl: bool = _POST_HEAD.enable_pdl,
                               projection_kernel: str = _POST_HEAD.kernel) -> Tensor:
        """flashmix.mhc_post_head on the FP8 stream as a custom op: a fresh bf16 out ``[B, C]``."""
        return mhc_post_head(x, f_out, h_post, h_res, phi, alpha, bias, x_scales=x_scales,
                             x_scale_format=x_scale_format, res_layout=res_layout, eps_norm=eps_norm,
                             eps_pre=eps_pre, enable_pdl=enable_pdl, kernel=projection_kernel)


# ---------------------------------------------------------------------------
# mhc_head, mhc_expand: the ends of an mHC model
# ---------------------------------------------------------------------------

def mhc_head(x, phi, alpha, bias, *, out=None, eps_norm=_HEAD.eps_norm, eps_pre=_HEAD.eps_pre,
             enable_pdl=_HEAD.enable_pdl, workspace=None, kernel=_HEAD.kernel, x_scales=None,
             x_scale_format=_HEAD.x_scale_format, stream=None):
    """mhc_head (before the final LM head): the pre mix only, with phi ``[n, n*C]``, alpha
    ``[1]`` (alpha_pre) and bias ``[n]``. Returns out bf16 ``[B, C]``. ``workspace``,
    ``kernel`` and the FP8 residual stream (``x_scales``, ``x_scale_format``) as in mhc_pre (the
    resident kernel does not take mhc_head)."""
    out = _new_mix(x, phi.shape[0], "mhc_head") if out is None else out
    xa, sa = _residual_args(x, x_scales)
    _C.mhc_head(xa, arg(phi), arg(alpha), arg(bias), arg(out), eps_norm=eps_norm, eps_pre=eps_pre,
                enable_pdl=enable_pdl, kernel=kernel, workspace=arg(workspace), x_scales=sa,
                x_scale_format=x_scale_format, stream=stream_of(stream, x))
    return out


if torch is not None:
    @custom_op("mhc_head", fake=lambda x, phi, **_: _new_mix(x, phi.shape[0], "mhc_head"))
    def _mhc_head_op(x: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor, eps_norm: float = _HEAD.eps_norm,
                     eps_pre: float = _HEAD.eps_pre, enable_pdl: bool = _HEAD.enable_pdl,
                     projection_kernel: str = _HEAD.kernel) -> Tensor:
        """flashmix.mhc_head as a custom op: a fresh bf16 ``[B, C]`` (phi ``[n, n*C]``);
        ``projection_kernel`` is mhc_head's ``kernel`` (as in the mhc_pre op)."""
        return mhc_head(x, phi, alpha, bias, eps_norm=eps_norm, eps_pre=eps_pre, enable_pdl=enable_pdl,
                        kernel=projection_kernel)


def _new_expanded(embedding, n):
    return empty(embedding, (embedding.shape[0], n, embedding.shape[1]), "bfloat16")


def mhc_expand(embedding, *, n=None, x=None, fp8=False, x_scales=None, x_scale_format=_EXPAND.x_scale_format,
               enable_pdl=_EXPAND.enable_pdl, stream=None):
    """mhc_expand: embedding bf16 ``[B, C]`` -> X ``[B, n, C]`` (n copies). Give ``n`` or ``x``.

    The FP8 residual stream (spec §4.9), with ``fp8=True`` (or ``x_scales`` given): each
    128-channel block of the embedding quantised by quantize_fp8's 1 x 128 rule, its e4m3 codes
    (``x``: float8_e4m3fn or uint8 ``[B, n, C]``, C a multiple of 128) and scale (``x_scales``
    ``[B, n, C/128]``, float32 or ue8m0 by ``x_scale_format``) written to every stream; both are
    allocated when None. Returns MhcExpandFp8Output(x, x_scales)."""
    if x is None and n is None:
        raise ValueError("mhc_expand: n: give n (or x)")
    if not fp8 and x_scales is None:
        if x is None:
            x = _new_expanded(embedding, n)
        _C.mhc_expand(arg(embedding), arg(x), x_scales=None, x_scale_format=x_scale_format, enable_pdl=enable_pdl,
                      stream=stream_of(stream, embedding))
        return x
    from .fp8 import _as_bytes, _e4m3_dtype, _scale_dtype
    if x is None:
        x = empty(embedding, (embedding.shape[0], n, embedding.shape[1]), _e4m3_dtype(embedding))
    if x_scales is None:
        x_scales = empty(embedding, (x.shape[0], x.shape[1], x.shape[2] // 128), _scale_dtype(embedding, x_scale_format))
    _C.mhc_expand(arg(embedding), arg(_as_bytes(x)), x_scales=arg(_as_bytes(x_scales)), x_scale_format=x_scale_format,
                  enable_pdl=enable_pdl, stream=stream_of(stream, embedding))
    return MhcExpandFp8Output(x, x_scales)


if torch is not None:
    @custom_op("mhc_expand", fake=lambda embedding, n, **_: _new_expanded(embedding, n))
    def _mhc_expand_op(embedding: Tensor, n: int, enable_pdl: bool = _EXPAND.enable_pdl) -> Tensor:
        """flashmix.mhc_expand as a custom op: a fresh X bf16 ``[B, n, C]`` holding n copies of the embedding."""
        return mhc_expand(embedding, n=n, enable_pdl=enable_pdl)


# ---------------------------------------------------------------------------
# The FP8 residual stream's custom ops (spec §4.9): X and X_next as e4m3 codes
# (float8_e4m3fn) with their [B, n, C/128] scales (float32, or ue8m0 as
# float8_e8m0fnu where torch has it), fresh outputs like the bf16 ops'.
# ---------------------------------------------------------------------------

if torch is not None:
    def _expand_fp8x_fake(embedding, n, x_scale_format, **_):
        from .fp8 import _e4m3_dtype, _scale_dtype
        B, C = embedding.shape
        return (empty(embedding, (B, n, C), _e4m3_dtype(embedding)),
                empty(embedding, (B, n, C // 128), _scale_dtype(embedding, x_scale_format)))

    @custom_op("mhc_expand_fp8x", fake=_expand_fp8x_fake)
    def _mhc_expand_fp8x_op(embedding: Tensor, n: int, x_scale_format: str = _EXPAND.x_scale_format,
                            enable_pdl: bool = _EXPAND.enable_pdl) -> Tuple[Tensor, Tensor]:
        """flashmix.mhc_expand onto the FP8 stream as a custom op: fresh (x e4m3 ``[B, n, C]``,
        x_scales ``[B, n, C/128]``)."""
        o = mhc_expand(embedding, n=n, fp8=True, x_scale_format=x_scale_format, enable_pdl=enable_pdl)
        return o.x, o.x_scales

    @custom_op("mhc_post_fp8x", fake=lambda x, x_scales, **_: (torch.empty_like(x), torch.empty_like(x_scales)))
    def _mhc_post_fp8x_op(x: Tensor, x_scales: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor,
                          res_layout: str = _POST.res_layout, x_scale_format: str = _POST.x_scale_format,
                          enable_pdl: bool = _POST.enable_pdl) -> Tuple[Tensor, Tensor]:
        """flashmix.mhc_post on the FP8 stream as a custom op: fresh (x_next, x_next_scales), x's and
        x_scales' shapes and dtypes."""
        o = mhc_post(x, f_out, h_post, h_res, x_scales=x_scales, x_scale_format=x_scale_format,
                     res_layout=res_layout, enable_pdl=enable_pdl)
        return o.x_next, o.x_next_scales

    @custom_op("mhc_pre_fp8x", fake=lambda x, phi, **_: _pre_outputs(x, phi, "mhc_pre"))
    def _mhc_pre_fp8x_op(x: Tensor, x_scales: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor,
                         x_scale_format: str = _PRE.x_scale_format, eps_norm: float = _PRE.eps_norm,
                         eps_pre: float = _PRE.eps_pre, post_mult: float = _PRE.post_mult,
                         eps_sinkhorn: float = _PRE.eps_sinkhorn, sinkhorn_iters: int = _PRE.sinkhorn_iters,
                         enable_pdl: bool = _PRE.enable_pdl, prefetch_weights: bool = _PRE.prefetch_weights,
                         projection_kernel: str = _PRE.kernel) -> Tuple[Tensor, Tensor, Tensor]:
        """flashmix.mhc_pre on the FP8 stream as a custom op: fresh (f_pre, h_post, h_res)."""
        return tuple(mhc_pre(x, phi, alpha, bias, x_scales=x_scales, x_scale_format=x_scale_format,
                             eps_norm=eps_norm, eps_pre=eps_pre, post_mult=post_mult, eps_sinkhorn=eps_sinkhorn,
                             sinkhorn_iters=sinkhorn_iters, enable_pdl=enable_pdl,
                             prefetch_weights=prefetch_weights, kernel=projection_kernel))

    def _post_pre_fp8x_fake(x, x_scales, phi, **_):
        _, f_pre, h_post_next, h_res_next = _post_pre_outputs(x, phi)
        return torch.empty_like(x), torch.empty_like(x_scales), f_pre, h_post_next, h_res_next

    @custom_op("mhc_post_pre_fp8x", fake=_post_pre_fp8x_fake)
    def _mhc_post_pre_fp8x_op(x: Tensor, x_scales: Tensor, f_out: Tensor, h_post: Tensor, h_res: Tensor,
                              phi: Tensor, alpha: Tensor, bias: Tensor, res_layout: str = _POST_PRE.res_layout,
                              x_scale_format: str = _POST_PRE.x_scale_format, eps_norm: float = _POST_PRE.eps_norm,
                              eps_pre: float = _POST_PRE.eps_pre, post_mult: float = _POST_PRE.post_mult,
                              eps_sinkhorn: float = _POST_PRE.eps_sinkhorn,
                              sinkhorn_iters: int = _POST_PRE.sinkhorn_iters, enable_pdl: bool = _POST_PRE.enable_pdl,
                              prefetch_weights: bool = _POST_PRE.prefetch_weights,
                              projection_kernel: str = _POST_PRE.kernel, boundary_path: str = _POST_PRE.path
                              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """flashmix.mhc_post_pre on the FP8 stream as a custom op: fresh (x_next, x_next_scales,
        f_pre, h_post, h_res)."""
        o = mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, x_scales=x_scales,
                         x_scale_format=x_scale_format, res_layout=res_layout, eps_norm=eps_norm, eps_pre=eps_pre,
                         post_mult=post_mult, eps_sinkhorn=eps_sinkhorn, sinkhorn_iters=sinkhorn_iters,
                         enable_pdl=enable_pdl, prefetch_weights=prefetch_weights, kernel=projection_kernel,
                         path=boundary_path)
        return o.x_next, o.x_next_scales, o.f_pre, o.h_post, o.h_res

    @custom_op("mhc_head_fp8x", fake=lambda x, phi, **_: _new_mix(x, phi.shape[0], "mhc_head"))
    def _mhc_head_fp8x_op(x: Tensor, x_scales: Tensor, phi: Tensor, alpha: Tensor, bias: Tensor,
                          x_scale_format: str = _HEAD.x_scale_format, eps_norm: float = _HEAD.eps_norm,
                          eps_pre: float = _HEAD.eps_pre, enable_pdl: bool = _HEAD.enable_pdl,
                          projection_kernel: str = _HEAD.kernel) -> Tensor:
        """flashmix.mhc_head on the FP8 stream as a custom op: a fresh bf16 ``[B, C]``."""
        return mhc_head(x, phi, alpha, bias, x_scales=x_scales, x_scale_format=x_scale_format, eps_norm=eps_norm,
                        eps_pre=eps_pre, enable_pdl=enable_pdl, kernel=projection_kernel)
