"""DP-OPT engine speed on SmolLM2-135M-Instruct (ratios measured in one run):

1. OPT (fixed meta-prompts, majority vote) per generated token: the KV-cached ensemble vs a plain
   batched Hugging Face ``generate`` of the same meta-prompts (goal ≤ 1.3×), and the reference
   code's way, re-encoding every meta-prompt at every token (goal: KV ≥ 5× faster at 50 tokens).
2. DP-OPT query (fresh meta-prompts every token: last-position logits of J sequences, the shared
   head's KV reused, length buckets): tokens/s and time per query for J = 64 and J = 205, vs one
   plain batched forward of the same J full sequences (goal ≤ 1.2×).

    .venv/bin/python bench/bench_dpopt.py [--tokens 50] [--members 16]

Timing-only runs where the weights cannot be had (a GPU machine without the hub): ``--random-weights``
builds the model from the config in ``--model`` (a folder with config.json and the tokenizer) with
random initialisation; ``--arch llama2-7b`` instead builds Llama-2-7B's architecture (Vicuna-7B's)
around that tokenizer (its vocabulary size). Random weights give the same times per token (every
run here generates exactly --tokens tokens, no EOS) and no meaningful text. ``--device``/``--dtype``
place it; ``--skip-opt`` runs part 2 only; ``--max-batch`` sets the engine's batch (the method's is 32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DATA = Path(os.environ.get("PRIVPROMPT_DATA_ROOT") or REPO.parent / "shared" / "data")


def _demos(n: int, whole: bool = False) -> list[tuple[str, str, str]]:
    rows = [json.loads(l) for l in (DATA / "sst2" / "train.jsonl").open().readlines()[:n]]
    return [(" ".join(r["text"].split()[:48 if whole else 40]), r["label"], r["label"] if i % 3 else "negative")
            for i, r in enumerate(rows)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--members", type=int, default=16, help="meta-prompts of the OPT comparison")
    add_model_args(ap, dtype="float32")
    ap.add_argument("--device", default=None, help="default: CUDA when present (PRIVPROMPT_DEVICE overrides)")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--js", default="64,205", help="DP-OPT query sizes J")
    ap.add_argument("--repeats", type=int, default=1, help="timed DP-OPT queries per J (median)")
    ap.add_argument("--skip-opt", action="store_true")
    ap.add_argument("--label-rows", type=int, default=64, help="rows labelled one by one (ŷ alone), timed")
    ap.add_argument("--mixed", action="store_true",
                    help="meta-prompts of 1-4 demos of whole texts (lengths as the method's Poisson-sampled members "
                         "vary), not 5 demos of 40 words each")
    args = ap.parse_args()
    import statistics

    import torch

    from tasks.methods.dp_opt.engine import CausalEngine
    from tasks.methods.dp_opt.templates import backward_body, backward_head
    from models.backbones import load_backbone

    from models.device import resolve_device

    dev = resolve_device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(2)
    if args.random_weights:
        bb = random_backbone(args.model, dev, getattr(torch, args.dtype), args.arch)
    else:
        bb = load_backbone(args.model, dev)
        bb.model.to(getattr(torch, args.dtype))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    print(f"model {bb.name}: {sum(p.numel() for p in bb.model.parameters()) / 1e6:,.1f} M parameters, "
          f"{next(bb.model.parameters()).dtype}, on {bb.device}; random weights: {args.random_weights}; "
          f"cuda available: {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=args.max_batch)
    head_text = backward_head("Classify the input text as positive or negative.")
    head = list(bb.tokenizer(head_text, add_special_tokens=True)["input_ids"])
    demos = _demos(205 * 5, whole=args.mixed)
    if args.mixed:  # as dp_opt's members: a Poisson-sampled number of demos (here 1-4, cap 2k = 4)
        import numpy as np

        counts = np.random.default_rng(0).integers(1, 5, size=205)
        bodies = [engine.ids(backward_body(demos[5 * j:5 * j + c])) for j, c in enumerate(counts)]
    else:
        bodies = [engine.ids(backward_body(demos[5 * j:5 * j + 5])) for j in range(205)]
    never = {-1}  # no EOS: every run generates exactly --tokens tokens

    # 1. OPT: KV-cached ensemble vs plain generate vs re-encoding, same J meta-prompts
    if not args.skip_opt:
        opt_comparison(args, bb, engine, head, bodies, never, sync)

    # 2. DP-OPT queries: fresh meta-prompts, shared head's KV, buckets
    prefix = engine.encode_prefix(head_text)
    generated = engine.ids(" Classify the review by its overall sentiment")
    for J in [int(j) for j in args.js.split(",")]:
        suffixes = [b + generated for b in bodies[:J]]
        engine.last_logits(suffixes[:4], prefix)  # warm-up
        engine.last_logits(suffixes, prefix)  # warm-up at full size (allocator, kernels per shape)
        t_queries = []
        for _ in range(args.repeats):
            sync()
            t = time.perf_counter()
            engine.last_logits(suffixes, prefix)
            sync()
            t_queries.append(time.perf_counter() - t)
        t_query = statistics.median(t_queries)
        full = [prefix.ids + s for s in suffixes]
        Lf = max(len(r) for r in full)

        def plain_forward(keep):  # one plain batched forward (right-padded), same chunking
            with torch.no_grad():
                for start in range(0, J, args.max_batch):
                    chunk = full[start:start + args.max_batch]
                    x = torch.full((len(chunk), Lf), engine.pad_id)
                    m = torch.zeros((len(chunk), Lf), dtype=torch.long)
                    for i, r in enumerate(chunk):
                        x[i, :len(r)], m[i, :len(r)] = torch.tensor(r), 1
                    bb.model(input_ids=x.to(dev), attention_mask=m.to(dev), logits_to_keep=keep)

        plain = {}
        for keep in (0, 1):  # 0: logits at every position (the comparison of the first CPU runs); 1: the last only
            if dev.type == "cuda":
                plain_forward(keep)  # warm-up
            sync()
            t = time.perf_counter()
            plain_forward(keep)
            sync()
            plain[keep] = time.perf_counter() - t
        tokens = sum(len(r) for r in full)
        print(f"DP-OPT query J={J} ({tokens:,} tokens, longest {Lf}, max_batch {args.max_batch}): {t_query:.3f} s "
              f"({tokens / t_query:,.0f} tokens/s; median of {len(t_queries)}); one plain batched forward "
              f"{plain[0]:.3f} s (all logits), {plain[1]:.3f} s (last logits only); query / plain = "
              f"{t_query / plain[0]:.2f} / {t_query / plain[1]:.2f} (goal ≤ 1.2)")
        # the row-own alternatives of review 6 (F1): every member alone, rowwise (what the method runs), ŷ alone
        def alone(rows):  # every member in its own forward pass
            return [engine.last_logits([s], prefix) for s in rows]

        alone(suffixes[:4])  # warm-up
        sync()
        t = time.perf_counter()
        alone(suffixes)
        sync()
        t_alone = time.perf_counter() - t
        t_rowwise = {}
        default = engine.batch_rows
        for batch_rows in (True, False):  # public row-own shapes, batched / every row alone at its length
            engine.batch_rows = batch_rows
            engine.last_logits_rowwise(suffixes, prefix)  # warm-up, and every shape's row check
            sync()
            t = time.perf_counter()
            engine.last_logits_rowwise(suffixes, prefix)
            sync()
            t_rowwise[batch_rows] = time.perf_counter() - t
        engine.batch_rows = default
        padded = sum(engine.row_batch(n) * -(-k // (engine.row_batch(n) - 1)) * n  # each pass: a pad-only row at least
                     for n, k in _buckets(suffixes, engine).items())
        texts = [d[0] for d in demos[:args.label_rows]]
        words = [" negative", " positive"]
        engine.label_logprobs("Classify the input text as positive or negative.", texts[:2], words,
                              lambda x: f"Input: {x}\nOutput:")  # warm-up (and the head encoded)
        sync()
        t = time.perf_counter()
        for x in texts:
            engine.label_logprobs("Classify the input text as positive or negative.", [x], words,
                                  lambda x: f"Input: {x}\nOutput:")
        sync()
        t_label = (time.perf_counter() - t) / len(texts)
        print(f"  members alone: {t_alone:.3f} s = {t_alone / t_query:.2f}× the batched query; rowwise batched (public "
              f"shapes, batches of {engine.row_batch(256)} at 256 tokens; {padded:,} padded tokens for {tokens - J * len(prefix.ids):,}): "
              f"{t_rowwise[True]:.3f} s = {t_rowwise[True] / t_query:.2f}×, shapes failing the row check: "
              f"{sum(not ok for ok in engine.row_checks.values())} of {len(engine.row_checks)}; rowwise alone (each row at its length): "
              f"{t_rowwise[False]:.3f} s = {t_rowwise[False] / t_query:.2f}×; the engine's default here: "
              f"{'batched' if default else 'alone'}; one row's ŷ alone: {1000 * t_label:.1f} ms (mean of {len(texts)})")
        if torch.cuda.is_available() and dev.type == "cuda":
            print(f"  peak GPU memory so far {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB")


def _buckets(suffixes, engine) -> dict[int, int]:
    """Rows per padded length of :meth:`CausalEngine.last_logits_rowwise`'s batched path."""
    w, out = engine.bucket_width, {}
    for s in suffixes:
        out[-(-len(s) // w) * w] = out.get(-(-len(s) // w) * w, 0) + 1
    return out


def opt_comparison(args, bb, engine, head, bodies, never, sync) -> None:
    import torch

    from tasks.methods.dp_opt.generate import ensemble_generate, reencode_generate

    dev = bb.device
    J = args.members
    if dev.type == "cuda":
        ensemble_generate(engine, head, bodies[:J], 3, eos_ids=never)  # warm-up
    sync()
    t = time.perf_counter()
    kv = ensemble_generate(engine, head, bodies[:J], args.tokens, eos_ids=never)
    sync()
    t_kv = (time.perf_counter() - t) / len(kv.tokens)
    ids, mask = left_padded([head + b for b in bodies[:J]], engine.pad_id, dev)

    def generate(n):
        with torch.no_grad():
            bb.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=engine.pad_id)

    if dev.type == "cuda":
        generate(3)  # warm-up
    sync()
    t = time.perf_counter()
    generate(args.tokens)
    sync()
    t_gen = (time.perf_counter() - t) / args.tokens
    sync()
    t = time.perf_counter()
    re = reencode_generate(engine, head, bodies[:J], min(args.tokens, 10), eos_ids=never)
    sync()
    t_re = (time.perf_counter() - t) / len(re.tokens)  # grows with length: 10 tokens is a lower bound at 50
    print(f"OPT, J={J}, {args.tokens} tokens: KV ensemble {t_kv * 1000:.0f} ms/token, plain generate "
          f"{t_gen * 1000:.0f} ms/token, re-encode {t_re * 1000:.0f} ms/token (first 10 tokens)")
    print(f"  KV / generate = {t_kv / t_gen:.2f} (goal ≤ 1.3); re-encode / KV = {t_re / t_kv:.2f} (goal ≥ 5)")



def add_model_args(ap, dtype: str) -> None:
    """The model options of the DP-OPT benches (this one, bench_cuda_shapes.py, profile_dpopt_decode.py)."""
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random-weights", action="store_true", help="random init from --model's config (timing only)")
    ap.add_argument("--arch", choices=["llama2-7b"], default=None, help="with --random-weights: this architecture")
    ap.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16", "float16"])


def left_padded(rows: list[list[int]], pad_id: int, device):
    """(input_ids, attention_mask) of token rows left-padded to the longest, on ``device``: what
    Hugging Face ``generate`` is given in the comparisons."""
    import torch

    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):], mask[i, L - len(r):] = torch.tensor(r), 1
    return ids.to(device), mask.to(device)


def random_backbone(model_dir: str, device, dtype, arch: str | None = None):
    """A Backbone of the architecture in ``model_dir``'s config.json (or Llama-2-7B's with
    ``arch='llama2-7b'``), randomly initialised on ``device`` in ``dtype``, with the tokenizer in
    ``model_dir``. For timing only: the weights are random."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from models.backbones import Backbone

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    if arch == "llama2-7b":  # meta-llama/Llama-2-7b-hf's (and lmsys/vicuna-7b-v1.5's) config, with this tokenizer's vocabulary
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                          rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        name = "llama2-7b-architecture (random weights)"
    else:
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        name = f"{Path(model_dir).name} (random weights)"
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # initialised where it runs: a 7B model's init on the CPU takes minutes
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(before)
    model.requires_grad_(False)
    model.eval()
    return Backbone(name, "causal", model, tok, int(model.get_input_embeddings().weight.shape[1]))


if __name__ == "__main__":
    main()
