"""POST: a prompt-transfer step vs a DP training step on the target (ratio measured in one run),
on MiniLM (target) and a 2-layer student, batch 32, public tweets / private SST-2 texts read from
../shared/data at run time.

    .venv/bin/python bench/bench_post.py [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DATA = REPO.parent / "shared" / "data"


def _texts(path: Path, n: int) -> tuple[list[str], list[str]]:
    rows = [json.loads(l) for l in path.open().readlines()[:n]]
    return [r["text"] for r in rows], [r["label"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import torch

    from models.classifiers import build_classifier
    from tasks.methods.post.distill import build_student, freeze
    from models.dp_prompt_training import DPConfig, PromptTrainingConfig, train_prompt
    from models.backbones import load_backbone
    from models.prompt_transfer import TransferConfig, transfer_prompt

    labels = ["negative", "positive"]
    desc = {"negative": "a negative, bad movie review", "positive": "a positive, great movie review"}
    teacher = load_backbone("minilm")
    student = freeze(build_student(teacher, 2))
    target_clf = build_classifier(teacher, labels, desc)
    source_clf = build_classifier(student, labels, desc)
    public, _ = _texts(DATA / "tweet_sentiment" / "validation.jsonl", 32 * args.steps)
    private, names = _texts(DATA / "sst2" / "train.jsonl", 32 * args.steps)
    y = torch.tensor([labels.index(n) for n in names])
    source_prompt = torch.randn(10, teacher.embed_dim) * 0.02
    dev = teacher.device
    print(f"target MiniLM on {dev}, student on {student.device}")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    sync()
    t0 = time.perf_counter()
    transfer_prompt(source_clf, source_prompt, target_clf, public,
                    TransferConfig(steps=args.steps, batch_size=32, max_length=48, log_every=10**9))
    sync()
    transfer_s = (time.perf_counter() - t0) / args.steps

    enc = target_clf.encode(private, max_length=48)
    cfg = PromptTrainingConfig(n_tokens=10, steps=args.steps, batch_size=32, max_length=48, log_every=10**9)
    sync()
    t0 = time.perf_counter()
    train_prompt(target_clf, enc, y, cfg, dp=DPConfig(noise_multiplier=1.0, max_grad_norm=1.0,
                                                        sample_rate=32 / len(private)))
    sync()
    train_s = (time.perf_counter() - t0) / args.steps
    print(f"| step | seconds |\n|---|---:|\n| POST transfer step (incl. its share of the no-grad "
          f"source/unprompted passes) | {transfer_s:.3f} |\n| DP training step on the target | {train_s:.3f} |")
    print(f"ratio transfer / DP target step: {transfer_s / train_s:.2f}")


if __name__ == "__main__":
    main()
