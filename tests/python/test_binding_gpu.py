"""The ops on CUDA torch tensors through the binding, against the CPU path
(the reference backend through the same binding) with the GPU tests'
tolerances, plus one CUDA-graph capture + replay, torch.compile of functions
calling the custom ops, streams and devices. Skipped (reported as skipped,
never as passed) without torch or a CUDA GPU.

FLASHMIX_GPU_TESTS_ON_CPU=1 runs the comparisons with CPU tensors on both
sides: it checks this file's own logic on a machine without a GPU and tests
nothing of the GPU path (CTest never sets it)."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

DRY_RUN = os.environ.get("FLASHMIX_GPU_TESTS_ON_CPU") == "1"
if not DRY_RUN and not torch.cuda.is_available():
    pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

import flashmix  # noqa: E402

import spec_reference as ref  # noqa: E402

DEV = torch.device("cpu") if DRY_RUN else torch.device("cuda", torch.cuda.current_device())
gpu_only = pytest.mark.skipif(DRY_RUN, reason="needs a GPU (FLASHMIX_GPU_TESTS_ON_CPU dry run)")
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensor(a, device=DEV):
    """numpy (ml_dtypes bf16 included) -> torch on `device`, bit for bit."""
    if a is None:
        return None
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(device)  # exact: bf16 values
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def f64(t):
    return t.detach().to("cpu", torch.float64)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def assert_within(got, want, tol, what):
    got, want = f64(got), f64(want)
    bad = ~((got - want).abs() <= tol) | ~torch.isfinite(got)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} out of tolerance; first at " \
                          f"{bad.nonzero()[0].tolist()}: got {got[bad][0].item()}, want {want[bad][0].item()}"


# ---------------------------------------------------------------------------
# finalize_moe_routing (spec §2): |gpu - ref| <= ulp(out) |ref| + 1e-6 (sum |terms| + 1)
# ---------------------------------------------------------------------------

FINALIZE_CASES = [
    # T, k, H, padded_H, rows, out, E, start, E_local, bias, shared, fill
    (1, 8, 7168, 7168, "bfloat16", "bfloat16", 256, 0, 256, False, False, True),   # decode
    (96, 8, 7168, 7168, "bfloat16", "bfloat16", 256, 0, 256, True, False, True),
    (64, 8, 7000, 7168, "bfloat16", "float32", 64, 24, 8, True, True, True),        # EP rank, tail, padded rows
    (50, 16, 136, 144, "float16", "float16", 32, 0, 32, True, True, True),          # k = 16
    (33, 2, 1000, 1000, "float32", "bfloat16", 8, 0, 8, False, True, True),
    (200, 8, 512, 512, "bfloat16", "bfloat16", 64, 32, 8, False, False, False),      # no-filling
    (0, 8, 64, 64, "bfloat16", "bfloat16", 8, 0, 8, False, False, True),             # T = 0
]


@pytest.mark.parametrize("case", FINALIZE_CASES, ids=lambda c: "T{}_k{}_H{}_{}to{}_E{}@{}+{}{}{}{}".format(
    c[0], c[1], c[2], c[4], c[5], c[6], c[7], c[8], "_bias" if c[9] else "", "_shared" if c[10] else "",
    "" if c[11] else "_nofill"))
def test_finalize_gpu_matches_cpu(case):
    T, k, H, padded_H, rows_dtype, out_dtype, E, start, E_local, bias, shared, fill = case
    rng = np.random.default_rng(T * 7 + k + H)
    p = ref.finalize_problem(rng, T, k, H, padded_H, rows_dtype, E, start, E_local, True, bias, shared, out_dtype)
    kw = dict(num_experts_per_node=E_local, start_expert_id=start, hidden=H, out_dtype=TORCH_DTYPE[out_dtype],
              fill=fill)
    names = ("rows", "u2p", "experts", "scales", "bias", "shared", "p2u", "offsets")

    def run(device):
        t = {n: tensor(p[n], device) for n in names}
        out = None
        if not fill:  # untouched tokens keep this
            out = torch.full((T, H), 5.0, dtype=TORCH_DTYPE[out_dtype], device=device)
        return flashmix.finalize_moe_routing(t["rows"], t["u2p"], t["experts"], scales=t["scales"], bias=t["bias"],
                                             shared_output=t["shared"], out=out, **kw,
                                             permuted_row_to_unpermuted_row=t["p2u"],
                                             expert_first_token_offset=t["offsets"])

    got = run(DEV)
    want = run("cpu")
    assert got.device.type == DEV.type and got.shape == (T, H) and got.dtype == TORCH_DTYPE[out_dtype]
    sync()
    _, mag = ref.finalize(p["rows"], p["u2p"], p["experts"], p["scales"], p["bias"], p["shared"], start, E_local, H)
    tol = ref.ULP[out_dtype] * f64(want).abs() + 1e-6 * (torch.from_numpy(mag) + 1)
    assert_within(got, want, tol, "out")


def test_finalize_is_bitwise_reproducible():
    rng = np.random.default_rng(1)
    p = ref.finalize_problem(rng, 128, 8, 2048, 2048, "bfloat16", 64, 0, 64, True, True)
    t = {n: tensor(p[n]) for n in ("rows", "u2p", "experts", "scales", "bias")}
    outs = [flashmix.finalize_moe_routing(t["rows"], t["u2p"], t["experts"], num_experts_per_node=64,
                                          scales=t["scales"], bias=t["bias"], prefetch_indices=prefetch)
            for prefetch in (False, False, True)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ---------------------------------------------------------------------------
# build_moe_routing_maps (spec §1): identical to the CPU path
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("T,k,E,start,E_local,single_block_max_slots,H", [
    (16, 8, 256, 0, 256, 0, 7168),      # decode: one block, no workspace
    (4096, 8, 256, 96, 32, 0, 512),     # three launches, a workspace, EP rank
    (300, 2, 8, 0, 8, -1, 0),           # three launches forced
    (0, 8, 64, 0, 64, 0, 0),            # T = 0: offsets zeroed
])
def test_routing_maps_gpu_match_cpu(T, k, E, start, E_local, single_block_max_slots, H):
    rng = np.random.default_rng(T + k + E)
    experts = np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k)
    x = torch.randn(T, H).bfloat16() if H else None

    def run(device):
        return flashmix.build_moe_routing_maps(tensor(experts, device), num_experts_per_node=E_local,
                                               start_expert_id=start, input=None if x is None else x.to(device),
                                               single_block_max_slots=single_block_max_slots)

    got, want = run(DEV), run("cpu")
    sync()
    P = int(want.expert_first_token_offset[-1])
    assert torch.equal(got.expert_first_token_offset.cpu(), want.expert_first_token_offset)
    assert torch.equal(got.unpermuted_row_to_permuted_row.cpu(), want.unpermuted_row_to_permuted_row)
    assert torch.equal(got.permuted_row_to_unpermuted_row[:P].cpu(), want.permuted_row_to_unpermuted_row[:P])
    if x is not None:
        assert torch.equal(got.permuted_input[:P].cpu(), want.permuted_input[:P])


# ---------------------------------------------------------------------------
# moe_fc2_finalize (spec §3): rtol 2^-7, atol 2^-10 max|ref| (unfused 2^-8, atomic k 2^-8)
# ---------------------------------------------------------------------------

def fc2_problem(T=64, k=4, E=8, H=256, I=128, seed=2):
    rng = np.random.default_rng(seed)
    experts = torch.from_numpy(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    A = torch.randn(k * T, I).bfloat16()
    W2 = (torch.randn(E, H, I) / I ** 0.5).bfloat16()
    scales = torch.rand(T, k)
    bias = torch.randn(E, H).bfloat16()
    return experts, A, W2, scales, bias


def run_fc2(device, mode, problem, **kw):
    experts, A, W2, scales, bias = problem
    k, E = experts.shape[1], W2.shape[0]
    maps = flashmix.build_moe_routing_maps(experts.to(device), num_experts_per_node=E)
    return flashmix.moe_fc2_finalize(A.to(device), W2.to(device), maps.expert_first_token_offset,
                                     maps.permuted_row_to_unpermuted_row, k=k, scales=scales.to(device),
                                     bias=bias.to(device), mode=mode, **kw)


@pytest.mark.parametrize("mode", flashmix.FC2_MODES)
def test_moe_fc2_finalize_gpu_matches_cpu(mode):
    problem = fc2_problem()
    try:
        got = run_fc2(DEV, mode, problem)
    except NotImplementedError as e:  # not Hopper, or built without CUTLASS
        pytest.skip(str(e))
    want = run_fc2("cpu", mode, problem)
    sync()
    k = problem[0].shape[1]
    peak = f64(want).abs().max()
    atol = {"unfused": 2.0 ** -8, "atomic": k * 2.0 ** -8}.get(mode, 2.0 ** -10) * peak
    assert_within(got, want, 2.0 ** -7 * f64(want).abs() + atol, f"out ({mode})")
    if mode == "deterministic":
        assert torch.equal(got, run_fc2(DEV, mode, problem))


@gpu_only
def test_moe_fc2_atomic_adds_to_a_caller_zeroed_out():
    problem = fc2_problem(seed=3)
    residual = torch.randn(64, 256, device=DEV).bfloat16()
    try:
        got = run_fc2(DEV, "atomic", problem, out=residual.clone(), out_already_zeroed=True)
    except NotImplementedError as e:
        pytest.skip(str(e))
    want = run_fc2("cpu", "atomic", problem, out=residual.cpu().clone(), out_already_zeroed=True)
    sync()
    peak = f64(want).abs().max()
    assert_within(got, want, 2.0 ** -7 * f64(want).abs() + 5 * 2.0 ** -8 * peak, "out")


# ---------------------------------------------------------------------------
# mHC (spec §4): bf16 |got - ref| <= 2^-7 |ref| + t * scale + 1e-6 (t = 2e-4 pre, 1e-5 post);
# fp32 coefficients: absolute 2e-4
# ---------------------------------------------------------------------------

def mhc_inputs(B, n, C, phi_dtype, seed, device=DEV):
    rng = np.random.default_rng(seed)
    x, phi, alpha, bias = ref.mhc_problem(rng, B, n, C, phi_dtype)
    return tuple(tensor(a, device) for a in (x, phi, alpha, bias))


@pytest.mark.parametrize("options", [{}, {"prefetch_weights": True}, {"enable_pdl": False},
                                     flashmix.MHC_SEED_PARAMS, {"sinkhorn_iters": 7, "eps_sinkhorn": 1e-3}],
                         ids=["defaults", "prefetch_weights", "no_pdl", "seed", "iters7"])
@pytest.mark.parametrize("B,n,C,phi_dtype", [(16, 4, 7168, "float32"), (64, 4, 1024, "float32"),
                                             (8, 4, 2048, "bfloat16"), (5, 2, 64, "float32"), (3, 8, 32, "float32"),
                                             (2, 1, 8, "bfloat16"), (0, 4, 64, "float32")])
def test_mhc_pre_gpu_matches_cpu(B, n, C, phi_dtype, options):
    x, phi, alpha, bias = mhc_inputs(B, n, C, phi_dtype, seed=B * 31 + n * 7 + C)
    got = flashmix.mhc_pre(x, phi, alpha, bias, **options)
    want = flashmix.mhc_pre(*(a.cpu() for a in (x, phi, alpha, bias)), **options)
    sync()
    scale = f64(x).abs().sum(dim=1)  # >= sum_i |H_pre[b, i] x[b, i, c]| (H_pre <= 1 + eps)
    assert_within(got.f_pre, want.f_pre, 2.0 ** -7 * f64(want.f_pre).abs() + 2e-4 * scale + 1e-6, "f_pre")
    assert_within(got.h_post, want.h_post, 2e-4, "h_post")
    assert_within(got.h_res, want.h_res, 2e-4, "h_res")


@pytest.mark.parametrize("B,n,C", [(16, 8, 7168), (32, 6, 1000), (1, 2, 64), (7, 4, 7168)])
def test_mhc_pre_gpu_with_workspace_matches_cpu_and_repeats_bitwise(B, n, C):
    x, phi, alpha, bias = mhc_inputs(B, n, C, "float32", seed=B * 17 + n + C)
    ws = torch.zeros(flashmix.mhc_workspace_bytes(B, n, C), dtype=torch.uint8, device=DEV)
    got = flashmix.mhc_pre(x, phi, alpha, bias, workspace=ws)
    again = flashmix.mhc_pre(x, phi, alpha, bias, workspace=ws)
    want = flashmix.mhc_pre(*(a.cpu() for a in (x, phi, alpha, bias)))
    sync()
    scale = f64(x).abs().sum(dim=1)
    assert_within(got.f_pre, want.f_pre, 2.0 ** -7 * f64(want.f_pre).abs() + 2e-4 * scale + 1e-6, "f_pre")
    assert_within(got.h_post, want.h_post, 2e-4, "h_post")
    assert_within(got.h_res, want.h_res, 2e-4, "h_res")
    for u, v in zip(got, again):
        assert torch.equal(u, v)
    assert int(ws[:4].view(torch.int32).item()) == 0  # the grid barrier's counter is back at 0


@pytest.mark.parametrize("res_layout", ["deepseek", "row_mix"])
@pytest.mark.parametrize("B,n,C", [(16, 4, 7168), (7, 3, 40), (4, 8, 64), (0, 4, 64)])
def test_mhc_post_gpu_matches_cpu(B, n, C, res_layout):
    rng = np.random.default_rng(B + n + C)
    x, f_out, h_post, h_res = (tensor(a) for a in ref.post_problem(rng, B, n, C))
    got = flashmix.mhc_post(x, f_out, h_post, h_res, res_layout=res_layout)
    want = flashmix.mhc_post(x.cpu(), f_out.cpu(), h_post.cpu(), h_res.cpu(), res_layout=res_layout)
    sync()
    R = f64(h_res) if res_layout == "row_mix" else f64(h_res).transpose(1, 2)
    scale = torch.einsum("bij,bjc->bic", R.abs(), f64(x).abs()) + (f64(h_post)[:, :, None] * f64(f_out)[:, None].abs())
    assert_within(got, want, 2.0 ** -7 * f64(want).abs() + 1e-5 * scale + 1e-6, "x_next")


def test_mhc_stages_and_head_and_expand_gpu_match_cpu():
    x, phi, alpha, bias = mhc_inputs(12, 4, 256, "float32", seed=5)
    cpu = [a.cpu() for a in (x, phi, alpha, bias)]
    h, r = flashmix.mhc_project(x, phi, alpha, bias)
    h_cpu, r_cpu = flashmix.mhc_project(*cpu)
    act = flashmix.mhc_activate(h_cpu.to(DEV))
    act_cpu = flashmix.mhc_activate(h_cpu)
    f_pre = flashmix.mhc_pre_mix(x, act_cpu.h_pre.to(DEV))
    f_pre_cpu = flashmix.mhc_pre_mix(cpu[0], act_cpu.h_pre)
    emb = torch.randn(12, 256).bfloat16()
    xs = flashmix.mhc_expand(emb.to(DEV), n=4)
    sync()
    assert_within(r, r_cpu, 1e-5 * f64(r_cpu), "r")
    # relative 1e-4 of sum |alpha x phi| / r + |bias|
    n = 4
    a = f64(alpha)[[0] * n + [1] * n + [2] * n * n]
    scale = a * (f64(x).reshape(12, -1).abs() @ f64(phi).abs().T) / f64(r_cpu)[:, None] + f64(bias).abs()
    assert_within(h, h_cpu, 1e-4 * scale, "h")
    for name in ("h_pre", "h_post", "h_res"):
        assert_within(getattr(act, name), getattr(act_cpu, name), 1e-5, name)
    assert_within(f_pre, f_pre_cpu, 2.0 ** -7 * f64(f_pre_cpu).abs() + 1e-5 * f64(x).abs().sum(1) + 1e-6, "f_pre")
    assert torch.equal(xs.cpu(), emb[:, None].expand(12, 4, 256))
    head_phi, head_alpha, head_bias = phi[:4], alpha[:1], bias[:4]
    out = flashmix.mhc_head(x, head_phi, head_alpha, head_bias)
    out_cpu = flashmix.mhc_head(cpu[0], head_phi.cpu(), head_alpha.cpu(), head_bias.cpu())
    sync()
    assert_within(out, out_cpu, 2.0 ** -7 * f64(out_cpu).abs() + 2e-4 * f64(x).abs().sum(1) + 1e-6, "head out")


# ---------------------------------------------------------------------------
# The projection kernel: pinned kernels agree with the automatic choice
# (docs/spec.md §4.6), and mhc_pre_kernel_choice says which one runs
# ---------------------------------------------------------------------------

PINNED = ("resident", "split", "cluster_tile", "portable")
SM90 = not DRY_RUN and torch.cuda.get_device_capability(DEV) == (9, 0)


def mhc_pre_within(got, want, x, factor, what):
    """The mhc_pre GPU tolerance of test_mhc_pre_gpu_matches_cpu, times `factor`."""
    scale = f64(x).abs().sum(dim=1)
    assert_within(got.f_pre, want.f_pre, factor * (2.0 ** -7 * f64(want.f_pre).abs() + 2e-4 * scale + 1e-6),
                  f"{what}: f_pre")
    assert_within(got.h_post, want.h_post, factor * 2e-4, f"{what}: h_post")
    assert_within(got.h_res, want.h_res, factor * 2e-4, f"{what}: h_res")


# B, n, C, phi dtype, workspace, the pinned kernels that take the call on an sm_90 GPU
PINNED_CASES = [
    (16, 4, 7168, "float32", True, {"resident", "split", "cluster_tile", "portable"}),  # decode, DeepSeek's shape
    (64, 4, 1024, "float32", False, {"resident", "cluster_tile", "portable"}),
    (16, 8, 1024, "bfloat16", True, {"split", "cluster_tile", "portable"}),
    (5, 2, 64, "float32", True, {"split", "cluster_tile", "portable"}),
    (0, 4, 1024, "float32", False, set(PINNED)),  # B = 0: OK, nothing launched, whatever the kernel
]


@pytest.mark.parametrize("B,n,C,phi_dtype,with_ws,takes", PINNED_CASES,
                         ids=lambda v: str(v) if not isinstance(v, set) else "")
def test_mhc_pre_pinned_kernels_match_auto(B, n, C, phi_dtype, with_ws, takes):
    x, phi, alpha, bias = mhc_inputs(B, n, C, phi_dtype, seed=B * 13 + n * 5 + C)
    ws_bytes = flashmix.mhc_workspace_bytes(B, n, C) if with_ws else 0

    def run(**kw):
        ws = torch.zeros(ws_bytes, dtype=torch.uint8, device=DEV) if ws_bytes else None
        return flashmix.mhc_pre(x, phi, alpha, bias, workspace=ws, **kw)

    auto = run()
    want = flashmix.mhc_pre(*(a.cpu() for a in (x, phi, alpha, bias)))
    ran = set()
    for kernel in PINNED:
        try:
            got = run(kernel=kernel)
        except NotImplementedError as e:
            assert str(e).startswith("mhc_pre: ") and kernel in str(e), str(e)  # says which kernel and why
            continue
        ran.add(kernel)
        sync()
        mhc_pre_within(got, want, x, 1, f"{kernel} vs cpu")
        mhc_pre_within(got, auto, x, 2, f"{kernel} vs auto")
    if DRY_RUN:
        return  # one CPU implementation: every name runs
    assert "portable" in ran  # any GPU, any shape
    if SM90:
        assert ran == takes
    if B > 0:  # the automatic choice is one of them, and pinning it gives auto's result bit for bit
        ws = torch.zeros(ws_bytes, dtype=torch.uint8, device=DEV) if ws_bytes else None
        chosen, reason = flashmix.mhc_pre_kernel_choice(x, phi, alpha, bias, workspace=ws)
        assert chosen in ran and chosen in reason, (chosen, reason)
        sync()
        assert all(torch.equal(a, b) for a, b in zip(run(kernel=chosen), auto)), chosen


@gpu_only
def test_mhc_pre_kernel_choice():
    x, phi, alpha, bias = mhc_inputs(16, 4, 7168, "float32", seed=31)
    kernel, reason = flashmix.mhc_pre_kernel_choice(x, phi, alpha, bias)
    if SM90:
        assert kernel == "resident", reason
    assert kernel in flashmix.MHC_PRE_KERNELS[1:] and reason, (kernel, reason)
    # the same with outputs passed, and any keyword of mhc_pre
    out = flashmix.mhc_pre(x, phi, alpha, bias)
    again = flashmix.mhc_pre_kernel_choice(x, phi, alpha, bias, f_pre=out.f_pre, h_post=out.h_post,
                                           h_res=out.h_res, prefetch_weights=True, stream=torch.cuda.current_stream())
    assert again[0] == kernel, again
    # pinned: the pin, or NotImplementedError saying why
    kernel, reason = flashmix.mhc_pre_kernel_choice(x, phi, alpha, bias, kernel="portable")
    assert kernel == "portable" and "pinned" in reason, reason
    x8, phi8, alpha8, bias8 = mhc_inputs(16, 8, 1024, "float32", seed=32)
    with pytest.raises(NotImplementedError, match=r"^mhc_pre_kernel_choice: kernel: resident cannot take"):
        flashmix.mhc_pre_kernel_choice(x8, phi8, alpha8, bias8, kernel="resident")
    ws = torch.zeros(flashmix.mhc_workspace_bytes(16, 8, 1024), dtype=torch.uint8, device=DEV)
    kernel, reason = flashmix.mhc_pre_kernel_choice(x8, phi8, alpha8, bias8, workspace=ws)
    assert kernel == "split", reason  # n = 8 at decode with a workspace: the split kernel (sm_80+)
    kernel, _ = flashmix.mhc_pre_kernel_choice(x8, phi8, alpha8, bias8)
    assert kernel == ("cluster_tile" if SM90 else "portable")
    with pytest.raises(ValueError, match=r"^mhc_pre_kernel_choice: kernel: "):
        flashmix.mhc_pre_kernel_choice(x, phi, alpha, bias, kernel="fast")
    with pytest.raises(ValueError, match=r"^mhc_pre_kernel_choice: x: "):
        flashmix.mhc_pre_kernel_choice(*(a.cpu() for a in (x, phi, alpha, bias)))


def test_mhc_project_and_head_pinned_kernels_match_auto():
    B, n, C = 16, 4, 1024
    x, phi, alpha, bias = mhc_inputs(B, n, C, "float32", seed=33)
    ws = torch.zeros(flashmix.mhc_workspace_bytes(B, n, C), dtype=torch.uint8, device=DEV)
    h_auto, r_auto = flashmix.mhc_project(x, phi, alpha, bias, workspace=ws)
    head = (phi[:n], alpha[:1], bias[:n])
    out_auto = flashmix.mhc_head(x, *head, workspace=ws)
    sync()
    a = f64(alpha)[[0] * n + [1] * n + [2] * n * n]
    h_scale = a * (f64(x).reshape(B, -1).abs() @ f64(phi).abs().T) / f64(r_auto)[:, None] + f64(bias).abs()
    projected, headed = set(), set()
    for kernel in PINNED:
        try:
            h, r = flashmix.mhc_project(x, phi, alpha, bias, workspace=ws, kernel=kernel)
            sync()
            assert_within(r, r_auto, 2e-5 * f64(r_auto), f"{kernel}: r")
            assert_within(h, h_auto, 2e-4 * h_scale, f"{kernel}: h")
            projected.add(kernel)
        except NotImplementedError as e:
            assert str(e).startswith("mhc_project: ") and kernel in str(e), str(e)
        try:
            out = flashmix.mhc_head(x, *head, workspace=ws, kernel=kernel)
            sync()
            assert_within(out, out_auto, 2 * (2.0 ** -7 * f64(out_auto).abs() + 2e-4 * f64(x).abs().sum(1) + 1e-6),
                          f"{kernel}: head out")
            headed.add(kernel)
        except NotImplementedError as e:
            assert str(e).startswith("mhc_head: ") and kernel in str(e), str(e)
    if DRY_RUN:
        return
    assert "resident" not in headed  # mhc_head has no resident kernel
    assert {"split", "portable"} <= projected & headed  # a workspace, B <= 32: sm_80+
    if SM90:
        assert projected == set(PINNED) and headed == {"split", "cluster_tile", "portable"}


def test_custom_ops_take_the_kernel():
    # `projection_kernel` in the ops (an op argument named `kernel` breaks Inductor's fallback lowering)
    x, phi, alpha, bias = mhc_inputs(8, 4, 1024, "float32", seed=34)
    for kernel in ("auto", "portable"):
        got = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias, projection_kernel=kernel)
        want = flashmix.mhc_pre(x, phi, alpha, bias, kernel=kernel)
        sync()
        assert all(torch.equal(g, w) for g, w in zip(got, want)), kernel
    head = (phi[:4], alpha[:1], bias[:4])
    assert torch.equal(torch.ops.flashmix.mhc_head(x, *head, projection_kernel="portable"),
                       flashmix.mhc_head(x, *head, kernel="portable"))
    if not DRY_RUN:
        with pytest.raises(NotImplementedError, match=r"^mhc_head: .*resident"):
            torch.ops.flashmix.mhc_head(x, *head, projection_kernel="resident")

    def pinned_layer(x, phi, alpha, bias):
        f_pre, h_post, h_res = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias, projection_kernel="portable")
        return torch.ops.flashmix.mhc_post(x, f_pre, h_post, h_res)

    got = torch.compile(pinned_layer, fullgraph=True)(x, phi, alpha, bias)
    want = pinned_layer(x, phi, alpha, bias)
    sync()
    assert torch.equal(got, want)


def test_weights_that_require_grad_are_accepted():
    x, phi, alpha, bias = mhc_inputs(4, 4, 64, "float32", seed=6)
    params = [torch.nn.Parameter(t) for t in (phi, alpha, bias)]
    got = flashmix.mhc_pre(x, *params)
    want = flashmix.mhc_pre(x, phi, alpha, bias)
    sync()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------------------
# Errors on CUDA tensors: ValueError naming the argument, nothing launched
# ---------------------------------------------------------------------------

def test_bad_input_on_cuda_raises_value_error_and_writes_nothing():
    x, phi, alpha, bias = mhc_inputs(4, 4, 64, "float32", seed=7)
    f_pre = torch.full((4, 64), 3.0, device=DEV).bfloat16()
    with pytest.raises(ValueError, match=r"^mhc_pre: params[.]sinkhorn_iters: "):
        flashmix.mhc_pre(x, phi, alpha, bias, f_pre=f_pre, sinkhorn_iters=0)
    with pytest.raises(ValueError, match=r"^mhc_pre: alpha: "):
        flashmix.mhc_pre(x, phi, alpha[:2], bias, f_pre=f_pre)
    sync()
    assert (f_pre == 3.0).all()


@gpu_only
def test_arrays_on_two_devices_raise_value_error_naming_the_argument():
    x, phi, alpha, bias = mhc_inputs(4, 4, 64, "float32", seed=8)
    with pytest.raises(ValueError, match=r"^mhc_pre: bias: is on cpu but x is on cuda:"):
        flashmix.mhc_pre(x, phi, alpha, bias.cpu())


# ---------------------------------------------------------------------------
# Streams and devices
# ---------------------------------------------------------------------------

@gpu_only
def test_ops_run_on_the_current_or_given_stream():
    rng = np.random.default_rng(9)
    x, f_out, h_post, h_res = (tensor(a) for a in ref.post_problem(rng, 64, 4, 4096))
    want = flashmix.mhc_post(x, f_out, h_post, h_res)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the current stream
        on_current = flashmix.mhc_post(x, f_out, h_post, h_res)
    x_next = torch.empty_like(x)
    explicit = flashmix.mhc_post(x, f_out, h_post, h_res, x_next=x_next, stream=side)  # a given stream
    side.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(on_current, want) and torch.equal(explicit, want)


@gpu_only
@pytest.mark.skipif(not DRY_RUN and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_device_run_there_and_the_current_device_is_kept():
    torch.cuda.set_device(0)
    x, phi, alpha, bias = mhc_inputs(8, 4, 512, "float32", seed=10, device=torch.device("cuda", 1))
    got = flashmix.mhc_pre(x, phi, alpha, bias)
    want = flashmix.mhc_pre(*(a.cpu() for a in (x, phi, alpha, bias)))
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0 and got.f_pre.device == x.device
    assert_within(got.h_res, want.h_res, 2e-4, "h_res")


@gpu_only
def test_debug_check_of_the_finalize_indices():
    rng = np.random.default_rng(11)
    p = ref.finalize_problem(rng, 32, 4, 64, 64, "bfloat16", 16, 4, 8)
    t = {n: tensor(p[n]) for n in ("rows", "u2p", "experts", "scales")}
    out = flashmix.finalize_moe_routing(t["rows"], t["u2p"], t["experts"], num_experts_per_node=8, start_expert_id=4,
                                        scales=t["scales"])
    flashmix.debug_check_finalize_moe_routing_indices(t["rows"], t["u2p"], t["experts"], out, num_experts_per_node=8,
                                                      start_expert_id=4)
    slot = int(np.flatnonzero((p["experts"].T.reshape(-1) >= 4) & (p["experts"].T.reshape(-1) < 12))[0])
    bad = t["u2p"].clone()
    bad[slot] = p["rows"].shape[0] + 100  # a local slot pointing past the rows
    with pytest.raises(ValueError, match=r"^finalize_moe_routing: unpermuted_row_to_permuted_row: "):
        flashmix.debug_check_finalize_moe_routing_indices(t["rows"], bad, t["experts"], out, num_experts_per_node=8,
                                                          start_expert_id=4)


# ---------------------------------------------------------------------------
# CUDA graphs and torch.compile
# ---------------------------------------------------------------------------

def moe_and_mhc_step(s):
    """One decode-like step over static tensors: routing maps, finalize, mhc_pre, a sublayer, mhc_post."""
    maps = flashmix.build_moe_routing_maps(s["experts"], num_experts_per_node=s["E_local"],
                                           start_expert_id=s["start"])
    moe = flashmix.finalize_moe_routing(s["rows"], maps.unpermuted_row_to_permuted_row, s["experts"],
                                        num_experts_per_node=s["E_local"], start_expert_id=s["start"],
                                        scales=s["scales"])
    f_pre, h_post, h_res = flashmix.mhc_pre(s["x"], s["phi"], s["alpha"], s["bias"], prefetch_weights=True)
    f_out = (f_pre.float() * 0.5).bfloat16()
    return maps, moe, flashmix.mhc_post(s["x"], f_out, h_post, h_res)


def step_inputs(seed, T=512, k=8, E=64, start=16, E_local=16, B=16, n=4, C=1024):
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    x, phi, alpha, bias = mhc_inputs(B, n, C, "float32", seed)
    return {"experts": tensor(experts), "rows": torch.randn(k * T, 256, device=DEV).bfloat16(),
            "scales": torch.rand(T, k, device=DEV), "x": x, "phi": phi, "alpha": alpha, "bias": bias,
            "start": start, "E_local": E_local}


def same_results(a, b):
    (maps_a, moe_a, x_a), (maps_b, moe_b, x_b) = a, b
    P = int(maps_b.expert_first_token_offset[-1])
    return (torch.equal(maps_a.expert_first_token_offset, maps_b.expert_first_token_offset)
            and torch.equal(maps_a.unpermuted_row_to_permuted_row, maps_b.unpermuted_row_to_permuted_row)
            and torch.equal(maps_a.permuted_row_to_unpermuted_row[:P], maps_b.permuted_row_to_unpermuted_row[:P])
            and torch.equal(moe_a, moe_b) and torch.equal(x_a, x_b))


@gpu_only
def test_cuda_graph_capture_and_replay():
    static = step_inputs(seed=12, T=4096)  # 32K slots: the three-launch routing path with a workspace
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        moe_and_mhc_step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_and_mhc_step(static)
    fresh = step_inputs(seed=13, T=4096)
    for name, value in fresh.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    assert same_results(captured, moe_and_mhc_step(fresh))
    graph.replay()  # again: same inputs, same outputs
    torch.cuda.synchronize()
    assert same_results(captured, moe_and_mhc_step(fresh))


def compiled_layer(x, phi, alpha, bias, rows, u2p, experts, scales):
    f_pre, h_post, h_res = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias)
    # prefetch_indices: the kernel ahead (mhc_pre) does not write the routing indices
    moe = torch.ops.flashmix.finalize_moe_routing(rows, u2p, experts, 16, start_expert_id=16, scales=scales,
                                                  hidden=f_pre.shape[1], prefetch_indices=True)
    f_out = f_pre + moe[:f_pre.shape[0]]  # stands in for the sublayer (one rounding: eager == compiled)
    return torch.ops.flashmix.mhc_post(x, f_out, h_post, h_res)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_of_a_function_calling_the_custom_ops(mode):
    if mode == "reduce-overhead" and DRY_RUN:
        pytest.skip("CUDA graphs need a GPU")
    s = step_inputs(seed=14, T=64)
    maps = flashmix.build_moe_routing_maps(s["experts"], num_experts_per_node=16, start_expert_id=16)
    s["rows"] = torch.randn(8 * 64, 1024, device=DEV).bfloat16()
    args = (s["x"], s["phi"], s["alpha"], s["bias"], s["rows"], maps.unpermuted_row_to_permuted_row, s["experts"],
            s["scales"])
    compiled = torch.compile(compiled_layer, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records a graph on a later call
        got = compiled(*args)
    want = compiled_layer(*args)
    sync()
    assert torch.equal(got, want)


def mhc_decode_step(x, phi, alpha, bias, ws):
    f_pre, h_post, h_res = torch.ops.flashmix.mhc_pre_with_workspace(x, phi, alpha, bias, ws)
    return torch.ops.flashmix.mhc_post(x, f_pre, h_post, h_res), h_res


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_of_mhc_pre_with_a_workspace(mode):
    """The custom op with the small-batch workspace (n = 8: the split kernel) under torch.compile,
    against the same op eagerly and against the binding without a workspace."""
    if mode == "reduce-overhead" and DRY_RUN:
        pytest.skip("CUDA graphs need a GPU")
    x, phi, alpha, bias = mhc_inputs(16, 8, 1024, "float32", seed=21)
    ws = torch.zeros(flashmix.mhc_workspace_bytes(16, 8, 1024), dtype=torch.uint8, device=DEV)
    compiled = torch.compile(mhc_decode_step, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records a graph on a later call
        got = compiled(x, phi, alpha, bias, ws)
    want = mhc_decode_step(x, phi, alpha, bias, ws)
    plain = flashmix.mhc_pre(x, phi, alpha, bias)
    sync()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert_within(want[1], plain.h_res, 2e-4, "h_res")
    assert int(ws.view(torch.int32)[0].item()) == 0


def compiled_moe_end(x, experts, scales, W2):
    """Routing maps (with the gathered input), the fused FC2 + finalize, and an unfused path (the
    finalize of stand-in rows), all custom ops; the torch between them is exact (a cast, a slice)."""
    off, p2u, u2p, xp = torch.ops.flashmix.build_moe_routing_maps(experts, W2.shape[0], input=x)
    act = xp.bfloat16()
    fused = torch.ops.flashmix.moe_fc2_finalize(act, W2, off, p2u, experts.shape[1], scales=scales,
                                                mode="deterministic")
    moe = torch.ops.flashmix.finalize_moe_routing(act[:, :W2.shape[1]], u2p, experts, W2.shape[0], scales=scales)
    return fused, moe


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_of_the_moe_end_custom_ops(mode):
    if mode == "reduce-overhead" and DRY_RUN:
        pytest.skip("CUDA graphs need a GPU")
    experts, A, W2, scales, _ = fc2_problem(T=96, k=4, E=8, H=256, I=512, seed=17)
    args = (A[:96].float().to(DEV), experts.to(DEV), scales.to(DEV), W2.to(DEV))
    try:
        want = compiled_moe_end(*args)
    except NotImplementedError as e:  # not Hopper, or built without CUTLASS
        pytest.skip(str(e))
    compiled = torch.compile(compiled_moe_end, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records a graph on a later call
        got = compiled(*args)
    sync()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
