"""flashmix.ep on two GPUs, one process each (torch.multiprocessing), the
communicator built from a torch.distributed process group (gloo, for the
unique id's broadcast): ep_moe_forward and ep_moe_forward_replicated against
the single-GPU flashmix.moe_forward over all experts on the same tokens,
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
    for sizing in flashmix.EP_SIZINGS:
        out = flashmix.ep_moe_forward(comm, x, w1d[lo:hi], w2d[lo:hi], ids, w, num_experts=E,
                                      max_tokens_per_rank=max(T), sizing=sizing)
        torch.cuda.synchronize()
        _check(out, single, f"rank {rank} ep_moe_forward ({sizing})")
    # The replicated way: rank 0's tokens on both ranks.
    x0, ids0, w0 = (t.to(dev) for t in toks[0])
    single0 = flashmix.moe_forward(x0, w1d, w2d, k=K, token_selected_experts=ids0, token_final_scales=w0,
                                   num_experts=E)
    out = flashmix.ep_moe_forward_replicated(comm, x0, w1d[lo:hi], w2d[lo:hi], ids0, w0, num_experts=E)
    torch.cuda.synchronize()
    _check(out, single0, f"rank {rank} ep_moe_forward_replicated")
    comm.destroy()
    dist.destroy_process_group()


def test_ep_two_gpus():
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(os.path.join(d, "store"),), nprocs=WORLD, join=True)
