#!/usr/bin/env bash
# The device check of issue 41, for a machine with one CUDA GPU: world 1, a ~1.2B Llama
# (Llama 3.2 1B's shape: hidden 2048, 16 layers, 32 heads / 8 kv heads, SwiGLU 8192, vocab
# 128256) on synthetic tokens, bf16; bf16 + compile; float8 tensorwise + compile (torchao).
# Prints tokens/s and MFU per run: the medians of the steps after the first WARM (compile and
# warm-up), MFU against the GPU's dense bf16 peak from plan's table of known GPUs
# (dtensor3d/plan/report.py GPUS, read by training/metrics.py; a GPU it lacks: mfu null).
#
#   bash bench/gpu_check.sh [STEPS]      (default 30; WARM=5)
# Exit 0: every run trained; 1: a run failed (its last lines are printed); 2: no CUDA here.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
STEPS=${1:-30}
WARM=${WARM:-5}
WORK=$(mktemp -d /tmp/gpu-check-XXXXXX)
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: bench/gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False on this machine)" >&2
  exit 2
fi
"$PYTHON" -c "import torch; print('gpu:', torch.cuda.get_device_name(0))"
MODEL=(model.vocab_size=128256 model.hidden_size=2048 model.intermediate_size=8192 model.num_hidden_layers=16
  model.num_attention_heads=32 model.num_key_value_heads=8 model.max_position_embeddings=2048
  model.rope_theta=500000.0 model.tie_word_embeddings=true)
COMMON=(training.steps="$STEPS" training.sequence_length=2048 training.global_batch_size=4 training.micro_batch_size=4
  training.dtype=bfloat16 training.device=cuda training.eval_every=0 data.kind=synthetic checkpoint.dir=null
  logging.every=1 optimizer.warmup_steps=0 optimizer.decay=constant)
run() {
  local name=$1; shift
  local dir="$WORK/$name"
  if ! (cd "$ROOT" && "$PYTHON" -m dtensor3d train recipes/debug.yaml "${MODEL[@]}" "${COMMON[@]}" \
      logging.run_dir="$dir" "$@" >"$dir.log" 2>&1); then
    echo "FAILED: $name"; tail -n 20 "$dir.log"; exit 1
  fi
  "$PYTHON" - "$dir/metrics.jsonl" "$name" "$WARM" <<'PY'
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if '"loss"' in x][int(sys.argv[3]):]
tps = statistics.median(r["tokens_per_sec"] for r in rows)
mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
m = f"{100 * statistics.median(mfu):.1f}%" if mfu else "n/a (GPU not in plan's table)"
print(f"{sys.argv[2]:28s} tokens/s {tps:12,.0f}   MFU {m}   last loss {rows[-1]['loss']:.3f}")
PY
}
run bf16
run bf16_compile training.compile=true
run float8_tensorwise_compile training.compile=true "training.float8={recipe: tensorwise}"
echo "runs in $WORK"
