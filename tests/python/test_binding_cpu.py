"""The CPU backend through the Python binding, with numpy arrays (bf16 through
ml_dtypes), against the numpy reference written from docs/spec.md
(spec_reference.py); argument errors; the CUDA call path's existence; import
without torch; and, where torch is importable, the custom ops on CPU tensors.
Runs on any machine (no GPU)."""
import ctypes
import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

import flashmix
from flashmix import _C

import spec_reference as ref
from spec_reference import BF16

needs_bf16 = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed (numpy has no bfloat16)")


def assert_rounded_close(got, want, dtype_name, magnitude=None):
    """got (stored as dtype) vs the float64 reference: one rounding apart (1 ulp, relative),
    plus 1e-12 of the summed |terms| for the summation order."""
    got = np.asarray(got).astype(np.float64)
    mag = np.abs(want) if magnitude is None else magnitude
    tol = ref.ULP[dtype_name] * np.abs(want) + 1e-12 * mag + 1e-30
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements out of tolerance; first at " \
                          f"{np.argwhere(bad)[0]}: got {got[bad][0]}, want {want[bad][0]}"


def raises_naming(exc, op, arg):
    """pytest.raises for an error whose message is "<op>: <arg>: <rule>"."""
    return pytest.raises(exc, match=rf"^{op}: {arg.replace('.', '[.]')}: ")


# ---------------------------------------------------------------------------
# finalize_moe_routing (spec §2)
# ---------------------------------------------------------------------------

FINALIZE_CASES = [
    # T, k, H, padded_H, rows, out, E, start, E_local, scales, bias, shared
    (1, 1, 8, 8, "float32", "float32", 4, 0, 4, True, False, False),
    (7, 2, 13, 16, "float32", "float32", 8, 0, 8, True, True, False),
    (33, 8, 64, 72, "float32", "float32", 64, 16, 16, True, True, True),  # expert-parallel rank
    (9, 16, 24, 24, "float32", "float32", 32, 8, 8, False, False, True),  # k = 16, NO_SCALE
    (5, 4, 40, 48, "bfloat16", "bfloat16", 16, 4, 8, True, True, True),
    (5, 4, 17, 17, "float16", "float32", 16, 0, 16, True, True, False),
    (6, 3, 33, 40, "float32", "bfloat16", 12, 6, 6, True, False, True),
    (4, 2, 1, 1, "float16", "float16", 4, 1, 2, True, True, True),  # H = 1
]


@pytest.mark.parametrize("case", FINALIZE_CASES, ids=lambda c: "T{}_k{}_H{}_{}_{}_E{}@{}+{}{}{}{}".format(
    c[0], c[1], c[2], c[4], c[5], c[6], c[7], c[8], "_scales" if c[9] else "", "_bias" if c[10] else "",
    "_shared" if c[11] else ""))
def test_finalize_matches_spec(case):
    T, k, H, padded_H, rows_dtype, out_dtype, E, start, E_local, scales, bias, shared = case
    if BF16 is None and "bfloat16" in (rows_dtype, out_dtype):
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(T * 1000 + k * 10 + H)
    p = ref.finalize_problem(rng, T, k, H, padded_H, rows_dtype, E, start, E_local, scales, bias, shared, out_dtype)
    out = flashmix.finalize_moe_routing(p["rows"], p["u2p"], p["experts"], num_experts_per_node=E_local,
                                        start_expert_id=start, scales=p["scales"], bias=p["bias"],
                                        shared_output=p["shared"], hidden=H, out_dtype=out_dtype)
    assert out.shape == (T, H) and out.dtype == ref.np_dtype(out_dtype)
    want, mag = ref.finalize(p["rows"], p["u2p"], p["experts"], p["scales"], p["bias"], p["shared"], start,
                             E_local, H)
    assert_rounded_close(out, want, out_dtype, mag)


def test_finalize_writes_only_the_first_hidden_columns_of_a_strided_out():
    rng = np.random.default_rng(1)
    p = ref.finalize_problem(rng, 6, 4, 20, 24, "float32", 8, 0, 8, bias=True)
    full = np.full((6, 32), -5.0, np.float32)
    out = full[:, :20]  # row stride 32
    flashmix.finalize_moe_routing(p["rows"], p["u2p"], p["experts"], num_experts_per_node=8, scales=p["scales"],
                                  bias=p["bias"], out=out)
    want, mag = ref.finalize(p["rows"], p["u2p"], p["experts"], p["scales"], p["bias"], None, 0, 8, 20)
    assert_rounded_close(full[:, :20], want, "float32", mag)
    assert (full[:, 20:] == -5.0).all()


def test_finalize_takes_prefetch_indices():
    # A GPU launch option (the indices read behind the previous kernel): the
    # binding takes it, and the CPU backend's result is the same with it.
    rng = np.random.default_rng(5)
    p = ref.finalize_problem(rng, 9, 4, 24, 24, "float32", 16, 0, 16, True, True, False, "float32")
    kw = dict(num_experts_per_node=16, scales=p["scales"], bias=p["bias"])
    want = flashmix.finalize_moe_routing(p["rows"], p["u2p"], p["experts"], **kw)
    got = flashmix.finalize_moe_routing(p["rows"], p["u2p"], p["experts"], prefetch_indices=True, **kw)
    np.testing.assert_array_equal(got, want)


def test_finalize_zero_tokens_is_valid():
    rows = np.zeros((0, 8), np.float32)
    out = flashmix.finalize_moe_routing(rows, np.zeros(0, np.int32), np.zeros((0, 4), np.int32),
                                        num_experts_per_node=4)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("num_rows", [0, 5])
def test_finalize_zero_tokens_without_filling_is_valid(num_rows):
    # Zero tokens read nothing: empty maps are fine whatever the rows buffer holds.
    rows = np.ones((num_rows, 8), np.float32)
    for offsets in (np.zeros(0, np.int64), np.zeros(5, np.int64)):
        out = flashmix.finalize_moe_routing(rows, np.zeros(0, np.int32), np.zeros((0, 4), np.int32),
                                            num_experts_per_node=4, fill=False,
                                            permuted_row_to_unpermuted_row=np.zeros(0, np.int32),
                                            expert_first_token_offset=offsets)
        assert out.shape == (0, 8)


def test_finalize_without_filling_leaves_tokens_without_a_local_slot_untouched():
    rng = np.random.default_rng(2)
    T, k, H, E, start, E_local = 40, 2, 16, 32, 8, 4  # most tokens have no local slot
    p = ref.finalize_problem(rng, T, k, H, H, "float32", E, start, E_local, shared=True)
    out = np.full((T, H), 7.0, np.float32)
    flashmix.finalize_moe_routing(p["rows"], p["u2p"], p["experts"], num_experts_per_node=E_local,
                                  start_expert_id=start, scales=p["scales"], shared_output=p["shared"], out=out,
                                  fill=False, permuted_row_to_unpermuted_row=p["p2u"],
                                  expert_first_token_offset=p["offsets"])
    want, mag = ref.finalize(p["rows"], p["u2p"], p["experts"], p["scales"], None, p["shared"], start, E_local, H,
                             fill=False, out_before=np.full((T, H), 7.0))
    assert_rounded_close(out, want, "float32", mag)
    local = ((p["experts"] >= start) & (p["experts"] < start + E_local)).any(axis=1)
    assert (~local).sum() > 0 and (out[~local] == 7.0).all()


def test_finalize_fresh_out_without_filling_is_zero_for_tokens_without_a_local_slot():
    rng = np.random.default_rng(3)
    p = ref.finalize_problem(rng, 20, 2, 8, 8, "float32", 32, 0, 4)
    out = flashmix.finalize_moe_routing(p["rows"], p["u2p"], p["experts"], num_experts_per_node=4,
                                        scales=p["scales"], fill=False, permuted_row_to_unpermuted_row=p["p2u"],
                                        expert_first_token_offset=p["offsets"])
    local = ((p["experts"] >= 0) & (p["experts"] < 4)).any(axis=1)
    assert (out[~local] == 0).all()


# ---------------------------------------------------------------------------
# build_moe_routing_maps (spec §1)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("T,k,E,start,E_local", [(1, 1, 4, 0, 4), (50, 8, 64, 0, 64), (37, 6, 64, 16, 8),
                                                  (300, 2, 8, 3, 2)])
def test_routing_maps_match_spec(T, k, E, start, E_local):
    rng = np.random.default_rng(T + k)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    x = rng.uniform(-1, 1, (T, 24)).astype(np.float32)
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E_local, start_expert_id=start, input=x)
    offsets, p2u, u2p = ref.routing_maps(experts, start, E_local)
    P = len(p2u)
    np.testing.assert_array_equal(maps.expert_first_token_offset, offsets)
    np.testing.assert_array_equal(maps.permuted_row_to_unpermuted_row[:P], p2u)
    np.testing.assert_array_equal(maps.unpermuted_row_to_permuted_row, u2p)
    np.testing.assert_array_equal(maps.permuted_input[:P], x[p2u % T])
    assert flashmix.build_moe_routing_maps_workspace_size(T, k, E_local, start) >= 0


def test_routing_maps_zero_tokens_zero_the_offsets():
    offsets = np.full(5, 9, np.int64)
    flashmix.build_moe_routing_maps(np.zeros((0, 2), np.int32), num_experts_per_node=4,
                                    expert_first_token_offset=offsets)
    assert (offsets == 0).all()


def test_routing_workspace_size_is_zero_for_decode_and_positive_for_many_slots():
    assert flashmix.build_moe_routing_maps_workspace_size(16, 8, 256) == 0  # one block, one launch
    assert flashmix.build_moe_routing_maps_workspace_size(8192, 8, 32) > 0
    with raises_naming(ValueError, "build_moe_routing_maps", "k"):
        flashmix.build_moe_routing_maps_workspace_size(16, 0, 256)


def test_finalize_consumes_the_routing_maps():
    rng = np.random.default_rng(4)
    T, k, H, E, start, E_local = 24, 4, 12, 32, 8, 16
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E_local, start_expert_id=start)
    rows = rng.uniform(-1, 1, (k * T, H)).astype(np.float32)
    scales = rng.uniform(0, 1, (T, k)).astype(np.float32)
    out = flashmix.finalize_moe_routing(rows, maps.unpermuted_row_to_permuted_row, experts,
                                        num_experts_per_node=E_local, start_expert_id=start, scales=scales)
    want, mag = ref.finalize(rows, maps.unpermuted_row_to_permuted_row, experts, scales, None, None, start, E_local,
                             H)
    assert_rounded_close(out, want, "float32", mag)


# ---------------------------------------------------------------------------
# moe_fc2_finalize (spec §3), CPU reference
# ---------------------------------------------------------------------------

@needs_bf16
@pytest.mark.parametrize("mode", flashmix.FC2_MODES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_moe_fc2_finalize_matches_spec(mode, with_bias):
    rng = np.random.default_rng(5)
    T, k, E, H, I = 9, 2, 4, 16, 24
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E)
    A = rng.uniform(-1, 1, (k * T, I)).astype(BF16)
    W2 = (rng.uniform(-1, 1, (E, H, I)) / 4).astype(BF16)
    scales = rng.uniform(0, 1, (T, k)).astype(np.float32)
    bias = rng.uniform(-1, 1, (E, H)).astype(BF16) if with_bias else None
    out = flashmix.moe_fc2_finalize(A, W2, maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row, k=k,
                                    scales=scales, bias=bias, mode=mode)
    assert out.shape == (T, H) and out.dtype == BF16
    want = ref.fc2_finalize(A, W2, maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row, scales, bias,
                            T, k)
    assert_rounded_close(out, want, "bfloat16", None)
    ignored = flashmix.moe_fc2_finalize(A, W2, maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row,
                                        k=k, scales=scales, bias=bias, apply_bias=False, mode=mode)
    want = ref.fc2_finalize(A, W2, maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row, scales, None,
                            T, k)
    assert_rounded_close(ignored, want, "bfloat16", None)


@needs_bf16
@pytest.mark.parametrize("mode", flashmix.FC2_MODES)
def test_moe_fc2_finalize_shared_output_and_fill(mode):
    # An expert-parallel rank (experts [4, 6) of 8): most tokens have no local row.
    rng = np.random.default_rng(6)
    T, k, E, start, E_local, H, I = 24, 2, 8, 4, 2, 16, 24
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E_local, start_expert_id=start)
    A = rng.uniform(-1, 1, (k * T, I)).astype(BF16)
    W2 = (rng.uniform(-1, 1, (E_local, H, I)) / 4).astype(BF16)
    scales = rng.uniform(0, 1, (T, k)).astype(np.float32)
    wide = rng.uniform(-1, 1, (T, H + 8)).astype(BF16)
    shared = wide[:, :H]  # rows strided: 24 elements apart
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    sums = ref.fc2_finalize(A, W2, off, p2u, scales, None, T, k)
    local = ((experts >= start) & (experts < start + E_local)).any(axis=1)
    assert local.any() and (~local).any()
    for fill in (True, False):
        out = np.full((T, H), 7.0, BF16)
        got = flashmix.moe_fc2_finalize(A, W2, off, p2u, k=k, scales=scales, shared_output=shared, fill=fill,
                                        mode=mode, out=out)
        assert got is out
        want = sums + ref.f64(shared)
        if not fill:
            want[~local] = 7.0
        assert_rounded_close(out, want, "bfloat16", np.abs(sums) + np.abs(ref.f64(shared)))
    # A fresh out: zeroed where nothing is written (fill=False); T from shared_output alone.
    fresh = flashmix.moe_fc2_finalize(A, W2, off, p2u, k=k, shared_output=shared, fill=False, mode=mode)
    assert (ref.f64(fresh)[~local] == 0).all()
    want = ref.fc2_finalize(A, W2, off, p2u, None, None, T, k) + ref.f64(shared)
    assert_rounded_close(fresh[local], want[local], "bfloat16", None)


@needs_bf16
def test_moe_fc2_finalize_shared_output_bad_input_names_the_argument():
    A, W2 = np.zeros((4, 8), BF16), np.zeros((2, 8, 8), BF16)
    off, p2u = np.zeros(3, np.int64), np.zeros(4, np.int32)
    out = np.zeros((2, 8), BF16)
    with raises_naming(ValueError, "moe_fc2_finalize", "shared_output"):  # not T rows
        flashmix.moe_fc2_finalize(A, W2, off, p2u, k=2, out=out, shared_output=np.zeros((3, 8), BF16))
    with raises_naming(ValueError, "moe_fc2_finalize", "shared_output"):  # not bf16
        flashmix.moe_fc2_finalize(A, W2, off, p2u, k=2, out=out, shared_output=np.zeros((2, 8), np.float32))
    with raises_naming(ValueError, "moe_fc2_finalize", "shared_stride"):  # library rule: a multiple of 8
        flashmix.moe_fc2_finalize(A, W2, off, p2u, k=2, out=out, shared_output=np.zeros((2, 12), BF16)[:, :8])
    with raises_naming(ValueError, "moe_fc2_finalize", "out_already_zeroed"):  # library rule
        flashmix.moe_fc2_finalize(A, W2, off, p2u, k=2, out=out, out_already_zeroed=True, fill=False)


# ---------------------------------------------------------------------------
# moe_router (spec §8), CPU reference
# ---------------------------------------------------------------------------

ROUTER_CASES = {
    # name: (E, k, options)
    "softmax": (32, 4, {}),
    "softmax_renormalize": (8, 2, {"renormalize": True}),  # Mixtral
    "sigmoid_noaux_tc": (64, 8, {"scoring": "sigmoid", "renormalize": True, "correction_bias": True, "n_group": 8,
                                 "topk_group": 4, "routed_scaling_factor": 2.5}),  # DeepSeek-V3
    "sqrtsoftplus": (48, 6, {"scoring": "sqrtsoftplus", "renormalize": True, "correction_bias": True,
                             "routed_scaling_factor": 1.5}),  # DeepSeek-V4
    "softmax_after_topk": (32, 4, {"scoring": "softmax_after_topk"}),  # gpt-oss
    "sigmoid_groups_no_bias": (16, 3, {"scoring": "sigmoid", "n_group": 4, "topk_group": 2}),
}


def router_problem(rng, T, E, options, dtype="float32"):
    logits = ref.grid_logits(rng, T, E).astype(ref.np_dtype(dtype))
    kw = dict(options)
    if kw.get("correction_bias"):
        kw["correction_bias"] = rng.uniform(-0.5, 0.5, E).astype(np.float32)
    return logits, kw


@pytest.mark.parametrize("logits_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(ROUTER_CASES))
def test_moe_router_matches_spec(case, logits_dtype):
    if BF16 is None and logits_dtype == "bfloat16":
        pytest.skip("ml_dtypes is not installed")
    E, k, options = ROUTER_CASES[case]
    rng = np.random.default_rng(E * 7 + k)
    T = 21
    logits, kw = router_problem(rng, T, E, options, logits_dtype)
    ids, weights = flashmix.moe_router(logits, k, **kw)
    assert ids.shape == (T, k) and ids.dtype == np.int32 and weights.dtype == np.float32
    want_ids, want_w = ref.router(logits, k, **kw)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2.0 ** -23, atol=1e-30)
    if kw.get("renormalize") or kw.get("scoring") == "softmax_after_topk":
        np.testing.assert_allclose(weights.sum(axis=1), kw.get("routed_scaling_factor", 1.0), rtol=1e-6)


def test_moe_router_special_values_and_given_outputs():
    # NaN reads as -inf, +inf as the largest float: a row of -inf/NaN gets the k lowest ids, weight 0.
    logits = np.array([[0.5, np.nan, np.inf, -1.0], [-np.inf, np.nan, -np.inf, -np.inf]], np.float32)
    ids = np.full((2, 2), -9, np.int32)
    scales = np.full((2, 2), -9.0, np.float32)
    out = flashmix.moe_router(logits, 2, renormalize=True, token_selected_experts=ids, token_final_scales=scales)
    assert out.token_selected_experts is ids and out.token_final_scales is scales
    np.testing.assert_array_equal(ids, [[2, 0], [0, 1]])
    np.testing.assert_array_equal(scales, [[1.0, 0.0], [0.0, 0.0]])
    want_ids, want_w = ref.router(logits, 2, renormalize=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scales, want_w)


@pytest.mark.parametrize("scoring,renormalize", [("sqrtsoftplus", True), ("sigmoid", False), ("softmax", False),
                                                  ("softmax", True), ("softmax_after_topk", False)])
@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
def test_moe_router_hash_selection_matches_spec(scoring, renormalize, ids_dtype):
    # spec §8.7: the table row of each token id, in order; ids outside [0, V) and entries outside
    # [0, E) give -1 / 0; a repeated expert keeps both slots.
    rng = np.random.default_rng(31)
    T, E, k, V = 40, 24, 6, 50
    logits = rng.uniform(-6, 6, (T, E)).astype(np.float32)
    table = np.array([rng.permutation(E)[:k] for _ in range(V)], np.int32)
    table[3, 1], table[7, 4], table[9, 5] = E, -1, table[9, 0]
    token_ids = rng.integers(0, V, T).astype(ids_dtype)
    token_ids[[0, 5]], token_ids[[1, 2, 6]] = V, [3, 7, 9]
    token_ids[8] = -2
    ids, weights = flashmix.moe_router(logits, k, scoring=scoring, renormalize=renormalize,
                                       routed_scaling_factor=1.5, token_ids=token_ids, hash_table=table)
    want_ids, want_w = ref.hash_router(logits, token_ids, table, scoring, renormalize, 1.5)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2.0 ** -23, atol=1e-30)
    assert (ids[[0, 5, 8]] == -1).all() and (weights[[0, 5, 8]] == 0).all()
    assert ids[1, 1] == -1 and ids[2, 4] == -1 and ids[6, 5] == ids[6, 0]


def test_moe_router_hash_selection_bad_input_raises_value_error_naming_the_argument():
    logits = np.zeros((4, 16), np.float32)
    table, tok = np.zeros((10, 2), np.int32), np.zeros(4, np.int64)
    for kw, arg in [({"token_ids": tok}, "hash_table"),                           # one without the other
                    ({"hash_table": table}, "token_ids"),
                    ({"token_ids": tok, "hash_table": np.zeros((10, 3), np.int32)}, "hash_table"),  # not k columns
                    ({"token_ids": tok, "hash_table": table.astype(np.int64)}, "hash_table"),        # dtype
                    ({"token_ids": tok[:3], "hash_table": table}, "token_ids"),                       # not [T]
                    ({"token_ids": tok.astype(np.float32), "hash_table": table}, "token_ids"),        # dtype
                    ({"token_ids": tok, "hash_table": table, "correction_bias": np.zeros(16, np.float32)},
                     "correction_bias"),                                                              # library rule
                    ({"token_ids": tok, "hash_table": table, "n_group": 4, "topk_group": 2}, "topk_group"),
                    ({"token_ids": tok, "hash_table": table[:0]}, "vocab_size")]:                     # library rule
        with raises_naming(ValueError, "moe_router", arg):
            flashmix.moe_router(logits, 2, **kw)


def test_moe_router_zero_tokens_is_valid():
    ids, weights = flashmix.moe_router(np.zeros((0, 16), np.float32), 4)
    assert ids.shape == (0, 4) and weights.shape == (0, 4)


@pytest.mark.parametrize("change,arg", [
    ({"scoring": "softmax_topk"}, "scoring"),
    ({"k": 0}, "k"),                                                        # library rule
    ({"k": 17}, "k"),                                                       # library rule
    ({"n_group": 3}, "n_group"),                                            # library rule: divides E
    ({"n_group": 4, "topk_group": 5}, "topk_group"),                        # library rule
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),     # library rule
    ({"path": 3}, "tuning.path"),                                           # library rule
    ({"correction_bias": np.zeros(15, np.float32)}, "correction_bias"),     # not [E]
    ({"correction_bias": np.zeros(16, np.float64)}, "correction_bias"),     # dtype
    ({"logits": np.zeros((4, 16), np.int32)}, "logits"),                    # dtype
    ({"logits": np.zeros((16, 4), np.float32).T}, "logits"),                # not dense
    ({"logits": np.zeros(16, np.float32)}, "logits"),                       # not [T, E]
    ({"token_selected_experts": np.zeros((3, 4), np.int32)}, "token_selected_experts"),  # not T rows
    ({"token_selected_experts": np.zeros((4, 4), np.int64)}, "token_selected_experts"),  # dtype
    ({"token_final_scales": np.zeros((4, 3), np.float32)}, "token_final_scales"),      # shape
    ({"token_selected_experts": np.zeros((4, 3), np.int32)}, "token_selected_experts"),  # not k columns
])
def test_moe_router_bad_input_raises_value_error_naming_the_argument(change, arg):
    kw = {"logits": np.zeros((4, 16), np.float32), "k": 4}
    kw.update(change)
    logits, k = kw.pop("logits"), kw.pop("k")
    with raises_naming(ValueError, "moe_router", arg):
        flashmix.moe_router(logits, k, **kw)


def test_moe_router_not_supported_raises_not_implemented_error():
    with pytest.raises(NotImplementedError, match=r"^moe_router: logits_dtype: "):
        flashmix.moe_router(np.zeros((4, 16), np.float16), 4)
    with pytest.raises(NotImplementedError, match=r"^moe_router: num_experts: "):
        flashmix.moe_router(np.zeros((2, 513), np.float32), 4)


# ---------------------------------------------------------------------------
# moe_fc1 (spec §9), CPU reference
# ---------------------------------------------------------------------------

def fc1_problem(rng, T=10, k=3, E=8, start=0, E_local=8, H=32, I=16, w_scale=0.5):
    """Random routing (distinct experts per token), X ~ U(-2, 2), W1 ~ U(-w, w) (clamps fire at
    limit 2.5), bias ~ U(-0.5, 0.5); W1 and bias in the gate_up layout."""
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    return {"experts": experts, "x": rng.uniform(-2, 2, (T, H)).astype(BF16),
            "w1": rng.uniform(-w_scale, w_scale, (E_local, 2 * I, H)).astype(BF16),
            "bias": rng.uniform(-0.5, 0.5, (E_local, 2 * I)).astype(BF16), "start": start, "E_local": E_local,
            "T": T, "k": k, "I": I}


def fc1_in_layout(p, layout):
    """(w1, bias) of problem p in `layout` (the same logical weights)."""
    if layout == "gate_up":
        return p["w1"], p["bias"]
    return ref.to_interleaved(p["w1"]), ref.to_interleaved(p["bias"])


FC1_OPTIONS = {"defaults": {}, "limit": {"limit": 2.5}, "limit_alpha": {"limit": 2.5, "alpha": 1.25}}


@needs_bf16
@pytest.mark.parametrize("options", list(FC1_OPTIONS))
@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "swiglu_clamped"])
@pytest.mark.parametrize("layout", ["gate_up", "interleaved"])
def test_moe_fc1_matches_spec(layout, activation, options):
    rng = np.random.default_rng(len(layout) * 10 + len(activation))
    p = fc1_problem(rng, start=4, E_local=4, E=12)  # an expert-parallel rank
    maps = flashmix.build_moe_routing_maps(p["experts"], num_experts_per_node=p["E_local"],
                                           start_expert_id=p["start"])
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    P = int(off[-1])
    w1, bias = fc1_in_layout(p, layout)
    kw = dict(FC1_OPTIONS[options], layout=layout, activation=activation)
    out = np.full((p["k"] * p["T"], p["I"]), np.nan, BF16)  # rows past P keep the poison
    got = flashmix.moe_fc1(p["x"], w1, off, p2u, k=p["k"], bias=bias, out=out, **kw)
    assert got is out
    want = ref.fc1(p["x"], w1, off, p2u, p["T"], bias, **kw)
    assert 0 < P < out.shape[0] and np.isnan(ref.f64(out[P:])).all()
    assert_rounded_close(out[:P], want, "bfloat16")
    # The same logical weights in the other layout: bitwise the same (spec §9.2).
    other = "interleaved" if layout == "gate_up" else "gate_up"
    w1_o, bias_o = fc1_in_layout(p, other)
    again = flashmix.moe_fc1(p["x"], w1_o, off, p2u, k=p["k"], bias=bias_o, **dict(kw, layout=other))
    np.testing.assert_array_equal(again[:P].view(np.uint16), out[:P].view(np.uint16))


@needs_bf16
def test_moe_fc1_gathers_through_the_maps_or_reads_a_permuted_copy():
    rng = np.random.default_rng(31)
    p = fc1_problem(rng, T=9, k=2, H=24, I=8)
    wide = np.zeros((p["T"], 40), BF16)
    wide[:, :24] = p["x"]
    x_strided = wide[:, :24]  # row stride 40, a multiple of 8
    maps = flashmix.build_moe_routing_maps(p["experts"], num_experts_per_node=8, input=p["x"])
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    plain = flashmix.moe_fc1(p["x"], p["w1"], off, p2u, k=2)
    strided = flashmix.moe_fc1(x_strided, p["w1"], off, p2u, k=2)
    permuted = flashmix.moe_fc1(maps.permuted_input, p["w1"], off, p2u, k=2, x_permuted=True)
    assert plain.shape == (2 * p["T"], 8) and plain.dtype == BF16
    np.testing.assert_array_equal(strided, plain)
    np.testing.assert_array_equal(permuted, plain)  # P = k*T: every row written
    assert_rounded_close(plain, ref.fc1(p["x"], p["w1"], off, p2u, p["T"]), "bfloat16")


@needs_bf16
def test_moe_fc1_keeps_nan_through_the_clamps():
    rng = np.random.default_rng(32)
    p = fc1_problem(rng, T=4, k=1, E=2, E_local=2, H=8, I=8)
    p["x"][1, 3] = np.nan  # token 1: g and u NaN
    maps = flashmix.build_moe_routing_maps(p["experts"], num_experts_per_node=2)
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    for activation in ("swiglu", "swiglu_oai", "swiglu_clamped"):
        out = flashmix.moe_fc1(p["x"], p["w1"], off, p2u, k=1, activation=activation, limit=0.5)
        nan_rows = np.isnan(ref.f64(out)).all(axis=1)
        np.testing.assert_array_equal(nan_rows, p2u % 4 == 1)


@needs_bf16
def test_moe_fc1_zero_tokens_is_valid():
    out = flashmix.moe_fc1(np.zeros((0, 8), BF16), np.zeros((2, 16, 8), BF16), np.zeros(3, np.int64),
                           np.zeros(0, np.int32), k=2)
    assert out.shape == (0, 8)


@needs_bf16
@pytest.mark.parametrize("change,arg", [
    ({"w1": np.zeros((2, 15, 16), BF16)}, "W1"),                # odd 2I
    ({"w1": np.zeros((2, 16, 16), np.float32)}, "W1"),          # dtype
    ({"w1": np.zeros((2, 16, 16, 1), BF16)}, "W1"),             # not 3-D
    ({"x": np.zeros((4, 8), BF16)}, "X"),                       # not H columns
    ({"x": np.zeros((4, 16), np.float32)}, "X"),                # dtype
    ({"x": np.zeros((3, 16), BF16), "num_tokens": 4}, "X"),     # fewer than T rows
    ({"x": np.zeros((7, 16), BF16), "x_permuted": True}, "num_tokens"),  # not k*T rows
    ({"out": np.zeros((7, 8), BF16)}, "out"),                   # fewer than k*T rows
    ({"out": np.zeros((8, 16), BF16)}, "out"),                  # not I columns
    ({"bias": np.zeros((2, 8), BF16)}, "bias"),                 # not [E_local, 2I]
    ({"off": np.zeros(2, np.int64)}, "expert_first_token_offset"),
    ({"p2u": np.zeros(8, np.int64)}, "permuted_row_to_unpermuted_row"),
    ({"activation": "gelu"}, "activation"),
    ({"layout": "up_gate"}, "layout"),
    ({"limit": -1.0}, "limit"),                                 # library rule
    ({"alpha": float("nan")}, "alpha"),                         # library rule
    ({"k": 17}, "k"),                                           # library rule
    ({"x": np.zeros((4, 12), BF16), "w1": np.zeros((2, 16, 12), BF16)}, "hidden"),  # library: H % 8
])
def test_moe_fc1_bad_input_raises_value_error_naming_the_argument(change, arg):
    kw = {"x": np.zeros((4, 16), BF16), "w1": np.zeros((2, 16, 16), BF16), "off": np.zeros(3, np.int64),
          "p2u": np.zeros(8, np.int32), "k": 2, "out": np.full((8, 8), 3.0, BF16)}
    kw.update(change)
    x, w1, off, p2u, out = (kw.pop(n) for n in ("x", "w1", "off", "p2u", "out"))
    before = out.copy()
    with raises_naming(ValueError, "moe_fc1", arg):
        flashmix.moe_fc1(x, w1, off, p2u, out=out, **kw)
    np.testing.assert_array_equal(out.view(np.uint16), before.view(np.uint16))  # nothing written


# ---------------------------------------------------------------------------
# moe_forward (spec §10), CPU reference: the stages chained
# ---------------------------------------------------------------------------

def forward_problem(rng, T=13, k=3, E=12, start=0, E_local=12, H=16, I=24, biases=True):
    p = {"T": T, "k": k, "E": E, "start": start, "E_local": E_local,
         "x": rng.uniform(-1, 1, (T, H)).astype(BF16),
         "w1": (rng.uniform(-1, 1, (E_local, 2 * I, H)) / 2).astype(BF16),
         "w2": (rng.uniform(-1, 1, (E_local, H, I)) / 4).astype(BF16),
         "logits": ref.grid_logits(rng, T, E),
         "experts": np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k),
         "scales": rng.uniform(0, 1, (T, k)).astype(np.float32),
         "shared": rng.uniform(-1, 1, (T, H)).astype(BF16)}
    p["b1"] = rng.uniform(-0.5, 0.5, (E_local, 2 * I)).astype(BF16) if biases else None
    p["b2"] = rng.uniform(-0.5, 0.5, (E_local, H)).astype(BF16) if biases else None
    return p


def forward_by_stages(p, experts, scales, out, layout="gate_up", activation="swiglu", mode="atomic", shared=None,
                      fill=True):
    """The layer from the package's stage functions (CPU): maps -> moe_fc1 -> moe_fc2_finalize."""
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=p["E_local"], start_expert_id=p["start"])
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    act = flashmix.moe_fc1(p["x"], p["w1"], off, p2u, k=p["k"], bias=p["b1"], layout=layout, activation=activation)
    return flashmix.moe_fc2_finalize(act, p["w2"], off, p2u, k=p["k"], scales=scales, bias=p["b2"],
                                     shared_output=shared, fill=fill, mode=mode, out=out)


@needs_bf16
@pytest.mark.parametrize("fill", [True, False])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("routing", ["router", "ids"])
@pytest.mark.parametrize("rank", ["all", "ep"])
def test_moe_forward_matches_the_stages_and_spec(rank, routing, shared, fill):
    rng = np.random.default_rng(40 + (rank == "ep") * 4 + (routing == "ids") * 2 + shared)
    start, E_local = (4, 4) if rank == "ep" else (0, 12)
    p = forward_problem(rng, start=start, E_local=E_local)
    T, k, H = p["T"], p["k"], p["x"].shape[1]
    shared_output = p["shared"] if shared else None
    kw = dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.0) if routing == "router" else {}
    if routing == "router":
        experts, scales = flashmix.moe_router(p["logits"], k, **kw)
        src = dict(router_logits=p["logits"], **kw)
    else:
        experts, scales = p["experts"], p["scales"]
        src = dict(token_selected_experts=experts, token_final_scales=scales)
    out = np.full((T, H), 5.0, BF16)
    got = flashmix.moe_forward(p["x"], p["w1"], p["w2"], k=k, start_expert_id=start, b1=p["b1"], b2=p["b2"],
                               shared_output=shared_output, fill=fill, out=out, **src)
    assert got is out
    by_stages = forward_by_stages(p, experts, scales, np.full((T, H), 5.0, BF16), shared=shared_output, fill=fill)
    np.testing.assert_array_equal(out.view(np.uint16), by_stages.view(np.uint16))
    want, mag = ref.moe_forward(p["x"], p["w1"], p["w2"], experts, scales, start, E_local, p["b1"], p["b2"],
                                shared=shared_output, fill=fill, out_before=np.full((T, H), 5.0))
    # FC1's rows may round one unit apart (2^-8 relative), which FC2 carries.
    tol = ref.ULP["bfloat16"] * np.abs(want) + 2.0 ** -8 * mag + 1e-30
    assert (np.abs(ref.f64(out) - want) <= tol).all()
    local = ((experts >= start) & (experts < start + E_local)).any(axis=1)
    if rank == "ep" and not fill:
        assert (~local).any() and (ref.f64(out)[~local] == 5.0).all()


@needs_bf16
@pytest.mark.parametrize("mode", flashmix.FC2_MODES)
@pytest.mark.parametrize("activation,layout", [("swiglu", "gate_up"), ("swiglu_oai", "interleaved"),
                                               ("swiglu_clamped", "gate_up")])
def test_moe_forward_modes_activations_and_router_outputs(mode, activation, layout):
    rng = np.random.default_rng(50)
    p = forward_problem(rng, T=9, k=2, E=8, E_local=8, biases=False)
    T, k = p["T"], p["k"]
    kw = dict(scoring="softmax_after_topk")
    ids = np.zeros((T, k), np.int32)
    scales = np.zeros((T, k), np.float32)
    out = flashmix.moe_forward(p["x"], p["w1"], p["w2"], k=k, router_logits=p["logits"], w1_layout=layout,
                               activation=activation, mode=mode, selected_experts_out=ids, final_scales_out=scales,
                               **kw)
    want_ids, want_scales = flashmix.moe_router(p["logits"], k, **kw)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(scales, want_scales)
    by_stages = forward_by_stages(p, ids, scales, np.zeros_like(out), layout=layout,
                                  activation=activation, mode=mode)
    np.testing.assert_array_equal(out.view(np.uint16), by_stages.view(np.uint16))


@needs_bf16
@pytest.mark.parametrize("routing", ["router", "ids"])
@pytest.mark.parametrize("rank", ["all", "ep"])
def test_moe_forward_fc1_inputs_give_bitwise_identical_outputs(rank, routing):
    # spec §10.3: FC1 reading x gathered or the permuted copy: the same products in the same order.
    rng = np.random.default_rng(53 + (rank == "ep") * 2 + (routing == "ids"))
    start, E_local = (4, 4) if rank == "ep" else (0, 12)
    p = forward_problem(rng, start=start, E_local=E_local)
    T, k, H = p["T"], p["k"], p["x"].shape[1]
    src = (dict(router_logits=p["logits"], scoring="sigmoid", renormalize=True) if routing == "router" else
           dict(token_selected_experts=p["experts"], token_final_scales=p["scales"]))
    xs = np.zeros((T, H + 8), BF16)  # strided rows: the copy and the gather both honour x_stride
    xs[:, :H] = p["x"]
    outs = {}
    for fc1_input in ("gather", "permuted_copy", "auto"):
        out = np.full((T, H), 5.0, BF16)
        got = flashmix.moe_forward(xs[:, :H], p["w1"], p["w2"], k=k, start_expert_id=start, b1=p["b1"], b2=p["b2"],
                                   shared_output=p["shared"], fill=False, fc1_input=fc1_input, out=out, **src)
        assert got is out
        outs[fc1_input] = out.view(np.uint16)
    assert flashmix.FC1_INPUTS == ("auto", "gather", "permuted_copy")
    np.testing.assert_array_equal(outs["gather"], outs["permuted_copy"])
    np.testing.assert_array_equal(outs["auto"], outs["gather"])
    assert (outs["gather"] != np.full((T, H), 5.0, BF16).view(np.uint16)).any()


@needs_bf16
def test_moe_forward_unknown_fc1_input_raises_value_error_naming_it():
    p = forward_problem(np.random.default_rng(57), T=4, k=2, E=8, E_local=8)
    out = np.full((4, 16), 3.0, BF16)
    before = out.copy()
    for name in ("copy", "Gather", "", "permuted-copy"):
        with raises_naming(ValueError, "moe_forward", "fc1_input"):
            flashmix.moe_forward(p["x"], p["w1"], p["w2"], k=2, router_logits=p["logits"], fc1_input=name, out=out)
        with raises_naming(ValueError, "moe_forward", "fc1_input"):
            flashmix.moe_forward_workspace_size(4, 2, 16, 24, 8, fc1_input=name)
    np.testing.assert_array_equal(out.view(np.uint16), before.view(np.uint16))  # nothing written


@needs_bf16
def test_moe_forward_fresh_out_without_filling_is_zero_for_tokens_without_a_local_expert():
    rng = np.random.default_rng(51)
    p = forward_problem(rng, T=20, k=2, E=16, start=8, E_local=2)
    out = flashmix.moe_forward(p["x"], p["w1"], p["w2"], k=2, token_selected_experts=p["experts"],
                               start_expert_id=8, fill=False)
    local = ((p["experts"] >= 8) & (p["experts"] < 10)).any(axis=1)
    assert (~local).any() and (ref.f64(out)[~local] == 0).all()


@needs_bf16
def test_moe_forward_zero_tokens_and_workspace_size():
    p = forward_problem(np.random.default_rng(52), T=0)
    out = flashmix.moe_forward(p["x"], p["w1"], p["w2"], k=3, router_logits=p["logits"])
    assert out.shape == (0, 16)
    # (one FC1 input for both: with num_experts = 256 the automatic rule estimates 16 rows an expert)
    with_router = flashmix.moe_forward_workspace_size(512, 8, 7168, 2048, 32, "atomic", num_experts=256,
                                                      start_expert_id=64, fc1_input="gather")
    given_ids = flashmix.moe_forward_workspace_size(512, 8, 7168, 2048, 32, with_router=False, fc1_input="gather")
    # at least the FC1 rows (k*T x I bf16) and the router's choice
    assert with_router > given_ids >= 512 * 8 * 2048 * 2
    assert with_router - given_ids >= 2 * 512 * 8 * 4
    # x's permuted copy [k*T, H] bf16 is held only where fc1_input resolves to it (auto: T*k >= 64*E)
    gather = flashmix.moe_forward_workspace_size(512, 8, 7168, 2048, 32, fc1_input="gather")
    copy = flashmix.moe_forward_workspace_size(512, 8, 7168, 2048, 32, fc1_input="permuted_copy")
    assert copy - gather >= 512 * 8 * 7168 * 2
    assert flashmix.moe_forward_workspace_size(512, 8, 7168, 2048, 32) == copy  # 4096 rows >= 64 * 32
    # except bf16 with I <= 1024 (Qwen3-MoE's experts): the gather
    assert flashmix.moe_forward_workspace_size(4096, 8, 2048, 768, 128) == flashmix.moe_forward_workspace_size(
        4096, 8, 2048, 768, 128, fc1_input="gather")
    # auto estimates rows an expert over all num_experts: 4096 < 64 * 256 picks the gather
    assert flashmix.moe_forward_workspace_size(512, 8, 7168, 2048, 32, num_experts=256,
                                               start_expert_id=64) == flashmix.moe_forward_workspace_size(
        512, 8, 7168, 2048, 32, num_experts=256, start_expert_id=64, fc1_input="gather")
    assert flashmix.moe_forward_workspace_size(4, 8, 7168, 2048, 32) == flashmix.moe_forward_workspace_size(
        4, 8, 7168, 2048, 32, fc1_input="gather")
    with raises_naming(ValueError, "moe_forward", "mode"):
        flashmix.moe_forward_workspace_size(512, 8, 7168, 2048, 32, "fast")
    with pytest.raises(ValueError, match=r"^moe_forward: (moe_fc1: )?inter: "):  # library: I % 8
        flashmix.moe_forward_workspace_size(512, 8, 7168, 100, 32)


@needs_bf16
@pytest.mark.parametrize("change,arg", [
    ({"router_logits": None}, "router_logits"),                                       # library: neither
    ({"token_selected_experts": np.zeros((4, 2), np.int32)}, "router_logits"),        # library: both
    ({"token_final_scales": np.zeros((4, 2), np.float32)}, "token_final_scales"),     # library: with logits
    ({"router_logits": np.zeros((3, 8), np.float32)}, "router_logits"),               # not T rows
    ({"router_logits": np.zeros((4, 8), np.int32)}, "router_logits"),                 # dtype
    ({"num_experts": 6}, "num_experts"),                                              # not logits' E
    ({"start_expert_id": 7}, "num_experts_per_node"),                                 # library: past E
    ({"w1": np.zeros((2, 8, 8), BF16)}, "W1"),                                        # not [E_local, 2I, H]
    ({"w2": np.zeros((2, 8, 8), np.float32)}, "W2"),                                  # dtype
    ({"x": np.zeros((4, 16), BF16)}, "X"),                                            # not H columns
    ({"out": np.zeros((4, 16), BF16)}, "out"),                                        # not [T, H]
    ({"b1": np.zeros((2, 8), BF16)}, "b1"),
    ({"b2": np.zeros((2, 4), BF16)}, "b2"),
    ({"shared_output": np.zeros((3, 8), BF16)}, "shared_output"),
    ({"correction_bias": np.zeros(7, np.float32)}, "correction_bias"),
    ({"router_logits": None, "token_selected_experts": np.zeros((4, 2), np.int32),
      "correction_bias": np.zeros(8, np.float32)}, "correction_bias"),                # only with the router
    ({"router_logits": None, "token_selected_experts": np.zeros((4, 2), np.int32),
      "selected_experts_out": np.zeros((4, 2), np.int32)}, "selected_experts_out"),   # only with the router
    ({"token_selected_experts": np.zeros((4, 3), np.int32), "router_logits": None}, "token_selected_experts"),
    ({"final_scales_out": np.zeros((4, 3), np.float32)}, "final_scales_out"),
    ({"scoring": "argmax"}, "scoring"),
    ({"w1_layout": "gate-up"}, "w1_layout"),
    ({"activation": "relu"}, "activation"),
    ({"mode": "fast"}, "mode"),
    ({"fc1_input": "copy"}, "fc1_input"),
    ({"k": 0}, "k"),                                                                  # library rule
    ({"n_group": 3}, "moe_router: n_group"),                                          # the router stage's rule
])
def test_moe_forward_bad_input_raises_value_error_naming_the_argument(change, arg):
    kw = {"x": np.zeros((4, 8), BF16), "w1": np.zeros((2, 16, 8), BF16), "w2": np.zeros((2, 8, 8), BF16),
          "k": 2, "router_logits": np.zeros((4, 8), np.float32), "out": np.full((4, 8), 3.0, BF16)}
    kw.update(change)
    x, w1, w2, out = (kw.pop(n) for n in ("x", "w1", "w2", "out"))
    before = out.copy()
    with raises_naming(ValueError, "moe_forward", arg):
        flashmix.moe_forward(x, w1, w2, out=out, **kw)
    np.testing.assert_array_equal(out.view(np.uint16), before.view(np.uint16))  # nothing written


# ---------------------------------------------------------------------------
# mHC (spec §4)
# ---------------------------------------------------------------------------

MHC_PARAMS = {
    "defaults": {},
    "seed": flashmix.MHC_SEED_PARAMS,
    "custom": {"eps_norm": 1e-3, "eps_pre": 0.01, "post_mult": 1.5, "eps_sinkhorn": 1e-4, "sinkhorn_iters": 5},
}


@needs_bf16
@pytest.mark.parametrize("params", list(MHC_PARAMS))
@pytest.mark.parametrize("phi_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n,C", [(1, 8), (2, 24), (4, 64), (8, 16)])
def test_mhc_pre_matches_spec(n, C, phi_dtype, params):
    rng = np.random.default_rng(n * 100 + C)
    B = 5
    x, phi, alpha, bias = ref.mhc_problem(rng, B, n, C, phi_dtype)
    kw = MHC_PARAMS[params]
    f_pre, h_post, h_res = flashmix.mhc_pre(x, phi, alpha, bias, **kw)
    assert f_pre.shape == (B, C) and f_pre.dtype == BF16
    assert h_post.shape == (B, n) and h_res.shape == (B, n, n) and h_res.dtype == np.float32
    want_f, want_post, want_res = ref.mhc_pre(x, phi, alpha, bias, n, **kw)
    # The reference backend keeps H_pre in double: F_pre is one rounding from the exact mix.
    assert_rounded_close(f_pre, want_f, "bfloat16")
    np.testing.assert_allclose(h_post, want_post, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h_res, want_res, rtol=1e-5, atol=1e-7)
    if not kw:  # doubly stochastic up to eps: columns sum to ~1
        np.testing.assert_allclose(h_res.sum(axis=1), 1.0, atol=1e-4)


def test_mhc_workspace_bytes_covers_small_batches_only():
    assert flashmix.mhc_workspace_bytes(0, 4, 7168) == 0
    assert flashmix.mhc_workspace_bytes(33, 4, 7168) == 0
    # 256 header bytes + [256 records][16 tokens x (N + 1) = 400] 8-byte tagged words
    assert flashmix.mhc_workspace_bytes(16, 4, 7168) == 256 + 8 * 256 * 400
    assert 0 < flashmix.mhc_workspace_bytes(1, 8, 64) < flashmix.mhc_workspace_bytes(32, 8, 64)


@needs_bf16
def test_mhc_workspace_is_checked_and_does_not_change_the_cpu_result():
    rng = np.random.default_rng(9)
    B, n, C = 5, 8, 16
    x, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    ws = np.zeros(flashmix.mhc_workspace_bytes(B, n, C), dtype=np.uint8)
    plain = flashmix.mhc_pre(x, phi, alpha, bias)
    with_ws = flashmix.mhc_pre(x, phi, alpha, bias, workspace=ws)
    for u, v in zip(plain, with_ws):
        np.testing.assert_array_equal(u, v)
    h, r = flashmix.mhc_project(x, phi, alpha, bias, workspace=ws)
    np.testing.assert_array_equal(h, flashmix.mhc_project(x, phi, alpha, bias)[0])
    with pytest.raises(ValueError, match="workspace_bytes"):
        flashmix.mhc_pre(x, phi, alpha, bias, workspace=ws[:64])
    with pytest.raises(ValueError, match="workspace_bytes"):
        flashmix.mhc_head(x, phi[:n], alpha[:1], bias[:n], workspace=ws[:64])


@needs_bf16
def test_mhc_pre_accepts_x_as_b_by_nc():
    rng = np.random.default_rng(6)
    x, phi, alpha, bias = ref.mhc_problem(rng, 3, 4, 32)
    a = flashmix.mhc_pre(x, phi, alpha, bias)
    b = flashmix.mhc_pre(x.reshape(3, 4 * 32), phi, alpha, bias)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


@needs_bf16
def test_mhc_pre_zero_batch_is_valid():
    rng = np.random.default_rng(7)
    x, phi, alpha, bias = ref.mhc_problem(rng, 0, 4, 16)
    f_pre, h_post, h_res = flashmix.mhc_pre(x, phi, alpha, bias)
    assert f_pre.shape == (0, 16) and h_res.shape == (0, 4, 4)


@needs_bf16
@pytest.mark.parametrize("res_layout", ["deepseek", "row_mix"])
@pytest.mark.parametrize("n,C", [(1, 16), (3, 8), (4, 64), (8, 24)])
def test_mhc_post_matches_spec(n, C, res_layout):
    rng = np.random.default_rng(n * 10 + C)
    x, f_out, h_post, h_res = ref.post_problem(rng, 4, n, C)
    x_next = flashmix.mhc_post(x, f_out, h_post, h_res, res_layout=res_layout)
    assert x_next.shape == x.shape and x_next.dtype == BF16
    assert_rounded_close(x_next, ref.mhc_post(x, f_out, h_post, h_res, res_layout), "bfloat16")


@needs_bf16
@pytest.mark.parametrize("res_layout", ["deepseek", "row_mix"])
@pytest.mark.parametrize("n,C", [(1, 16), (3, 8), (4, 64), (8, 24)])
def test_mhc_post_pre_is_post_then_pre(n, C, res_layout):
    rng = np.random.default_rng(n * 7 + C)
    B = 5
    x, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    _, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    kw = MHC_PARAMS["custom"]
    out = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, res_layout=res_layout, **kw)
    assert isinstance(out, flashmix.MhcPostPreOutput)
    assert out.x_next.shape == x.shape and out.x_next.dtype == BF16
    assert out.f_pre.shape == (B, C) and out.h_post.shape == (B, n) and out.h_res.shape == (B, n, n)
    # The definition: mhc_post, then mhc_pre on the stored X_next (the CPU references agree bitwise).
    x_next = flashmix.mhc_post(x, f_out, h_post, h_res, res_layout=res_layout)
    np.testing.assert_array_equal(out.x_next, x_next)
    for u, v in zip(out[1:], flashmix.mhc_pre(x_next, phi, alpha, bias, **kw)):
        np.testing.assert_array_equal(u, v)
    # And the spec written out in numpy: X_next one rounding from the post, the pre from the stored X_next.
    assert_rounded_close(out.x_next, ref.mhc_post(x, f_out, h_post, h_res, res_layout), "bfloat16")
    want_f, want_post, want_res = ref.mhc_pre(out.x_next, phi, alpha, bias, n, **kw)
    assert_rounded_close(out.f_pre, want_f, "bfloat16")
    np.testing.assert_allclose(out.h_post, want_post, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out.h_res, want_res, rtol=1e-5, atol=1e-7)


@needs_bf16
@pytest.mark.parametrize("res_layout", ["deepseek", "row_mix"])
@pytest.mark.parametrize("n,C", [(1, 16), (4, 64), (8, 24)])
def test_mhc_post_head_is_post_then_head(n, C, res_layout):
    """spec §4.10: mhc_post then mhc_head on the stored X_next, bit for bit, X_next kept or not;
    bad arguments named."""
    rng = np.random.default_rng(n * 11 + C)
    B = 4
    x, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    _, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    hphi, halpha, hbias = np.ascontiguousarray(phi[:n]), alpha[:1].copy(), bias[:n].copy()
    x_next = flashmix.mhc_post(x, f_out, h_post, h_res, res_layout=res_layout)
    want = flashmix.mhc_head(x_next, hphi, halpha, hbias, eps_pre=1e-3)
    out = flashmix.mhc_post_head(x, f_out, h_post, h_res, hphi, halpha, hbias, res_layout=res_layout, eps_pre=1e-3)
    assert out.shape == (B, C) and out.dtype == BF16
    np.testing.assert_array_equal(out, want)
    kept = flashmix.mhc_post_head(x, f_out, h_post, h_res, hphi, halpha, hbias, res_layout=res_layout,
                                  eps_pre=1e-3, keep_x_next=True)
    assert isinstance(kept, flashmix.MhcPostHeadOutput) and kept.x_next_scales is None
    np.testing.assert_array_equal(kept.out, want)
    np.testing.assert_array_equal(kept.x_next, x_next)
    with raises_naming(ValueError, "mhc_post_head", "x_next"):
        flashmix.mhc_post_head(x, f_out, h_post, h_res, hphi, halpha, hbias, x_next=x)
    with raises_naming(ValueError, "mhc_post_head", "bias"):
        flashmix.mhc_post_head(x, f_out, h_post, h_res, hphi, halpha, bias)  # bias [N], not [n]
    with raises_naming(ValueError, "mhc_post_head", "res_layout"):
        flashmix.mhc_post_head(x, f_out, h_post, h_res, hphi, halpha, hbias, res_layout="transposed")
    with raises_naming(ValueError, "mhc_post_head", "f_out"):
        flashmix.mhc_post_head(x, f_out[:2], h_post, h_res, hphi, halpha, hbias)
    with raises_naming(ValueError, "mhc_post_head", "kernel"):
        flashmix.mhc_post_head(x, f_out, h_post, h_res, hphi, halpha, hbias, kernel="fastest")
    empty = flashmix.mhc_post_head(x[:0], f_out[:0], h_post[:0], h_res[:0], hphi, halpha, hbias)  # B = 0
    assert empty.shape == (0, C)


@needs_bf16
def test_mhc_post_pre_rejects_outputs_overlapping_inputs():
    rng = np.random.default_rng(17)
    x, f_out, h_post, h_res = ref.post_problem(rng, 3, 4, 16)
    _, phi, alpha, bias = ref.mhc_problem(rng, 3, 4, 16)
    with raises_naming(ValueError, "mhc_post_pre", "x_next"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, x_next=x)
    with raises_naming(ValueError, "mhc_post_pre", "h_res_next"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, h_res_next=h_res)
    with raises_naming(ValueError, "mhc_post_pre", "res_layout"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, res_layout="transposed")
    with raises_naming(ValueError, "mhc_post_pre", "f_out"):
        flashmix.mhc_post_pre(x, f_out[:2], h_post, h_res, phi, alpha, bias)
    out = flashmix.mhc_post_pre(x[:0], f_out[:0], h_post[:0], h_res[:0], phi, alpha, bias)  # B = 0
    assert out.x_next.shape == (0, 4, 16) and out.f_pre.shape == (0, 16)


@needs_bf16
@pytest.mark.parametrize("weight_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("n,C", [(1, 128), (4, 256), (6, 384)])
def test_mhc_post_pre_norm_and_fp8_match_spec(n, C, weight_dtype):
    """spec §4.8: f_pre = bf16(v / sqrt(mean v^2 + eps) * w) from the bf16 F_pre v of the plain
    call, and the FP8 copy = quantize_fp8 (1 x 128) of that bf16 f_pre, bit for bit; the other
    outputs unchanged; with bf16_f_pre=False only the FP8 copy."""
    rng = np.random.default_rng(n * 13 + C)
    B = 3
    x, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    _, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    w = rng.uniform(0.25, 1.5, C).astype(np.float32)
    if weight_dtype == "bfloat16":
        w = w.astype(BF16)
    plain = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias)
    normed = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, norm_weight=w, norm_eps=1e-5)
    assert isinstance(normed, flashmix.MhcPostPreOutput)
    for u, v in ((normed.x_next, plain.x_next), (normed.h_post, plain.h_post), (normed.h_res, plain.h_res)):
        np.testing.assert_array_equal(u, v)
    v = plain.f_pre.astype(np.float64)
    inv = 1.0 / np.sqrt((v * v).mean(axis=1, keepdims=True) + np.float64(np.float32(1e-5)))
    want = (v * inv * w.astype(np.float64)).astype(np.float32).astype(BF16)
    np.testing.assert_array_equal(normed.f_pre, want)
    for scale_format in ("float32", "ue8m0"):
        out = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, norm_weight=w, norm_eps=1e-5,
                                    fp8=True, f_pre_scale_format=scale_format)
        assert isinstance(out, flashmix.MhcPostPreFp8Output)
        np.testing.assert_array_equal(out.f_pre, want)
        q, s = flashmix.quantize_fp8(out.f_pre, scale_format=scale_format)
        assert out.f_pre_fp8.shape == (B, C) and out.f_pre_scales.shape == (B, C // 128)
        np.testing.assert_array_equal(out.f_pre_fp8, q)
        np.testing.assert_array_equal(out.f_pre_scales, s)
        only = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, norm_weight=w, norm_eps=1e-5,
                                     fp8=True, f_pre_scale_format=scale_format, bf16_f_pre=False)
        assert only.f_pre is None
        np.testing.assert_array_equal(only.f_pre_fp8, q)
        np.testing.assert_array_equal(only.f_pre_scales, s)


@needs_bf16
def test_mhc_pre_epilogue_equals_the_boundary_one():
    """mhc_pre with the epilogue on the X_next mhc_post_pre stored: the same bytes (spec §4.8)."""
    rng = np.random.default_rng(23)
    B, n, C = 3, 4, 256
    x, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    _, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    w = rng.uniform(0.5, 1.5, C).astype(np.float32)
    kw = dict(norm_weight=w, norm_eps=1e-5, fp8=True, f_pre_scale_format="ue8m0")
    b = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, **kw)
    p = flashmix.mhc_pre(b.x_next, phi, alpha, bias, **kw)
    assert isinstance(p, flashmix.MhcPreFp8Output)
    for u, v in zip(p, (b.f_pre, b.h_post, b.h_res, b.f_pre_fp8, b.f_pre_scales)):
        np.testing.assert_array_equal(u, v)
    only = flashmix.mhc_pre(b.x_next, phi, alpha, bias, bf16_f_pre=False, **kw)
    assert only.f_pre is None
    np.testing.assert_array_equal(only.f_pre_fp8, b.f_pre_fp8)
    normed = flashmix.mhc_pre(b.x_next, phi, alpha, bias, norm_weight=w, norm_eps=1e-5)
    assert isinstance(normed, flashmix.MhcPreOutput)
    np.testing.assert_array_equal(normed.f_pre, b.f_pre)
    with raises_naming(ValueError, "mhc_pre", "f_pre_scales"):  # [B, C/128] float32 for "float32"
        flashmix.mhc_pre(b.x_next, phi, alpha, bias, f_pre_fp8=b.f_pre_fp8, f_pre_scales=np.zeros((B, 1), np.float32))


@needs_bf16
def test_mhc_post_pre_epilogue_rejects_bad_arguments():
    rng = np.random.default_rng(19)
    x, f_out, h_post, h_res = ref.post_problem(rng, 3, 4, 64)
    _, phi, alpha, bias = ref.mhc_problem(rng, 3, 4, 64)
    with raises_naming(ValueError, "mhc_post_pre", "hidden"):  # FP8 needs C a multiple of 128
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, fp8=True)
    with raises_naming(ValueError, "mhc_post_pre", "norm_weight"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, norm_weight=np.ones(32, np.float32))
    with raises_naming(ValueError, "mhc_post_pre", "norm_eps"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, norm_weight=np.ones(64, np.float32),
                              norm_eps=-1.0)
    with raises_naming(ValueError, "mhc_post_pre", "f_pre_scale_format"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, f_pre_scale_format="e5m2")


@needs_bf16
def test_mhc_stages_compose_to_mhc_pre():
    rng = np.random.default_rng(8)
    n, C = 4, 32
    x, phi, alpha, bias = ref.mhc_problem(rng, 6, n, C)
    h, r = flashmix.mhc_project(x, phi, alpha, bias)
    want_h, want_r, want_pre, want_post, want_res = ref.mhc_coefficients(x, phi, alpha, bias, n)
    np.testing.assert_allclose(h, want_h, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(r, want_r, rtol=1e-6)
    h_pre, h_post, h_res = flashmix.mhc_activate(h)
    np.testing.assert_allclose(h_pre, want_pre, rtol=1e-5)
    np.testing.assert_allclose(h_post, want_post, rtol=1e-5)
    np.testing.assert_allclose(h_res, want_res, rtol=1e-4, atol=1e-6)
    f_pre = flashmix.mhc_pre_mix(x, h_pre)
    whole = flashmix.mhc_pre(x, phi, alpha, bias)
    np.testing.assert_allclose(f_pre.astype(np.float32), whole.f_pre.astype(np.float32), rtol=2 ** -7, atol=1e-6)


@needs_bf16
def test_mhc_head_and_expand_match_spec():
    rng = np.random.default_rng(9)
    n, C, B = 4, 16, 3
    x, _, _, _ = ref.mhc_problem(rng, B, n, C)
    phi = (rng.uniform(-1, 1, (n, n * C)) / 8).astype(np.float32)
    alpha = np.array([0.9], np.float32)
    bias = rng.uniform(-1, 1, n).astype(np.float32)
    out = flashmix.mhc_head(x, phi, alpha, bias)
    X = ref.f64(x).reshape(B, n * C)
    r = np.sqrt((X * X).sum(axis=1) / (n * C) + 1e-6)
    h_pre = ref.sigmoid(0.9 * (X @ ref.f64(phi).T) / r[:, None] + bias) + 1e-6
    assert_rounded_close(out, np.einsum("bi,bic->bc", h_pre, X.reshape(B, n, C)), "bfloat16")
    emb = rng.uniform(-1, 1, (B, C)).astype(BF16)
    xs = flashmix.mhc_expand(emb, n=n)
    assert xs.shape == (B, n, C)
    for i in range(n):
        np.testing.assert_array_equal(xs[:, i], emb)


# ---------------------------------------------------------------------------
# The projection kernel (`kernel`): parsed everywhere, one implementation on the CPU
# ---------------------------------------------------------------------------

def test_mhc_pre_kernels_are_the_library_names():
    assert flashmix.MHC_PRE_KERNELS == ("auto", "resident", "split", "cluster_tile", "portable")
    for fn in (flashmix.mhc_pre, flashmix.mhc_project, flashmix.mhc_head, flashmix.mhc_pre_kernel_choice):
        assert inspect.signature(fn).parameters["kernel"].default == "auto", fn.__name__


@needs_bf16
def test_mhc_post_pre_paths_are_the_library_names_and_one_result_on_the_cpu():
    """spec §4.7 MhcBoundaryPath: the names, the default, every path accepted (the CPU reference
    has one), a bad one named."""
    assert flashmix.MHC_BOUNDARY_PATHS == ("auto", "fused", "post_then_pre")
    assert inspect.signature(flashmix.mhc_post_pre).parameters["path"].default == "auto"
    rng = np.random.default_rng(47)
    B, n, C = 3, 4, 64
    x, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    _, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    want = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias)
    for path in flashmix.MHC_BOUNDARY_PATHS:
        got = flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, path=path)
        for u, v in zip(got, want):
            np.testing.assert_array_equal(u, v)
    with raises_naming(ValueError, "mhc_post_pre", "path"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, path="two_pass")


@needs_bf16
@pytest.mark.parametrize("kernel", ["auto", "resident", "split", "cluster_tile", "portable"])
def test_mhc_kernel_is_accepted_and_ignored_on_the_cpu(kernel):
    rng = np.random.default_rng(21)
    B, n, C = 3, 4, 32
    x, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    ws = np.zeros(flashmix.mhc_workspace_bytes(B, n, C), dtype=np.uint8)
    for got, want in zip(flashmix.mhc_pre(x, phi, alpha, bias, kernel=kernel, workspace=ws),
                         flashmix.mhc_pre(x, phi, alpha, bias)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(flashmix.mhc_project(x, phi, alpha, bias, kernel=kernel),
                         flashmix.mhc_project(x, phi, alpha, bias)):
        np.testing.assert_array_equal(got, want)
    # mhc_head has no resident kernel on the GPU; the CPU backend has one implementation for all
    head = (phi[:n], alpha[:1], bias[:n])
    np.testing.assert_array_equal(flashmix.mhc_head(x, *head, kernel=kernel), flashmix.mhc_head(x, *head))


@needs_bf16
@pytest.mark.parametrize("op", ["mhc_pre", "mhc_project", "mhc_head"])
@pytest.mark.parametrize("kernel", ["fast", "Resident", "", "kResident"])
def test_mhc_bad_kernel_name_raises_value_error_naming_kernel(op, kernel):
    rng = np.random.default_rng(22)
    x, phi, alpha, bias = ref.mhc_problem(rng, 2, 4, 16)
    if op == "mhc_head":
        phi, alpha, bias = phi[:4], alpha[:1], bias[:4]
    with raises_naming(ValueError, op, "kernel") as e:
        getattr(flashmix, op)(x, phi, alpha, bias, kernel=kernel)
    assert '"auto", "resident", "split", "cluster_tile" or "portable"' in str(e.value)


@needs_bf16
def test_mhc_pre_kernel_choice_wants_cuda_arrays():
    rng = np.random.default_rng(23)
    x, phi, alpha, bias = ref.mhc_problem(rng, 2, 4, 16)
    with raises_naming(ValueError, "mhc_pre_kernel_choice", "x"):
        flashmix.mhc_pre_kernel_choice(x, phi, alpha, bias)
    with raises_naming(ValueError, "mhc_pre_kernel_choice", "kernel"):  # the name is checked first
        flashmix.mhc_pre_kernel_choice(x, phi, alpha, bias, kernel="fast")
    with raises_naming(ValueError, "mhc_pre_kernel_choice", "alpha"):  # and the arrays, as mhc_pre's
        flashmix.mhc_pre_kernel_choice(x, phi, alpha[:2], bias)


# ---------------------------------------------------------------------------
# Defaults: the library's, stated once (include/flashmix/*.h), through the binding
# ---------------------------------------------------------------------------

def defaults_of(fn):
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def test_defaults_are_the_library_values():
    pre = defaults_of(flashmix.mhc_pre)
    assert pre["eps_norm"] == 1e-6 and pre["eps_pre"] == 1e-6 and pre["eps_sinkhorn"] == 1e-6  # 1e-6f, shown as 1e-6
    assert pre["post_mult"] == 2.0 and pre["sinkhorn_iters"] == 20 and pre["res_layout"] == "deepseek"
    assert pre["enable_pdl"] is True and pre["prefetch_weights"] is False and pre["kernel"] == "auto"
    assert defaults_of(flashmix.mhc_pre_kernel_choice) == pre
    assert flashmix.MHC_SEED_PARAMS == {"eps_norm": 0.0, "eps_pre": 0.0, "eps_sinkhorn": 0.0}
    fin = defaults_of(flashmix.finalize_moe_routing)
    assert (fin["start_expert_id"], fin["fill"], fin["enable_pdl"], fin["prefetch_indices"]) == (0, True, True, False)
    assert (fin["threads_per_block"], fin["vectors_per_thread"], fin["chunks_per_token"], fin["schedule"]) == (0, 0, 0, 0)
    fc2 = defaults_of(flashmix.moe_fc2_finalize)
    assert (fc2["mode"], fc2["apply_bias"], fc2["out_already_zeroed"]) == ("atomic", True, False)
    assert (fc2["gemm_kernel"], fc2["raster"], fc2["swizzle"], fc2["fill"]) == ("auto", 0, 0, True)
    assert defaults_of(flashmix.build_moe_routing_maps)["single_block_max_slots"] == 0
    router = defaults_of(flashmix.moe_router)
    assert (router["scoring"], router["renormalize"], router["n_group"], router["topk_group"]) == ("softmax", False,
                                                                                                  1, 1)
    assert router["routed_scaling_factor"] == 1.0 and (router["path"], router["generic_layout"]) == (0, False)
    fc1 = defaults_of(flashmix.moe_fc1)
    assert (fc1["layout"], fc1["activation"], fc1["limit"], fc1["alpha"], fc1["x_permuted"]) == (
        "gate_up", "swiglu", 0.0, 0.0, False)
    fwd = defaults_of(flashmix.moe_forward)
    assert {key: fwd[key] for key in ("scoring", "renormalize", "n_group", "topk_group", "routed_scaling_factor",
                                      "start_expert_id", "w1_layout", "activation", "limit", "alpha", "fc1_input",
                                      "mode", "fill", "apply_b2")} == {
        "scoring": "softmax", "renormalize": False, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "start_expert_id": 0, "w1_layout": "gate_up", "activation": "swiglu", "limit": 0.0, "alpha": 0.0,
        "fc1_input": "auto", "mode": "atomic", "fill": True, "apply_b2": True}
    assert flashmix.ROUTER_SCORINGS == ("softmax", "sigmoid", "sqrtsoftplus", "softmax_after_topk")
    assert flashmix.FC1_ACTIVATIONS == ("swiglu", "swiglu_oai", "swiglu_clamped")
    assert flashmix.FC1_WEIGHT_LAYOUTS == ("gate_up", "interleaved")
    assert flashmix.FC1_INPUTS == ("auto", "gather", "permuted_copy")


def test_the_package_restates_none_of_the_library_defaults():
    # Every keyword the binding reports a library default for has that default in the package's
    # function, and the binding itself has no defaults (its signatures are all required keywords).
    tables = {**_C.moe_defaults(), **_C.mhc_defaults(), **_C.fp8_defaults()}
    for op, table in tables.items():
        got = defaults_of(getattr(flashmix, op))
        for keyword, value in table.items():
            assert got[keyword] == value and type(got[keyword]) is type(value), (op, keyword)
    for name in BOUND_OPS + ("mhc_pre_kernel_choice", "build_moe_routing_maps_workspace_size",
                             "moe_fc2_finalize_workspace_size", "moe_forward_workspace_size"):
        signature = getattr(_C, name).__doc__.splitlines()[0]
        assert " = " not in signature, signature


# ---------------------------------------------------------------------------
# Bad input: ValueError naming the argument, nothing written
# ---------------------------------------------------------------------------

def finalize_inputs():
    rng = np.random.default_rng(10)
    return ref.finalize_problem(rng, 4, 2, 8, 8, "float32", 4, 0, 4)


def call_finalize(p, rows=None, u2p=None, experts=None, **kw):
    args = dict(num_experts_per_node=p["e_local"], scales=p["scales"])
    args.update(kw)
    return flashmix.finalize_moe_routing(p["rows"] if rows is None else rows, p["u2p"] if u2p is None else u2p,
                                         p["experts"] if experts is None else experts, **args)


@pytest.mark.parametrize("change,arg", [
    ({"num_experts_per_node": 0}, "num_experts_per_node"),                  # library rule
    ({"start_expert_id": -1}, "start_expert_id"),                           # library rule
    ({"experts": np.zeros((4, 17), np.int32), "u2p": np.zeros(68, np.int32), "scales": None}, "k"),  # library: k <= 16
    ({"experts": np.zeros((4, 2), np.int64)}, "token_selected_experts"),    # dtype
    ({"experts": np.zeros((2, 4), np.int32).T}, "token_selected_experts"),  # not contiguous
    ({"u2p": np.zeros(7, np.int32)}, "unpermuted_row_to_permuted_row"),     # not k*T
    ({"scales": np.zeros((4, 3), np.float32)}, "scales"),                   # shape
    ({"scales": np.zeros((4, 2), np.float64)}, "scales"),                   # dtype
    ({"rows": np.zeros((8, 4), np.float32)}, "expanded_permuted_rows"),     # shorter than H
    ({"rows": np.zeros((8, 8), np.int32)}, "expanded_permuted_rows"),       # dtype
    ({"out": np.zeros((5, 8), np.float32)}, "out"),                         # not T rows
    ({"out": np.zeros((8, 4), np.float32).T}, "out"),                       # columns strided
    ({"bias": np.zeros((4, 8), np.float16)}, "bias"),                       # not the rows' dtype
    ({"bias": np.zeros((3, 8), np.float32)}, "bias"),                       # not E_local rows
    ({"shared_output": np.zeros((4, 8), np.float16)}, "shared_output"),     # not out's dtype
    ({"fill": False}, "permuted_row_to_unpermuted_row"),                    # library rule: no-fill maps
    ({"threads_per_block": 48}, "tuning.threads_per_block"),                # library rule
])
def test_finalize_bad_input_raises_value_error_naming_the_argument(change, arg):
    p = finalize_inputs()
    change.setdefault("out", np.full((4, 8), 3.0, np.float32))
    before = change["out"].copy()
    with raises_naming(ValueError, "finalize_moe_routing", arg):
        call_finalize(p, **change)
    np.testing.assert_array_equal(change["out"], before)  # nothing written


@needs_bf16
@pytest.mark.parametrize("op,arg,call", [
    ("mhc_pre", "hidden", lambda x, phi, a, b: flashmix.mhc_pre(  # library rule: C a multiple of 8
        np.zeros((2, 4, 12), BF16), np.zeros((24, 48), np.float32), a, b)),
    ("mhc_pre", "params.sinkhorn_iters", lambda x, phi, a, b: flashmix.mhc_pre(x, phi, a, b, sinkhorn_iters=0)),
    ("mhc_pre", "params.eps_norm", lambda x, phi, a, b: flashmix.mhc_pre(x, phi, a, b, eps_norm=-1.0)),
    ("mhc_pre", "phi", lambda x, phi, a, b: flashmix.mhc_pre(x, phi[:23], a, b)),            # N not n*n + 2n
    ("mhc_pre", "phi", lambda x, phi, a, b: flashmix.mhc_pre(x, phi.astype(np.float16), a, b)),
    ("mhc_pre", "x", lambda x, phi, a, b: flashmix.mhc_pre(x.astype(np.float32), phi, a, b)),
    ("mhc_pre", "x", lambda x, phi, a, b: flashmix.mhc_pre(x[:, :, ::2], phi[:, ::2], a, b)),  # not contiguous
    ("mhc_pre", "alpha", lambda x, phi, a, b: flashmix.mhc_pre(x, phi, a[:2], b)),
    ("mhc_pre", "bias", lambda x, phi, a, b: flashmix.mhc_pre(x, phi, a, b[:-1])),
    ("mhc_pre", "h_res", lambda x, phi, a, b: flashmix.mhc_pre(x, phi, a, b, h_res=np.zeros((2, 16), np.float32))),
    ("mhc_pre", "res_layout", lambda x, phi, a, b: flashmix.mhc_pre(x, phi, a, b, res_layout="columns")),
])
def test_mhc_bad_input_raises_value_error_naming_the_argument(op, arg, call):
    rng = np.random.default_rng(11)
    x, phi, alpha, bias = ref.mhc_problem(rng, 2, 4, 16)
    with raises_naming(ValueError, op, arg):
        call(x, phi, alpha, bias)


@needs_bf16
def test_mhc_post_rejects_x_next_overlapping_x():
    rng = np.random.default_rng(12)
    x, f_out, h_post, h_res = ref.post_problem(rng, 2, 4, 16)
    with raises_naming(ValueError, "mhc_post", "x_next"):
        flashmix.mhc_post(x, f_out, h_post, h_res, x_next=x)
    big = np.zeros((3, 4, 16), BF16)
    big[:2] = x
    with raises_naming(ValueError, "mhc_post", "x_next"):  # partly overlapping
        flashmix.mhc_post(big[:2], f_out, h_post, h_res, x_next=big[1:])


def _fp8x_scales(s, scale_format):
    """spec §4.9 / §11.2: the scales as float32 (ue8m0: 2^(b - 127), 255 NaN)."""
    if scale_format != "ue8m0":
        return s
    return np.where(s == 255, np.float32(np.nan), np.ldexp(np.float32(1), s.astype(np.int32) - 127)).astype(np.float32)


def _fp8x_values(q, s, scale_format):
    """spec §4.9: an element's value, fp32(e4m3(code) * scale); q [B, K] uint8, s [B, K/128]."""
    import ml_dtypes
    codes = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (codes * np.repeat(_fp8x_scales(s, scale_format), 128, axis=1)).astype(np.float32)


@needs_bf16
@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
@pytest.mark.parametrize("res_layout", ["deepseek", "row_mix"])
@pytest.mark.parametrize("n,C", [(1, 128), (3, 256), (4, 384), (8, 128)])
def test_mhc_post_fp8x_matches_spec(n, C, res_layout, scale_format):
    """spec §4.9: X as e4m3 codes + [B, n*C/128] scales (quantize_fp8 of X seen as [B, n*C]), X_next
    the same way, within half an e4m3 step of the exact sum; [B, n, C] takes the same bytes; with
    X = 0 and H_post = 1 every stream is quantize_fp8(F_out), bit for bit."""
    rng = np.random.default_rng(n * 31 + C)
    B = 3
    x, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    q, s = flashmix.quantize_fp8(x.reshape(B, n * C), scale_format=scale_format)
    out = flashmix.mhc_post(q, f_out, h_post, h_res, x_scales=s, x_scale_format=scale_format, res_layout=res_layout)
    assert isinstance(out, flashmix.MhcPostFp8Output)
    assert out.x_next.shape == q.shape and out.x_next.dtype == np.uint8
    assert out.x_next_scales.shape == s.shape and out.x_next_scales.dtype == s.dtype
    xv = _fp8x_values(q, s, scale_format)
    want = ref.mhc_post(xv, f_out, h_post, h_res, res_layout).reshape(B, n * C)
    got = _fp8x_values(out.x_next, out.x_next_scales, scale_format).astype(np.float64)
    R = np.abs(ref.f64(h_res))
    R = np.transpose(R, (0, 2, 1)) if res_layout == "deepseek" else R
    terms = (np.einsum("bij,bjc->bic", R, np.abs(xv.astype(np.float64)).reshape(B, n, C))
             + np.abs(ref.f64(h_post))[:, :, None] * np.abs(ref.f64(f_out))[:, None, :]).reshape(B, n * C)
    sc = np.repeat(_fp8x_scales(out.x_next_scales, scale_format), 128, axis=1).astype(np.float64)
    tol = np.ldexp(np.abs(want), -4) + np.ldexp(sc, -10) + np.ldexp(terms, -20)
    bad = ~(np.abs(got - want) <= tol)
    assert not bad.any(), f"{bad.sum()} elements out of tolerance, first at {np.argwhere(bad)[0]}"
    three = flashmix.mhc_post(q.reshape(B, n, C), f_out, h_post, h_res, x_scales=s.reshape(B, n, C // 128),
                              x_scale_format=scale_format, res_layout=res_layout)
    np.testing.assert_array_equal(three.x_next.reshape(B, n * C), out.x_next)
    np.testing.assert_array_equal(three.x_next_scales.reshape(s.shape), out.x_next_scales)
    zero = flashmix.mhc_post(np.zeros_like(q), f_out, np.ones_like(h_post), h_res, x_scales=s,
                             x_scale_format=scale_format, res_layout=res_layout)
    fq, fs = flashmix.quantize_fp8(f_out, scale_format=scale_format)
    np.testing.assert_array_equal(zero.x_next, np.tile(fq, (1, n)))
    np.testing.assert_array_equal(zero.x_next_scales, np.tile(fs, (1, n)))


@needs_bf16
@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
@pytest.mark.parametrize("n,C", [(1, 128), (4, 384), (6, 256)])
def test_mhc_pre_head_post_pre_fp8x_read_the_stream(n, C, scale_format):
    """spec §4.9: mhc_pre and mhc_head on the FP8 stream read each element as fp32(code * scale).
    With power-of-two scales the values are bf16 numbers, so the results are bitwise the bf16 ops'
    on them ([B, n, C] and [B, n*C] alike); mhc_post_pre is mhc_post then mhc_pre on the stored
    X_next, bit for bit; bad arguments are named."""
    rng = np.random.default_rng(n * 13 + C)
    B = 3
    x, phi, alpha, bias = ref.mhc_problem(rng, B, n, C)
    q, s = flashmix.quantize_fp8(x.reshape(B, n * C), scale_format="ue8m0")
    xv = _fp8x_values(q, s, "ue8m0")
    xb = xv.astype(BF16)
    assert np.array_equal(xb.astype(np.float32), xv)
    if scale_format == "float32":
        s = _fp8x_scales(s, "ue8m0")
    want = flashmix.mhc_pre(xb, phi, alpha, bias)
    got = flashmix.mhc_pre(q, phi, alpha, bias, x_scales=s, x_scale_format=scale_format)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    got3 = flashmix.mhc_pre(q.reshape(B, n, C), phi, alpha, bias, x_scales=s.reshape(B, n, C // 128),
                            x_scale_format=scale_format)
    np.testing.assert_array_equal(got3.f_pre, want.f_pre)
    hphi = np.ascontiguousarray(phi[:n])
    np.testing.assert_array_equal(
        flashmix.mhc_head(q, hphi, alpha, bias[:n].copy(), x_scales=s, x_scale_format=scale_format),
        flashmix.mhc_head(xb, hphi, alpha, bias[:n].copy()))
    _, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    post = flashmix.mhc_post(q, f_out, h_post, h_res, x_scales=s, x_scale_format=scale_format)
    pre = flashmix.mhc_pre(post.x_next, phi, alpha, bias, x_scales=post.x_next_scales, x_scale_format=scale_format)
    pp = flashmix.mhc_post_pre(q, f_out, h_post, h_res, phi, alpha, bias, x_scales=s, x_scale_format=scale_format)
    assert isinstance(pp, flashmix.MhcPostPreFp8xOutput) and pp.f_pre_fp8 is None
    np.testing.assert_array_equal(pp.x_next, post.x_next)
    np.testing.assert_array_equal(pp.x_next_scales, post.x_next_scales)
    np.testing.assert_array_equal(pp.f_pre, pre.f_pre)
    np.testing.assert_array_equal(pp.h_post, pre.h_post)
    np.testing.assert_array_equal(pp.h_res, pre.h_res)
    with raises_naming(ValueError, "mhc_pre", "x_scales"):  # wrong shape
        flashmix.mhc_pre(q, phi, alpha, bias, x_scales=s[:, :0], x_scale_format=scale_format)
    with raises_naming(ValueError, "mhc_pre", "x"):  # bf16 x with scales
        flashmix.mhc_pre(xb, phi, alpha, bias, x_scales=s, x_scale_format=scale_format)
    with raises_naming(ValueError, "mhc_head", "x_scale_format"):
        flashmix.mhc_head(q, hphi, alpha, bias[:n].copy(), x_scales=s, x_scale_format="e5m2")
    # mhc_post_head on the stream: mhc_post then mhc_head on the stored codes and scales.
    ph = flashmix.mhc_post_head(q, f_out, h_post, h_res, hphi, alpha, bias[:n].copy(), x_scales=s,
                                x_scale_format=scale_format, keep_x_next=True)
    np.testing.assert_array_equal(ph.x_next, post.x_next)
    np.testing.assert_array_equal(ph.x_next_scales, post.x_next_scales)
    head = flashmix.mhc_head(post.x_next, hphi, alpha, bias[:n].copy(), x_scales=post.x_next_scales,
                             x_scale_format=scale_format)
    np.testing.assert_array_equal(ph.out, head)
    np.testing.assert_array_equal(
        flashmix.mhc_post_head(q, f_out, h_post, h_res, hphi, alpha, bias[:n].copy(), x_scales=s,
                               x_scale_format=scale_format), head)
    with raises_naming(ValueError, "mhc_post_pre", "x_scales"):  # x_next_scales without x_scales
        flashmix.mhc_post_pre(q, f_out, h_post, h_res, phi, alpha, bias, x_next=np.zeros_like(q),
                              x_next_scales=np.zeros_like(s))


@needs_bf16
def test_mhc_post_fp8x_rejects_bad_arguments():
    rng = np.random.default_rng(29)
    B, n, C = 2, 4, 256
    x, f_out, h_post, h_res = ref.post_problem(rng, B, n, C)
    q, s = flashmix.quantize_fp8(x.reshape(B, n * C))
    with raises_naming(ValueError, "mhc_post", "x_scales"):  # x_next_scales without x_scales
        flashmix.mhc_post(q, f_out, h_post, h_res, x_next_scales=np.zeros_like(s))
    with raises_naming(ValueError, "mhc_post", "x"):  # bf16 x with scales
        flashmix.mhc_post(x, f_out, h_post, h_res, x_scales=s)
    with raises_naming(ValueError, "mhc_post", "x_scales"):  # float32 scales named ue8m0
        flashmix.mhc_post(q, f_out, h_post, h_res, x_scales=s, x_scale_format="ue8m0")
    with raises_naming(ValueError, "mhc_post", "x_scale_format"):
        flashmix.mhc_post(q, f_out, h_post, h_res, x_scales=s, x_scale_format="e5m2")
    with raises_naming(ValueError, "mhc_post", "x_scales"):  # wrong shape
        flashmix.mhc_post(q, f_out, h_post, h_res, x_scales=s[:, :4])
    with raises_naming(ValueError, "mhc_post", "x_next"):
        flashmix.mhc_post(q, f_out, h_post, h_res, x_scales=s, x_next=q)
    x8, f8, p8, r8 = ref.post_problem(rng, B, n, 64)
    with raises_naming(ValueError, "mhc_post", "hidden"):  # C a multiple of 128
        flashmix.mhc_post(np.zeros((B, n * 64), np.uint8), f8, p8, r8, x_scales=np.zeros((B, 2), np.float32))


@needs_bf16
@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
@pytest.mark.parametrize("n,C", [(1, 128), (4, 384), (8, 256)])
def test_mhc_expand_fp8x_is_quantize_fp8_in_every_stream(n, C, scale_format):
    """spec §4.9: mhc_expand onto the FP8 stream writes quantize_fp8(embedding)'s codes and scales
    to every stream, bit for bit; a given x / x_scales is filled in place; bad arguments are named."""
    rng = np.random.default_rng(n * 7 + C)
    emb = rng.standard_normal((3, C)).astype(BF16)
    out = flashmix.mhc_expand(emb, n=n, fp8=True, x_scale_format=scale_format)
    assert isinstance(out, flashmix.MhcExpandFp8Output)
    fq, fs = flashmix.quantize_fp8(emb, scale_format=scale_format)
    assert out.x.shape == (3, n, C) and out.x_scales.shape == (3, n, C // 128)
    np.testing.assert_array_equal(out.x, np.repeat(fq[:, None, :], n, axis=1))
    np.testing.assert_array_equal(out.x_scales, np.repeat(fs[:, None, :], n, axis=1))
    x = np.zeros((3, n, C), np.uint8)
    xs = np.zeros_like(out.x_scales)
    again = flashmix.mhc_expand(emb, x=x, x_scales=xs, x_scale_format=scale_format)
    assert again.x is x and again.x_scales is xs
    np.testing.assert_array_equal(x, out.x)
    with raises_naming(ValueError, "mhc_expand", "x_scale_format"):
        flashmix.mhc_expand(emb, n=n, fp8=True, x_scale_format="e5m2")
    with raises_naming(ValueError, "mhc_expand", "x_scales"):  # wrong shape
        flashmix.mhc_expand(emb, x=x, x_scales=xs[:, :, :0])
    with raises_naming(ValueError, "mhc_expand", "hidden"):  # C a multiple of 128
        flashmix.mhc_expand(np.ascontiguousarray(emb[:, :64]), n=n, fp8=True)


@needs_bf16
def test_fc2_bad_mode_and_shapes_raise_value_error_naming_the_argument():
    A, W2 = np.zeros((4, 8), BF16), np.zeros((2, 8, 8), BF16)
    off, p2u = np.zeros(3, np.int64), np.zeros(4, np.int32)
    with raises_naming(ValueError, "moe_fc2_finalize", "mode"):
        flashmix.moe_fc2_finalize(A, W2, off, p2u, k=2, num_tokens=2, mode="fast")
    with raises_naming(ValueError, "moe_fc2_finalize", "gemm_kernel"):
        flashmix.moe_fc2_finalize(A, W2, off, p2u, k=2, num_tokens=2, gemm_kernel="cutlass")
    with raises_naming(ValueError, "moe_fc2_finalize", "A"):
        flashmix.moe_fc2_finalize(np.zeros((4, 16), BF16), W2, off, p2u, k=2, num_tokens=2)
    with raises_naming(ValueError, "moe_fc2_finalize", "hidden"):  # library rule: H a multiple of 8
        flashmix.moe_fc2_finalize(A, np.zeros((2, 12, 8), BF16), off, p2u, k=2, num_tokens=2)
    with raises_naming(ValueError, "moe_fc2_finalize", "expert_first_token_offset"):
        flashmix.moe_fc2_finalize(A, W2, off[:2], p2u, k=2, num_tokens=2)


def test_routing_not_supported_raises_not_implemented_error_a_runtime_error():
    experts = np.zeros((2, 2), np.int32)
    with pytest.raises(NotImplementedError, match=r"^build_moe_routing_maps: num_experts_per_node: ") as e:
        flashmix.build_moe_routing_maps(experts, num_experts_per_node=2000)  # at most 1024 local experts
    assert isinstance(e.value, RuntimeError)


def test_routing_bad_input_raises_value_error_naming_the_argument():
    experts = np.zeros((4, 2), np.int32)
    with raises_naming(ValueError, "build_moe_routing_maps", "permuted_row_to_unpermuted_row"):
        flashmix.build_moe_routing_maps(experts, num_experts_per_node=4,
                                        permuted_row_to_unpermuted_row=np.zeros(7, np.int32))
    with raises_naming(ValueError, "build_moe_routing_maps", "permuted_input"):
        flashmix.build_moe_routing_maps(experts, num_experts_per_node=4, input=np.zeros((4, 8), np.float32),
                                        permuted_input=np.zeros((7, 8), np.float32))
    with raises_naming(ValueError, "build_moe_routing_maps", "start_expert_id"):
        flashmix.build_moe_routing_maps(experts, num_experts_per_node=4, start_expert_id=-3)


# ---------------------------------------------------------------------------
# The CUDA call path (without a GPU: fake CUDA DLPack tensors, never dereferenced)
# ---------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_DL_CODES = {"int": 0, "uint": 1, "float": 2, "bfloat": 4}


class FakeCudaArray:
    """A DLPack producer claiming a CUDA tensor at a bogus address (only metadata is ever read)."""

    def __init__(self, shape, dtype, device_id=0):
        kind = dtype.rstrip("0123456789")
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._mt = _DLManagedTensor()
        t = self._mt.dl_tensor
        t.data, t.device, t.ndim = 1 << 20, _DLDevice(2, device_id), len(shape)
        t.dtype, t.shape, t.strides = _DLDataType(_DL_CODES[kind], int(dtype[len(kind):]), 1), self._shape, None
        self.shape = tuple(shape)

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        if max_version is not None:
            raise TypeError("unversioned DLPack only")
        return _capsule_new(ctypes.addressof(self._mt), b"dltensor", None)

    def __dlpack_device__(self):
        return (2, self._mt.dl_tensor.device.device_id)


def fc2_zero_tokens(make):
    """moe_fc2_finalize with T = 0: valid input on either backend, nothing to do."""
    return dict(A=make((0, 8), "bfloat16"), W2=make((2, 8, 8), "bfloat16"), off=make((3,), "int64"),
                p2u=make((0,), "int32"), out=make((0, 8), "bfloat16"))


def test_cuda_arrays_take_the_gpu_path():
    if BF16 is not None:  # the CPU path: T = 0 is valid, nothing to do
        a = fc2_zero_tokens(lambda shape, dtype: np.zeros(shape, ref.np_dtype(dtype)))
        flashmix.moe_fc2_finalize(a["A"], a["W2"], a["off"], a["p2u"], k=2, out=a["out"])
    a = fc2_zero_tokens(FakeCudaArray)
    # The GPU entry point: without a GPU the device cannot be made current (RuntimeError naming
    # it); on a GPU, T = 0 is valid and nothing is launched (no workspace needed).
    try:  # the binding takes every argument: the library's defaults
        _C.moe_fc2_finalize(a["A"], a["W2"], a["off"], a["p2u"], a["out"], k=2, scales=None, bias=None,
                            shared_output=None, a_scales=None, w2_scales=None, w2_mx_scales=None, workspace=None,
                            stream=0,
                            **_C.moe_defaults()["moe_fc2_finalize"])
    except RuntimeError as e:
        assert str(e).startswith("moe_fc2_finalize: ") and "cuda:0" in str(e), str(e)


def test_cuda_arrays_take_the_gpu_path_for_the_router_fc1_and_the_layer():
    # T = 0 on fake CUDA arrays: without a GPU the device cannot be made current (RuntimeError
    # naming the op and cuda:0); on a GPU nothing is launched.
    def gpu_call(op, call):
        try:
            call()
        except RuntimeError as e:
            assert str(e).startswith(f"{op}: ") and "cuda:0" in str(e), str(e)

    d = _C.moe_defaults()
    logits, ids, scales = FakeCudaArray((0, 16), "float32"), FakeCudaArray((0, 4), "int32"), FakeCudaArray((0, 4),
                                                                                                           "float32")
    gpu_call("moe_router", lambda: _C.moe_router(logits, ids, scales, correction_bias=None, token_ids=None,
                                                 hash_table=None, stream=0,
                                                 **d["moe_router"]))
    x, w1, w2 = FakeCudaArray((0, 8), "bfloat16"), FakeCudaArray((2, 16, 8), "bfloat16"), FakeCudaArray(
        (2, 8, 8), "bfloat16")
    off, p2u, act = FakeCudaArray((3,), "int64"), FakeCudaArray((0,), "int32"), FakeCudaArray((0, 8), "bfloat16")
    gpu_call("moe_fc1", lambda: _C.moe_fc1(x, w1, off, p2u, act, k=4, num_tokens=-1, bias=None, x_scales=None,
                                           w1_scales=None, w1_mx_scales=None, out_scales=None,
                                           out_scale_format="float32", stream=0, **d["moe_fc1"]))
    out = FakeCudaArray((0, 8), "bfloat16")
    none = dict.fromkeys(("router_logits", "correction_bias", "token_ids", "hash_table", "token_final_scales",
                          "selected_experts_out",
                          "final_scales_out", "b1", "b2", "shared_output", "workspace", "w1_scales", "w2_scales",
                          "w1_mx_scales", "w2_mx_scales"))
    gpu_call("moe_forward", lambda: _C.moe_forward(x, w1, w2, out, k=4, num_experts=0, token_selected_experts=ids,
                                                   stream=0, **none, **d["moe_forward"]))


def test_mixed_devices_raise_value_error_naming_the_argument():
    rows, out = FakeCudaArray((0, 8), "float32"), FakeCudaArray((0, 8), "float32")
    u2p = FakeCudaArray((0,), "int32")
    with raises_naming(ValueError, "finalize_moe_routing", "token_selected_experts"):
        flashmix.finalize_moe_routing(rows, u2p, np.zeros((0, 2), np.int32), out=out, num_experts_per_node=4)
    with raises_naming(ValueError, "finalize_moe_routing", "token_selected_experts"):  # another CUDA device
        flashmix.finalize_moe_routing(rows, u2p, FakeCudaArray((0, 2), "int32", device_id=1), out=out,
                                      num_experts_per_node=4)


BOUND_OPS = ("finalize_moe_routing", "debug_check_finalize_moe_routing_indices", "build_moe_routing_maps",
             "moe_fc2_finalize", "moe_router", "moe_fc1", "moe_forward", "mhc_pre", "mhc_post", "mhc_project", "mhc_activate", "mhc_pre_mix", "mhc_head",
             "mhc_expand", "mhc_post_pre", "quantize_fp8")


def test_every_op_takes_a_stream():
    for name in BOUND_OPS:
        assert "stream: int" in getattr(_C, name).__doc__, name


def test_stream_is_ignored_on_the_cpu():
    p = finalize_inputs()
    out = call_finalize(p, stream=12345)
    want, mag = ref.finalize(p["rows"], p["u2p"], p["experts"], p["scales"], None, None, 0, 4, 8)
    assert_rounded_close(out, want, "float32", mag)


# ---------------------------------------------------------------------------
# The package without torch; the torch custom ops with CPU tensors
# ---------------------------------------------------------------------------

def test_import_works_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import flashmix, numpy as np\n"
            "assert not flashmix.torch_ops_registered\n"
            "out = flashmix.finalize_moe_routing(np.ones((2, 4), np.float32), np.arange(2, dtype=np.int32),"
            " np.zeros((2, 1), np.int32), num_experts_per_node=1)\n"
            "assert (out == 1).all()\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def torch_or_skip():
    torch = pytest.importorskip("torch")
    if not flashmix.torch_ops_registered:
        pytest.skip("torch was imported after flashmix")
    return torch


def test_torch_custom_ops_on_cpu_tensors():
    torch = torch_or_skip()
    rng = np.random.default_rng(13)
    p = ref.finalize_problem(rng, 6, 4, 16, 16, "float32", 8, 2, 4, bias=True)
    t = {k: torch.from_numpy(v) for k, v in p.items() if isinstance(v, np.ndarray)}
    out = torch.ops.flashmix.finalize_moe_routing(t["rows"], t["u2p"], t["experts"], 4, start_expert_id=2,
                                                  scales=t["scales"], bias=t["bias"], out_dtype=torch.bfloat16)
    want, mag = ref.finalize(p["rows"], p["u2p"], p["experts"], p["scales"], p["bias"], None, 2, 4, 16)
    assert out.dtype == torch.bfloat16
    assert_rounded_close(out.float().numpy(), want, "bfloat16", mag)
    x = torch.randn(3, 4, 16).bfloat16()
    phi, alpha, bias = torch.randn(24, 64) * 0.1, torch.ones(3), torch.zeros(24)
    torch.library.opcheck(torch.ops.flashmix.mhc_pre.default, (x, phi, alpha, bias))
    f_pre, h_post, h_res = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias)
    torch.library.opcheck(torch.ops.flashmix.mhc_post.default, (x, f_pre, h_post, h_res))
    torch.library.opcheck(torch.ops.flashmix.finalize_moe_routing.default,
                          (t["rows"], t["u2p"], t["experts"], 4), {"start_expert_id": 2, "scales": t["scales"]})
    # prefetch_indices is in the op's schema (a launch option: same values)
    kw = {"start_expert_id": 2, "scales": t["scales"], "bias": t["bias"], "out_dtype": torch.bfloat16}
    got = torch.ops.flashmix.finalize_moe_routing(t["rows"], t["u2p"], t["experts"], 4, prefetch_indices=True, **kw)
    assert torch.equal(got, out)
    torch.library.opcheck(torch.ops.flashmix.finalize_moe_routing.default, (t["rows"], t["u2p"], t["experts"], 4),
                          {"start_expert_id": 2, "scales": t["scales"], "prefetch_indices": True})


def test_torch_custom_op_mhc_post_pre_on_cpu_tensors():
    torch = torch_or_skip()
    n, C, B = 4, 32, 5
    x = torch.randn(B, n, C).bfloat16()
    f_out = torch.randn(B, C).bfloat16()
    h_post, h_res = torch.rand(B, n) * 2, (torch.rand(B, n, n) + 0.5) / n
    phi, alpha, bias = torch.randn(24, n * C) * 0.1, torch.rand(3) + 0.5, torch.randn(24)
    torch.library.opcheck(torch.ops.flashmix.mhc_post_pre.default, (x, f_out, h_post, h_res, phi, alpha, bias))
    got = torch.ops.flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, res_layout="row_mix")
    x_next = torch.ops.flashmix.mhc_post(x, f_out, h_post, h_res, res_layout="row_mix")
    assert torch.equal(got[0], x_next)
    assert all(torch.equal(g, w) for g, w in zip(got[1:], torch.ops.flashmix.mhc_pre(x_next, phi, alpha, bias)))

    def two_layers(x, f_out, h_post, h_res, phi, alpha, bias):  # a boundary, a sublayer, a boundary
        x1, f_pre, hp, hr = torch.ops.flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias)
        return torch.ops.flashmix.mhc_post_pre(x1, (f_pre.float() * 0.5).bfloat16(), hp, hr, phi, alpha, bias)

    compiled = torch.compile(two_layers, fullgraph=True)
    args = (x, f_out, h_post, h_res, phi, alpha, bias)
    assert all(torch.equal(g, w) for g, w in zip(compiled(*args), two_layers(*args)))


def test_torch_custom_ops_mhc_post_pre_norm_and_fp8_on_cpu_tensors():
    torch = torch_or_skip()
    n, C, B = 4, 256, 5
    x = torch.randn(B, n, C).bfloat16()
    f_out = torch.randn(B, C).bfloat16()
    h_post, h_res = torch.rand(B, n) * 2, (torch.rand(B, n, n) + 0.5) / n
    phi, alpha, bias = torch.randn(24, n * C) * 0.05, torch.rand(3) + 0.5, torch.randn(24)
    w = (torch.rand(C) + 0.5).bfloat16()
    args = (x, f_out, h_post, h_res, phi, alpha, bias)
    torch.library.opcheck(torch.ops.flashmix.mhc_post_pre_norm.default, args + (w,))
    torch.library.opcheck(torch.ops.flashmix.mhc_post_pre_fp8.default, args, {"norm_weight": w})
    got = torch.ops.flashmix.mhc_post_pre_norm(*args, w)
    want = flashmix.mhc_post_pre(*args, norm_weight=w)
    assert all(torch.equal(g, v) for g, v in zip(got, want))
    x1, q, s, hp, hr = torch.ops.flashmix.mhc_post_pre_fp8(*args, norm_weight=w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (B, C) and s.shape == (B, C // 128)
    q_ref, s_ref = flashmix.quantize_fp8(want.f_pre)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(x1, want.x_next) and torch.equal(hp, want.h_post) and torch.equal(hr, want.h_res)


def test_torch_compile_of_the_custom_ops_on_cpu_tensors():
    torch = torch_or_skip()

    def layer(x, phi, alpha, bias):
        f_pre, h_post, h_res = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias)
        f_out = (f_pre.float() * 2).bfloat16()  # the sublayer
        return torch.ops.flashmix.mhc_post(x, f_out, h_post, h_res)

    x = torch.randn(5, 4, 32).bfloat16()
    phi, alpha, bias = torch.randn(24, 128) * 0.1, torch.rand(3) + 0.5, torch.randn(24)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x, phi, alpha, bias), layer(x, phi, alpha, bias))


def test_torch_custom_ops_for_the_moe_end_on_cpu_tensors():
    torch = torch_or_skip()
    rng = np.random.default_rng(15)
    T, k, E, start, E_local, H, I = 11, 3, 12, 4, 6, 16, 24
    experts = torch.from_numpy(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    x = torch.randn(T, I)
    off, p2u, u2p, permuted = torch.ops.flashmix.build_moe_routing_maps(experts, E_local, start_expert_id=start,
                                                                        input=x)
    want_off, want_p2u, want_u2p = ref.routing_maps(experts.numpy(), start, E_local)
    P = int(want_off[-1])
    assert off.dtype == torch.int64 and p2u.dtype == torch.int32 and u2p.dtype == torch.int32
    assert p2u.shape == (k * T,) and u2p.shape == (k * T,) and permuted.shape == (k * T, I)
    np.testing.assert_array_equal(off.numpy(), want_off)
    np.testing.assert_array_equal(p2u[:P].numpy(), want_p2u)
    np.testing.assert_array_equal(u2p.numpy(), want_u2p)
    assert torch.equal(permuted[:P], x[p2u[:P].long() % T])
    _, _, _, none = torch.ops.flashmix.build_moe_routing_maps(experts, E_local, start_expert_id=start)
    assert none.shape == (0, 0)
    # Past P the maps are unspecified: the checks that compare outputs across runs are left out.
    torch.library.opcheck(torch.ops.flashmix.build_moe_routing_maps.default, (experts, E_local),
                          {"start_expert_id": start, "input": x},
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    A = (torch.rand(k * T, I) * 2 - 1).bfloat16()
    W2 = ((torch.rand(E_local, H, I) * 2 - 1) / 4).bfloat16()
    scales, bias = torch.rand(T, k), (torch.rand(E_local, H) * 2 - 1).bfloat16()
    for mode in flashmix.FC2_MODES:
        out = torch.ops.flashmix.moe_fc2_finalize(A, W2, off, p2u, k, scales=scales, bias=bias, mode=mode)
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        want = ref.fc2_finalize(A.float().numpy(), W2.float().numpy(), off.numpy(), p2u.numpy(), scales.numpy(),
                                bias.float().numpy(), T, k)
        assert_rounded_close(out.float().numpy(), want, "bfloat16", None)
    no_scales = torch.ops.flashmix.moe_fc2_finalize(A, W2, off, p2u, k, num_tokens=T)
    want = ref.fc2_finalize(A.float().numpy(), W2.float().numpy(), off.numpy(), p2u.numpy(), None, None, T, k)
    assert_rounded_close(no_scales.float().numpy(), want, "bfloat16", None)
    with pytest.raises(ValueError, match="^moe_fc2_finalize: num_tokens: "):
        torch.ops.flashmix.moe_fc2_finalize(A, W2, off, p2u, k)
    torch.library.opcheck(torch.ops.flashmix.moe_fc2_finalize.default, (A, W2, off, p2u, k),
                          {"scales": scales, "bias": bias, "mode": "deterministic"})


def test_torch_custom_ops_for_mhc_expand_and_head_on_cpu_tensors():
    torch = torch_or_skip()
    n, C, B = 4, 16, 3
    emb = torch.randn(B, C).bfloat16()
    x = torch.ops.flashmix.mhc_expand(emb, n)
    assert x.shape == (B, n, C) and all(torch.equal(x[:, i], emb) for i in range(n))
    torch.library.opcheck(torch.ops.flashmix.mhc_expand.default, (emb, n))
    phi, alpha, bias = torch.randn(n, n * C) / 8, torch.tensor([0.9]), torch.randn(n)
    out = torch.ops.flashmix.mhc_head(x, phi, alpha, bias)
    assert torch.equal(out, flashmix.mhc_head(x, phi, alpha, bias))
    torch.library.opcheck(torch.ops.flashmix.mhc_head.default, (x, phi, alpha, bias))


def test_torch_compile_of_a_moe_end_and_an_mhc_model_on_cpu_tensors():
    torch = torch_or_skip()
    rng = np.random.default_rng(16)
    T, k, E, E_local, H, I = 7, 2, 8, 8, 16, 32
    experts = torch.from_numpy(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))

    # The stand-ins for FC1 and an unfused FC2 are exact (a cast, a slice), so eager == compiled.
    def moe_end(x, experts, scales, W2):
        off, p2u, u2p, xp = torch.ops.flashmix.build_moe_routing_maps(experts, E_local, input=x)
        act = xp.bfloat16()
        fused = torch.ops.flashmix.moe_fc2_finalize(act, W2, off, p2u, k, scales=scales, mode="deterministic")
        rows = act[:, :H]
        return fused, torch.ops.flashmix.finalize_moe_routing(rows, u2p, experts, E_local, scales=scales)

    def mhc_model(emb, phi, alpha, bias, head_phi, head_alpha, head_bias):
        x = torch.ops.flashmix.mhc_expand(emb, 4)
        for _ in range(2):
            f_pre, h_post, h_res = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias)
            x = torch.ops.flashmix.mhc_post(x, (f_pre.float() * 0.5).bfloat16(), h_post, h_res)
        return torch.ops.flashmix.mhc_head(x, head_phi, head_alpha, head_bias)

    moe_args = (torch.randn(T, I), experts, torch.rand(T, k), (torch.randn(E_local, H, I) / 4).bfloat16())
    for got, want in zip(torch.compile(moe_end, fullgraph=True)(*moe_args), moe_end(*moe_args)):
        assert torch.equal(got, want)
    C = 32
    mhc_args = (torch.randn(5, C).bfloat16(), torch.randn(24, 4 * C) * 0.1, torch.rand(3) + 0.5, torch.randn(24),
                torch.randn(4, 4 * C) * 0.1, torch.tensor([0.8]), torch.randn(4))
    assert torch.equal(torch.compile(mhc_model, fullgraph=True)(*mhc_args), mhc_model(*mhc_args))


def test_torch_custom_ops_for_the_router_fc1_and_the_layer_on_cpu_tensors():
    torch = torch_or_skip()
    rng = np.random.default_rng(17)
    T, k, E, H, I = 11, 2, 8, 16, 24
    logits = torch.from_numpy(ref.grid_logits(rng, T, E))
    router_kw = {"scoring": "sigmoid", "renormalize": True, "routed_scaling_factor": 2.0}
    ids, scales = torch.ops.flashmix.moe_router(logits, k, **router_kw)
    want_ids, want_scales = ref.router(logits.numpy(), k, **router_kw)
    assert ids.dtype == torch.int32 and scales.dtype == torch.float32 and ids.shape == (T, k)
    np.testing.assert_array_equal(ids.numpy(), want_ids)
    np.testing.assert_allclose(scales.numpy(), want_scales, rtol=2.0 ** -23)
    torch.library.opcheck(torch.ops.flashmix.moe_router.default, (logits, k), router_kw)
    bias = torch.rand(E) - 0.5
    torch.library.opcheck(torch.ops.flashmix.moe_router.default, (logits.bfloat16(), 4),
                          {"scoring": "sigmoid", "correction_bias": bias, "n_group": 4, "topk_group": 2})

    x = (torch.rand(T, H) * 2 - 1).bfloat16()
    w1 = ((torch.rand(E, 2 * I, H) * 2 - 1) / 2).bfloat16()
    w2 = ((torch.rand(E, H, I) * 2 - 1) / 4).bfloat16()
    b1 = (torch.rand(E, 2 * I) - 0.5).bfloat16()
    off, p2u, _, _ = torch.ops.flashmix.build_moe_routing_maps(ids, E)  # every expert local: P = k*T
    act = torch.ops.flashmix.moe_fc1(x, w1, off, p2u, k, bias=b1, activation="swiglu_oai", layout="interleaved")
    assert act.shape == (k * T, I) and act.dtype == torch.bfloat16
    want = ref.fc1(x.float().numpy(), w1.float().numpy(), off.numpy(), p2u.numpy(), T, b1.float().numpy(),
                   layout="interleaved", activation="swiglu_oai")
    assert_rounded_close(act.float().numpy(), want, "bfloat16")
    torch.library.opcheck(torch.ops.flashmix.moe_fc1.default, (x, w1, off, p2u, k),
                          {"bias": b1, "activation": "swiglu_clamped", "limit": 1.5})
    xp = x[p2u.long() % T]  # the permuted copy: T from its rows over k
    assert torch.equal(torch.ops.flashmix.moe_fc1(xp, w1, off, p2u, k, x_permuted=True),
                       torch.ops.flashmix.moe_fc1(x, w1, off, p2u, k))

    # The layer: the router on the logits, or the caller's ids; fill, shared_output.
    out = torch.ops.flashmix.moe_forward(x, w1, w2, k, router_logits=logits, b1=b1, **router_kw)
    act = torch.ops.flashmix.moe_fc1(x, w1, off, p2u, k, bias=b1)
    assert torch.equal(out, torch.ops.flashmix.moe_fc2_finalize(act, w2, off, p2u, k, scales=scales))
    torch.library.opcheck(torch.ops.flashmix.moe_forward.default, (x, w1, w2, k),
                          dict(router_logits=logits, b1=b1, mode="deterministic", **router_kw))
    for fc1_input in ("gather", "permuted_copy"):
        assert torch.equal(out, torch.ops.flashmix.moe_forward(x, w1, w2, k, router_logits=logits, b1=b1,
                                                               fc1_input=fc1_input, **router_kw))
    torch.library.opcheck(torch.ops.flashmix.moe_forward.default, (x, w1, w2, k),
                          dict(router_logits=logits, fc1_input="permuted_copy", **router_kw))
    shared = (torch.rand(T, H) - 0.5).bfloat16()
    ep = torch.ops.flashmix.moe_forward(x, w1[:2], w2[:2], k, token_selected_experts=ids, token_final_scales=scales,
                                        start_expert_id=3, shared_output=shared, fill=False)
    local = ((ids >= 3) & (ids < 5)).any(dim=1)
    assert (~local).any() and (ep[~local] == 0).all()
    off2, p2u2, _, _ = torch.ops.flashmix.build_moe_routing_maps(ids, 2, start_expert_id=3)
    act2 = torch.ops.flashmix.moe_fc1(x, w1[:2], off2, p2u2, k)
    want = torch.ops.flashmix.moe_fc2_finalize(act2, w2[:2], off2, p2u2, k, scales=scales, shared_output=shared,
                                               fill=False)
    assert torch.equal(ep, want)
    torch.library.opcheck(torch.ops.flashmix.moe_forward.default, (x, w1[:2], w2[:2], k),
                          {"token_selected_experts": ids, "token_final_scales": scales, "start_expert_id": 3,
                           "shared_output": shared, "fill": False})
    torch.library.opcheck(torch.ops.flashmix.moe_fc2_finalize.default, (act2, w2[:2], off2, p2u2, k),
                          {"scales": scales, "shared_output": shared, "fill": False})
    with pytest.raises(ValueError, match="^moe_forward: router_logits: "):
        torch.ops.flashmix.moe_forward(x, w1, w2, k)


def test_moe_layer_on_cpu_tensors():
    torch = torch_or_skip()
    torch.manual_seed(0)
    E, k, H, I = 8, 2, 16, 24
    layer = flashmix.MoeLayer(E, k, H, I, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, correction_bias=True, bias=True, activation="swiglu_oai",
                              w1_layout="interleaved", mode="deterministic")
    with torch.no_grad():
        layer.correction_bias.uniform_(-0.1, 0.1)
        layer.b1.uniform_(-0.5, 0.5)
    assert set(layer.state_dict()) == {"gate", "w1", "w2", "b1", "b2", "correction_bias"}
    assert not any(p.requires_grad for p in layer.parameters())
    assert layer.w1.shape == (E, 2 * I, H) and layer.w2.shape == (E, H, I) and layer.gate.shape == (E, H)
    x = torch.randn(3, 5, H).bfloat16()
    out = layer(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    x2 = x.reshape(-1, H)
    want = flashmix.moe_forward(x2, layer.w1, layer.w2, k=k, router_logits=x2 @ layer.gate.t(), scoring="sigmoid",
                                renormalize=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                correction_bias=layer.correction_bias, b1=layer.b1, b2=layer.b2,
                                activation="swiglu_oai", w1_layout="interleaved", mode="deterministic")
    assert torch.equal(out.reshape(-1, H), want)
    shared = torch.randn(3, 5, H).bfloat16()
    with_shared = layer(x, shared_output=shared)
    # one more rounding than out + shared: within one unit of either
    err = (with_shared.double() - (out.double() + shared.double())).abs()
    assert (err <= 2.0 ** -7 * (out.double().abs() + shared.double().abs())).all()
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), out)
    ep = flashmix.MoeLayer(E, k, H, I, num_local_experts=2, start_expert_id=4)
    assert ep.w1.shape == (2, 2 * I, H) and ep(x).shape == x.shape
    assert layer.fc1_input == "auto" and "fc1_input='auto'" in repr(layer)
    for fc1_input in ("gather", "permuted_copy"):
        layer.fc1_input = fc1_input
        assert torch.equal(layer(x), out)
    with pytest.raises(ValueError, match="^MoeLayer: dtype: "):
        flashmix.MoeLayer(E, k, H, I, dtype=torch.float32)


TORCH_OPS = ("build_moe_routing_maps", "finalize_moe_routing", "moe_fc2_finalize", "moe_router", "moe_fc1",
             "moe_forward", "mhc_expand", "mhc_pre", "mhc_pre_with_workspace", "mhc_post", "mhc_head",
             "mhc_post_pre", "mhc_post_pre_with_workspace", "mhc_post_pre_norm", "mhc_post_pre_fp8")


def test_torch_op_schemas_take_the_functions_defaults():
    torch = torch_or_skip()
    for name in TORCH_OPS:
        schema = getattr(torch.ops.flashmix, name).default._schema
        fn = getattr(flashmix, {"mhc_pre_with_workspace": "mhc_pre", "mhc_post_pre_norm": "mhc_post_pre",
                                "mhc_post_pre_with_workspace": "mhc_post_pre",
                                "mhc_post_pre_fp8": "mhc_post_pre"}.get(name, name))
        want = defaults_of(fn)
        for a in schema.arguments:
            keyword = "kernel" if a.name == "projection_kernel" else a.name  # the ops' name for `kernel`
            if a.has_default_value() and keyword in want and keyword not in ("hidden", "num_tokens",
                                                                              "num_experts"):  # -1 in ops
                assert a.default_value == want[keyword], (name, a.name, a.default_value, want[keyword])
    pre = {a.name: a.default_value for a in torch.ops.flashmix.mhc_pre.default._schema.arguments}
    assert pre["eps_norm"] == 1e-6 and pre["sinkhorn_iters"] == 20 and pre["projection_kernel"] == "auto", pre


def test_torch_custom_ops_take_the_kernel_on_cpu_tensors():
    # `projection_kernel` in the ops: an op argument named `kernel` breaks Inductor's fallback lowering
    torch = torch_or_skip()
    n, C, B = 4, 16, 3
    x = torch.randn(B, n, C).bfloat16()
    phi, alpha, bias = torch.randn(24, n * C) * 0.1, torch.rand(3) + 0.5, torch.randn(24)
    want = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias)
    for kernel in flashmix.MHC_PRE_KERNELS:
        got = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias, projection_kernel=kernel)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), kernel
    torch.library.opcheck(torch.ops.flashmix.mhc_pre.default, (x, phi, alpha, bias), {"projection_kernel": "portable"})
    ws = torch.zeros(flashmix.mhc_workspace_bytes(B, n, C), dtype=torch.uint8)
    got = torch.ops.flashmix.mhc_pre_with_workspace(x, phi, alpha, bias, ws, projection_kernel="split")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # the boundary with the workspace: the CPU reference, whatever the kernel named
    f_out, h_post = torch.randn(B, C).bfloat16(), torch.rand(B, n)
    h_res = torch.rand(B, n, n)
    want_pp = torch.ops.flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias)
    got_pp = torch.ops.flashmix.mhc_post_pre_with_workspace(x, f_out, h_post, h_res, phi, alpha, bias, ws,
                                                            projection_kernel="split")
    assert all(torch.equal(g, w) for g, w in zip(got_pp, want_pp))
    with pytest.raises(ValueError, match="^mhc_post_pre: workspace"):
        flashmix.mhc_post_pre(x, f_out, h_post, h_res, phi, alpha, bias, workspace=ws[:-1])
    head = (phi[:n], alpha[:1], bias[:n])
    assert torch.equal(torch.ops.flashmix.mhc_head(x, *head, projection_kernel="cluster_tile"),
                       flashmix.mhc_head(x, *head))
    torch.library.opcheck(torch.ops.flashmix.mhc_head.default, (x, *head), {"projection_kernel": "portable"})
    with pytest.raises(ValueError, match="^mhc_pre: kernel: "):
        torch.ops.flashmix.mhc_pre(x, phi, alpha, bias, projection_kernel="fast")

    def layer(x, phi, alpha, bias):
        f_pre, h_post, h_res = torch.ops.flashmix.mhc_pre(x, phi, alpha, bias, projection_kernel="portable")
        return torch.ops.flashmix.mhc_post(x, f_pre, h_post, h_res)

    assert torch.equal(torch.compile(layer, fullgraph=True)(x, phi, alpha, bias), layer(x, phi, alpha, bias))


def test_an_array_not_aligned_to_its_element_raises_value_error_naming_it():
    buf = bytearray(4 * 8 + 2)
    rows = np.frombuffer(buf, dtype=np.float32, offset=2, count=8).reshape(2, 4)  # 2 bytes past a float
    assert not rows.flags.aligned
    with raises_naming(ValueError, "finalize_moe_routing", "expanded_permuted_rows"):
        flashmix.finalize_moe_routing(rows, np.arange(2, dtype=np.int32), np.zeros((2, 1), np.int32),
                                      num_experts_per_node=1)


# ---------------------------------------------------------------------------
# quantize_fp8 (spec §12): bitwise against the numpy reference
# ---------------------------------------------------------------------------

needs_fp8_reference = pytest.mark.skipif(ref.ml_dtypes is None, reason="ml_dtypes is not installed")


def fp8_bits(a):
    """The bytes of a float32 / uint8 array as unsigned integers (NaN compares by its bits)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a.view(np.uint8)


@needs_fp8_reference
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
@pytest.mark.parametrize("shape", [(1, 128), (7, 384), (130, 256), (3, 45, 128), (2, 129, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_quantize_fp8_matches_spec(block, scale_format, shape):
    rng = np.random.default_rng(sum(shape) * 10 + block[0])
    x = ref.fp8_input(rng, shape)
    q, scales = flashmix.quantize_fp8(x, block=block, scale_format=scale_format)
    want_q, want_s = ref.quantize_fp8(x, block[0], scale_format)
    assert q.dtype == np.uint8 and q.shape == shape
    assert scales.dtype == (np.uint8 if scale_format == "ue8m0" else np.float32) and scales.shape == want_s.shape
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(fp8_bits(scales), fp8_bits(want_s))


@needs_fp8_reference
def test_quantize_fp8_special_values_match_spec():
    x = np.zeros((4, 512), np.float32)
    x[0, :128] = np.linspace(-3, 3, 128)
    x[0, 7] = np.nan                    # a NaN block
    x[1, 128:256] = np.linspace(-1, 1, 128)
    x[1, 130] = -np.inf                 # an infinite element
    x[2, 256:384] = 1e-39               # bf16 subnormals
    x[3, 384] = 3e38                    # one huge value
    x = x.astype(ref.BF16)
    for block in [(1, 128), (128, 128)]:
        for fmt in ["float32", "ue8m0"]:
            q, s = flashmix.quantize_fp8(x, block=block, scale_format=fmt)
            want_q, want_s = ref.quantize_fp8(x, block[0], fmt)
            np.testing.assert_array_equal(q, want_q)
            np.testing.assert_array_equal(fp8_bits(s), fp8_bits(want_s))
    q, s = flashmix.quantize_fp8(x)
    assert np.isnan(s[0, 0]) and (q[0, :128] == 0x7F).all()
    assert s[1, 1] == np.inf and q[1, 130] == 0x7F
    assert s[0, 1] == 1.0  # a zero block


@needs_fp8_reference
def test_quantize_fp8_writes_strided_outputs_and_leaves_their_padding():
    rng = np.random.default_rng(3)
    big = ref.fp8_input(rng, (2, 40, 272))
    x = big[:, :33, :256]  # row stride 272, matrix stride 40 * 272
    q_big = np.full((2, 35, 300), 0xA5, np.uint8)
    q = q_big[:, :33, :256]
    q_ret, s = flashmix.quantize_fp8(x, block=(128, 128), out=q, scale_format="ue8m0")
    assert q_ret is q
    want_q, want_s = ref.quantize_fp8(np.ascontiguousarray(x), 128, "ue8m0")
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s, want_s)
    assert (q_big[:, :33, 256:] == 0xA5).all() and (q_big[:, 33:, :] == 0xA5).all()
    # an ml_dtypes float8_e4m3fn output and given scales are written in place
    q8 = np.zeros((33, 256), ref.ml_dtypes.float8_e4m3fn)
    s8 = np.zeros((33, 2), np.float32)
    flashmix.quantize_fp8(x[0], out=q8, scales=s8)
    want_q, want_s = ref.quantize_fp8(np.ascontiguousarray(x[0]), 1, "float32")
    np.testing.assert_array_equal(q8.view(np.uint8), want_q)
    np.testing.assert_array_equal(s8, want_s)


def test_quantize_fp8_zero_rows_is_valid():
    x = np.zeros((0, 256), ref.BF16) if ref.BF16 is not None else None
    if x is None:
        pytest.skip("ml_dtypes is not installed")
    q, s = flashmix.quantize_fp8(x, block=(128, 128))
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.parametrize("change, arg", [
    ({"block": (2, 128)}, "block"),
    ({"block": "1x64"}, "block"),
    ({"scale_format": "e8m0"}, "scale_format"),
    ({"x": np.zeros((4, 256), np.float32)}, "x"),
    ({"x": "cols100"}, "x"),
    ({"x": "four_dims"}, "x"),
    ({"out": np.zeros((4, 128), np.uint8)}, "out"),
    ({"out": np.zeros((4, 256), np.int8)}, "out"),
    ({"scales": np.zeros((4, 3), np.float32)}, "scales"),
    ({"scales": np.zeros((4, 2), np.uint8)}, "scales"),
    ({"scales": np.zeros((4, 4), np.float32)[:, ::2]}, "scales"),
])
def test_quantize_fp8_bad_input_raises_value_error_naming_the_argument(change, arg):
    if ref.BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    kw = {"x": np.ones((4, 256), ref.BF16)}
    kw.update(change)
    if isinstance(kw["x"], str):
        kw["x"] = {"cols100": np.ones((4, 100), ref.BF16), "four_dims": np.ones((1, 2, 4, 128), ref.BF16)}[kw["x"]]
    x = kw.pop("x")
    with raises_naming(ValueError, "quantize_fp8", arg):
        flashmix.quantize_fp8(x, **kw)


@needs_fp8_reference
@pytest.mark.parametrize("scale_format", ["float32", "ue8m0"])
def test_routing_maps_fp8_expansion_is_quantize_fp8_of_the_permuted_rows(scale_format):
    rng = np.random.default_rng(11)
    T, k, E, start, E_local, H = 40, 4, 16, 4, 8, 256
    experts = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    x = ref.fp8_input(rng, (T, H))
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E_local, start_expert_id=start, input=x,
                                           fp8_scale_format=scale_format)
    _, p2u, _ = ref.routing_maps(experts, start, E_local)
    P = len(p2u)
    assert P > 0
    want_q, want_s = ref.quantize_fp8(x[p2u % T], 1, scale_format)
    assert maps.permuted_input.dtype == np.uint8 and maps.permuted_input.shape == (k * T, H)
    np.testing.assert_array_equal(maps.permuted_input[:P], want_q)
    np.testing.assert_array_equal(fp8_bits(maps.permuted_input_scales[:P]), fp8_bits(want_s))
    with raises_naming(ValueError, "build_moe_routing_maps", "hidden"):
        flashmix.build_moe_routing_maps(experts, num_experts_per_node=E_local, input=x[:, :200].copy(),
                                        fp8_scale_format=scale_format)


def test_quantize_fp8_defaults_and_names_are_the_library_values():
    d = defaults_of(flashmix.quantize_fp8)
    assert (d["block"], d["scale_format"], d["enable_pdl"]) == ("1x128", "float32", True)
    assert flashmix.FP8_SCALE_FORMATS == ("float32", "ue8m0")
    assert flashmix.FP8_BLOCKS == ("1x128", "128x128")
    for name, value in _C.fp8_defaults()["quantize_fp8"].items():
        assert d[name] == value and type(d[name]) is type(value), name
    assert " = " not in _C.quantize_fp8.__doc__.splitlines()[0]
    assert "stream: int" in _C.quantize_fp8.__doc__


def test_torch_custom_op_quantize_fp8_on_cpu_tensors():
    torch = torch_or_skip()
    rng = np.random.default_rng(21)
    x_np = ref.fp8_input(rng, (3, 130, 256))
    x = torch.from_numpy(x_np.view(np.uint16)).view(torch.bfloat16)
    for block in ["1x128", "128x128"]:
        for fmt in ["float32", "ue8m0"]:
            q, s = torch.ops.flashmix.quantize_fp8(x, block, fmt)
            assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
            want_q, want_s = ref.quantize_fp8(x_np, 128 if block == "128x128" else 1, fmt)
            np.testing.assert_array_equal(q.view(torch.uint8).numpy(), want_q)
            got_s = s.view(torch.uint8).numpy() if fmt == "ue8m0" else s.numpy()
            np.testing.assert_array_equal(fp8_bits(got_s), fp8_bits(want_s))
    q, s = flashmix.quantize_fp8(x, block=(128, 128))
    compiled = torch.compile(lambda t: torch.ops.flashmix.quantize_fp8(t, "128x128"), fullgraph=True)
    q2, s2 = compiled(x)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def _dequantise(q, scales, block_rows):
    """float64 of e4m3 bytes q [(batch,) rows, cols] times their block scales (spec §11.2);
    block_rows 0: one scale per matrix (per tensor)."""
    v = np.asarray(q).view(ref.ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = np.asarray(scales, np.float64)
    if block_rows == 0:
        return v * s.reshape(s.shape + (1, 1))[..., :, :] if v.ndim == 3 else v * s.reshape(())
    rows = v.shape[-2]
    full = np.repeat(np.repeat(s, block_rows, axis=-2)[..., :rows, :], 128, axis=-1)
    return v * full


@needs_bf16
@pytest.mark.parametrize("scaling", ["block", "tensor"])
def test_moe_fc1_and_fc2_fp8_are_the_dequantised_math(scaling):
    # spec §9.7 / §3.5: e4m3 X, W1 (A, W2) with their scales give FC1 (FC2) of the dequantised values.
    rng = np.random.default_rng(25)
    T, k, E, H, I = 9, 2, 4, 256, 128
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E)
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    P = int(off[-1])
    x = ref.fp8_input(rng, (T, H))
    w1 = (rng.uniform(-1, 1, (E, 2 * I, H)) * 0.05).astype(BF16)
    if scaling == "block":
        xq, xs = ref.quantize_fp8(x, 1, "float32")
        wq, ws = ref.quantize_fp8(w1, 128, "float32")
        x_deq, w_deq = _dequantise(xq, xs, 1), _dequantise(wq, ws, 128)
    else:  # one scale for x, one per expert (the per-tensor scales are any positive floats)
        xs = np.array([np.abs(ref.f64(x)).max() / 448], np.float32)
        ws = (np.abs(ref.f64(w1)).max(axis=(1, 2)) / 448).astype(np.float32)
        xq = np.clip(ref.f64(x) / xs[0], -448, 448).astype(ref.ml_dtypes.float8_e4m3fn).view(np.uint8)
        wq = np.clip(ref.f64(w1) / ws[:, None, None], -448, 448).astype(ref.ml_dtypes.float8_e4m3fn).view(np.uint8)
        x_deq = xq.view(ref.ml_dtypes.float8_e4m3fn).astype(np.float64) * float(xs[0])
        w_deq = wq.view(ref.ml_dtypes.float8_e4m3fn).astype(np.float64) * ws[:, None, None].astype(np.float64)
    a = flashmix.moe_fc1(xq.view(ref.ml_dtypes.float8_e4m3fn), wq, off, p2u, k=k, fp8=scaling, x_scales=xs,
                         w1_scales=ws)
    want = ref.fc1(x_deq, w_deq, off, p2u, T)
    assert_rounded_close(a[:P], want, "bfloat16")
    # FC2 on FC1's output, quantised 1 x 128 (block) or per tensor, with FP8 W2.
    w2 = (rng.uniform(-1, 1, (E, H, I)) * 0.05).astype(BF16)
    scales = rng.uniform(0, 1, (T, k)).astype(np.float32)
    if scaling == "block":
        aq, as_ = ref.quantize_fp8(a, 1, "float32")
        w2q, w2s = ref.quantize_fp8(w2, 128, "float32")
        a_deq, w2_deq = _dequantise(aq, as_, 1), _dequantise(w2q, w2s, 128)
    else:
        as_ = np.array([np.abs(ref.f64(a[:P])).max() / 448], np.float32)
        w2s = (np.abs(ref.f64(w2)).max(axis=(1, 2)) / 448).astype(np.float32)
        aq = np.clip(ref.f64(a) / as_[0], -448, 448).astype(ref.ml_dtypes.float8_e4m3fn).view(np.uint8)
        w2q = np.clip(ref.f64(w2) / w2s[:, None, None], -448, 448).astype(ref.ml_dtypes.float8_e4m3fn).view(np.uint8)
        a_deq = aq.view(ref.ml_dtypes.float8_e4m3fn).astype(np.float64) * float(as_[0])
        w2_deq = w2q.view(ref.ml_dtypes.float8_e4m3fn).astype(np.float64) * w2s[:, None, None].astype(np.float64)
    out = flashmix.moe_fc2_finalize(aq, w2q, off, p2u, k=k, scales=scales, fp8=scaling, a_scales=as_,
                                    w2_scales=w2s)
    want2 = ref.fc2_finalize(a_deq, w2_deq, off, p2u, scales, None, T, k)
    assert_rounded_close(out, want2, "bfloat16", magnitude=np.abs(want2) + 1e-3 * np.abs(want2).max())
    # bf16 operands with scales, or FP8 without: named errors.
    with raises_naming(ValueError, "moe_fc1", "x_scales"):
        flashmix.moe_fc1(x, w1, off, p2u, k=k, x_scales=xs, w1_scales=ws)
    with raises_naming(ValueError, "moe_fc1", "x_scales"):
        flashmix.moe_fc1(xq, wq, off, p2u, k=k, fp8=scaling)
    with raises_naming(ValueError, "moe_fc2_finalize", "W2"):  # bf16 W2 under fp8
        flashmix.moe_fc2_finalize(aq, w2, off, p2u, k=k, scales=scales, fp8=scaling, a_scales=as_, w2_scales=w2s)


@needs_bf16
def test_moe_forward_fp8_weights_follow_the_staged_fp8_ops():
    # spec §10.4: FP8 weights (128 x 128 block scales): x and FC1's output quantised 1 x 128, FC1 and
    # FC2 on e4m3 -- the same as running those stages one by one through the bindings (CPU: the
    # references, so bit for bit).
    rng = np.random.default_rng(104)
    T, k, E, H, I = 7, 2, 4, 256, 128
    experts = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    scales = rng.uniform(0, 1, (T, k)).astype(np.float32)
    x = ref.fp8_input(rng, (T, H))
    w1 = (rng.uniform(-1, 1, (E, 2 * I, H)) * 0.05).astype(BF16)
    w2 = (rng.uniform(-1, 1, (E, H, I)) * 0.05).astype(BF16)
    w1q, w1s = flashmix.quantize_fp8(w1, block="128x128")
    w2q, w2s = flashmix.quantize_fp8(w2, block="128x128")
    got = flashmix.moe_forward(x, w1q, w2q, k=k, token_selected_experts=experts, token_final_scales=scales,
                               num_experts=E, fc1_input="gather", fp8="block", w1_scales=w1s, w2_scales=w2s)
    maps = flashmix.build_moe_routing_maps(experts, num_experts_per_node=E)
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    P = int(off[-1])
    xq, xs = flashmix.quantize_fp8(x)
    a = flashmix.moe_fc1(xq, w1q, off, p2u, k=k, fp8="block", x_scales=xs, w1_scales=w1s)
    aq, as_ = np.zeros((k * T, I), np.uint8), np.zeros((k * T, I // 128), np.float32)
    aq[:P], as_[:P] = flashmix.quantize_fp8(a[:P])
    # FC1's FP8 output (spec §9.8): those codes and scales, from FC1 itself.
    fq, fs = flashmix.moe_fc1(xq, w1q, off, p2u, k=k, fp8="block", x_scales=xs, w1_scales=w1s,
                              out_scale_format="float32")
    assert fq.dtype == np.uint8 and fq.shape == (k * T, I) and fs.shape == (k * T, I // 128)
    np.testing.assert_array_equal(fq[:P], aq[:P])
    np.testing.assert_array_equal(fs[:P].view(np.uint32), as_[:P].view(np.uint32))
    want = flashmix.moe_fc2_finalize(aq, w2q, off, p2u, k=k, scales=scales, fp8="block", a_scales=as_,
                                     w2_scales=w2s)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert flashmix.moe_forward_workspace_size(T, k, H, I, E, fp8="block") > flashmix.moe_forward_workspace_size(
        T, k, H, I, E)
    with raises_naming(ValueError, "moe_forward", "w1_scales"):
        flashmix.moe_forward(x, w1q, w2q, k=k, token_selected_experts=experts, num_experts=E, fp8="block")
    with raises_naming(ValueError, "moe_forward", "W2"):  # bf16 weights under fp8
        flashmix.moe_forward(x, w1, w2, k=k, token_selected_experts=experts, num_experts=E, fp8="block",
                             w1_scales=w1s, w2_scales=w2s)


def test_moe_layer_fp8_quantises_bf16_weights_once_or_takes_them_as_given():
    torch = torch_or_skip()
    torch.manual_seed(3)
    layer = flashmix.MoeLayer(8, 2, 256, 128, fp8="block")
    assert layer.w1.dtype == torch.float8_e4m3fn and layer.w1_scales.shape == (8, 2, 2)
    assert layer.w2.dtype == torch.float8_e4m3fn and layer.w2_scales.shape == (8, 2, 1)
    w1 = (torch.randn(8, 256, 256) * 0.06).to(torch.bfloat16)
    w2 = (torch.randn(8, 256, 128) * 0.09).to(torch.bfloat16)
    layer.load_expert_weights(w1, w2)
    x = (torch.randn(5, 256)).to(torch.bfloat16)
    got = layer(x)
    # The same layer in bf16 on the dequantised weights: FP8's error is a few per cent.
    dense = flashmix.MoeLayer(8, 2, 256, 128)
    with torch.no_grad():
        dense.gate.copy_(layer.gate)
        deq = lambda q, s: (q.float() * s.repeat_interleave(128, 1)[:, :q.shape[1]]  # noqa: E731
                            .repeat_interleave(128, 2)[:, :, :q.shape[2]]).to(torch.bfloat16)
        dense.load_expert_weights(deq(layer.w1, layer.w1_scales), deq(layer.w2, layer.w2_scales))
    want = dense(x)
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert 0 < err < 0.125, err
    # e4m3 weights with their scales, taken as given: the same output bit for bit.
    again = flashmix.MoeLayer(8, 2, 256, 128, fp8="block")
    with torch.no_grad():
        again.gate.copy_(layer.gate)
    again.load_expert_weights(layer.w1.clone(), layer.w2.clone(), layer.w1_scales.clone(), layer.w2_scales.clone())
    assert torch.equal(again(x).view(torch.int16), got.view(torch.int16))
    with pytest.raises(ValueError, match="fp8"):
        flashmix.MoeLayer(8, 2, 256, 128, fp8="tensor")


# --- MXFP4 conversions (spec §13) --------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def _mxfp4_reference(w, s):
    """spec §13.1 written out: the low nibble is the even element, a scale byte b is 2^(b - 127)."""
    lo, hi = E2M1[w & 0xF], E2M1[w >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*w.shape[:-1], 2 * w.shape[-1])
    return vals * np.repeat(np.exp2(s.astype(np.float64) - 127), 32, axis=-1)


def test_mxfp4_to_bf16_and_to_fp8_block_are_the_spec_values():
    rng = np.random.default_rng(11)
    w = rng.integers(0, 256, (3, 130, 128), dtype=np.uint8)
    s = rng.integers(113, 128, (3, 130, 8), dtype=np.uint8)  # spreads <= 14 in a 128 block: exact in e4m3
    want = _mxfp4_reference(w, s)
    got = flashmix.mxfp4_to_bf16(w, s)
    assert got.shape == (3, 130, 256) and got.dtype.name == "bfloat16"
    np.testing.assert_array_equal(got.astype(np.float64), want)  # every value exact in bf16 here
    import ml_dtypes
    for block, rows in (("128x128", 128), ("1x128", 1)):
        q, sc = flashmix.mxfp4_to_fp8_block(w, s, block=block)
        assert q.shape == (3, 130, 256) and sc.shape == (3, (130 + rows - 1) // rows, 2)
        scale = np.repeat(np.repeat(sc, rows, axis=1)[:, :130], 128, axis=2)
        np.testing.assert_array_equal(q.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale, want)
    with pytest.raises(ValueError, match="mxfp4_to_fp8_block: w_scales"):
        flashmix.mxfp4_to_fp8_block(w, s[:, :, :4])
    with pytest.raises(ValueError, match="mxfp4_to_bf16: w"):
        flashmix.mxfp4_to_bf16(w.astype(np.int32), s)


def test_moe_layer_dense_converts_mxfp4_experts_once():
    torch = torch_or_skip()
    g = torch.Generator().manual_seed(5)
    w1 = torch.randint(0, 256, (8, 256, 128), dtype=torch.uint8, generator=g)
    s1 = torch.randint(118, 126, (8, 256, 8), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (8, 256, 64), dtype=torch.uint8, generator=g)
    s2 = torch.randint(118, 126, (8, 256, 4), dtype=torch.uint8, generator=g)
    layer = flashmix.MoeLayer(8, 2, 256, 128, fp8="block")
    layer.load_mxfp4_experts(w1, s1, w2, s2)
    q1, c1 = flashmix.mxfp4_to_fp8_block(w1, s1)
    q2, c2 = flashmix.mxfp4_to_fp8_block(w2, s2)
    assert torch.equal(layer.w1.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(layer.w1_scales, c1)
    assert torch.equal(layer.w2.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(layer.w2_scales, c2)
    # a bf16 layer takes them dequantised (mxfp4_to_bf16); an MXFP4 layer keeps them (below)
    bf16 = flashmix.MoeLayer(8, 2, 256, 128)
    bf16.load_mxfp4_experts(w1, s1, w2, s2)
    assert torch.equal(bf16.w1, flashmix.mxfp4_to_bf16(w1, s1)) and torch.equal(bf16.w2, flashmix.mxfp4_to_bf16(w2, s2))


# --- The expert GEMMs on MXFP4 weights (spec §13.7) ---------------------------
# CPU: the references take each weight element as spec §13.7's table says; with
# scales spread narrowly (here: 6 binades), mxfp4_to_bf16 and mxfp4_to_fp8_block
# are exact and the MXFP4 ops equal the dense ops on the converted weights.

def mxfp4_checkpoint(rng, E, H, I, lo=116, hi=122):
    """A small synthetic DeepSeek-V4 layer (spec §13.6): per expert the gate w1 and the up w3
    ``[I, H/2]`` packed bytes + ``[I, H/32]`` ue8m0 scales, the down w2 ``[H, I/2]`` + ``[H, I/32]``;
    scale bytes in [lo, hi)."""
    def part(rows, cols):
        return (rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                rng.integers(lo, hi, (rows, cols // 32), dtype=np.uint8))
    experts = []
    for _ in range(E):
        (w1, s1), (w3, s3), (w2, s2) = part(I, H), part(I, H), part(H, I)
        experts.append({"w1": w1, "w1_scale": s1, "w3": w3, "w3_scale": s3, "w2": w2, "w2_scale": s2})
    return experts


def mxfp4_problem(seed, T=9, k=2, E=8, H=256, I=128, layout="gate_up"):
    rng = np.random.default_rng(seed)
    w1, s1, w2, s2 = flashmix.stack_deepseek_v4_experts(mxfp4_checkpoint(rng, E, H, I), layout)
    return {"T": T, "k": k, "E": E, "H": H, "I": I, "w1": w1, "s1": s1, "w2": w2, "s2": s2,
            "x": rng.uniform(-1, 1, (T, H)).astype(BF16), "logits": ref.grid_logits(rng, T, E),
            "experts": np.array([rng.permutation(E)[:k] for _ in range(T)], np.int32).reshape(T, k),
            "scales": rng.uniform(0, 1, (T, k)).astype(np.float32)}


def dense_twin(p, fp8, start=0, E_local=None):
    """The converted weights of experts [start, start + E_local): bf16 (fp8 "none", W4A16's twin) or
    e4m3 with 128 x 128 block scales (fp8 "block", W4A8's twin), as a dict of moe_forward keywords."""
    E_local = p["E"] if E_local is None else E_local
    sl = slice(start, start + E_local)
    if fp8 == "none":
        return {"w1": flashmix.mxfp4_to_bf16(p["w1"][sl], p["s1"][sl]),
                "w2": flashmix.mxfp4_to_bf16(p["w2"][sl], p["s2"][sl])}
    q1, c1 = flashmix.mxfp4_to_fp8_block(p["w1"][sl], p["s1"][sl])
    q2, c2 = flashmix.mxfp4_to_fp8_block(p["w2"][sl], p["s2"][sl])
    return {"w1": q1, "w2": q2, "w1_scales": c1, "w2_scales": c2, "fp8": "block"}


def mxfp4_kw(p, fp8, start=0, E_local=None):
    E_local = p["E"] if E_local is None else E_local
    sl = slice(start, start + E_local)
    return {"w1": p["w1"][sl], "w2": p["w2"][sl], "w1_mx_scales": p["s1"][sl], "w2_mx_scales": p["s2"][sl],
            "weights": "mxfp4", "fp8": fp8}


def assert_same_bf16(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@needs_bf16
@pytest.mark.parametrize("fp8", ["none", "block"], ids=["W4A16", "W4A8"])
def test_moe_fc1_and_fc2_on_mxfp4_weights_are_the_dense_ops_on_the_converted_weights(fp8):
    p = mxfp4_problem(60 + (fp8 == "block"))
    T, k, I = p["T"], p["k"], p["I"]
    maps = flashmix.build_moe_routing_maps(p["experts"], num_experts_per_node=p["E"])
    off, p2u = maps.expert_first_token_offset, maps.permuted_row_to_unpermuted_row
    P = int(off[-1])
    twin, mx = dense_twin(p, fp8), mxfp4_kw(p, fp8)
    x_kw = {}
    x = p["x"]
    if fp8 == "block":
        x, xs = flashmix.quantize_fp8(p["x"])
        x_kw = {"fp8": "block", "x_scales": xs}
    got = flashmix.moe_fc1(x, mx["w1"], off, p2u, k=k, weights="mxfp4", w1_mx_scales=mx["w1_mx_scales"], **x_kw)
    want = flashmix.moe_fc1(x, twin["w1"], off, p2u, k=k, w1_scales=twin.get("w1_scales"), **x_kw)
    assert got.shape == (k * T, I)
    assert_same_bf16(got[:P], want[:P])
    # FC2 on FC1's rows (quantised 1 x 128 for W4A8)
    a, a_kw = got, {}
    if fp8 == "block":
        a, a_s = np.zeros((k * T, I), np.uint8), np.zeros((k * T, I // 128), np.float32)
        a[:P], a_s[:P] = flashmix.quantize_fp8(got[:P])
        a_kw = {"fp8": "block", "a_scales": a_s}
    got2 = flashmix.moe_fc2_finalize(a, mx["w2"], off, p2u, k=k, scales=p["scales"], weights="mxfp4",
                                     w2_mx_scales=mx["w2_mx_scales"], **a_kw)
    want2 = flashmix.moe_fc2_finalize(a, twin["w2"], off, p2u, k=k, scales=p["scales"],
                                      w2_scales=twin.get("w2_scales"), **a_kw)
    assert got2.shape == (T, p["H"])
    assert_same_bf16(got2, want2)
    # The ue8m0 scales may come as ml_dtypes.float8_e8m0fnu (the same bytes).
    e8m0 = getattr(ref.ml_dtypes, "float8_e8m0fnu", None)
    if e8m0 is not None:
        again = flashmix.moe_fc1(x, mx["w1"], off, p2u, k=k, weights="mxfp4",
                                 w1_mx_scales=mx["w1_mx_scales"].view(e8m0), **x_kw)
        assert_same_bf16(again[:P], got[:P])


@needs_bf16
@pytest.mark.parametrize("fp8", ["none", "block"], ids=["W4A16", "W4A8"])
@pytest.mark.parametrize("rank", ["all", "ep"])
def test_moe_forward_on_mxfp4_weights_is_the_dense_layer_on_the_converted_weights(fp8, rank):
    # moe_forward(weights="mxfp4"): fp8 "none" is the bf16 layer on mxfp4_to_bf16's weights, fp8
    # "block" the FP8 layer on mxfp4_to_fp8_block's (x and FC1's rows quantised the same way), bit
    # for bit here; an expert-parallel rank holds experts [4, 7) of 8.
    p = mxfp4_problem(70 + (fp8 == "block") + 2 * (rank == "ep"), T=11, k=3)
    start, E_local = (4, 3) if rank == "ep" else (0, p["E"])
    common = {"k": p["k"], "router_logits": p["logits"], "renormalize": True, "start_expert_id": start,
              "activation": "swiglu_clamped"}
    got = flashmix.moe_forward(p["x"], **mxfp4_kw(p, fp8, start, E_local), **common)
    want = flashmix.moe_forward(p["x"], **dense_twin(p, fp8, start, E_local), **common)
    assert got.shape == p["x"].shape
    assert_same_bf16(got, want)
    if rank == "ep":  # tokens with none of this rank's experts get 0
        ids = flashmix.moe_router(p["logits"], p["k"], renormalize=True).token_selected_experts
        local = ((ids >= start) & (ids < start + E_local)).any(axis=1)
        assert (ref.f64(got)[~local] == 0).all()
    # the caller's ids, fill=False: the same rows
    ids, w = flashmix.moe_router(p["logits"], p["k"], renormalize=True)
    by_ids = flashmix.moe_forward(p["x"], **mxfp4_kw(p, fp8, start, E_local), k=p["k"], token_selected_experts=ids,
                                  token_final_scales=w, start_expert_id=start, activation="swiglu_clamped",
                                  fill=False)
    assert_same_bf16(by_ids, got)


@needs_bf16
def test_moe_forward_on_mxfp4_weights_takes_either_w1_layout():
    # stack_deepseek_v4_experts(layout="interleaved") with w1_layout="interleaved": the same layer.
    p = mxfp4_problem(80)
    q = mxfp4_problem(80, layout="interleaved")
    kw = {"k": p["k"], "router_logits": p["logits"]}
    got = flashmix.moe_forward(q["x"], **mxfp4_kw(q, "block"), w1_layout="interleaved", **kw)
    assert_same_bf16(got, flashmix.moe_forward(p["x"], **mxfp4_kw(p, "block"), **kw))


@needs_bf16
def test_moe_forward_workspace_size_with_mxfp4_weights():
    T, k, H, I, E = 64, 4, 256, 128, 8
    w4a8 = flashmix.moe_forward_workspace_size(T, k, H, I, E, fp8="block", weights="mxfp4")
    w4a16 = flashmix.moe_forward_workspace_size(T, k, H, I, E, weights="mxfp4")
    assert w4a8 == flashmix.moe_forward_workspace_size(T, k, H, I, E, fp8="block")  # the FP8 layer's intermediates
    assert w4a16 == flashmix.moe_forward_workspace_size(T, k, H, I, E)              # the bf16 layer's
    with raises_naming(ValueError, "moe_forward", "fp8"):
        flashmix.moe_forward_workspace_size(T, k, H, I, E, fp8="tensor", weights="mxfp4")
    with raises_naming(ValueError, "moe_forward", "weights"):
        flashmix.moe_forward_workspace_size(T, k, H, I, E, weights="fp4")
    with pytest.raises(ValueError, match=r"^moe_forward: (moe_fc1: |moe_fc2_finalize: )?inter: "):  # library: I % 128
        flashmix.moe_forward_workspace_size(T, k, H, 96, E, weights="mxfp4")
    assert flashmix.MOE_WEIGHT_FORMATS == ("dense", "mxfp4")
    for fn in (flashmix.moe_fc1, flashmix.moe_fc2_finalize, flashmix.moe_forward):
        assert defaults_of(fn)["weights"] == "dense"


U8 = np.uint8


@needs_bf16
@pytest.mark.parametrize("change,arg", [
    ({"w1": np.zeros((2, 16, 32), U8), "x": np.zeros((4, 64), BF16),
      "w1_mx_scales": np.zeros((2, 16, 2), U8)}, "W1"),                        # H = 64: not a multiple of 128
    ({"w1": np.zeros((2, 16, 128), BF16)}, "W1"),                              # not packed bytes
    ({"w1": np.zeros((2, 15, 64), U8), "w1_mx_scales": np.zeros((2, 15, 4), U8)}, "W1"),  # odd 2I
    ({"w1": np.zeros((2, 16, 64, 1), U8)}, "W1"),                              # not 3-D
    ({"w1_mx_scales": np.zeros((2, 16, 2), U8)}, "w1_mx_scales"),              # not H/32 columns
    ({"w1_mx_scales": np.zeros((2, 8, 4), U8)}, "w1_mx_scales"),               # not W1's rows
    ({"w1_mx_scales": np.zeros((1, 16, 4), U8)}, "w1_mx_scales"),              # not W1's experts
    ({"w1_mx_scales": np.zeros((2, 16, 4), np.float32)}, "w1_mx_scales"),      # not bytes
    ({"w1_mx_scales": None}, "w1_mx_scales"),                                  # required
    ({"w1_scales": np.ones((2, 1, 1), np.float32)}, "w1_scales"),              # the dense weights' scales
    ({"weights": "dense"}, "w1_mx_scales"),                                    # ue8m0 scales with dense weights
    ({"weights": "fp4"}, "weights"),
    ({"fp8": "tensor"}, "fp8"),                                                # W4A8 or W4A16 only
    ({"x": np.zeros((4, 256), BF16)}, "X"),                                    # not H = 2 * W1.shape[2] columns
    ({"fp8": "block"}, "X"),                                                   # W4A8: e4m3 x
    ({"fp8": "block", "x": np.zeros((4, 128), U8)}, "x_scales"),               # W4A8: x's scales
    ({"fp8": "block", "x": np.zeros((4, 128), U8), "x_scales": np.ones((4, 2), np.float32)}, "x_scales"),
    ({"x_scales": np.ones((4, 1), np.float32)}, "x_scales"),                   # W4A16: bf16 x has none
])
def test_moe_fc1_mxfp4_bad_input_raises_value_error_naming_the_argument(change, arg):
    kw = {"x": np.zeros((4, 128), BF16), "w1": np.zeros((2, 16, 64), U8), "w1_mx_scales": np.zeros((2, 16, 4), U8),
          "off": np.zeros(3, np.int64), "p2u": np.zeros(8, np.int32), "k": 2, "out": np.full((8, 8), 3.0, BF16),
          "weights": "mxfp4"}
    kw.update(change)
    x, w1, off, p2u, out = (kw.pop(n) for n in ("x", "w1", "off", "p2u", "out"))
    before = out.copy()
    with raises_naming(ValueError, "moe_fc1", arg):
        flashmix.moe_fc1(x, w1, off, p2u, out=out, **kw)
    assert_same_bf16(out, before)  # nothing written


@needs_bf16
@pytest.mark.parametrize("change,arg", [
    ({"W2": np.zeros((2, 16, 32), U8), "A": np.zeros((8, 64), BF16),
      "w2_mx_scales": np.zeros((2, 16, 2), U8)}, "W2"),                        # I = 64: not a multiple of 128
    ({"W2": np.zeros((2, 16, 128), BF16)}, "W2"),                              # not packed bytes
    ({"w2_mx_scales": np.zeros((2, 16, 8), U8)}, "w2_mx_scales"),              # not I/32 columns
    ({"w2_mx_scales": np.zeros((2, 8, 4), U8)}, "w2_mx_scales"),               # not W2's rows
    ({"w2_mx_scales": None}, "w2_mx_scales"),
    ({"w2_scales": np.ones((2, 1, 1), np.float32)}, "w2_scales"),
    ({"weights": "dense"}, "w2_mx_scales"),
    ({"fp8": "tensor"}, "fp8"),
    ({"A": np.zeros((8, 64), BF16)}, "A"),                                     # not I = 2 * W2.shape[2] columns
    ({"fp8": "block", "A": np.zeros((8, 128), U8)}, "a_scales"),
    ({"out": np.zeros((4, 8), BF16)}, "out"),                                  # not H = W2.shape[1] columns
])
def test_moe_fc2_finalize_mxfp4_bad_input_raises_value_error_naming_the_argument(change, arg):
    kw = {"A": np.zeros((8, 128), BF16), "W2": np.zeros((2, 16, 64), U8), "w2_mx_scales": np.zeros((2, 16, 4), U8),
          "off": np.zeros(3, np.int64), "p2u": np.zeros(8, np.int32), "k": 2, "out": np.full((4, 16), 3.0, BF16),
          "weights": "mxfp4"}
    kw.update(change)
    A, W2, off, p2u, out = (kw.pop(n) for n in ("A", "W2", "off", "p2u", "out"))
    before = out.copy()
    with raises_naming(ValueError, "moe_fc2_finalize", arg):
        flashmix.moe_fc2_finalize(A, W2, off, p2u, out=out, **kw)
    assert_same_bf16(out, before)


@needs_bf16
@pytest.mark.parametrize("change,arg", [
    ({"w2": np.zeros((2, 128, 32), U8), "w2_mx_scales": np.zeros((2, 128, 2), U8)}, "W2"),  # I = 64
    ({"w2": np.zeros((2, 64, 64), U8), "w2_mx_scales": np.zeros((2, 64, 4), U8)}, "W2"),    # H = 64
    ({"w2": np.zeros((2, 128, 128), BF16)}, "W2"),                             # not packed bytes
    ({"w1": np.zeros((2, 256, 32), U8)}, "W1"),                                # not H/2 columns
    ({"w1": np.zeros((2, 128, 64), U8)}, "W1"),                                # not 2I rows
    ({"w1": np.zeros((1, 256, 64), U8)}, "W1"),                                # not W2's experts
    ({"w1": np.zeros((2, 256, 128), BF16)}, "W1"),                             # not packed bytes
    ({"w1_mx_scales": np.zeros((2, 256, 2), U8)}, "w1_mx_scales"),
    ({"w1_mx_scales": None}, "w1_mx_scales"),
    ({"w2_mx_scales": np.zeros((2, 128, 8), U8)}, "w2_mx_scales"),
    ({"w2_mx_scales": np.zeros((2, 128, 4), np.int32)}, "w2_mx_scales"),
    ({"w2_mx_scales": None}, "w2_mx_scales"),
    ({"w1_scales": np.ones((2, 2, 1), np.float32)}, "w1_scales"),
    ({"w2_scales": np.ones((2, 1, 1), np.float32)}, "w2_scales"),
    ({"weights": "dense"}, "w1_mx_scales"),
    ({"weights": "nvfp4"}, "weights"),
    ({"fp8": "tensor"}, "fp8"),
    ({"x": np.zeros((4, 256), BF16), "out": np.zeros((4, 256), BF16)}, "X"),   # not H columns
    ({"b1": np.zeros((2, 128), BF16)}, "b1"),                                  # not [E_local, 2I]
])
def test_moe_forward_mxfp4_bad_input_raises_value_error_naming_the_argument(change, arg):
    kw = {"x": np.zeros((4, 128), BF16), "w1": np.zeros((2, 256, 64), U8), "w2": np.zeros((2, 128, 64), U8),
          "w1_mx_scales": np.zeros((2, 256, 4), U8), "w2_mx_scales": np.zeros((2, 128, 4), U8), "weights": "mxfp4",
          "k": 2, "router_logits": np.zeros((4, 8), np.float32), "out": np.full((4, 128), 3.0, BF16)}
    kw.update(change)
    x, w1, w2, out = (kw.pop(n) for n in ("x", "w1", "w2", "out"))
    before = out.copy()
    with raises_naming(ValueError, "moe_forward", arg):
        flashmix.moe_forward(x, w1, w2, out=out, **kw)
    assert_same_bf16(out, before)


def test_moe_layer_mxfp4_on_cpu_tensors():
    # MoeLayer(weights="mxfp4") keeps the packed bytes and the ue8m0 scales and runs moe_forward on
    # them: W4A8 (default) is the FP8 layer on mxfp4_to_fp8_block's weights, W4A16 the bf16 layer on
    # mxfp4_to_bf16's (both: load_mxfp4_experts on a dense layer), bit for bit on the CPU; also on an
    # expert-parallel rank, and compiled.
    torch = torch_or_skip()
    torch.manual_seed(21)
    E, k, H, I = 8, 2, 256, 128
    ckpt = [{n: torch.from_numpy(a) for n, a in e.items()}
            for e in mxfp4_checkpoint(np.random.default_rng(22), E, H, I)]
    if hasattr(torch, "float4_e2m1fn_x2"):  # the checkpoint's own dtypes (spec §13.1)
        ckpt = [{n: a.view(torch.float8_e8m0fnu if n.endswith("scale") else torch.float4_e2m1fn_x2)
                 for n, a in e.items()} for e in ckpt]
    w1, s1, w2, s2 = flashmix.stack_deepseek_v4_experts(ckpt)
    x = torch.randn(3, 5, H).bfloat16()
    for fp8 in ("block", "none"):
        for start, E_local in ((0, E), (4, 2)):
            kw = dict(num_local_experts=E_local, start_expert_id=start, activation="swiglu_clamped",
                      renormalize=True)
            mx = flashmix.MoeLayer(E, k, H, I, weights="mxfp4", **({} if fp8 == "block" else {"fp8": "none"}), **kw)
            assert mx.fp8 == fp8 and mx.weights == "mxfp4" and "weights='mxfp4'" in repr(mx)
            assert mx.w1.dtype == torch.uint8 and mx.w1.shape == (E_local, 2 * I, H // 2)
            assert mx.w2.shape == (E_local, H, I // 2) and mx.w1_mx_scales.shape == (E_local, 2 * I, H // 32)
            assert mx.w2_mx_scales.shape == (E_local, H, I // 32) and mx.w1_scales is None
            assert set(mx.state_dict()) == {"gate", "w1", "w2", "w1_mx_scales", "w2_mx_scales"}
            y0 = mx(x)  # random MXFP4 weights: finite, of the right shape
            assert y0.shape == x.shape and torch.isfinite(y0.float()).all()
            sl = slice(start, start + E_local)
            mx.load_mxfp4_experts(w1[sl], s1[sl], w2[sl], s2[sl])
            assert torch.equal(mx.w1, w1[sl].view(torch.uint8)) and torch.equal(mx.w2_mx_scales,
                                                                                s2[sl].view(torch.uint8))
            dense = flashmix.MoeLayer(E, k, H, I, fp8=fp8, **kw)
            with torch.no_grad():
                dense.gate.copy_(mx.gate)
            dense.load_mxfp4_experts(w1[sl], s1[sl], w2[sl], s2[sl])
            got = mx(x)
            assert got.shape == x.shape and got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), dense(x).view(torch.int16)), (fp8, start)
            if start == 0:
                torch._dynamo.reset()  # other tests compiled MoeLayer.forward too: stay under the recompile limit
                compiled = torch.compile(mx, fullgraph=True)
                assert torch.equal(compiled(x).view(torch.int16), got.view(torch.int16))
    torch.library.opcheck(torch.ops.flashmix.moe_forward.default, (x.reshape(-1, H), mx.w1, mx.w2, k),
                          {"router_logits": x.reshape(-1, H) @ mx.gate.t(), "num_experts": E, "start_expert_id": 0,
                           "fp8": "none", "weights": "mxfp4", "w1_mx_scales": mx.w1_mx_scales,
                           "w2_mx_scales": mx.w2_mx_scales})
    with pytest.raises(ValueError, match="^MoeLayer.load_expert_weights: w1: "):
        mx.load_expert_weights(torch.zeros(E, 2 * I, H).bfloat16(), torch.zeros(E, H, I).bfloat16())
    with pytest.raises(ValueError, match="^MoeLayer.load_mxfp4_experts: w1_scales: "):
        mx.load_mxfp4_experts(w1[4:6], s1[4:6, :, :4], w2[4:6], s2[4:6])  # the last layer: experts [4, 6)
    with pytest.raises(ValueError, match="^MoeLayer: hidden: "):
        flashmix.MoeLayer(E, k, 192, I, weights="mxfp4")
    with pytest.raises(ValueError, match="^MoeLayer: weights: "):
        flashmix.MoeLayer(E, k, H, I, weights="nvfp4")
    with pytest.raises(ValueError, match="^MoeLayer: fp8: "):
        flashmix.MoeLayer(E, k, H, I, weights="mxfp4", fp8="tensor")


def test_torch_custom_ops_fc1_and_fc2_take_mxfp4_weights_on_cpu_tensors():
    torch = torch_or_skip()
    p = mxfp4_problem(90)
    t = {n: torch.from_numpy(p[n]) for n in ("w1", "s1", "w2", "s2", "experts", "scales")}
    x = torch.from_numpy(p["x"].astype(np.float32)).bfloat16()
    off, p2u, _, _ = torch.ops.flashmix.build_moe_routing_maps(t["experts"], p["E"])
    a = torch.ops.flashmix.moe_fc1(x, t["w1"], off, p2u, p["k"], weights="mxfp4", w1_mx_scales=t["s1"])
    want = flashmix.moe_fc1(x, t["w1"], off, p2u, k=p["k"], weights="mxfp4", w1_mx_scales=t["s1"])
    P = int(off[-1])
    assert torch.equal(a[:P], want[:P])
    out = torch.ops.flashmix.moe_fc2_finalize(a, t["w2"], off, p2u, p["k"], scales=t["scales"], weights="mxfp4",
                                              w2_mx_scales=t["s2"])
    assert out.shape == (p["T"], p["H"])
    torch.library.opcheck(torch.ops.flashmix.moe_fc2_finalize.default, (a, t["w2"], off, p2u, p["k"]),
                          {"scales": t["scales"], "weights": "mxfp4", "w2_mx_scales": t["s2"]})


@needs_bf16
def test_mxfp4_weights_of_another_one_byte_float_type_raise_value_error_naming_them():
    # The package views one-byte float types as uint8; under weights="mxfp4" only the MXFP4 ones
    # (float4_e2m1fn_x2 packed, float8_e8m0fnu scales) or plain bytes are taken.
    p = mxfp4_problem(95)
    kw = {"k": p["k"], "router_logits": p["logits"], "weights": "mxfp4"}
    e4m3 = ref.ml_dtypes.float8_e4m3fn
    with raises_naming(ValueError, "moe_forward", "W1"):
        flashmix.moe_forward(p["x"], p["w1"].view(e4m3), p["w2"], w1_mx_scales=p["s1"], w2_mx_scales=p["s2"], **kw)
    with raises_naming(ValueError, "moe_forward", "w2_mx_scales"):
        flashmix.moe_forward(p["x"], p["w1"], p["w2"], w1_mx_scales=p["s1"], w2_mx_scales=p["s2"].view(e4m3), **kw)
    fp4 = getattr(ref.ml_dtypes, "float4_e2m1fn", None)  # one code a byte: not packed
    if fp4 is not None:
        with raises_naming(ValueError, "moe_fc1", "W1"):
            flashmix.moe_fc1(p["x"], p["w1"].view(fp4), np.zeros(p["E"] + 1, np.int64), np.zeros(18, np.int32),
                             k=p["k"], weights="mxfp4", w1_mx_scales=p["s1"])


def test_moe_forward_takes_torch_mxfp4_dtypes_on_cpu_tensors():
    torch = torch_or_skip()
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    p = mxfp4_problem(96)
    t = {n: torch.from_numpy(p[n]) for n in ("w1", "s1", "w2", "s2", "logits")}
    x = torch.from_numpy(p["x"].astype(np.float32)).bfloat16()
    kw = {"k": p["k"], "router_logits": t["logits"], "weights": "mxfp4", "fp8": "block"}
    want = flashmix.moe_forward(x, t["w1"], t["w2"], w1_mx_scales=t["s1"], w2_mx_scales=t["s2"], **kw)
    fp4, e8m0 = torch.float4_e2m1fn_x2, torch.float8_e8m0fnu
    got = flashmix.moe_forward(x, t["w1"].view(fp4), t["w2"].view(fp4), w1_mx_scales=t["s1"].view(e8m0),
                               w2_mx_scales=t["s2"].view(e8m0), **kw)
    assert torch.equal(got, want)
    op = torch.ops.flashmix.moe_forward(x, t["w1"].view(fp4), t["w2"].view(fp4), p["k"], router_logits=t["logits"],
                                        fp8="block", weights="mxfp4", w1_mx_scales=t["s1"].view(e8m0),
                                        w2_mx_scales=t["s2"].view(e8m0))
    assert torch.equal(op, want)
    with raises_naming(ValueError, "moe_forward", "W2"):
        flashmix.moe_forward(x, t["w1"], t["w2"].view(torch.float8_e4m3fn), w1_mx_scales=t["s1"],
                             w2_mx_scales=t["s2"], **kw)
