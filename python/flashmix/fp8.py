"""FP8: quantize_fp8 (spec §12 of docs/spec.md; the formats: spec §11) and the MXFP4
conversions mxfp4_to_fp8_block / mxfp4_to_bf16 (spec §13) -- the
function with its torch custom op and shape function beside it.

e4m3 arrays are ``torch.float8_e4m3fn`` tensors, or uint8 arrays of its bytes
(numpy has no FP8 type; ``ml_dtypes.float8_e4m3fn`` arrays are taken too).
ue8m0 scales are ``torch.float8_e8m0fnu`` tensors where torch has that type,
else uint8 (the byte b means 2^(b - 127); 255 is NaN).

Keyword defaults are the library's (the Args initialisers of
include/flashmix/fp8.h, read through ``_C.fp8_defaults()``); the binding
(python/src/fp8.cpp) takes every argument explicitly.
"""
from ._common import _C, arg, defaults, empty, is_tensor, stream_of, torch

__all__ = ["quantize_fp8", "mxfp4_to_fp8_block", "mxfp4_to_bf16", "FP8_SCALE_FORMATS", "FP8_BLOCKS"]

if torch is not None:
    from ._torch_ops import Tensor, Tuple, custom_op

_QUANTIZE = defaults(_C.fp8_defaults())["quantize_fp8"]
_MXFP4 = defaults(_C.fp8_defaults())["mxfp4_to_fp8_block"]

#: The ``scale_format`` values: "float32" (the scale itself) and "ue8m0" (a power of two, one byte).
FP8_SCALE_FORMATS = _C.FP8_SCALE_FORMATS
#: The blocks a scale covers, by name ("1x128", "128x128"); ``block`` also takes them as (rows, cols).
FP8_BLOCKS = _C.FP8_BLOCKS


def _block_name(block):
    """"1x128" / "128x128" for (1, 128) / (128, 128) or those names; ValueError otherwise."""
    if isinstance(block, str):
        name = block
    else:
        try:
            name = "x".join(str(int(v)) for v in block) if len(block) == 2 else None
        except (TypeError, ValueError):
            name = None
    if name not in FP8_BLOCKS:
        raise ValueError(f"quantize_fp8: block: must be (1, 128) or (128, 128) (got {block!r})")
    return name


def _block_rows(block_name):
    return 128 if block_name == "128x128" else 1


def _scale_shape(shape, block_name):
    """[(batch,) ceil(rows / block rows), cols // 128] for x of `shape`."""
    rows, cols = shape[-2], shape[-1]
    br = _block_rows(block_name)
    return tuple(shape[:-2]) + ((rows + br - 1) // br, cols // 128)


def _e4m3_dtype(x):
    return torch.float8_e4m3fn if is_tensor(x) else "uint8"


def _scale_dtype(x, scale_format):
    if scale_format != "ue8m0":
        return "float32"
    if is_tensor(x) and hasattr(torch, "float8_e8m0fnu"):
        return torch.float8_e8m0fnu
    return "uint8"


def _as_bytes(a):
    """A one-byte FP8 array (torch float8 types, ml_dtypes' float8 types) as uint8, the same memory;
    anything else unchanged (the binding checks its dtype)."""
    if a is None:
        return None
    if is_tensor(a):
        one_byte_float = a.element_size() == 1 and a.dtype not in (torch.uint8, torch.int8, torch.bool)
        return a.view(torch.uint8) if one_byte_float else a
    dtype = getattr(a, "dtype", None)
    if dtype is not None and getattr(dtype, "itemsize", 0) == 1 and getattr(dtype, "kind", "") == "V":
        return a.view("uint8")  # ml_dtypes.float8_* (numpy kind 'V')
    return a


def _mx_bytes(a, weights, op, name, scales=False):
    """``_as_bytes`` for an expert weight (``scales``: its ue8m0 scales) under ``weights``. With
    ``weights="mxfp4"`` a one-byte float type other than the MXFP4 ones (``float4_e2m1fn_x2`` packed,
    ``float8_e8m0fnu`` scales; e.g. an e4m3 weight, or ml_dtypes' unpacked ``float4_e2m1fn``) is a
    ValueError naming the argument: its bytes are not packed e2m1 codes (ue8m0 scales)."""
    if a is not None and weights == "mxfp4":
        want = "float8_e8m0fnu" if scales else "float4_e2m1fn_x2"
        if is_tensor(a):
            other = a.element_size() == 1 and a.dtype not in (torch.uint8, torch.int8, torch.bool)
            got = str(a.dtype).rpartition(".")[2]
        else:
            dtype = getattr(a, "dtype", None)
            other = dtype is not None and getattr(dtype, "itemsize", 0) == 1 and getattr(dtype, "kind", "") == "V"
            got = getattr(dtype, "name", str(dtype))
        if other and got != want:
            what = "ue8m0 scale bytes" if scales else "packed e2m1 bytes (two codes a byte)"
            raise ValueError(f"{op}: {name}: must be {what} with weights = \"mxfp4\": {want} or uint8 (got {got})")
    return _as_bytes(a)


def _new_outputs(x, block_name, scale_format):
    return (empty(x, tuple(x.shape), _e4m3_dtype(x)),
            empty(x, _scale_shape(tuple(x.shape), block_name), _scale_dtype(x, scale_format)))


def quantize_fp8(x, *, block=_QUANTIZE.block, scale_format=_QUANTIZE.scale_format, out=None, scales=None,
                 enable_pdl=_QUANTIZE.enable_pdl, stream=None):
    """spec §12: bf16 -> e4m3 with one scale per block (spec §11.3):
    ``amax = max |x|``, ``s = amax / 448`` (``"float32"``) or the smallest power of two >= it
    (``"ue8m0"``), ``s = 1`` for a zero block, ``q = e4m3(x / s)`` (fp32 division, round to nearest
    even, saturating at +-448).

    Args:
      x: bfloat16 ``[rows, cols]`` or ``[batch, rows, cols]`` (e.g. weights ``[E, N, K]``); cols a
        multiple of 128; rows (and matrices) may be strided, columns contiguous.
      block: ``(1, 128)`` or ``"1x128"`` (activations: a scale per row per 128 columns), or
        ``(128, 128)`` or ``"128x128"`` (weights: per 128 x 128 tile of each matrix; the last row
        block may be partial).
      scale_format: ``"float32"`` or ``"ue8m0"``.
      out: e4m3 output of x's shape (``torch.float8_e4m3fn``, or uint8), rows may be strided;
        allocated when None.
      scales: dense ``[(batch,) ceil(rows / block rows), cols / 128]`` of float32 (``"float32"``) or
        of ``torch.float8_e8m0fnu`` / uint8 (``"ue8m0"``); allocated when None.
      enable_pdl: programmatic dependent launch (GPU).
      stream: see the package docstring.

    Returns ``(out, scales)``. A block holding a NaN gets a NaN scale and NaN (0x7f) elements.
    """
    name = _block_name(block)
    if out is None or scales is None:
        fresh_q, fresh_s = _new_outputs(x, name, scale_format)
        out = fresh_q if out is None else out
        scales = fresh_s if scales is None else scales
    _C.quantize_fp8(arg(x), arg(_as_bytes(out)), arg(_as_bytes(scales)), block=name, scale_format=scale_format,
                    enable_pdl=enable_pdl, stream=stream_of(stream, x))
    return out, scales


if torch is not None:
    def _quantize_fp8_fake(x, block, scale_format, **_):
        return _new_outputs(x, _block_name(block), scale_format)

    @custom_op("quantize_fp8", fake=_quantize_fp8_fake)
    def _quantize_fp8_op(x: Tensor, block: str = _QUANTIZE.block, scale_format: str = _QUANTIZE.scale_format,
                         enable_pdl: bool = _QUANTIZE.enable_pdl) -> Tuple[Tensor, Tensor]:
        """flashmix.quantize_fp8 as a custom op: fresh ``(q float8_e4m3fn, scales)`` (scales float32, or
        float8_e8m0fnu / uint8 for ``"ue8m0"``); ``block`` is ``"1x128"`` or ``"128x128"``."""
        return quantize_fp8(x, block=block, scale_format=scale_format, enable_pdl=enable_pdl)


# --- MXFP4 weights (spec §13): the conversions onto FP8 (and bf16) ---------------------------------

def _one_byte(a, name, op):
    """The loader's one-byte view (torch float4_e2m1fn_x2 / float8_e8m0fnu / uint8, numpy uint8)."""
    from .mxfp4 import _as_bytes as one_byte
    return one_byte(a, name, op)
def _mxfp4_inputs(w, w_scales, op):
    """(w, w_scales) as uint8 arrays, and (leading dims, rows, cols) of the unpacked matrices."""
    wb, sb = _one_byte(w, "w", op), _one_byte(w_scales, "w_scales", op)
    if len(wb.shape) not in (2, 3):
        raise ValueError(f"{op}: w: must be [rows, cols / 2] or [batch, rows, cols / 2] (got {tuple(wb.shape)})")
    return wb, sb, tuple(int(d) for d in wb.shape[:-2]), int(wb.shape[-2]), 2 * int(wb.shape[-1])


def mxfp4_to_fp8_block(w, w_scales, *, block=_MXFP4.block, out=None, scales=None, enable_pdl=_MXFP4.enable_pdl,
                       stream=None):
    """spec §13.3: MXFP4 weights (packed e2m1 ``[(E,) N, K/2]`` with ue8m0 scales ``[(E,) N, K/32]``; torch
    ``float4_e2m1fn_x2`` / ``float8_e8m0fnu`` or uint8) into e4m3 ``[(E,) N, K]`` (``torch.float8_e4m3fn``,
    or uint8 for numpy) and float32 scales ``[(E,) ceil(N / rows), K / 128]`` for ``block`` "128x128" (the
    FP8 layer's weights: ``MoeLayer(fp8="block")``, ``moe_forward(fp8="block")``) or "1x128". The scales of
    a 128-wide block fold into the e4m3 values, exactly where spec §13.2 says. Returns ``(out, scales)``."""
    op = "mxfp4_to_fp8_block"
    wb, sb, lead, rows, cols = _mxfp4_inputs(w, w_scales, op)
    block_rows = 128 if block == "128x128" else 1
    if out is None:
        out = empty(wb, lead + (rows, cols), _e4m3_dtype(wb))
    if scales is None:
        scales = empty(wb, lead + ((rows + block_rows - 1) // block_rows, cols // 128), "float32")
    _C.mxfp4_to_fp8_block(arg(wb), arg(sb), arg(_as_bytes(out)), arg(scales), block=block, enable_pdl=enable_pdl,
                          stream=stream_of(stream, wb))
    return out, scales


def mxfp4_to_bf16(w, w_scales, *, out=None, enable_pdl=_MXFP4.enable_pdl, stream=None):
    """spec §13.4: MXFP4 weights (as ``mxfp4_to_fp8_block`` takes them) into bf16 ``[(E,) N, K]`` (W4A16,
    and references). Returns ``out``."""
    op = "mxfp4_to_bf16"
    wb, sb, lead, rows, cols = _mxfp4_inputs(w, w_scales, op)
    if out is None:
        out = empty(wb, lead + (rows, cols), "bfloat16")
    _C.mxfp4_to_bf16(arg(wb), arg(sb), arg(out), enable_pdl=enable_pdl, stream=stream_of(stream, wb))
    return out
