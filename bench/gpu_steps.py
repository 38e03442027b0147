"""DP prompt-tuning steps on a big backbone, on a GPU (issue 39): what the whole-run ratio is made of.

    python bench/gpu_steps.py MODEL_DIR DATA.jsonl OUT.json [--sections attention,physical,4bit,holdout] [--steps 15]

* ``attention``: the DP step (Poisson batches of expected size 32, per-sample gradients, clipping, one
  noise draw) against the non-private step (fixed batches of 32) through ``models.dp_prompt_training
  .train_prompt``, with cuDNN attention left out (PrivPrompt's default on CUDA) and left in
  (``PRIVPROMPT_CUDNN_ATTENTION=1``): seconds per step, interleaved runs, after a warm-up run each.
* ``physical``: one logical DP step of expected batch 64 over micro-batches of 64, 16 and 8
  (``physical_batch_size``): seconds per step and peak GPU memory.
* ``4bit``: the same DP and non-private steps on the backbone loaded in 4-bit (NF4, bitsandbytes,
  ``models.placement``) against bf16: load time, weights' memory, seconds per step, peak memory.
* ``holdout``: the private holdout scoring (``models.scoring.row_wise_logits``: a selection's counts, the
  released comparison with no prompt) in row-own batches vs one row per pass, on 672 rows (a 1 % holdout
  of SST-2), with and without a soft prompt: seconds, and whether both paths predict the same.

Random weights are fine (timings only). Prints one JSON line per measurement and writes them all
to OUT.json as they come (a timed-out run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: list[dict] = []


def cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def sync() -> None:
    if cuda():
        cuda().synchronize()


def gib(fn: str) -> float | None:
    """torch.cuda.<fn>() in GiB (None on a machine without CUDA: the script also runs on CPU, for checks)."""
    return getattr(cuda(), fn)() / 2**30 if cuda() else None


def emit(out: str, **row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    Path(out).write_text(json.dumps(RESULTS, indent=1))


def texts_and_labels(path: str, n: int):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()[:n]]
    return [r["text"] for r in rows], [0 if r["label"] == "negative" else 1 for r in rows]


def timed_train(clf, enc, y, *, dp: bool, steps: int, batch: int, physical: int, seed: int = 0) -> dict:
    from models.dp_prompt_training import DPConfig, PromptTrainingConfig, seeded_dp_generators, train_prompt

    N = int(enc["input_ids"].shape[0])
    cfg = PromptTrainingConfig(n_tokens=4, lr=0.05, steps=steps, batch_size=batch, physical_batch_size=physical,
                               log_every=10**9, seed=seed)
    dpc = DPConfig(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=batch / N) if dp else None
    gens = seeded_dp_generators(seed) if dp else (None, None)  # timings only: no release
    sync()
    if cuda():
        cuda().reset_peak_memory_stats()
    t0 = time.perf_counter()
    res = train_prompt(clf, enc, y, cfg, dpc, sample_generator=gens[0], noise_generator=gens[1])
    sync()
    dt = time.perf_counter() - t0
    examples = sum(h["batch_size"] for h in res.history)
    return {"s_per_step": dt / steps, "examples_per_step": examples / steps,
            "peak_gib": gib("max_memory_allocated")}


def classifier(model_dir: str, placement=None):
    from models.backbones import load_backbone
    from models.classifiers import build_classifier

    t0 = time.perf_counter()
    bb = load_backbone(model_dir, placement=placement)
    load_s = time.perf_counter() - t0
    return build_classifier(bb, ["negative", "positive"], template="Review: {text}\nSentiment:"), load_s


def attention(out, clf, enc, y, steps):
    for setting in ("0", "1"):
        os.environ["PRIVPROMPT_CUDNN_ATTENTION"] = setting
        timed_train(clf, enc, y, dp=False, steps=3, batch=32, physical=64)  # warm-up
        timed_train(clf, enc, y, dp=True, steps=3, batch=32, physical=64)
        runs = {"nonprivate": [], "dp": []}
        for rep in range(2):
            for name in (("nonprivate", "dp") if rep == 0 else ("dp", "nonprivate")):
                runs[name].append(timed_train(clf, enc, y, dp=name == "dp", steps=steps, batch=32, physical=64,
                                              seed=rep + 1))
        np_s = min(r["s_per_step"] for r in runs["nonprivate"])
        dp_s = min(r["s_per_step"] for r in runs["dp"])
        emit(out, section="attention", cudnn_attention=setting == "1", nonprivate_s_per_step=np_s, dp_s_per_step=dp_s,
             dp_over_nonprivate=dp_s / np_s, runs=runs)
    os.environ.pop("PRIVPROMPT_CUDNN_ATTENTION", None)


def physical(out, clf, enc, y, steps):
    for size in (64, 16, 8):
        timed_train(clf, enc, y, dp=True, steps=2, batch=64, physical=size)
        r = timed_train(clf, enc, y, dp=True, steps=steps, batch=64, physical=size, seed=1)
        emit(out, section="physical", expected_batch=64, physical_batch_size=size, **r)


def four_bit(out, model_dir, enc_texts, y, steps, bf16_weights_gib):
    from models.backbones import clear_backbone_cache
    from models.placement import Placement

    clear_backbone_cache()
    import gc

    gc.collect()
    if cuda():
        cuda().empty_cache()
    clf, load_s = classifier(model_dir, Placement(quantization="4bit"))
    weights = gib("memory_allocated")
    enc = clf.encode(enc_texts, max_length=64)
    timed_train(clf, enc, y, dp=False, steps=3, batch=32, physical=64)
    timed_train(clf, enc, y, dp=True, steps=3, batch=32, physical=64)
    np_r = timed_train(clf, enc, y, dp=False, steps=steps, batch=32, physical=64, seed=1)
    dp_r = timed_train(clf, enc, y, dp=True, steps=steps, batch=32, physical=64, seed=1)
    emit(out, section="4bit", load_s=load_s, weights_gib=weights, bf16_weights_gib=bf16_weights_gib,
         nonprivate=np_r, dp=dp_r, dp_over_nonprivate=dp_r["s_per_step"] / np_r["s_per_step"])


def holdout(out, clf, texts, rows: int = 672):
    """The holdout scoring of a selection or of the comparison with no prompt (``row_wise_logits``):
    each row its own, in row-own batches (an accelerator's default) vs one row per pass, with a
    4-token soft prompt and without; the predictions of the two paths compared, and one row's
    logits with an added long record (must be the same bits)."""
    import torch

    from models.scoring import row_wise_logits

    part = texts[:rows]
    prompt = torch.randn(4, clf.embed_dim, generator=torch.Generator().manual_seed(0)) * 0.02
    for p in (None, prompt):
        for batch_rows in (True, False):
            row_wise_logits(clf, part[:40], 64, p, batch_rows=batch_rows)  # warm-up (and the shapes' checks)
        timed = {}
        for batch_rows in (True, False):
            sync()
            t0 = time.perf_counter()
            logits = row_wise_logits(clf, part, 64, p, batch_rows=batch_rows)
            sync()
            timed[batch_rows] = (time.perf_counter() - t0, logits)
        added = row_wise_logits(clf, ["an added record, longer than the rest " * 10] + part[:64], 64, p, batch_rows=True)
        (t_b, l_b), (t_a, l_a) = timed[True], timed[False]
        emit(out, section="holdout", prompt=p is not None, rows=len(part), row_own_batches_s=t_b, one_row_per_pass_s=t_a,
             speedup=t_a / t_b, same_predictions=float((l_b.argmax(1) == l_a.argmax(1)).float().mean()),
             max_abs_logit_diff=float((l_b - l_a).abs().max()), added_record_moves_none=bool(torch.equal(added[1:], l_b[:64])),
             shapes_checked=len(clf.row_checks), shapes_failing=sum(not ok for ok in clf.row_checks.values()))
    # privacy review 9's case on the device's own kernels: rows all cut to max_length (a pass of them alone would carry
    # no padding, and Transformers would drop its mask) must give the same bits beside a shorter added record
    n_tokens = lambda t: len(clf.backbone.tokenizer(t, verbose=False)["input_ids"])  # noqa: E731
    long_rows = []
    for i, t in enumerate(part[:48]):
        j = i + 1
        while n_tokens(t) <= 64:
            t, j = t + " " + part[j % len(part)], j + 1
        long_rows.append(t)
    cut = row_wise_logits(clf, long_rows, 64, None, batch_rows=True)
    beside = row_wise_logits(clf, ["a short added record"] + long_rows, 64, None, batch_rows=True)
    alone = row_wise_logits(clf, long_rows, 64, None, batch_rows=False)
    emit(out, section="holdout_cut_rows", rows=len(long_rows), all_cut=all(n_tokens(t) > 64 for t in long_rows),
         added_record_moves_none=bool(torch.equal(beside[1:], cut)), max_abs_diff_vs_alone=float((cut - alone).abs().max()),
         attention=str(getattr(clf.backbone.model.config, "_attn_implementation", "?")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("data")
    ap.add_argument("out")
    ap.add_argument("--sections", default="attention,physical,4bit")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--holdout-rows", type=int, default=672)
    a = ap.parse_args()
    import torch

    sections = a.sections.split(",")
    texts, labels = texts_and_labels(a.data, a.rows)
    y = torch.tensor(labels)
    if sections == ["4bit"]:  # on its own, in a fresh process: the 4-bit model's memory alone
        return four_bit(a.out, a.model_dir, texts, y, max(5, a.steps // 2), None)
    clf, load_s = classifier(a.model_dir)
    weights = gib("memory_allocated")
    enc = clf.encode(texts, max_length=64)
    emit(a.out, section="setup", device=cuda().get_device_name(0) if cuda() else "cpu", torch=torch.__version__, load_s=load_s,
         weights_gib=weights, rows=len(texts), mean_tokens=float(enc["attention_mask"].sum(1).float().mean()),
         dtype=str(clf.backbone.model.dtype))
    parts = {"attention": lambda: attention(a.out, clf, enc, y, a.steps),
             "physical": lambda: physical(a.out, clf, enc, y, max(5, a.steps // 2)),
             "holdout": lambda: holdout(a.out, clf, texts, a.holdout_rows),
             "4bit": lambda: four_bit(a.out, a.model_dir, texts, y, max(5, a.steps // 2), weights)}
    for name in sections:
        try:
            parts[name]()
        except Exception as e:  # noqa: BLE001 - one section's failure is a result too; the others still run
            emit(a.out, section=name, error=f"{type(e).__name__}: {e}"[:500])


if __name__ == "__main__":
    main()
