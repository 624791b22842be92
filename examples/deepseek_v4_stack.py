"""A DeepSeek-V4-style stack of blocks on flashmix: how the ops compose into a model.

Every sublayer sits between mHC hyper-connections (n residual streams): the embedding is expanded
to n streams, each layer boundary is one ``mhc_post_pre`` (this sublayer's post fused with the next
sublayer's pre and its input RMSNorm), and the last boundary is ``mhc_post_head``. The FFN sublayers are the routed
experts (``flashmix.MoeLayer``): the first ``n_hash_layers`` choose their experts by token id
(hash selection, spec §8.7), the others by sqrt-softplus scores with a correction bias (spec §8),
both renormalised and scaled; the experts are MXFP4 run on FP8 tensor cores (W4A8, spec §13.7)
with DeepSeek-V4's clamped SwiGLU, and a shared expert's output is added in the same kernel
(``shared_output``). Attention and the shared expert are stand-ins (one bf16 linear map each):
this file shows the plumbing, not a model. ``mode="deterministic"`` makes the layer bitwise
reproducible.

The same module runs on CPU tensors, where every flashmix op runs its CPU reference (double
accumulation): ``tests/python/test_binding_gpu.py`` compares the two.

    python3 examples/deepseek_v4_stack.py      # on a Hopper GPU: one forward, timed
"""
import torch

import flashmix


def _hc_params(n, C, gen, device):
    """One sublayer's mHC pre parameters: phi float32 ``[n*n + 2n, n*C]``, alpha ``[3]``, bias."""
    N = n * n + 2 * n
    phi = torch.randn(N, n * C, generator=gen) * (n * C) ** -0.5
    alpha = torch.tensor([0.5, 0.5, 0.5])
    bias = torch.randn(N, generator=gen) * 0.1
    return tuple(t.to(device) for t in (phi, alpha, bias))


class DeepSeekV4Stack(torch.nn.Module):
    """``layers`` blocks of (attention stand-in, routed experts + shared expert stand-in) between
    mHC boundaries; ``forward(token_ids, embedding)`` -> bf16 ``[T, hidden]`` (the head's mix)."""

    def __init__(self, *, layers=3, n_hash_layers=1, hc_mult=4, hidden=512, inter=256, experts=32, k=4,
                 vocab=1000, routed_scaling_factor=1.5, swiglu_limit=10.0, seed=0, device="cuda"):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.n, self.hidden, self.n_hash_layers = hc_mult, hidden, n_hash_layers
        self.moe = torch.nn.ModuleList()
        for layer in range(layers):
            hashed = layer < n_hash_layers
            moe = flashmix.MoeLayer(experts, k, hidden, inter, scoring="sqrtsoftplus", renormalize=True,
                                    routed_scaling_factor=routed_scaling_factor, activation="swiglu_clamped",
                                    limit=swiglu_limit, weights="mxfp4", fp8="block", mode="deterministic",
                                    correction_bias=not hashed, hash_vocab_size=vocab if hashed else 0,
                                    device=device)
            with torch.no_grad():
                moe.gate.copy_(torch.randn(moe.gate.shape, generator=gen) * hidden ** -0.5)
                if hashed:  # the checkpoint's tid2eid: k distinct experts a token id
                    moe.hash_table.copy_(torch.stack([torch.randperm(experts, generator=gen)[:k]
                                                      for _ in range(vocab)]).int())
                else:
                    moe.correction_bias.copy_(torch.randn(experts, generator=gen) * 0.05)
                # MXFP4 experts: random e2m1 codes with one ue8m0 scale (2^-5) a 32-value block.
                for w, s in ((moe.w1, moe.w1_mx_scales), (moe.w2, moe.w2_mx_scales)):
                    w.copy_(torch.randint(0, 256, w.shape, generator=gen, dtype=torch.uint8))
                    s.fill_(127 - 5)
            self.moe.append(moe)
        lin = lambda: torch.nn.Parameter(  # noqa: E731
            (torch.randn(hidden, hidden, generator=gen) * hidden ** -0.5).bfloat16().to(device), requires_grad=False)
        self.attn = torch.nn.ParameterList([lin() for _ in range(layers)])
        self.shared = torch.nn.ParameterList([lin() for _ in range(layers)])
        # The pre of every sublayer (attention, then FFN, per layer), its input RMSNorm's weight
        # (V4's attn_norm / ffn_norm, fused into the pre), and the head's [n, n*C].
        self.hc = [_hc_params(hc_mult, hidden, gen, device) for _ in range(2 * layers)]
        self.norm = [(1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16().to(device) for _ in range(2 * layers)]
        head_phi = torch.randn(hc_mult, hc_mult * hidden, generator=gen) * (hc_mult * hidden) ** -0.5
        self.hc_head = (head_phi.to(device), torch.tensor([0.5]).to(device),
                        (torch.randn(hc_mult, generator=gen) * 0.1).to(device))

    def forward(self, token_ids, embedding):
        x = flashmix.mhc_expand(embedding, n=self.n)  # [T, n, C]: n copies of the embedding
        f, h_post, h_res = flashmix.mhc_pre(x, *self.hc[0], norm_weight=self.norm[0])  # the first attention's input
        layers = len(self.moe)
        for layer in range(layers):
            a = f @ self.attn[layer]  # attention stand-in
            # Attention's post fused with the FFN's pre.
            x, f, h_post, h_res = flashmix.mhc_post_pre(x, a, h_post, h_res, *self.hc[2 * layer + 1],
                                                        norm_weight=self.norm[2 * layer + 1])
            moe = self.moe[layer]
            out = moe(f, shared_output=f @ self.shared[layer],
                      token_ids=token_ids if moe.hash_table is not None else None)
            if layer + 1 < layers:  # the FFN's post fused with the next attention's pre
                x, f, h_post, h_res = flashmix.mhc_post_pre(x, out, h_post, h_res, *self.hc[2 * layer + 2],
                                                            norm_weight=self.norm[2 * layer + 2])
            else:  # the last post fused with the head (the last residual is not stored)
                return flashmix.mhc_post_head(x, out, h_post, h_res, *self.hc_head)


if __name__ == "__main__":
    T, vocab = 64, 1000
    model = DeepSeekV4Stack(vocab=vocab)
    ids = torch.randint(0, vocab, (T,), device="cuda")
    emb = torch.randn(T, model.hidden, device="cuda").bfloat16()
    out = model(ids, emb)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        out = model(ids, emb)
    stop.record()
    stop.synchronize()
    print(f"{T} tokens through {len(model.moe)} blocks: out {tuple(out.shape)} {out.dtype}, "
          f"{start.elapsed_time(stop) / 10 * 1e3:.0f} us a forward")
