#!/usr/bin/env bash
# Set up (if needed) and run the default test suite (slow tests and benchmarks: -m slow / -m bench).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
