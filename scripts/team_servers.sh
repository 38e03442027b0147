#!/usr/bin/env bash
# Start a team's servers on this machine, for trying the shared set-up or for the on-demand test
# (tests/pipeline/test_team_servers.py): PostgreSQL (Debian's package) with two databases, `mlflow` (the
# tracking server's store) and `ledger` (the team's privacy budget ledger), an MLflow tracking server
# backed by it (artifacts served by MLflow from a folder), and a Prefect server. Prints the three
# URLs to export.
#
#   bash scripts/team_servers.sh start DIR   # DIR holds the database cluster, artifacts, logs and pids
#   bash scripts/team_servers.sh stop DIR
#
# On several machines: run the servers once, then on every machine
#   export MLFLOW_TRACKING_URI=http://<host>:5055  PREFECT_API_URL=http://<host>:4299/api \
#          PRIVPROMPT_LEDGER_URL=postgresql://privprompt@<host>:5433/ledger
# and `privprompt run CONFIG` (or a Prefect worker on the work pool of prefect.yaml) logs there and
# spends every dataset's one budget in the shared ledger (the team key is a file on each machine, never in
# the ledger: `privprompt key export FILE` on the first, `privprompt key import FILE` on the others). The
# cluster here trusts local connections (--auth=trust, listening on 127.0.0.1 only): for machines
# on a network, give the role a password (in ~/.pgpass or the URL in the environment, never in a
# config) and allow their addresses in pg_hba.conf.
set -euo pipefail
cd "$(dirname "$0")/.."
ACTION=${1:?start or stop}
DIR=$(realpath -m "${2:?a folder for the server state}")
PG_PORT=${PG_PORT:-5433}
MLFLOW_PORT=${MLFLOW_PORT:-5055}
PREFECT_PORT=${PREFECT_PORT:-4299}
PY=.venv/bin/python
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
RUN_AS=()
PG_DATA="$DIR/pg"
if [ "$(id -u)" = 0 ]; then  # PostgreSQL refuses to run as root: its user owns a cluster it can reach
  RUN_AS=(runuser -u postgres --)
  PG_DATA="/var/tmp/privprompt-pg-$(printf %s "$DIR" | sha256sum | cut -c1-12)"
fi

case "$ACTION" in
start)
  [ -n "$PG_BIN" ] || { echo "PostgreSQL is not installed: apt-get install postgresql" >&2; exit 1; }
  $PY -c "import psycopg2" 2>/dev/null || $PY -m pip install -q "psycopg2-binary>=2.9"
  mkdir -p "$DIR/artifacts" "$DIR/logs" "$DIR/prefect"
  if [ ! -d "$PG_DATA" ]; then
    mkdir -p "$PG_DATA"
    [ ${#RUN_AS[@]} -eq 0 ] || chown postgres "$PG_DATA"
    "${RUN_AS[@]}" "$PG_BIN/initdb" -D "$PG_DATA" -U privprompt --auth=trust >"$DIR/logs/initdb.log"
  fi
  "${RUN_AS[@]}" "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$PG_DATA/postgres.log" -w \
    -o "-p $PG_PORT -k /tmp -c listen_addresses=127.0.0.1" start >/dev/null
  "${RUN_AS[@]}" "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U privprompt mlflow 2>/dev/null || true  # exists
  "${RUN_AS[@]}" "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U privprompt ledger 2>/dev/null || true  # exists
  # --app-name privprompt: MLflow's server whose page neither shows the usage-data notice nor sends UI
  # telemetry (tasks/mlflow_ui.py); the server's own telemetry is off by the environment
  MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=true setsid nohup $PY -m mlflow server --app-name privprompt \
    --host 127.0.0.1 --port "$MLFLOW_PORT" \
    --backend-store-uri "postgresql+psycopg2://privprompt@127.0.0.1:$PG_PORT/mlflow" \
    --artifacts-destination "$DIR/artifacts" --serve-artifacts --workers 1 \
    >"$DIR/logs/mlflow.log" 2>&1 & echo $! >"$DIR/mlflow.pid"
  PREFECT_HOME="$DIR/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false setsid nohup $PY -m prefect server start \
    --host 127.0.0.1 --port "$PREFECT_PORT" >"$DIR/logs/prefect.log" 2>&1 & echo $! >"$DIR/prefect.pid"
  for url in "http://127.0.0.1:$MLFLOW_PORT/health" "http://127.0.0.1:$PREFECT_PORT/api/health"; do
    for _ in $(seq 1 180); do
      if $PY -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url" 2>/dev/null; then
        break
      fi
      sleep 1
    done
    $PY -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$url" \
      || { echo "server at $url did not come up; logs in $DIR/logs" >&2; exit 1; }
  done
  echo "export MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api" \
    "PRIVPROMPT_LEDGER_URL=postgresql://privprompt@127.0.0.1:$PG_PORT/ledger"
  ;;
stop)
  for name in mlflow prefect; do
    # each server leads its own process group (setsid): stop it with its workers
    if [ -f "$DIR/$name.pid" ]; then kill -TERM -- "-$(cat "$DIR/$name.pid")" 2>/dev/null || true; rm -f "$DIR/$name.pid"; fi
  done
  if [ -n "$PG_BIN" ] && [ -d "$PG_DATA" ]; then
    "${RUN_AS[@]}" "$PG_BIN/pg_ctl" -D "$PG_DATA" -m fast stop >/dev/null 2>&1 || true
  fi
  ;;
*) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
