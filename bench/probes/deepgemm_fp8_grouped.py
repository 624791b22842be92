"""DeepGEMM's block-scaled FP8 m-grouped GEMM alone on FC1's and FC2's bench shapes.

A probe, not a bench record: it times `deep_gemm.m_grouped_fp8_gemm_nt_contiguous`
(1 x 128 activation scales, 128 x 128 weight scales, bf16 out, no activation)
with every expert holding the same number of rows (its contiguous layout pads
each expert to 128 rows; equal experts need no padding), and is the process
to put under ncu to compare that kernel's stall profile with FC1's and FC2's
block-FP8 tiles (docs/moe_fc1.md, docs/fc2_grouped_gemm.md). Needs torch and the DeepGEMM wheel of docs/peers.md
on PYTHONPATH (bench/peers_setup.sh).

Usage: python3 bench/probes/deepgemm_fp8_grouped.py [SHAPE ...]
  SHAPE: qwen3 | deepseek_ep | mixtral (FC1) | fc2_qwen3 | fc2_deepseek_ep | fc2_mixtral
         (default: all six)
"""
import sys

import torch

# name: (experts, rows an expert, N, K): FC1 (N = 2I, K = H) and FC2 (N = H,
# K = I) of flashmix-bench's cases with T k / E rows an expert.
SHAPES = {
    "qwen3": (128, 256, 2 * 768, 2048),
    "deepseek_ep": (32, 256, 2 * 2048, 7168),
    "mixtral": (8, 1024, 2 * 14336, 4096),
    "fc2_qwen3": (128, 256, 2048, 768),
    "fc2_deepseek_ep": (32, 256, 7168, 2048),
    "fc2_mixtral": (8, 1024, 4096, 14336),
}


def cast_rows(x):
    """1 x 128 block scales along K (fp32), e4m3 codes."""
    m, k = x.shape
    v = x.view(m, k // 128, 128).float()
    sf = v.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    return (v / sf.unsqueeze(2)).to(torch.float8_e4m3fn).view(m, k), sf


def cast_blocks(w):
    """128 x 128 block scales (fp32), e4m3 codes; w [n, k] with n % 128 == 0."""
    n, k = w.shape
    v = w.view(n // 128, 128, k // 128, 128).float()
    sf = v.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4) / 448.0
    return (v / sf).to(torch.float8_e4m3fn).view(n, k), sf.view(n // 128, k // 128)


def run(name, dg):
    G, rows, N, K = SHAPES[name]
    M = G * rows
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    a8, sa = cast_rows(a)
    b8 = torch.empty(G, N, K, device="cuda", dtype=torch.float8_e4m3fn)
    sb = torch.empty(G, N // 128, K // 128, device="cuda", dtype=torch.float32)
    for g in range(G):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
        b8[g], sb[g] = cast_blocks(w)
    m_indices = torch.arange(G, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def call():
        dg.m_grouped_fp8_gemm_nt_contiguous((a8, sa), (b8, sb), d, m_indices, disable_ue8m0_cast=True)

    call()  # JIT compile
    torch.cuda.synchronize()
    # Check two experts' first rows against the dequantised product.
    for g in (0, G - 1):
        r0 = g * rows
        xa = (a8[r0:r0 + 4].float().view(4, K // 128, 128) * sa[r0:r0 + 4].unsqueeze(2)).view(4, K)
        wb = (b8[g].float().view(N // 128, 128, K // 128, 128) * sb[g].view(N // 128, 1, K // 128, 1)).view(N, K)
        ref = xa @ wb.t()
        err = (d[r0:r0 + 4].float() - ref).abs().max().item() / ref.abs().max().item()
        if not err < 2e-2:
            raise SystemExit("%s: DeepGEMM result off by %.3g (relative to the largest)" % (name, err))
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(30):
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    times.sort()
    us = times[len(times) // 2]
    tflops = 2.0 * M * N * K / us * 1e-6
    print("deepgemm m_grouped_fp8_gemm_nt_contiguous %-12s G=%d rows=%d N=%d K=%d: %.1f us (%.0f TFLOP/s)"
          % (name, G, rows, N, K, us, tflops))


def main():
    import deep_gemm as dg

    print("deep_gemm", getattr(dg, "__version__", "?"), "on", torch.cuda.get_device_name())
    for name in sys.argv[1:] or list(SHAPES):
        run(name, dg)


if __name__ == "__main__":
    main()
