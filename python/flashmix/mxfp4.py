"""MXFP4 expert weights (spec §13 of docs/spec.md): DeepSeek-V4's checkpoint
layout -> flashmix's stacked layout.

DeepSeek-V4 stores each routed expert ``e`` of layer ``L`` as three
projections, each a packed-e2m1 weight and a ue8m0 scale (docs/mxfp4.md)::

    layers.{L}.ffn.experts.{e}.w1.weight   [I, H/2]   float4_e2m1fn_x2 (gate)
    layers.{L}.ffn.experts.{e}.w1.scale    [I, H/32]  float8_e8m0fnu
    layers.{L}.ffn.experts.{e}.w3.weight / .scale     (up: the same shapes)
    layers.{L}.ffn.experts.{e}.w2.weight   [H, I/2]   (down)
    layers.{L}.ffn.experts.{e}.w2.scale    [H, I/32]

flashmix takes them stacked (spec §13.1): W1 ``[E, 2I, H/2]`` bytes with
``[E, 2I, H/32]`` scales, gate and up rows in a ``Fc1WeightLayout`` order
("gate_up": gate rows then up rows, V4's own; "interleaved": gate i at 2i,
up i at 2i + 1), and W2 ``[E, H, I/2]`` with ``[E, H, I/32]``. Bytes are
copied unchanged: the low nibble of a byte is the even element, a scale
byte b means 2^(b - 127). The conversions themselves (``mxfp4_to_fp8_block``,
``mxfp4_to_bf16``) are C++ (include/flashmix/mxfp4.h).

The loader is plain Python over numpy arrays or torch tensors (CPU or
CUDA; the stacks are made on the inputs' device), with no binding: it
imports without ``flashmix._C``. The C++ twin is
``flashmix::stack_deepseek_v4_experts``. The conversions
(``mxfp4_to_fp8_block``, ``mxfp4_to_bf16``) are in ``flashmix.fp8``. The
stacks run as they are in ``moe_fc1`` / ``moe_fc2_finalize`` /
``moe_forward(weights="mxfp4", w1_mx_scales=, w2_mx_scales=)`` and
``MoeLayer(weights="mxfp4").load_mxfp4_experts`` (spec §13.7).
"""

__all__ = ["deepseek_v4_expert_keys", "stack_deepseek_v4_experts", "load_deepseek_v4_experts"]

_PARTS = ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")
_LAYOUTS = ("gate_up", "interleaved")


def deepseek_v4_expert_keys(layer, expert, prefix="layers"):
    """The checkpoint names of one expert's six tensors, keyed like ``stack_deepseek_v4_experts`` takes them."""
    base = f"{prefix}.{layer}.ffn.experts.{expert}"
    return {
        "w1": f"{base}.w1.weight", "w1_scale": f"{base}.w1.scale",
        "w3": f"{base}.w3.weight", "w3_scale": f"{base}.w3.scale",
        "w2": f"{base}.w2.weight", "w2_scale": f"{base}.w2.scale",
    }


def _is_torch(a):
    return type(a).__module__.startswith("torch")


def _as_bytes(a, name, op="stack_deepseek_v4_experts"):
    """The same memory as uint8: torch float4_e2m1fn_x2 / float8_e8m0fnu / int8 / uint8 tensors, numpy
    uint8 / int8 arrays or ml_dtypes' one-byte floats. Anything else: ValueError naming the tensor."""
    if _is_torch(a):
        import torch

        one_byte = {torch.uint8, torch.int8}
        for name_ in ("float4_e2m1fn_x2", "float8_e8m0fnu"):
            if hasattr(torch, name_):
                one_byte.add(getattr(torch, name_))
        if a.dtype not in one_byte:
            raise ValueError(f"{op}: {name}: dtype must be float4_e2m1fn_x2, "
                             f"float8_e8m0fnu, int8 or uint8 (got {a.dtype})")
        return a.view(torch.uint8) if a.dtype != torch.uint8 else a
    dtype = getattr(a, "dtype", None)
    if dtype is None or getattr(dtype, "itemsize", 0) != 1 or getattr(dtype, "kind", "") not in "uiV":
        raise ValueError(f"{op}: {name}: must be a one-byte array (got {dtype})")
    return a.view("uint8")


def _check_shape(a, want, name):
    got = tuple(int(d) for d in a.shape)
    if got != want:
        raise ValueError(f"stack_deepseek_v4_experts: {name}: shape {got} disagrees with {want} "
                         f"(from experts[0].w1: I = rows, H = 2 * packed columns)")


def stack_deepseek_v4_experts(experts, layout="gate_up"):
    """Stacks the local experts' tensors into flashmix's layout.

    ``experts``: a sequence (one per local expert, in order) of mappings with
    the keys "w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale" (V4's
    tensors; see ``deepseek_v4_expert_keys``). ``layout``: "gate_up" or
    "interleaved". Returns ``(w1, w1_scales, w2, w2_scales)`` as uint8,
    ``[E, 2I, H/2]``, ``[E, 2I, H/32]``, ``[E, H, I/2]``, ``[E, H, I/32]``.
    Every shape is checked against H and I read from the first expert's w1;
    H and I must be multiples of 32. ValueError names the tensor that disagrees.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"stack_deepseek_v4_experts: layout: must be one of {_LAYOUTS} (got {layout!r})")
    experts = list(experts)
    if not 1 <= len(experts) <= 1024:
        raise ValueError(f"stack_deepseek_v4_experts: experts: 1..1024 experts (got {len(experts)})")
    views = []
    for e, x in enumerate(experts):
        missing = [p for p in _PARTS if p not in x]
        if missing:
            raise ValueError(f"stack_deepseek_v4_experts: experts[{e}]: missing {missing}")
        views.append({p: _as_bytes(x[p], f"experts[{e}].{p}") for p in _PARTS})
    first = views[0]["w1"]
    if len(first.shape) != 2:
        raise ValueError(f"stack_deepseek_v4_experts: experts[0].w1: must be 2-D [I, H/2] (got {tuple(first.shape)})")
    I, H = int(first.shape[0]), 2 * int(first.shape[1])
    if I % 32 or H % 32 or I == 0 or H == 0:
        raise ValueError(f"stack_deepseek_v4_experts: experts[0].w1: H = {H} and I = {I} must be positive "
                         f"multiples of 32")
    want = {"w1": (I, H // 2), "w1_scale": (I, H // 32), "w3": (I, H // 2), "w3_scale": (I, H // 32),
            "w2": (H, I // 2), "w2_scale": (H, I // 32)}
    for e, v in enumerate(views):
        for p in _PARTS:
            _check_shape(v[p], want[p], f"experts[{e}].{p}")

    if _is_torch(first):
        import torch

        stack, cat = torch.stack, torch.cat
    else:
        import numpy

        stack, cat = numpy.stack, numpy.concatenate

    def gate_and_up(gate, up):
        if layout == "gate_up":
            return cat([gate, up], 0)
        return stack([gate, up], 1).reshape(2 * gate.shape[0], gate.shape[1])  # row 2i gate i, 2i + 1 up i

    w1 = stack([gate_and_up(v["w1"], v["w3"]) for v in views], 0)
    w1_scales = stack([gate_and_up(v["w1_scale"], v["w3_scale"]) for v in views], 0)
    w2 = stack([v["w2"] for v in views], 0)
    w2_scales = stack([v["w2_scale"] for v in views], 0)
    return w1, w1_scales, w2, w2_scales


def load_deepseek_v4_experts(get_tensor, layer, experts, layout="gate_up", prefix="layers"):
    """``stack_deepseek_v4_experts`` over a checkpoint: ``get_tensor(name)`` returns a tensor by its
    checkpoint name (a dict's ``__getitem__``, or safetensors' ``safe_open(...).get_tensor``);
    ``experts`` are the (global) expert ids this rank holds, in order."""
    picked = []
    for e in experts:
        keys = deepseek_v4_expert_keys(layer, e, prefix)
        picked.append({p: get_tensor(k) for p, k in keys.items()})
    return stack_deepseek_v4_experts(picked, layout)

