"""What the areas of the package (moe.py, mhc.py, fp8.py) share: loading torch and the
compiled module, arrays (torch tensors or numpy arrays), streams, devices,
workspaces, and the library's defaults."""
import types

# torch first, when it is there: the process then runs on torch's CUDA runtime
# (one libcudart.so.<major> per process, whichever loads first), which torch
# needs and which serves flashmix as long as it is not older than the toolkit
# flashmix was built with.
try:
    import torch
except ImportError:
    torch = None

try:
    from . import _C
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "flashmix._C is not built or not on the path: configure with -DFLASHMIX_PYTHON=ON, build the "
        "flashmix_python target and put <build>/python on PYTHONPATH (python/README.md)") from e


def defaults(table):
    """{op: {keyword: value}} from the binding (``_C.moe_defaults()``, ``_C.mhc_defaults()``: the
    library's Args initialisers) -> {op: namespace}, so a signature reads ``fill=_FINALIZE.fill``."""
    return {op: types.SimpleNamespace(**keywords) for op, keywords in table.items()}


# ---------------------------------------------------------------------------
# Arrays: torch tensors (when torch is importable) or numpy arrays.
# ---------------------------------------------------------------------------

def is_tensor(x):
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(x):
    """'float32', 'bfloat16', 'int32', ... for a torch tensor or a numpy array."""
    if is_tensor(x):
        return str(x.dtype).rpartition(".")[2]
    return x.dtype.name  # ml_dtypes.bfloat16 is 'bfloat16'


def framework_dtype(like, name):
    """The dtype called `name` in the framework of `like` (a dtype object is passed through)."""
    if not isinstance(name, str):
        return name
    if is_tensor(like):
        return getattr(torch, name)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:
            raise ImportError("flashmix: bfloat16 numpy arrays need the ml_dtypes package") from e
        return ml_dtypes.bfloat16
    import numpy
    return numpy.dtype(name)


def empty(like, shape, dtype, zero=False):
    """An uninitialised (or zeroed) array beside `like`: same framework and device. Under
    torch.compile's fake tensors it makes fake tensors, so the custom ops' shape functions use
    the same allocation as the functions."""
    dtype = framework_dtype(like, dtype)
    if is_tensor(like):
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=like.device)
    import numpy
    return (numpy.zeros if zero else numpy.empty)(shape, dtype=dtype)


def arg(x):
    """What the binding receives for an array argument (None passes through)."""
    if x is None:
        return None
    if is_tensor(x):
        # The legacy capsule: unlike Tensor.__dlpack__ it synchronises no streams (older torch
        # made the default stream wait, which breaks a graph capture), does not require the
        # tensor's device to be current (the binding makes it current) and takes tensors that
        # require grad (the ops are forward only); and it costs a tenth.
        return torch.utils.dlpack.to_dlpack(x)
    dtype = getattr(x, "dtype", None)
    if dtype is not None and getattr(dtype, "name", None) == "bfloat16" and hasattr(x, "view"):
        # numpy cannot export bfloat16 through DLPack: hand over a bfloat16 view of its bits.
        import numpy
        return _C.bfloat16_view(x.view(numpy.uint16))
    return x


def stream_of(stream, like):
    """The cudaStream_t (an int) a call runs on."""
    if stream is None:
        if is_tensor(like) and like.is_cuda:
            return torch.cuda.current_stream(like.device).cuda_stream
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"flashmix: stream must be None, an int (cudaStream_t) or a torch.cuda.Stream, got {stream!r}")


def cuda_device(like):
    """The CUDA device index of `like`, or None for CPU arrays."""
    if is_tensor(like):
        return like.device.index if like.is_cuda else None
    dev = getattr(like, "__dlpack_device__", None)
    if dev is not None:
        kind, index = dev()
        return index if kind == 2 else None
    return None


def new_workspace(like, nbytes):
    """A fresh uint8 buffer of `nbytes` on `like`'s device; None when no workspace is needed."""
    return empty(like, (nbytes,), "uint8") if nbytes else None
