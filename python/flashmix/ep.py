"""Expert parallelism across GPUs on NCCL (spec §14 of docs/spec.md): the
routed-expert layer over the ranks of an NCCL communicator, one GPU each.

Rank r of W holds experts ``[r*E/W, (r+1)*E/W)`` (``w1``/``w2`` are its
``E/W`` experts, as ``moe_forward`` takes them). Two ways:

- ``ep_moe_forward``: every rank owns its own tokens. Each token's row goes
  once to each rank that holds one of its experts, that rank's experts run on
  what it received, and the owner sums the rows that come back, in rank order.
  ``sizing="capacity"`` (default) moves fixed-size messages and never
  synchronises (CUDA-graph safe); ``"exact"`` exchanges the counts first and
  synchronises the stream twice. ``transport="direct"`` (GPUs that reach
  each other, NVLink within a node) moves the rows with flashmix's own
  kernels instead of NCCL (spec §14.7): the ranks map each other's workspace
  on the first call of a shape (collective, synchronises; not inside a graph
  capture), later calls need no NCCL call and no sync; the mapped workspaces
  (one per communicator, device, stream, shape and workspace, laid out
  without the NCCL transport's slabs: ``EpShape::direct_only``) stay until
  the collective ``ep_direct_release(comm)``.
- ``ep_moe_forward_replicated``: every rank holds the same tokens; each
  computes its experts' partial and NCCL sums them ("all_reduce", or
  "reduce_scatter": rank r keeps rows ``[r*T/W, (r+1)*T/W)``).

The communicator: ``nccl_communicator(group)`` builds one from a
``torch.distributed`` process group (rank 0's unique id is broadcast through
the group), or ``NcclComm.wrap(handle)`` takes the caller's ``ncclComm_t``.
Available when the build has flashmix_ep (``ep_available()``).
"""
from ._common import _C, arg, cuda_device, defaults, empty, new_workspace, stream_of, torch
from .fp8 import _as_bytes, _mx_bytes

__all__ = ["ep_available", "nccl_communicator", "NcclComm", "ep_moe_forward", "ep_moe_forward_replicated",
           "ep_direct_release", "EP_SIZINGS", "EP_REDUCES", "EP_TRANSPORTS"]

#: ``transport`` values of ep_moe_forward: NCCL's, or flashmix's direct one over NVLink (spec §14.7).
EP_TRANSPORTS = ("nccl", "direct")

# The direct transport's mapped workspaces: key -> (comm, workspace, EpPeers).
_DIRECT = {}

_FORWARD = defaults(_C.moe_defaults())["moe_forward"]


def ep_available():
    """Whether this build has expert parallelism (flashmix_ep, built with NCCL)."""
    return _C.ep_available()


if ep_available():
    NcclComm = _C.NcclComm
    #: ``sizing`` values of ep_moe_forward: "capacity" (graph-safe) and "exact" (synchronises).
    EP_SIZINGS = _C.EP_SIZINGS
    #: ``reduce`` values of ep_moe_forward_replicated.
    EP_REDUCES = _C.EP_REDUCES
else:  # pragma: no cover - depends on the build
    NcclComm = None
    EP_SIZINGS = ()
    EP_REDUCES = ()


def _require():
    if not ep_available():
        raise NotImplementedError("flashmix: this build has no expert parallelism (flashmix_ep needs NCCL at build "
                                  "time: scripts/setup_nccl.sh)")


def nccl_communicator(group=None, device=None):
    """An ``NcclComm`` over the ranks of a ``torch.distributed`` process group (default: the world):
    rank 0 of the group makes the NCCL unique id and broadcasts it through the group; every rank joins
    on ``device`` (default: the current CUDA device). Collective: every rank of the group calls it."""
    _require()
    import torch.distributed as dist
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box = [_C.nccl_unique_id() if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    if device is None:
        device = torch.cuda.current_device()
    return _C.NcclComm(box[0], world, rank, int(device))


def _experts(op, weights, w1, w2, w1_mx_scales, w2_mx_scales):
    """The expert weights as the binding takes them (one-byte float types viewed as uint8, MXFP4 dtypes
    checked); each use still goes through arg() (a DLPack capsule is consumed once)."""
    return (_mx_bytes(w1, weights, op, "W1"), _mx_bytes(w2, weights, op, "W2"),
            _mx_bytes(w1_mx_scales, weights, op, "w1_mx_scales", True),
            _mx_bytes(w2_mx_scales, weights, op, "w2_mx_scales", True))


def ep_direct_release(comm=None, stream=None):
    """Unmaps the direct transport's workspaces of ``comm`` (all of them when None), collectively: every
    rank calls it, in the same order as the others, once its calls that used them were issued; it waits
    for this GPU and for every rank, then frees. Not while a captured graph that used them may still
    run. The next ``transport="direct"`` call maps again."""
    for key in [k for k, v in _DIRECT.items() if comm is None or v[0] is comm]:
        c, workspace, peers = _DIRECT.pop(key)
        peers.release(c, stream_of(stream, workspace))


def _direct(comm, workspace, nbytes, x, hidden, k, num_experts, max_tokens_per_rank, recv_capacity, fp8_rows,
            stream):
    """The workspace and EpPeers of a direct-transport call: one per (communicator, device, stream, shape,
    workspace), made on its first use (collective: every rank makes the same calls in the same order) and
    kept until ep_direct_release."""
    s = stream_of(stream, x)
    ws_key = (workspace.data_ptr(), workspace.numel()) if workspace is not None else ("auto", nbytes)
    key = (id(comm), str(x.device), s, (hidden, k, num_experts, max_tokens_per_rank, recv_capacity, bool(fp8_rows)),
           ws_key)
    hit = _DIRECT.get(key)
    if hit is not None and hit[0] is comm:
        return hit[1], hit[2]
    if workspace is None:
        workspace = new_workspace(x, nbytes)
    peers = _C.EpPeers(comm, arg(workspace), hidden=hidden, k=k, num_experts=num_experts,
                       max_tokens_per_rank=max_tokens_per_rank, recv_capacity=recv_capacity, fp8_rows=fp8_rows,
                       direct_only=True, stream=s)
    _DIRECT[key] = (comm, workspace, peers)
    return workspace, peers


def ep_moe_forward(comm, x, w1, w2, topk_ids, topk_weights, *, num_experts, max_tokens_per_rank,
                   recv_capacity=0, sizing="capacity", fp8_rows=False, transport="nccl", b1=None, b2=None,
                   w1_layout=_FORWARD.w1_layout,
                   activation=_FORWARD.activation, limit=_FORWARD.limit, alpha=_FORWARD.alpha, mode=_FORWARD.mode,
                   fp8=_FORWARD.fp8, w1_scales=None, w2_scales=None, weights=_FORWARD.weights, w1_mx_scales=None,
                   w2_mx_scales=None, shared_output=None, out=None, dropped=None, workspace=None, stream=None):
    """spec §14.3: this rank's tokens ``x`` (bf16 ``[T, H]``, T <= max_tokens_per_rank on every rank) with
    their ids / weights (int32 / float32 ``[T, k]``, global ids) through dispatch, this rank's experts
    (``w1``, ``w2`` and the FC1/FC2 settings as moe_forward's) and combine into ``out`` (bf16 ``[T, H]``).
    ``recv_capacity``: rows kept per source rank (0 = max_tokens_per_rank, never overflows); with less,
    tokens past it get NaN rows and ``dropped`` (int32 ``[1]``) counts them. ``fp8_rows``: the rows are
    quantised 1 x 128 before they are sent (half the bytes; needs ``fp8="block"`` experts). ``weights``,
    ``w1_mx_scales``, ``w2_mx_scales``: MXFP4 experts as moe_forward's (spec §13.7). ``transport``:
    "nccl", or "direct" (spec §14.7; the module docstring). Returns ``out``."""
    _require()
    if transport not in EP_TRANSPORTS:
        raise ValueError(f"ep_moe_forward: transport: must be one of {EP_TRANSPORTS} (got {transport!r})")
    W1, W2, S1, S2 = _experts("ep_moe_forward", weights, w1, w2, w1_mx_scales, w2_mx_scales)
    if out is None:
        out = empty(x, (x.shape[0], x.shape[1]), "bfloat16")
    peers = None
    if transport == "direct":
        nbytes = 0 if workspace is not None else _C.ep_moe_forward_workspace_size(
            comm, arg(W1), arg(W2), k=topk_ids.shape[1], num_experts=num_experts,
            max_tokens_per_rank=max_tokens_per_rank, recv_capacity=recv_capacity, sizing=sizing, fp8_rows=fp8_rows,
            direct_only=True, mode=mode, fp8=fp8, w1_scales=arg(w1_scales), w2_scales=arg(w2_scales), weights=weights,
            w1_mx_scales=arg(S1), w2_mx_scales=arg(S2))
        workspace, peers = _direct(comm, workspace, nbytes, x, x.shape[1], topk_ids.shape[1], num_experts,
                                   max_tokens_per_rank, recv_capacity, fp8_rows, stream)
    if workspace is None:
        workspace = new_workspace(out, _C.ep_moe_forward_workspace_size(
            comm, arg(W1), arg(W2), k=topk_ids.shape[1], num_experts=num_experts,
            max_tokens_per_rank=max_tokens_per_rank, recv_capacity=recv_capacity, sizing=sizing, fp8_rows=fp8_rows,
            direct_only=False, mode=mode, fp8=fp8, w1_scales=arg(w1_scales), w2_scales=arg(w2_scales), weights=weights,
            w1_mx_scales=arg(S1), w2_mx_scales=arg(S2)))
    _C.ep_moe_forward(comm, arg(x), arg(W1), arg(W2), arg(topk_ids), arg(topk_weights), arg(out),
                      num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank, recv_capacity=recv_capacity,
                      sizing=sizing, fp8_rows=fp8_rows, direct_only=peers is not None, b1=arg(b1), b2=arg(b2),
                      w1_layout=w1_layout, activation=activation, limit=limit, alpha=alpha, mode=mode, fp8=fp8,
                      w1_scales=arg(w1_scales), w2_scales=arg(w2_scales),
                      weights=weights, w1_mx_scales=arg(S1), w2_mx_scales=arg(S2),
                      shared_output=arg(shared_output), dropped=arg(dropped), workspace=arg(workspace),
                      peers=peers, stream=stream_of(stream, x))
    return out


def ep_moe_forward_replicated(comm, x, w1, w2, topk_ids, topk_weights, *, num_experts, reduce="all_reduce", b1=None,
                              b2=None, w1_layout=_FORWARD.w1_layout, activation=_FORWARD.activation,
                              limit=_FORWARD.limit, alpha=_FORWARD.alpha, mode=_FORWARD.mode, fp8=_FORWARD.fp8,
                              w1_scales=None, w2_scales=None, weights=_FORWARD.weights, w1_mx_scales=None,
                              w2_mx_scales=None, shared_output=None, out=None, workspace=None, stream=None):
    """spec §14.2: the same ``x`` [T, H] and routing on every rank; this rank's experts' partial, summed
    across the ranks by NCCL into ``out``: ``[T, H]`` ("all_reduce") or rank r's rows
    ``[r*T/W, (r+1)*T/W)`` ("reduce_scatter", T % W == 0). shared_output is added once. MXFP4 experts
    (``weights="mxfp4"``, ``w1_mx_scales``, ``w2_mx_scales``) as moe_forward's. Returns ``out``."""
    _require()
    W1, W2, S1, S2 = _experts("ep_moe_forward_replicated", weights, w1, w2, w1_mx_scales, w2_mx_scales)
    if out is None:
        rows = x.shape[0] if reduce == "all_reduce" else x.shape[0] // comm.world
        out = empty(x, (rows, x.shape[1]), "bfloat16")
    if workspace is None:
        workspace = new_workspace(out, _C.ep_moe_forward_replicated_workspace_size(
            comm, arg(W1), arg(W2), num_tokens=x.shape[0], k=topk_ids.shape[1], num_experts=num_experts,
            reduce=reduce,
            mode=mode, fp8=fp8, w1_scales=arg(w1_scales), w2_scales=arg(w2_scales), weights=weights,
            w1_mx_scales=arg(S1), w2_mx_scales=arg(S2)))
    _C.ep_moe_forward_replicated(
        comm, arg(x), arg(W1), arg(W2), arg(topk_ids), arg(topk_weights), arg(out),
        num_experts=num_experts, reduce=reduce, b1=arg(b1), b2=arg(b2), w1_layout=w1_layout, activation=activation,
        limit=limit, alpha=alpha, mode=mode, fp8=fp8, w1_scales=arg(w1_scales), w2_scales=arg(w2_scales),
        weights=weights, w1_mx_scales=arg(S1), w2_mx_scales=arg(S2),
        shared_output=arg(shared_output), workspace=arg(workspace), stream=stream_of(stream, x))
    return out
