"""Speed of a DP LoRA step against a non-private LoRA step (issue 54's ≤ 1.3× on CPU), through the
trainer itself (``models.dp_prompt_training.train_prompt``, ``kind="lora"``).

* DP step: Poisson batch of expected size ``--batch``, per-sample gradients of every adapter
  (per-example copies, one backward), clipping, one Gaussian draw, Adam;
* non-private step: a fixed batch of the same size, the batch-mean gradient of the shared adapters, Adam.

Interleaved runs (DP, non-private, non-private, DP) after a warm-up of each; the best of two runs
per side is compared. Memory: the per-sample gradients DP adds (B × P floats) and, on CUDA, the peak
allocated of each side. Defaults: the real all-MiniLM-L6-v2 on SST-2 texts, CPU. On a GPU:
``--model DIR --device cuda --dtype bfloat16`` (a Llama-7B-shaped folder: ``bench/gpu_flow.py``).

    .venv/bin/python -u bench/bench_lora.py [--steps 6] [--batch 32] [--r 8]
 or .venv/bin/python -m pytest -q -p no:cacheprovider -m bench bench/bench_lora.py -s
Prints the times and ratios of one run; always exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest
import torch

SST2 = Path(os.environ.get("PRIVPROMPT_DATA_ROOT", ROOT.parent / "shared" / "data")) / "sst2" / "train.jsonl"


def _rows(n: int):
    if not SST2.is_file():
        raise SystemExit(f"{SST2} is not available")
    rows = [json.loads(line) for _, line in zip(range(n), SST2.open())]
    return [r["text"] for r in rows], torch.tensor([int(r["label"] == "positive") for r in rows])


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run(steps: int = 6, batch: int = 32, r: int = 8, model: str = "minilm", device: str = "cpu",
        dtype: str | None = None) -> dict:
    from models import build_classifier, load_backbone
    from models.dp_prompt_training import DPConfig, PromptTrainingConfig, seeded_dp_generators, train_prompt
    from models.placement import Placement

    print(f"nproc={os.cpu_count()}, torch threads={torch.get_num_threads()}, load average={os.getloadavg()}, "
          f"device {device}, model {model}, dtype {dtype or 'float32'}")
    placement = Placement(dtype=dtype) if dtype else None
    bb = load_backbone(model, device, placement=placement) if placement else load_backbone(model, device)
    clf = build_classifier(bb, ["negative", "positive"],
                           {"negative": "a negative, bad movie review", "positive": "a positive, great movie review"}
                           if bb.kind == "encoder" else None)
    texts, y = _rows(8 * batch)
    enc = clf.encode(texts, max_length=48)
    dev = clf.device
    N = len(texts)

    def side(dp: bool, seed: int) -> dict:
        config = PromptTrainingConfig(kind="lora", lora_r=r, lora_alpha=2 * r, lr=0.002, steps=steps,
                                      batch_size=batch, max_length=48, physical_batch_size=batch, log_every=10**9,
                                      seed=seed)
        dpc = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=batch / N) if dp else None
        gens = seeded_dp_generators(seed) if dp else (None, None)  # timings only: nothing is released
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        res = train_prompt(clf, enc, y, config, dpc, sample_generator=gens[0], noise_generator=gens[1])
        _sync(dev)
        return {"s_per_step": (time.perf_counter() - t) / steps,
                "examples_per_step": sum(h["batch_size"] for h in res.history) / steps,
                "trainable": int(res.prompt.weight.numel()),
                "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None}

    side(False, 0), side(True, 0)  # warm-up
    runs = {"dp": [], "nonprivate": []}
    for rep, order in enumerate((("dp", "nonprivate"), ("nonprivate", "dp"))):
        for name in order:
            runs[name].append(side(name == "dp", rep + 1))
    best = {k: min(v, key=lambda x: x["s_per_step"]) for k, v in runs.items()}
    P = best["dp"]["trainable"]
    out = {"model": model, "device": str(dev), "dtype": dtype or "float32", "batch": batch, "r": r, "steps": steps,
           "trainable_parameters": P, "dp_s_per_step": best["dp"]["s_per_step"],
           "nonprivate_s_per_step": best["nonprivate"]["s_per_step"],
           "dp_over_nonprivate": best["dp"]["s_per_step"] / best["nonprivate"]["s_per_step"],
           "dp_examples_per_step": best["dp"]["examples_per_step"],
           # a Poisson batch holds batch examples on average, not each step: the per-example ratio too
           "dp_over_nonprivate_per_example": (best["dp"]["s_per_step"] / best["dp"]["examples_per_step"])
           / (best["nonprivate"]["s_per_step"] / best["nonprivate"]["examples_per_step"]),
           "per_sample_gradients_mib": batch * P * 4 / 2**20,
           "dp_peak_gib": best["dp"]["peak_gib"], "nonprivate_peak_gib": best["nonprivate"]["peak_gib"], "runs": runs}
    print(f"LoRA r={r} on {model} ({P:,} trainable parameters), batch {batch}, best of 2 interleaved runs of "
          f"{steps} steps:")
    print(f"  DP step          {out['dp_s_per_step'] * 1000:8.1f} ms  ({out['dp_examples_per_step']:.1f} examples)")
    print(f"  non-private step {out['nonprivate_s_per_step'] * 1000:8.1f} ms")
    print(f"DP LoRA step / non-private LoRA step: {out['dp_over_nonprivate']:.2f}× (goal ≤ 1.3×); per-sample "
          f"gradients {out['per_sample_gradients_mib']:.1f} MiB")
    print(f"per example: {out['dp_over_nonprivate_per_example']:.2f}× (the DP batches held "
          f"{out['dp_examples_per_step']:.1f} examples on average, the non-private ones {batch})")
    return out


@pytest.mark.bench
def test_bench_lora():
    out = run(steps=3)
    assert out["dp_over_nonprivate"] > 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="e.g. bfloat16 (the DP math stays float32)")
    a = ap.parse_args()
    print(json.dumps(run(a.steps, a.batch, a.r, a.model, a.device, a.dtype), indent=1))
