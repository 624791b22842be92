#!/usr/bin/env python3
"""Performance tables (markdown) from flashmix-bench JSON records.

    scripts/perf_table.py full RECORD.json          every case of one record (docs/performance.md)
    scripts/perf_table.py summary RECORD.json ...   the README's main cases, one column per record

Each full row: op, case, median time, the fraction of the same run's ceiling
(copy bandwidth for memory-bound ops, dense cuBLAS for GEMMs), the issue's
target where the case has one and whether this run met it, and the check of
the outputs against the CPU reference (correctness, not the target).
"""
import json
import sys

# The README's summary: the headline case of each op.
SUMMARY_CASES = [
    ("moe_routing", "T8192_k8_E256_maps"),
    ("moe_routing", "T8192_k8_E256_expand_H7168"),
    ("moe_finalize", "T8192_k8_H7168_bf16"),
    ("moe_finalize", "T8192_k2_H4096_bf16"),
    ("moe_finalize", "decode_T16_k8_H7168"),
    ("moe_fc2", "deepseek_ep_T1024_k8_E32_I2048_H7168/atomic"),
    ("moe_fc2", "deepseek_ep_T1024_k8_E32_I2048_H7168/deterministic"),
    ("moe_fc2", "mixtral_T4096_k2_E8_I14336_H4096/atomic"),
    ("moe_fc2", "qwen3moe_T4096_k8_E128_I768_H2048/atomic"),
    ("mhc_pre", "B8192_n4_C7168_phif32"),
    ("mhc_pre", "decode_B16_n4_C7168_graph"),
    ("mhc_post", "B8192_n4_C7168"),
]


def target_of(r):
    if "target_fraction" in r:
        return ">= %.2f of copy" % r["target_fraction"]
    if "target_max_us" in r:
        return "<= %.0f us" % r["target_max_us"]
    if "target_max_time_over_bound" in r:
        return "<= %.2f x bound" % r["target_max_time_over_bound"]
    if "target_ratio" in r:
        return "<= %.2f x dense" % r["target_ratio"]
    if "target_max_time_over_floor" in r:
        return "<= %.2f x floor" % r["target_max_time_over_floor"]
    return ""


def target_met(r):
    """'yes' / 'no' where the record carries a target, '' otherwise."""
    checks = [
        ("target_fraction", lambda t: r["fraction"] >= t),
        ("target_max_us", lambda t: r["median_us"] <= t),
        ("target_max_time_over_bound", lambda t: r["time_over_bound"] <= t),
        ("target_ratio", lambda t: r["ratio_to_dense"] <= t),
        ("target_max_time_over_floor", lambda t: r["time_over_floor"] <= t),
    ]
    for key, ok in checks:
        if key in r:
            return "yes" if ok(r[key]) else "**no**"
    return ""


def measured_of(r):
    if "time_over_bound" in r:
        return "%.2f x bound" % r["time_over_bound"]
    if "time_over_floor" in r:
        return "%.2f x floor" % r["time_over_floor"]
    if "ratio_to_dense" in r:
        return "%.2f x dense" % r["ratio_to_dense"]
    if r.get("ceiling") in ("copy", "gemm"):
        return "%.3f of %s" % (r["fraction"], r["ceiling"])
    return ""


def header(data):
    return ("Measured on %s, %s, commit %s; copy ceiling %.0f GB/s, dense bf16 GEMM %.0f TFLOP/s (same run)."
            % (data["gpu"], data["date"], data["commit"], data["copy_gbps"], data["gemm_tflops"]))


def full(path):
    data = json.load(open(path))
    print(header(data))
    print()
    print("| op | case | median | measured | target | target met | check (vs CPU reference) |")
    print("|---|---|---:|---:|---|---|---|")
    for r in data["records"]:
        print("| %s | %s | %.2f us | %s | %s | %s | %s |" % (r["op"], r["case"], r["median_us"], measured_of(r),
                                                            target_of(r), target_met(r), r["check"]))


def summary(paths):
    records = [json.load(open(p)) for p in paths]
    names = ["%s (%s)" % (d["gpu"].replace("NVIDIA ", ""), d["date"][:10]) for d in records]
    print("| op | case | " + " | ".join(names) + " | target |")
    print("|---|---|" + "---:|" * len(names) + "---|")
    for op, case in SUMMARY_CASES:
        cells, target = [], ""
        for d in records:
            r = next((x for x in d["records"] if x["op"] == op and x["case"] == case), None)
            if r is None:
                cells.append("")
                continue
            m = measured_of(r)
            cells.append("%.1f us%s" % (r["median_us"], ", " + m if m else ""))
            target = target or target_of(r)
        print("| %s | %s | %s | %s |" % (op, case, " | ".join(cells), target))
    for d, n in zip(records, names):
        print()
        print("%s: %s" % (n, header(d)))


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "full":
        full(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "summary":
        summary(sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
