#!/usr/bin/env bash
# A/B of one bench script's figures in one GPU run: an earlier commit (its tree unpacked at BASE, e.g.
# `git archive COMMIT | tar -x -C .baseline`) against this tree, alternating ROUNDS times so drift on the
# machine shows as spread, not as a difference. Each side runs its own copy of the script with its own
# pegainfer and plugins installed into a folder of its own (`pip install --target`, no build isolation:
# nothing is fetched) put first on PYTHONPATH. Records go to OUT/base.jsonl and OUT/new.jsonl, written by
# the script with each side's commit; the medians of every step time and utilisation figure are printed
# side by side last.
#   bash bench/ab.sh BASE BASE_COMMIT NEW_COMMIT OUT ROUNDS SCRIPT [ARGS...]
#   bash bench/ab.sh .baseline 795a5bd fa9699f $OUT 2 qwen35.py --shapes 35b_a3b --batches 1 --prefill "" --skip-peer
set -euo pipefail
base=$(cd "$1" && pwd); base_commit=$2; new_commit=$3; out=$(mkdir -p "$4" && cd "$4" && pwd); rounds=$5
script=$6; shift 6
here=$(pwd)
install() {  # tree, target folder: the core and every plugin the tree ships
  rm -rf "$2"  # a warm machine keeps the last call's
  python3 -m pip install -q --no-deps --no-build-isolation --target "$2" "$1" \
    $(ls -d "$1"/plugins/*/pyproject.toml 2>/dev/null | xargs -r -n1 dirname)
}
install "$base" /tmp/ab-base
install "$here" /tmp/ab-new
for round in $(seq "$rounds"); do
  (cd "$base/bench" && PYTHONPATH="/tmp/ab-base:${PYTHONPATH:-}" python3 "$script" "$@" --commit "$base_commit" --out "$out/base.jsonl")
  (cd "$here/bench" && PYTHONPATH="/tmp/ab-new:${PYTHONPATH:-}" python3 "$script" "$@" --commit "$new_commit" --out "$out/new.jsonl")
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {side: [json.loads(l) for l in (out / f"{side}.jsonl").read_text().splitlines()] for side in ("base", "new")}
figures = dict.fromkeys(
    r["figure"] for r in rows["base"] if r["figure"].endswith(("step_ms", "bandwidth_utilization", "mfu"))
)
for figure in figures:
    base = [r["value"] for r in rows["base"] if r["figure"] == figure]
    new = [r["value"] for r in rows["new"] if r["figure"] == figure]
    if not new:
        print(f"{figure:<48} base {statistics.median(base):9.4f} {base}  new: none")
        continue
    b, n = statistics.median(base), statistics.median(new)
    print(f"{figure:<48} base {b:9.4f} {base}  new {n:9.4f} {new}  new/base {n / b:6.3f}")
PY
