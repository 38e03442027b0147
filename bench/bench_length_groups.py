"""Speed benchmark of length groups (models/length_groups.py): the same batch run as one call
padded to its longest row vs as groups of rows of similar length, with the real
all-MiniLM-L6-v2 on SST-2 — training phrases (short, a few long) and test sentences.

* DP prefix step (per-sample gradients of a (B, L, 2, n, d) prefix, clipping, noise);
* DP soft-prompt step;
* RAPT tuning step with the reconstruction head (m = 40 plain tokens before the text);
* no-grad forward on test sentences (evaluation, flatness curves, MIA scores).

Grouping is switched with PRIVPROMPT_LENGTH_GROUP_OVERHEAD (a huge value: one padded call);
steps are interleaved (one, grouped, one, grouped, …) after warm-up and medians compared, so load
changes hit both sides alike. Run:  .venv/bin/python -u bench/bench_length_groups.py [--steps 6] [--device cuda]
 or:  .venv/bin/python -m pytest -q -p no:cacheprovider -m bench bench/bench_length_groups.py -s
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

DATA = ROOT.parent / "shared" / "data" / "sst2"
ONE_CALL = str(10**12)


def _texts(split: str, n: int, seed: int = 0) -> list[str]:
    path = DATA / f"{split}.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} is not available")
    rows = [json.loads(line)["text"] for line in path.open()]
    return [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))[:n]]


def run(steps: int = 6, batch: int = 64, device: str = "cpu") -> dict:
    from models import build_classifier, load_backbone, per_sample_prompt_gradients
    from models.length_groups import call_overhead, length_groups
    from tasks.methods.rapt.encoding import default_plain_ids, encode_rapt, privatize_encoding
    from tasks.methods.rapt.head import ReconstructionHead
    from tasks.methods.rapt.model import RaptModel, build_task_head
    from tasks.methods.rapt.privatize import BackbonePrivatizer
    from models.soft_prompt import PrefixPrompt, SoftPrompt

    print(f"nproc={os.cpu_count()}, torch threads={torch.get_num_threads()}, load average={os.getloadavg()}, "
          f"device {device}")
    bb = load_backbone("minilm", device)
    dev = bb.device
    labels = {"negative": "a negative, bad movie review", "positive": "a positive, great movie review"}
    clf = build_classifier(bb, list(labels), labels)
    train = clf.encode(_texts("train", batch), max_length=48)
    test = clf.encode(_texts("validation", 256), max_length=48)
    y = torch.tensor([i % 2 for i in range(batch)], device=dev)
    prefix = PrefixPrompt.init_from_vocab(bb, "it was a movie review", n_tokens=5).weight.detach().to(dev)
    soft = SoftPrompt.init_from_vocab(bb, "it was a movie review", n_tokens=5).weight.detach().to(dev)

    def dp(p):
        grads = per_sample_prompt_gradients(clf, train, y, p)
        factor = (1.0 / (grads.flatten(1).norm(dim=1) + 1e-6)).clamp(max=1.0)
        return (grads * factor.view(-1, *[1] * p.dim())).sum(0) + torch.randn(p.shape).to(dev)

    plain = default_plain_ids(bb.tokenizer, 40, 0)
    renc = encode_rapt(bb.tokenizer, _texts("train", batch), plain, 96)
    rdata = privatize_encoding(renc, plain, BackbonePrivatizer(bb), 100.0, np.random.default_rng(0))
    head_vocab = torch.tensor(sorted(set(renc["input_ids"].flatten().tolist()) | set(plain)))
    rmodel = RaptModel(bb, SoftPrompt.init_from_vocab(bb, 10, seed=0), build_task_head(bb, list(labels), labels),
                       len(plain), ReconstructionHead(head_vocab, bb.embed_dim))

    def rapt_step(_):
        rmodel.zero_grad(set_to_none=True)
        rmodel.losses(rdata, y)["total"].backward()

    @torch.no_grad()
    def forward(p):
        for s in range(0, 256, 64):
            clf({k: v[s:s + 64] for k, v in test.items()}, p)

    fns = {"dp_prefix_step": (dp, prefix), "dp_soft_step": (dp, soft), "rapt_step_reconstruction": (rapt_step, None),
           "forward_test_256": (forward, soft)}
    times = {(k, mode): [] for k in fns for mode in ("one_call", "grouped")}
    for i in range(steps + 1):
        for name, (fn, p) in fns.items():
            for mode in ("one_call", "grouped"):
                os.environ["PRIVPROMPT_LENGTH_GROUP_OVERHEAD"] = ONE_CALL if mode == "one_call" else ""
                _sync(dev)
                t = time.perf_counter()
                fn(p)
                _sync(dev)
                if i:  # the first round warms up
                    times[(name, mode)].append(time.perf_counter() - t)
    os.environ.pop("PRIVPROMPT_LENGTH_GROUP_OVERHEAD", None)
    med = {f"{k}.{m}": float(np.median(v)) for (k, m), v in times.items()}
    lengths = train["attention_mask"].sum(1)
    groups = length_groups(lengths, call_overhead(dev))
    out = {"batch": batch, "steps": steps, "device": str(dev), "median_s": med,
           "train_lengths": {"mean": float(lengths.float().mean()), "max": int(lengths.max()),
                             "groups": [len(g) for g in groups]},
           "speedup": {k: med[f"{k}.one_call"] / med[f"{k}.grouped"] for k in fns}}
    print(f"MiniLM, SST-2 training batch of {batch} (mean {out['train_lengths']['mean']:.1f} tokens, longest "
          f"{out['train_lengths']['max']}; groups of {out['train_lengths']['groups']} rows), median of {steps} "
          "interleaved steps:")
    for k in fns:
        print(f"  {k:<26} one call {med[f'{k}.one_call'] * 1000:8.1f} ms   grouped {med[f'{k}.grouped'] * 1000:8.1f} ms"
              f"   one call / grouped {out['speedup'][k]:.2f}×")
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@pytest.mark.bench
def test_bench_length_groups():
    out = run(steps=2)
    assert all(v > 0 for v in out["speedup"].values())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    a = ap.parse_args()
    print(json.dumps(run(a.steps, a.batch, a.device), indent=1))
