#!/usr/bin/env bash
# Serving benchmark: `pegainfer serve` on random weights in a real shape (bf16 unless FP8), driven by
# `pegainfer bench serve` with 1024-token prompts and 256 output tokens (greedy, ignore_eos). MODEL is
# qwen3_14b (Qwen3-14B), deepseek_moonlight (the ~16B Moonlight-16B-A3B-like deepseek_v3 model of
# bench/deepseek.py), both on one GPU at concurrency 1, 16 and 64; qwen35_27b_tp2 (the 27B-like Qwen3.5
# shape of bench/qwen35.py over two GPUs, concurrency 1 and 16); deepseek_v3_671b_tp8 (the published
# DeepSeek-V3 in FP8 blocks with its MTP layer drafting one token, over eight GPUs, concurrency 1, 8 and
# 64). Writes one JSON report per concurrency into the folder given (default bench/results/serve_MODEL),
# prints a summary and appends the figures (MODEL.serve.cC.*) to bench/results/serve_MODEL.jsonl (or the
# JSONL file given third), labelled with $COMMIT where set (a copy of the tree whose git HEAD is not the
# tree), else git's HEAD. Multi-GPU hosts here keep NVLink multicast off (the variables below).
#   [COMMIT=<sha>] bash bench/serve.sh MODEL [OUT_DIR [HISTORY.jsonl]]
set -euo pipefail
model=${1:?usage: bash bench/serve.sh qwen3_14b|deepseek_moonlight|qwen35_27b_tp2|deepseek_v3_671b_tp8 [OUT_DIR [HISTORY.jsonl]]}
out=${2:-bench/results/serve_$model}
history=${3:-bench/results/serve_$model.jsonl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
extra=()
specs="1:8 16:48 64:128"
case $model in
  qwen3_14b)
    make_folder="from qwen3_14b import checkpoint_folder; print(checkpoint_folder(40, full_vocab_tokenizer=True))"
    vocab=151000 ;;
  deepseek_moonlight)
    make_folder="from deepseek import MOONLIGHT, checkpoint_folder; print(checkpoint_folder(MOONLIGHT, 163840, None, full_vocab_tokenizer=True))"
    vocab=163000 ;;
  qwen35_27b_tp2)
    make_folder="from qwen35 import SHAPES, checkpoint_folder; print(checkpoint_folder(SHAPES['27b'], full_vocab_tokenizer=True))"
    vocab=248000 extra=(tp=2) specs="1:8 16:48" ;;
  deepseek_v3_671b_tp8)
    make_folder="from deepseek_671b_plan import write_folder; print(write_folder())"
    vocab=129000 extra=(tp=8 speculative.num_tokens=1 parallel.timeout_s=1800) specs="1:8 8:32 64:128" ;;
  *) echo "unknown model $model" >&2; exit 2 ;;
esac
mkdir -p "$out"
port=8011
folder=$(cd bench && python3 -c "$make_folder")
pegainfer serve model.path="$folder" model.load_format=dummy model.dtype=bfloat16 model.max_model_len=1536 \
  scheduler.max_num_seqs=64 server.port=$port server.log_interval=0 "${extra[@]}" >"$out/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
# A model of hundreds of GB takes minutes to build and capture its graphs.
for _ in $(seq 1200); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { tail -20 "$out/serve.log"; exit 1; }
  sleep 1
done
for spec in $specs; do
  c=${spec%%:*}; n=${spec##*:}
  pegainfer bench serve --url "http://127.0.0.1:$port" --concurrency "$c" --num-prompts "$n" \
    --input-len 1024 --output-len 256 --vocab-size $vocab --json --no-progress >"$out/concurrency$c.json"
done
python3 - "$out" "$history" "$model" "${COMMIT:-}" <<'PY'
import json, pathlib, sys
sys.path.insert(0, "bench")
from common import Results
units = {"output_throughput": "tok/s", "request_throughput": "req/s", "median_ttft_ms": "ms", "p99_ttft_ms": "ms",
         "median_tpot_ms": "ms", "p99_tpot_ms": "ms", "median_itl_ms": "ms", "p99_itl_ms": "ms",
         "median_e2el_ms": "ms", "failed": "count"}
model = sys.argv[3]
results = Results(pathlib.Path(sys.argv[2]), f"bash bench/serve.sh {model}", commit=sys.argv[4] or None)
for path in sorted(pathlib.Path(sys.argv[1]).glob("concurrency*.json"), key=lambda p: int(p.stem[11:])):
    r = json.loads(path.read_text())
    print(path.stem, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, (dict, list))})
    for key, unit in units.items():
        results.add(f"{model}.serve.c{path.stem[11:]}.{key}", r[key], unit)
results.write()
PY
