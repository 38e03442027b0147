#!/usr/bin/env bash
# Set up the on-demand browser check (tests/pipeline/test_browser.py, -m browser): Debian's Chromium
# (Playwright cannot download browsers here) and the Playwright Python package, which drives it
# through `executable_path`. Idempotent; needs root for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
.venv/bin/python -c "import playwright" 2>/dev/null || .venv/bin/python -m pip install -q "playwright>=1.40"
chromium --version
