#!/usr/bin/env bash
# Serving benchmark on one GPU: `pegainfer serve` on Qwen3-14B (random weights in the real shape, bf16)
# driven by `pegainfer bench serve` at concurrency 1, 16 and 64 with 1024-token prompts and 256 output
# tokens (greedy, ignore_eos). Writes one JSON report per concurrency into the folder given (default
# bench/results/serve), prints a summary and appends the figures to bench/results/serve_qwen3_14b.jsonl
# (or the JSONL file given second).
#   bash bench/serve_qwen3_14b.sh [OUT_DIR [HISTORY.jsonl]]
set -euo pipefail
out=${1:-bench/results/serve}
history=${2:-bench/results/serve_qwen3_14b.jsonl}
mkdir -p "$out"
port=8011
folder=$(cd bench && python3 -c "from qwen3_14b import checkpoint_folder; print(checkpoint_folder(40, full_vocab_tokenizer=True))")
pegainfer serve model.path="$folder" model.load_format=dummy model.dtype=bfloat16 model.max_model_len=1536 \
  scheduler.max_num_seqs=64 server.port=$port server.log_interval=0 >"$out/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { tail -20 "$out/serve.log"; exit 1; }
  sleep 1
done
for spec in 1:8 16:48 64:128; do
  c=${spec%%:*}; n=${spec##*:}
  pegainfer bench serve --url "http://127.0.0.1:$port" --concurrency "$c" --num-prompts "$n" \
    --input-len 1024 --output-len 256 --vocab-size 151000 --json --no-progress >"$out/concurrency$c.json"
done
python3 - "$out" "$history" <<'PY'
import json, pathlib, sys
sys.path.insert(0, "bench")
from common import Results
units = {"output_throughput": "tok/s", "request_throughput": "req/s", "median_ttft_ms": "ms", "p99_ttft_ms": "ms",
         "median_tpot_ms": "ms", "p99_tpot_ms": "ms", "median_itl_ms": "ms", "p99_itl_ms": "ms",
         "median_e2el_ms": "ms", "failed": "count"}
results = Results(pathlib.Path(sys.argv[2]), "bash bench/serve_qwen3_14b.sh")
for path in sorted(pathlib.Path(sys.argv[1]).glob("concurrency*.json"), key=lambda p: int(p.stem[11:])):
    r = json.loads(path.read_text())
    print(path.stem, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (dict, list))})
    for key, unit in units.items():
        results.add(f"qwen3_14b.serve.c{path.stem[11:]}.{key}", r[key], unit)
results.write()
PY
