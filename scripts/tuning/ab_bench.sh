#!/usr/bin/env bash
# Same-run A/B of several builds on a GPU machine: runs each build's
# flashmix-bench over the same cases, interleaved (A B C A B C ...), and
# prints one line per case and build with every round's median, so that
# run-to-run spread and the difference between builds can be read together.
# Usage: scripts/tuning/ab_bench.sh OUT_DIR FILTER ROUNDS BUILD [BUILD ...]
#   BUILD: a directory holding flashmix-bench, or the .tar.xz that
#          scripts/stage_gpu_binaries.sh packs (its name names the build)
# Each run's JSON and log end up in OUT_DIR/runs.tar.gz (<build>-<round>.json).
set -uo pipefail
out=${1:?usage: ab_bench.sh OUT_DIR FILTER ROUNDS BUILD...}
filter=${2:?usage: ab_bench.sh OUT_DIR FILTER ROUNDS BUILD...}
rounds=${3:?usage: ab_bench.sh OUT_DIR FILTER ROUNDS BUILD...}
shift 3
mkdir -p "$out"
names=()
bins=()
source "$(dirname "$0")/../bin_dir.sh"
for b in "$@"; do
  names+=("$(basename "$b" .tar.xz)")
  bins+=("$(bin_dir "$b")/flashmix-bench")
done
status=0
for r in $(seq 1 "$rounds"); do
  for i in "${!bins[@]}"; do
    "${bins[$i]}" --filter "$filter" --json "$out/${names[$i]}-$r.json" > "$out/${names[$i]}-$r.log" 2>&1 ||
      { echo "${names[$i]} round $r: checks failed"; grep -E "FAILED|error" "$out/${names[$i]}-$r.log" | head -5; status=1; }
  done
done
python3 - "$out" "$rounds" "${names[@]}" <<'EOF'
import json, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
cases = {}
for n in names:
    for r in range(1, rounds + 1):
        try:
            recs = json.load(open(f"{out}/{n}-{r}.json"))["records"]
        except Exception:
            continue
        for rec in recs:
            key = rec["op"] + "/" + rec["case"]
            cases.setdefault(key, {}).setdefault(n, []).append((rec["median_us"], rec.get("fraction", 0), rec["check"]))
for key, per in cases.items():
    print(key)
    for n in names:
        v = per.get(n, [])
        print("  %-12s %s" % (n, "  ".join("%8.2f us %.3f %s" % (t, f, c[:6]) for t, f, c in v)))
EOF
# One file back from a device call instead of two per run (the device tool
# returns at most 8): the runs' JSON and logs packed together.
(cd "$out" && shopt -s nullglob && runs=(*-[0-9]*.json *-[0-9]*.log) && ((${#runs[@]})) &&
  tar czf runs.tar.gz -- "${runs[@]}" && rm -f -- "${runs[@]}")
exit $status
