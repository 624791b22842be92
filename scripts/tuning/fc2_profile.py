#!/usr/bin/env python3
"""Sums the stamps of the FC2 rows kernel's profiling build
(scripts/tuning/profile_bench.sh, FLASHMIX_FC2_PROFILE_LAUNCH=n): per consumer
warpgroup and tile class (N >= 224 'big', else 'small'), the mean cycles
from a tile's start to its first stage, of the mainloop (and its waits for
later stages), from the mainloop's end to the row table, and of the rest of
the epilogue (and its store issue); the cycles between tiles; each CTA's
total; and, from the producer's stamps (FC2P lines), how long before a
tile's start its first k-block was issued and how long it took to land.
Usage: fc2_profile.py LOG [k_blocks]"""
import collections
import sys

tiles = collections.defaultdict(list)  # (wg, class) -> stamps
ctas = collections.defaultdict(list)   # wg -> (total cycles, tiles)
prev_end = {}
gaps = collections.defaultdict(list)
first_ld = {}  # (cta, tile) of warpgroup 0 -> (start, first-stage wait, N)
prod = {}      # (cta, tile) -> (before the stage wait, k-block 0 issued, k-block 3 issued)
for line in open(sys.argv[1]):
    f = line.split()
    if not f:
        continue
    if f[0] == "FC2CTA":
        ctas[int(f[2])].append((int(f[3]), int(f[4])))
    elif f[0] == "FC2P":
        prod[(int(f[1]), int(f[2]))] = tuple(int(x) for x in f[3:6])
    elif f[0] == "FC2T":
        c, wg, i = int(f[1]), int(f[2]), int(f[3])
        start, first, main, tab, rest, n, wait, drain = (int(x) for x in f[4:12])
        if wg == 0:
            first_ld[(c, i)] = (start, first, n)
        tiles[(wg, "big" if n >= 224 else "small")].append((first, main, wait, tab, rest, drain, n))
        end = start + first + main + tab + rest
        if (c, wg) in prev_end and i > 0:
            gaps[wg].append(start - prev_end[(c, wg)])
        prev_end[(c, wg)] = end
if not ctas:
    sys.exit("no FC2CTA lines")
kb = int(sys.argv[2]) if len(sys.argv) > 2 else 0
for wg in sorted(ctas):
    tot = [t for t, _ in ctas[wg]]
    print(f"WG{wg}: {len(tot)} CTAs; cycles per CTA mean {sum(tot) / len(tot):.0f}, max {max(tot)}, min {min(tot)}; "
          f"tiles per CTA {min(n for _, n in ctas[wg])}-{max(n for _, n in ctas[wg])}")
    for cls in ("big", "small"):
        v = tiles.get((wg, cls))
        if not v:
            continue
        m = lambda i: sum(x[i] for x in v) / len(v)
        per_kb = f" ({m(1) / kb:.0f} per k-block, waiting {m(2) / kb:.0f})" if kb else f" (waiting {m(2):.0f})"
        print(f"  {cls}: {len(v)} tiles, mean N {m(6):.0f}: first stage {m(0):.0f}, mainloop {m(1):.0f}{per_kb}, "
              f"to the row table {m(3):.0f}, rest of the epilogue {m(4):.0f} (store issue {m(5):.0f})")
    g = gaps[wg]
    if g:
        print(f"  between tiles: mean {sum(g) / len(g):.0f}, max {max(g)}")
lead = collections.defaultdict(list)
for k, (start, first, n) in first_ld.items():
    if k in prod and k[1] > 0:
        w0, i0, i3 = prod[k]
        lead["big" if n >= 224 else "small"].append((start - i0, start + first - i0, i0 - w0))
for cls, v in lead.items():
    m = lambda j: sum(x[j] for x in v) / len(v)
    print(f"producer, {cls} tiles: k-block 0 issued {m(0):.0f} cycles before the tile starts, landed {m(1):.0f} after "
          f"its issue (the producer waited {m(2):.0f} for its stage)")
