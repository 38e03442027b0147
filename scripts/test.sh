#!/usr/bin/env bash
# Set up (if needed) and run the default test suite (slow tests and benchmarks: -m slow / -m bench).
set -euo pipefail
cd "$(dirname "$0")/.."
PRIVPROMPT_NO_TEMPLATES=1 bash scripts/setup.sh  # the suite makes its own templates (tests/conftest.py)
# two pytest workers, one test file each (module fixtures run once): the suite waits on Prefect,
# MLflow and SQLite as much as on torch, so two processes on two cores take ~0.7x the time of one
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
