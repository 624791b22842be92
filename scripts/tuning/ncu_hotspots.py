#!/usr/bin/env python3
"""Prints the SASS instructions with the most warp-stall samples from an ncu
source-page CSV (ncu -i REPORT --page source --csv --print-source sass).
Usage: ncu_hotspots.py CSV [top]"""
import csv
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    hdr_i = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    hdr = rows[hdr_i]
    body = rows[hdr_i + 1:]

    def col(*names):
        for n in names:
            for i, c in enumerate(hdr):
                if c.strip() == n:
                    return i
        for n in names:
            for i, c in enumerate(hdr):
                if n.lower() in c.lower():
                    return i
        return None

    src = col("Source")
    addr = col("Address")
    samp = col("Warp Stall Sampling (All Samples)")
    print("columns:", [c for c in hdr if "Stall" in c or "stall" in c][:40])

    def num(s):
        try:
            return float(s.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[samp]) for r in body if len(r) > samp)
    ranked = sorted(body, key=lambda r: -num(r[samp]) if len(r) > samp else 0)
    print(f"total samples {total:.0f}")
    for r in ranked[:top]:
        s = num(r[samp])
        print(f"{s:8.0f} {100 * s / max(total, 1):5.1f}%  {r[addr] if addr is not None else ''}  {r[src]}")


if __name__ == "__main__":
    main()
