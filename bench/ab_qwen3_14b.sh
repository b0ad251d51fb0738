#!/usr/bin/env bash
# A/B of bench/qwen3_14b.py's decode figures in one GPU run: an earlier commit (its tree unpacked at BASE,
# e.g. `git archive COMMIT | tar -x -C .baseline`) against this tree, alternating ROUNDS times so drift
# on the machine shows as spread, not as a difference. Each side runs its own bench script with its own
# pegainfer installed into a folder of its own (`pip install --target`, no build isolation: nothing is
# fetched) put first on PYTHONPATH.
# Figures go to OUT/base.jsonl and OUT/new.jsonl; a side-by-side table is printed last.
#   bash bench/ab_qwen3_14b.sh BASE BASE_COMMIT NEW_COMMIT OUT [ROUNDS]
set -euo pipefail
base=$(cd "$1" && pwd); base_commit=$2; new_commit=$3; out=$4; rounds=${5:-2}
here=$(pwd)
mkdir -p "$out"
rm -rf /tmp/ab-base /tmp/ab-new  # a warm machine keeps the last call's
# The Qwen3 plugin is a distribution of its own since ebfcaa1; an older tree ships it inside the core.
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/ab-base "$base" $(ls -d "$base"/plugins/qwen3_14b/pyproject.toml 2>/dev/null | xargs -r dirname)
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/ab-new "$here" "$here/plugins/qwen3_14b"
args=(--steps 64 --skip-peer --skip-prefill --batches 1,64 --sync-batches "")
for round in $(seq "$rounds"); do
  (cd "$base/bench" && PYTHONPATH="/tmp/ab-base:${PYTHONPATH:-}" python3 qwen3_14b.py "${args[@]}" --commit "$base_commit" --out "$out/base.jsonl")
  (cd "$here/bench" && PYTHONPATH="/tmp/ab-new:${PYTHONPATH:-}" python3 qwen3_14b.py "${args[@]}" --commit "$new_commit" --out "$out/new.jsonl")
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = {side: [json.loads(l) for l in (out / f"{side}.jsonl").read_text().splitlines()] for side in ("base", "new")}
for figure in ("qwen3_14b.decode.bs1.step_ms", "qwen3_14b.decode.bs64.step_ms", "qwen3_14b.host.bs64.cpu_ms_per_step"):
    base = [r["value"] for r in rows["base"] if r["figure"] == figure]
    new = [r["value"] for r in rows["new"] if r["figure"] == figure]
    b, n = statistics.median(base), statistics.median(new)
    print(f"{figure:<40} base {b:8.3f} {base}  new {n:8.3f} {new}  new/base {n / b:6.3f}")
PY
