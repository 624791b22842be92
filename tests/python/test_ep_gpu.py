"""flashmix.ep on two GPUs, one process each (torch.multiprocessing), the
communicator built from a torch.distributed process group (gloo, for the
unique id's broadcast): ep_moe_forward and ep_moe_forward_replicated against
the single-GPU flashmix.moe_forward over all experts on the same tokens
(bf16 experts, and MXFP4 experts as W4A8 and W4A16),
within spec §14.1's bound (each rank's partial is rounded to bf16 once):
|ep - single| <= 2^-7 |single| + 2^-7 max|single|. Skipped without torch,
without flashmix_ep, or with fewer than two GPUs."""
import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import flashmix  # noqa: E402

if not flashmix.ep_available():
    pytest.skip("this build has no flashmix_ep", allow_module_level=True)
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)

WORLD, E, K, H, I = 2, 8, 3, 256, 128
T = (40, 33)


def _problem(rank):
    """Every rank's tokens and all E experts, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(1234)
    w1 = (torch.rand(E, 2 * I, H, generator=g) * 0.3 - 0.15).to(torch.bfloat16)
    w2 = (torch.rand(E, H, I, generator=g) * 0.3 - 0.15).to(torch.bfloat16)
    toks = []
    for t in T:
        x = (torch.rand(t, H, generator=g) * 2 - 1).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(torch.int32)
        w = torch.rand(t, K, generator=g) * 0.9 + 0.1
        toks.append((x, ids, w))
    return w1, w2, toks


def _mxfp4_experts():
    """All E experts as MXFP4 (spec §13.7), stacked from a synthetic DeepSeek-V4 layer (spec §13.6); the
    same on every rank."""
    g = torch.Generator().manual_seed(4321)

    def part(rows, cols):
        return (torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
                torch.randint(118, 124, (rows, cols // 32), dtype=torch.uint8, generator=g))
    experts = []
    for _ in range(E):
        (w1, s1), (w3, s3), (w2, s2) = part(I, H), part(I, H), part(H, I)
        experts.append({"w1": w1, "w1_scale": s1, "w3": w3, "w3_scale": s3, "w2": w2, "w2_scale": s2})
    return flashmix.stack_deepseek_v4_experts(experts)


def _check(got, want, what):
    got, want = got.double().cpu(), want.double().cpu()
    tol = want.abs() * 2.0 ** -7 + want.abs().max() * 2.0 ** -7
    bad = (got - want).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements past the bound; worst {float((got - want).abs().max())}"


def _rank(rank, store):
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    comm = flashmix.nccl_communicator()
    assert (comm.rank, comm.world) == (rank, WORLD)
    dev = torch.device("cuda", rank)
    w1, w2, toks = _problem(rank)
    lo, hi = rank * E // WORLD, (rank + 1) * E // WORLD
    x, ids, w = (t.to(dev) for t in toks[rank])
    w1d, w2d = w1.to(dev), w2.to(dev)
    single = flashmix.moe_forward(x, w1d, w2d, k=K, token_selected_experts=ids, token_final_scales=w, num_experts=E)
    outs = {}
    for sizing in flashmix.EP_SIZINGS:
        for transport in flashmix.EP_TRANSPORTS:
            for call in range(2):  # the direct transport maps on the first call, reuses on the second
                out = flashmix.ep_moe_forward(comm, x, w1d[lo:hi], w2d[lo:hi], ids, w, num_experts=E,
                                              max_tokens_per_rank=max(T), sizing=sizing, transport=transport,
                                              mode="deterministic")
            torch.cuda.synchronize()
            _check(out, single, f"rank {rank} ep_moe_forward ({sizing}, {transport})")
            outs[sizing, transport] = out
    # spec §14.7: the direct transport's result is the NCCL transport's, bit for bit (deterministic FC2).
    for sizing in flashmix.EP_SIZINGS:
        assert torch.equal(outs[sizing, "direct"], outs[sizing, "nccl"]), f"rank {rank}: direct != nccl ({sizing})"
    try:
        flashmix.ep_moe_forward(comm, x, w1d[lo:hi], w2d[lo:hi], ids, w, num_experts=E, max_tokens_per_rank=max(T),
                                transport="nvshmem")
        raise AssertionError("an unknown transport was accepted")
    except ValueError as e:
        assert "transport" in str(e)
    flashmix.ep_direct_release(comm)
    # The replicated way: rank 0's tokens on both ranks.
    x0, ids0, w0 = (t.to(dev) for t in toks[0])
    single0 = flashmix.moe_forward(x0, w1d, w2d, k=K, token_selected_experts=ids0, token_final_scales=w0,
                                   num_experts=E)
    out = flashmix.ep_moe_forward_replicated(comm, x0, w1d[lo:hi], w2d[lo:hi], ids0, w0, num_experts=E)
    torch.cuda.synchronize()
    _check(out, single0, f"rank {rank} ep_moe_forward_replicated")
    # MXFP4 experts (spec §13.7): W4A8 through dispatch / combine with the rows sent as FP8, W4A16
    # replicated; against the single-GPU layer on all experts' MXFP4 weights.
    m1, c1, m2, c2 = (t.to(dev) for t in _mxfp4_experts())
    for fp8 in ("block", "none"):
        mx = {"weights": "mxfp4", "fp8": fp8}
        single_mx = flashmix.moe_forward(x, m1, m2, k=K, token_selected_experts=ids, token_final_scales=w,
                                         num_experts=E, w1_mx_scales=c1, w2_mx_scales=c2, **mx)
        out = flashmix.ep_moe_forward(comm, x, m1[lo:hi], m2[lo:hi], ids, w, num_experts=E,
                                      max_tokens_per_rank=max(T), fp8_rows=fp8 == "block",
                                      w1_mx_scales=c1[lo:hi], w2_mx_scales=c2[lo:hi], **mx)
        torch.cuda.synchronize()
        _check(out, single_mx, f"rank {rank} ep_moe_forward, MXFP4 fp8={fp8}")
        single_mx0 = flashmix.moe_forward(x0, m1, m2, k=K, token_selected_experts=ids0, token_final_scales=w0,
                                          num_experts=E, w1_mx_scales=c1, w2_mx_scales=c2, **mx)
        out = flashmix.ep_moe_forward_replicated(comm, x0, m1[lo:hi], m2[lo:hi], ids0, w0, num_experts=E,
                                                 w1_mx_scales=c1[lo:hi], w2_mx_scales=c2[lo:hi], **mx)
        torch.cuda.synchronize()
        _check(out, single_mx0, f"rank {rank} ep_moe_forward_replicated, MXFP4 fp8={fp8}")
    comm.destroy()
    dist.destroy_process_group()


def test_ep_two_gpus():
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(os.path.join(d, "store"),), nprocs=WORLD, join=True)
