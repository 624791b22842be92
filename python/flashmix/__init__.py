"""flashmix: fused GPU kernels for the end of a Mixture-of-Experts layer and
for DeepSeek's mHC hyper-connections (the math: docs/spec.md; this package:
python/README.md).

The package is split by area: ``flashmix.moe`` (routing maps, finalize, FC2,
the router, FC1, the whole routed-expert layer ``moe_forward`` and its torch
module ``MoeLayer``), ``flashmix.mhc`` (the mHC ops), ``flashmix.fp8``
(``quantize_fp8``) and ``flashmix.ep`` (expert parallelism on NCCL, when built); everything they export is here too.

Every function takes torch tensors (CUDA or CPU) or numpy arrays (CPU). The
arrays decide the backend: all on one CUDA device -> the fused kernels,
asynchronous on a CUDA stream; all on the CPU -> the reference backend
(double accumulation), synchronous. Outputs the caller does not pass are
allocated like the inputs (``torch.empty`` on the input's device, or
``numpy.empty``) and returned. Nothing is copied implicitly: an array with the
wrong dtype or layout raises ``ValueError`` naming the argument, as does any
argument the library rejects (its message: ``"<op>: <argument>: <rule>"``).
A request this build or GPU cannot serve raises ``NotImplementedError`` (a
``RuntimeError``); a CUDA error, ``RuntimeError``. Keyword defaults are the
C++ library's (include/flashmix/*.h).

Streams: ``stream=None`` means the current torch stream of the tensors'
device (``torch.cuda.current_stream(device).cuda_stream``), or the legacy
default stream 0 without torch. Pass a ``torch.cuda.Stream`` or a raw
``cudaStream_t`` as an int to choose another. Nothing synchronises the stream
and no device memory is read on the host, so every call can be captured in a
CUDA graph; workspaces are allocated with ``torch.empty(uint8)`` (inside a
capture, from the graph's pool).

bfloat16 on the CPU without torch: numpy arrays of ``ml_dtypes.bfloat16``.

torch.compile: when torch is importable, ``torch.ops.flashmix.build_moe_routing_maps``,
``finalize_moe_routing``, ``moe_fc2_finalize``, ``moe_router``, ``moe_fc1``,
``moe_forward``, ``quantize_fp8``, ``mhc_expand``, ``mhc_pre``,
``mhc_pre_with_workspace`` (mhc_pre with the small-batch workspace), ``mhc_post``,
``mhc_head``, the boundary ``mhc_post_pre`` (``mhc_post_pre_with_workspace``, and its
``_norm`` / ``_fp8`` F_pre epilogues), the last boundary ``mhc_post_head``
(``mhc_post_head_with_workspace``) and the FP8 residual stream's ``mhc_expand_fp8x``, ``mhc_pre_fp8x``,
``mhc_post_fp8x``, ``mhc_post_pre_fp8x``, ``mhc_head_fp8x``, ``mhc_post_head_fp8x`` are registered as custom ops with shape
functions; call those inside compiled code (the functions here call the
binding directly, which is cheaper in eager mode but a graph break under
torch.compile). ``MoeLayer`` (a ``torch.nn.Module``, only with torch) calls
``torch.ops.flashmix.moe_forward``.
"""
import pkgutil

# The compiled module may live in a build tree beside this source package
# (PYTHONPATH=<build>/python:<source>/python): look for flashmix/ there too.
# Before anything imports flashmix._C.
__path__ = pkgutil.extend_path(__path__, __name__)

from . import _common  # noqa: E402  (torch first, when it is there; then flashmix._C)
from . import ep, fp8, mhc, moe, mxfp4  # noqa: E402
from .ep import *  # noqa: E402,F401,F403
from .fp8 import *  # noqa: E402,F401,F403
from .mhc import *  # noqa: E402,F401,F403
from .moe import *  # noqa: E402,F401,F403
from .mxfp4 import *  # noqa: E402,F401,F403

__version__ = _common._C.__version__

#: Whether torch was importable, so that the torch.ops.flashmix custom ops are registered.
torch_ops_registered = _common.torch is not None

__all__ = moe.__all__ + mhc.__all__ + fp8.__all__ + ep.__all__ + mxfp4.__all__ + ["torch_ops_registered"]
