#!/usr/bin/env python3
"""Where a kernel's warps wait, per SASS instruction, from an ncu report.

Reads the per-instruction table that ncu prints for a report profiled with
`--section SourceCounters` (warp-state sampling at every PC):

    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > K.csv   (or | gzip > K.csv.gz)
    bench/probes/sass_stalls.py K.csv[.gz] [--top N] [--range LO:HI[:NAME] ...]

and prints the samples by opcode and by stall reason, the N instructions
with the most samples (with their top reasons and execution counts), and
each barrier spin loop (a `SYNCS...TRYWAIT` on a shared address + offset
followed by its branch back) with the samples it took, so that waits on a
ring's full and empty barriers can be told apart by their offsets. A
--range (hexadecimal offsets into the kernel, as the table's addresses'
low 20 bits print) sums the samples of one role's code, e.g. a producer
loop: compare it with the samples a warp takes (total / resident warps) to
see whether that warp is busy or waiting. 2026-11-28: this is how the FC2
FP8 producer warp was found busy ~80 % of the kernel
(docs/fc2_grouped_gemm.md).
"""
import argparse
import collections
import csv
import gzip
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"


def read_table(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    # The first row names the kernel; the header follows.
    start = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    hdr = rows[start]
    return rows[0], hdr, [r for r in rows[start + 1:] if len(r) == len(hdr)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--range", action="append", default=[], help="LO:HI[:NAME], hexadecimal offsets")
    a = ap.parse_args()
    title, hdr, data = read_table(a.table)
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def n(r, key=SAMPLES):
        v = r[ix[key]].replace(",", "")
        return int(float(v)) if v not in ("", "-") else 0

    def off(r):
        return int(r[ix["Address"]], 16) & 0xFFFFF

    def src(r):
        return r[ix["Source"]].strip()

    total = sum(n(r) for r in data)
    if total == 0:
        sys.exit("sass_stalls: no samples (profile with --section SourceCounters)")
    print(" ".join(title)[:160])
    print(f"samples {total}, instructions {len(data)}")
    by_op, by_reason = collections.Counter(), collections.Counter()
    for r in data:
        words = [w for w in src(r).split() if not w.startswith("@")]
        by_op[words[0].split(".")[0] if words else "?"] += n(r)
        for s in stalls:
            by_reason[s[6:]] += n(r, s)
    pct = lambda v: f"{100.0 * v / total:.1f}%"
    print("by opcode:", ", ".join(f"{k} {pct(v)}" for k, v in by_op.most_common(12)))
    print("by reason:", ", ".join(f"{k} {pct(v)}" for k, v in by_reason.most_common(10)))

    print(f"\ntop {a.top} instructions (offset, samples, executed, top reasons):")
    for r in sorted(data, key=lambda r: -n(r))[: a.top]:
        top = sorted(((n(r, s), s[6:]) for s in stalls), reverse=True)[:3]
        why = ", ".join(f"{k} {v}" for v, k in top if v)
        print(f"  {off(r):05x} {pct(n(r)):>6} {r[ix['Instructions Executed']]:>10}  {src(r)[:64]:64s} {why}")

    print("\nbarrier waits (the TRYWAIT and its spin branch; offset into shared memory):")
    spins = collections.Counter()
    for i, r in enumerate(data):
        m = re.search(r"TRYWAIT\s+\w+,\s*\[([^\]]+)\]", src(r))
        if not m:
            continue
        bar = re.sub(r"R\d+\+|UR\d+\+|URZ\+", "", m.group(1))
        spent = n(r) + sum(n(x) for x in data[i + 1:i + 3] if "BRA" in src(x))
        spins[bar] += spent
    for bar, v in sorted(spins.items(), key=lambda kv: -kv[1])[:16]:
        if v:
            print(f"  [{bar}] {pct(v)}")

    for spec in a.range:
        parts = spec.split(":")
        lo, hi = int(parts[0], 16), int(parts[1], 16)
        name = parts[2] if len(parts) > 2 else spec
        s = sum(n(r) for r in data if lo <= off(r) < hi)
        print(f"\nrange {name} [{lo:05x}, {hi:05x}): {s} samples = {pct(s)} of all")


if __name__ == "__main__":
    main()
