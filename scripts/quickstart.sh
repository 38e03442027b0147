#!/usr/bin/env bash
# Set up (if needed) and run the quickstart: DP soft-prompt tuning on SST-2 with MiniLM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/privprompt run configs/quickstart.yaml "$@"
