#!/bin/bash
# Issue 30's experiment, small (2 shared CPU cores): from the repository root,
#   PY=/path/to/python bash docs/results/selection/run.sh
# Data built into /tmp (never into the repo); state and MLflow in /tmp/sel-exp-state.
# Two chains at once: the fixed quickstart settings of then (2 epochs) (with the zero-shot baseline), and the selection.
set -u
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"0 1 2"}
STATE=${STATE:-/tmp/sel-exp-state}
LOGS=${LOGS:-/tmp/sel-exp-logs}
export PRIVPROMPT_HOME=/tmp/sel-exp-home OMP_NUM_THREADS=1
mkdir -p "$LOGS"
$PY docs/results/selection/make_data.py /tmp/sel-data
# the two chains below share one MLflow store: create it first (two processes creating it at once
# collide on its schema migration, which is how the first attempt of selection seed 0 failed here)
$PY -c "import sys; sys.path.insert(0, '.'); from tasks.record import client; from tasks.state import state_paths; client(state_paths('$STATE').create()).search_experiments()"
(for seed in $SEEDS; do
  /usr/bin/time -f "fixed seed=$seed wall %e s" $PY privprompt_cli.py --state-dir "$STATE" run \
    docs/results/selection/sst2_fixed.yaml --set seed=$seed > "$LOGS/fixed_$seed.log" 2>&1
done) &
(for seed in $SEEDS; do
  /usr/bin/time -f "selection seed=$seed wall %e s" $PY privprompt_cli.py --state-dir "$STATE" run \
    docs/results/selection/sst2_selection.yaml --set seed=$seed > "$LOGS/selection_$seed.log" 2>&1
done) &
wait
$PY privprompt_cli.py --state-dir "$STATE" report selection_sst2 --out docs/results/selection/report
