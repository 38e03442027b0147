"""What a lent GPU machine needs carried (bench/make_gpu_carry.sh): prune a ``pip install --target`` folder of
the packages the machine's image already holds, keeping the small pure ones whose versions Prefect and MLflow pin.

    python bench/gpu_carry.py prune SITE_DIR DEVICE_PACKAGES_FILE

DEVICE_PACKAGES_FILE: the image's package names, separated by commas or newlines (a line "Packages: a, b, …" as
the device notes list them is read too). Prints what was removed and what stays."""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys

# the image's copies are used for these (large, or tied to its torch/CUDA build); any other package the image
# holds is carried anyway when small and pure (its version is the one Prefect/MLflow were resolved with)
LARGE = {"torch", "triton", "numpy", "scipy", "pandas", "pyarrow", "transformers", "tokenizers", "safetensors",
         "matplotlib", "scikit-learn", "sympy", "pillow", "accelerate", "huggingface-hub", "hf-xet", "fonttools",
         "contourpy", "kiwisolver", "regex", "xxhash", "aiohttp", "yarl", "multidict", "frozenlist", "propcache",
         "aiohappyeyeballs", "aiosignal", "networkx", "mpmath", "cuda-bindings", "cuda-pathfinder", "joblib",
         "threadpoolctl", "narwhals", "cycler", "pyparsing", "absl-py", "markdown"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip().lower())


def device_packages(path: str) -> set[str]:
    text = open(path, encoding="utf-8").read()
    if "Packages: " in text:
        text = text.split("Packages: ", 1)[1].split("\n", 1)[0]
    return {normalize(p.rstrip(".")) for p in re.split(r"[,\n]", text) if p.strip()}


def prune(site: str, listing: str) -> None:
    on_device = device_packages(listing)
    removed, kept = [], []
    for info in sorted(glob.glob(os.path.join(site, "*.dist-info"))):
        meta = open(os.path.join(info, "METADATA"), encoding="utf-8").read()
        name = re.search(r"^Name: (.+)$", meta, re.M).group(1).strip()
        n = normalize(name)
        if not (n.startswith("nvidia-") or (n in on_device and n in LARGE)):
            kept.append(name)
            continue
        tops = {line.split(",")[0].split("/")[0] for line in open(os.path.join(info, "RECORD"), encoding="utf-8")}
        for top in tops - {"..", "bin", ""}:
            path = os.path.join(site, top)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
        removed.append(name)
    for cache in glob.glob(os.path.join(site, "**", "__pycache__"), recursive=True):
        shutil.rmtree(cache, ignore_errors=True)
    print(f"removed {len(removed)} (the image's): {' '.join(removed)}")
    print(f"carried {len(kept)}: {' '.join(kept)}")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd != "prune" or len(args) != 2:
        raise SystemExit(__doc__)
    prune(*args)
