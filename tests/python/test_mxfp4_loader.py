"""flashmix.mxfp4.stack_deepseek_v4_experts on a small synthetic DeepSeek-V4
checkpoint (spec §13.6): every row lands where the layout says, bytes
unchanged, the checkpoint names are V4's, and tensors whose shapes disagree
are named. numpy only (torch tensors take the same path where torch is
installed); the module needs no binding, so it is loaded from its file."""
import importlib.util
import os

import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "python", "flashmix", "mxfp4.py")
_spec = importlib.util.spec_from_file_location("flashmix_mxfp4_standalone", _PATH)
mxfp4 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mxfp4)


def synthetic_checkpoint(rng, layer, expert_ids, H, I):
    """V4's names and shapes, random bytes: {name: uint8 array}."""
    ck = {}
    for e in expert_ids:
        keys = mxfp4.deepseek_v4_expert_keys(layer, e)
        shapes = {"w1": (I, H // 2), "w1_scale": (I, H // 32), "w3": (I, H // 2), "w3_scale": (I, H // 32),
                  "w2": (H, I // 2), "w2_scale": (H, I // 32)}
        for part, name in keys.items():
            ck[name] = rng.integers(0, 256, size=shapes[part], dtype=np.uint8)
    return ck


def test_names_are_v4s():
    keys = mxfp4.deepseek_v4_expert_keys(3, 17)
    assert keys["w1"] == "layers.3.ffn.experts.17.w1.weight"
    assert keys["w3_scale"] == "layers.3.ffn.experts.17.w3.scale"
    assert keys["w2"] == "layers.3.ffn.experts.17.w2.weight"


@pytest.mark.parametrize("layout", ["gate_up", "interleaved"])
def test_every_row_lands_in_place(layout):
    rng = np.random.default_rng(28)
    H, I, layer, ids = 64, 96, 5, [8, 9, 10]  # this rank's experts: 8..10
    ck = synthetic_checkpoint(rng, layer, ids, H, I)
    w1, s1, w2, s2 = mxfp4.load_deepseek_v4_experts(ck.__getitem__, layer, ids, layout)
    assert w1.shape == (3, 2 * I, H // 2) and s1.shape == (3, 2 * I, H // 32)
    assert w2.shape == (3, H, I // 2) and s2.shape == (3, H, I // 32)
    assert w1.dtype == np.uint8 and s2.dtype == np.uint8
    for local, e in enumerate(ids):
        k = mxfp4.deepseek_v4_expert_keys(layer, e)
        gate_rows = np.arange(I) if layout == "gate_up" else 2 * np.arange(I)
        up_rows = I + np.arange(I) if layout == "gate_up" else 2 * np.arange(I) + 1
        np.testing.assert_array_equal(w1[local][gate_rows], ck[k["w1"]])
        np.testing.assert_array_equal(w1[local][up_rows], ck[k["w3"]])
        np.testing.assert_array_equal(s1[local][gate_rows], ck[k["w1_scale"]])
        np.testing.assert_array_equal(s1[local][up_rows], ck[k["w3_scale"]])
        np.testing.assert_array_equal(w2[local], ck[k["w2"]])
        np.testing.assert_array_equal(s2[local], ck[k["w2_scale"]])


def test_int8_and_one_byte_float_views_keep_the_bytes():
    rng = np.random.default_rng(1)
    H, I = 32, 32
    ck = synthetic_checkpoint(rng, 0, [0], H, I)
    k = mxfp4.deepseek_v4_expert_keys(0, 0)
    signed = {p: ck[n].view(np.int8) for p, n in k.items()}  # a checkpoint read as int8
    w1, s1, w2, s2 = mxfp4.stack_deepseek_v4_experts([signed])
    np.testing.assert_array_equal(w1[0][:I], ck[k["w1"]])
    try:
        import ml_dtypes
    except ImportError:
        return
    e8m0 = dict(signed, w1_scale=ck[k["w1_scale"]].view(ml_dtypes.float8_e8m0fnu))
    _, s1b, _, _ = mxfp4.stack_deepseek_v4_experts([e8m0])
    np.testing.assert_array_equal(s1b, s1.view(np.uint8))


def test_disagreeing_shapes_and_bad_arguments_are_named():
    rng = np.random.default_rng(2)
    H, I = 64, 32
    ck = synthetic_checkpoint(rng, 0, [0, 1], H, I)
    experts = [{p: ck[n] for p, n in mxfp4.deepseek_v4_expert_keys(0, e).items()} for e in (0, 1)]
    bad = [dict(experts[0]), dict(experts[1])]
    bad[1]["w3_scale"] = bad[1]["w3_scale"][:, :1]
    with pytest.raises(ValueError, match=r"experts\[1\]\.w3_scale: shape"):
        mxfp4.stack_deepseek_v4_experts(bad)
    bad = [dict(experts[0])]
    bad[0]["w2"] = np.zeros((H, I), np.uint8)  # unpacked by mistake
    with pytest.raises(ValueError, match=r"experts\[0\]\.w2: shape"):
        mxfp4.stack_deepseek_v4_experts(bad)
    bad = [dict(experts[0])]
    bad[0]["w1"] = bad[0]["w1"].astype(np.float32)
    with pytest.raises(ValueError, match=r"experts\[0\]\.w1: must be a one-byte array"):
        mxfp4.stack_deepseek_v4_experts(bad)
    bad = [dict(experts[0])]
    del bad[0]["w2_scale"]
    with pytest.raises(ValueError, match=r"experts\[0\]: missing \['w2_scale'\]"):
        mxfp4.stack_deepseek_v4_experts(bad)
    with pytest.raises(ValueError, match="layout"):
        mxfp4.stack_deepseek_v4_experts(experts, layout="up_gate")
    with pytest.raises(ValueError, match="experts: 1..1024"):
        mxfp4.stack_deepseek_v4_experts([])
    odd = {p: ck[n] for p, n in mxfp4.deepseek_v4_expert_keys(0, 0).items()}
    odd["w1"] = np.zeros((I, 24), np.uint8)  # H = 48: not a multiple of 32
    with pytest.raises(ValueError, match="multiples of 32"):
        mxfp4.stack_deepseek_v4_experts([odd])
