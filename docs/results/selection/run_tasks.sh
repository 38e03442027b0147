#!/bin/bash
# Issue 30's three tasks with the selection's defaults (every candidate once, balanced accuracy, the
# scores' default σ): from the repository root,  PY=/path/to/python bash docs/results/selection/run_tasks.sh
# Data built into /tmp (never into the repo); state and MLflow in /tmp/sel-exp-state. Two chains at once.
set -u
PY=${PY:-.venv/bin/python}
STATE=${STATE:-/tmp/sel-exp-state}
LOGS=${LOGS:-/tmp/sel-exp-logs}
export PRIVPROMPT_HOME=/tmp/sel-exp-home OMP_NUM_THREADS=1
mkdir -p "$LOGS"
$PY docs/results/selection/make_data.py /tmp/sel-data
$PY -c "import sys; sys.path.insert(0, '.'); from tasks.record import client; from tasks.state import state_paths; client(state_paths('$STATE').create()).search_experiments()"
run() {  # config, tag, seed, experiment, extra --set
  /usr/bin/time -f "$2 seed=$3 wall %e s" $PY privprompt_cli.py --state-dir "$STATE" run docs/results/selection/$1.yaml \
    --set seed=$3 --set experiment=$4 ${5:+--set $5} > "$LOGS/$2_$3.log" 2>&1
}
(for seed in 0 1 2; do run trec_fixed trec_fixed $seed selection_trec; run agnews_fixed agnews_fixed $seed selection_agnews; done
 for seed in 0 1 2; do run sst2_selection sst2_auto $seed selection_sst2_auto; done) &
(for seed in 0 1 2; do run trec_fixed trec_auto $seed selection_trec selection.enabled=true
                       run agnews_fixed agnews_auto $seed selection_agnews selection.enabled=true; done) &
wait
$PY docs/results/selection/summarize_tasks.py "$STATE" docs/results/selection
for e in selection_sst2_auto selection_trec selection_agnews; do
  $PY privprompt_cli.py --state-dir "$STATE" report $e --out docs/results/selection/report_$e
done
