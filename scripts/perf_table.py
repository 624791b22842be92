#!/usr/bin/env python3
"""Prints the README's performance table (markdown) from a flashmix-bench JSON file.

    scripts/perf_table.py bench/results/<file>.json

Each row: op, case, median time, the fraction of the same run's ceiling
(copy bandwidth for memory-bound ops, dense cuBLAS for GEMMs), the issue's
target where the case has one and whether this run met it, and the check of
the outputs against the CPU reference (correctness, not the target).
"""
import json
import sys


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


def main():
    data = json.load(open(sys.argv[1]))
    print("Measured on %s, %s, commit %s; copy ceiling %.0f GB/s, dense bf16 GEMM %.0f TFLOP/s (same run)."
          % (data["gpu"], data["date"], data["commit"], data["copy_gbps"], data["gemm_tflops"]))
    print()
    print("| op | case | median | measured | target | target met | check (vs CPU reference) |")
    print("|---|---|---:|---:|---|---|---|")
    for r in data["records"]:
        print("| %s | %s | %.2f us | %s | %s | %s | %s |" % (r["op"], r["case"], r["median_us"], measured_of(r),
                                                            target_of(r), target_met(r), r["check"]))


if __name__ == "__main__":
    main()
