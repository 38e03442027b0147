"""DP-OPT engine speed on SmolLM2-135M-Instruct (ratios measured in one run):

1. OPT (fixed meta-prompts, majority vote) per generated token: the KV-cached ensemble vs a plain
   batched Hugging Face ``generate`` of the same meta-prompts (goal ≤ 1.3×), and the reference
   code's way, re-encoding every meta-prompt at every token (goal: KV ≥ 5× faster at 50 tokens).
2. DP-OPT query (fresh meta-prompts every token: last-position logits of J sequences, the shared
   head's KV reused, length buckets): tokens/s and time per query for J = 64 and J = 205, vs one
   plain batched forward of the same J full sequences (goal ≤ 1.2×).

    .venv/bin/python bench/bench_dpopt.py [--tokens 50] [--members 16]
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


def _demos(n: int) -> list[tuple[str, str, str]]:
    rows = [json.loads(l) for l in (DATA / "sst2" / "train.jsonl").open().readlines()[:n]]
    return [(" ".join(r["text"].split()[:40]), r["label"], r["label"] if i % 3 else "negative")
            for i, r in enumerate(rows)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--members", type=int, default=16, help="meta-prompts of the OPT comparison")
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    import torch

    from tasks.methods.dp_opt.engine import CausalEngine
    from tasks.methods.dp_opt.generate import ensemble_generate, reencode_generate
    from tasks.methods.dp_opt.templates import backward_body, backward_head
    from models.backbones import load_backbone

    torch.set_num_threads(2)
    bb = load_backbone(args.model)
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=64)
    head_text = backward_head("Classify the input text as positive or negative.")
    head = list(bb.tokenizer(head_text, add_special_tokens=True)["input_ids"])
    demos = _demos(205 * 5)
    bodies = [engine.ids(backward_body(demos[5 * j:5 * j + 5])) for j in range(205)]
    never = {-1}  # no EOS: every run generates exactly --tokens tokens

    # 1. OPT: KV-cached ensemble vs plain generate vs re-encoding, same J meta-prompts
    J = args.members
    t = time.perf_counter()
    kv = ensemble_generate(engine, head, bodies[:J], args.tokens, eos_ids=never)
    t_kv = (time.perf_counter() - t) / len(kv.tokens)
    rows = [head + b for b in bodies[:J]]
    L = max(len(r) for r in rows)
    ids = torch.full((J, L), engine.pad_id)
    mask = torch.zeros((J, L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):], mask[i, L - len(r):] = torch.tensor(r), 1
    t = time.perf_counter()
    with torch.no_grad():
        bb.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                          do_sample=False, pad_token_id=engine.pad_id)
    t_gen = (time.perf_counter() - t) / args.tokens
    t = time.perf_counter()
    re = reencode_generate(engine, head, bodies[:J], min(args.tokens, 10), eos_ids=never)
    t_re = (time.perf_counter() - t) / len(re.tokens)  # grows with length: 10 tokens is a lower bound at 50
    print(f"OPT, J={J}, {args.tokens} tokens: KV ensemble {t_kv * 1000:.0f} ms/token, plain generate "
          f"{t_gen * 1000:.0f} ms/token, re-encode {t_re * 1000:.0f} ms/token (first 10 tokens)")
    print(f"  KV / generate = {t_kv / t_gen:.2f} (goal ≤ 1.3); re-encode / KV = {t_re / t_kv:.2f} (goal ≥ 5)")

    # 2. DP-OPT queries: fresh meta-prompts, shared head's KV, buckets
    prefix = engine.encode_prefix(head_text)
    generated = engine.ids(" Classify the review by its overall sentiment")
    for J in (64, 205):
        suffixes = [b + generated for b in bodies[:J]]
        engine.last_logits(suffixes[:4], prefix)  # warm-up
        t = time.perf_counter()
        engine.last_logits(suffixes, prefix)
        t_query = time.perf_counter() - t
        full = [prefix.ids + s for s in suffixes]
        Lf = max(len(r) for r in full)
        t = time.perf_counter()
        with torch.no_grad():
            for start in range(0, J, 64):  # one plain batched forward (right-padded), same chunking
                chunk = full[start:start + 64]
                x = torch.full((len(chunk), Lf), engine.pad_id)
                m = torch.zeros((len(chunk), Lf), dtype=torch.long)
                for i, r in enumerate(chunk):
                    x[i, :len(r)], m[i, :len(r)] = torch.tensor(r), 1
                bb.model(input_ids=x, attention_mask=m)
        t_plain = time.perf_counter() - t
        tokens = sum(len(r) for r in full)
        print(f"DP-OPT query J={J}: {t_query:.2f} s ({tokens / t_query:,.0f} tokens/s); one plain batched forward "
              f"{t_plain:.2f} s; query / plain = {t_query / t_plain:.2f} (goal ≤ 1.2)")


if __name__ == "__main__":
    main()
