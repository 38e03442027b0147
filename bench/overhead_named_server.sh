#!/bin/bash
# What a long-lived Prefect server would save a run (issue 29): the same code in the same state
# folder, runs that start their own embedded server (E) alternating with runs given PREFECT_API_URL
# of a server already running (W), each a `bench_overhead.py --runs 1`.
#   PYTHON=.venv/bin/python bench/overhead_named_server.sh STATE_HOME PAIRS [PORT]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
HOME_DIR=$1; PAIRS=$2; PORT=${3:-4297}
SERVER_HOME=$(mktemp -d /tmp/privprompt-named-server-XXXX)
APP_DIR=$($PY -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('prefect').submodule_search_locations[0]))")
PREFECT_HOME=$SERVER_HOME PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_ENABLED=0 PREFECT__SERVER_EPHEMERAL=1 \
  $PY -m uvicorn --app-dir "$APP_DIR" --factory prefect.server.api.server:create_app --host 127.0.0.1 \
  --port "$PORT" --log-level error --lifespan on > "$SERVER_HOME/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf "http://127.0.0.1:$PORT/api/health" > /dev/null; do sleep 0.5; done
for i in $(seq 1 "$PAIRS"); do
  for mode in E W; do
    if [ $mode = W ]; then export PREFECT_API_URL="http://127.0.0.1:$PORT/api"; else unset PREFECT_API_URL; fi
    $PY bench/bench_overhead.py --runs 1 --home "$HOME_DIR" --json "$SERVER_HOME/$mode-$i.json" > "$SERVER_HOME/$mode-$i.out" 2>&1
    $PY -c "
import json, os
r = json.load(open('$SERVER_HOME/$mode-$i.json'))['runs'][0]
print('$mode', $i, 'wall %.1f s, model work %.1f s, overhead %.1f s, CPU %.1f s (+ %.1f s server); load %.1f' % (
    r['wall_s'], r['model_work_s'], r['overhead_s'], r.get('cpu_main_s', 0), r.get('cpu_children_s', 0), os.getloadavg()[0]))"
  done
done
