"""Speed benchmark of DP prefix tuning, Privacy-Flat's AWP step and DPZero (issue 12), on this
machine's CPU cores, with the real all-MiniLM-L6-v2 and SST-2 texts.

* DP prefix step (per-sample gradients, clipping, noise) / non-private prefix step — goal ≤ 1.2×;
* AWP DP step (the un-noised mean gradient for v, then the DP step at w + v) / DP prefix step;
* DPZero step (two loss queries per example, no backward) / one forward pass;
* the same DP / non-private ratio for a soft prompt, for reference.

Steps are interleaved (A, B, A, B, …) after warm-up and the medians compared, so load changes
hit both sides alike. Run:  .venv/bin/python -u bench/bench_flat.py [--steps 8] [--batch 32] [--device cuda]
 or:  .venv/bin/python -m pytest -q -p no:cacheprovider -m bench bench/bench_flat.py -s
Prints times and ratios measured in one run; always exits 0.
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

import numpy as np
import pytest
import torch
import torch.nn.functional as F

SST2 = ROOT.parent / "shared" / "data" / "sst2" / "train.jsonl"


def _texts(n: int) -> list[str]:
    if not SST2.is_file():
        raise SystemExit(f"{SST2} is not available")
    out = []
    with SST2.open() as f:
        for line in f:
            out.append(json.loads(line)["text"])
            if len(out) == n:
                break
    return out


def run(steps: int = 8, batch: int = 32, n_tokens: int = 5, device: str = "cpu") -> dict:
    from models import build_classifier, load_backbone, per_sample_prompt_gradients
    from tasks.methods.dpzero.training import per_example_losses, two_point_differences
    from models.landscape import mean_gradient
    from tasks.methods.privacy_flat.flat import awp_perturbation
    from models.soft_prompt import PrefixPrompt, SoftPrompt

    print(f"nproc={os.cpu_count()}, torch threads={torch.get_num_threads()}, load average={os.getloadavg()}, "
          f"device {device}")
    clf = build_classifier(load_backbone("minilm", device), ["negative", "positive"],
                           {"negative": "a negative, bad movie review", "positive": "a positive, great movie review"})
    enc = clf.encode(_texts(batch), max_length=48)
    dev = clf.device
    y = torch.tensor([i % 2 for i in range(batch)], device=dev)
    prefix = PrefixPrompt.init_from_vocab(clf.backbone, "it was a movie review", n_tokens=n_tokens).weight.detach().to(dev)
    soft = SoftPrompt.init_from_vocab(clf.backbone, "it was a movie review", n_tokens=n_tokens).weight.detach().to(dev)
    g_noise = torch.Generator().manual_seed(0)  # a CPU stream, as the trainer's; the noise moves to the device

    def nonprivate(p):
        w = p.clone().requires_grad_()
        F.cross_entropy(clf(enc, w), y).backward()
        return w.grad

    def dp(p, at=None):
        grads = per_sample_prompt_gradients(clf, enc, y, p if at is None else at)
        norms = grads.flatten(1).norm(dim=1)
        factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
        summed = (grads * factor.view(-1, *[1] * p.dim())).sum(0)
        return (summed + torch.normal(0.0, 1.0, size=tuple(p.shape), generator=g_noise).to(dev)) / batch

    def awp(p):
        v = awp_perturbation(p, mean_gradient(clf, enc, y, p, batch), 0.01)
        return dp(p, at=p + v)

    z = torch.randn(soft.shape, generator=torch.Generator().manual_seed(1)).to(dev)

    def dpzero(p):
        return two_point_differences(lambda w: per_example_losses(clf, enc, y, w, batch), p, z, 1e-3)

    @torch.no_grad()
    def forward(p):
        return clf(enc, p)

    fns = {"nonprivate_prefix": (nonprivate, prefix), "dp_prefix": (dp, prefix), "awp_dp_prefix": (awp, prefix),
           "nonprivate_soft": (nonprivate, soft), "dp_soft": (dp, soft), "dpzero": (dpzero, soft),
           "forward_soft": (forward, soft)}
    times = {k: [] for k in fns}
    for i in range(steps + 1):
        for name, (fn, p) in fns.items():
            _sync(dev)
            t = time.perf_counter()
            fn(p)
            _sync(dev)
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) for k, v in times.items()}
    out = {"batch": batch, "prefix_tokens": n_tokens, "steps": steps, "device": str(dev), "median_s": med,
           "dp_prefix_over_nonprivate_prefix": med["dp_prefix"] / med["nonprivate_prefix"],
           "awp_over_dp_prefix": med["awp_dp_prefix"] / med["dp_prefix"],
           "dpzero_over_forward": med["dpzero"] / med["forward_soft"],
           "dp_soft_over_nonprivate_soft": med["dp_soft"] / med["nonprivate_soft"]}
    print(f"MiniLM, batch {batch}, {n_tokens} prefix tokens × {prefix.shape[0]} layers, median of {steps} "
          "interleaved steps:")
    for k, v in med.items():
        print(f"  {k:<20} {v * 1000:8.1f} ms")
    print(f"DP prefix step / non-private prefix step: {out['dp_prefix_over_nonprivate_prefix']:.2f}× (goal ≤ 1.2×)")
    print(f"AWP DP step / DP prefix step:             {out['awp_over_dp_prefix']:.2f}×")
    print(f"DPZero step / one forward:                {out['dpzero_over_forward']:.2f}×")
    print(f"DP soft step / non-private soft step:     {out['dp_soft_over_nonprivate_soft']:.2f}×")
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@pytest.mark.bench
def test_bench_flat():
    out = run(steps=4)
    assert out["dp_prefix_over_nonprivate_prefix"] > 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    a = ap.parse_args()
    print(json.dumps(run(a.steps, a.batch, a.tokens, a.device), indent=1))
