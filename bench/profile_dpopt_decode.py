"""Where OPT's KV-cached ensemble step spends its time against Hugging Face ``generate``, per decoded
token (a diagnostic beside bench_dpopt.py part 1). Same model and meta-prompts as bench_dpopt.py;
``--random-weights``/``--arch``/``--dtype`` as there (timing only).

For T tokens it times (CUDA synchronised): the engine's ``step`` as a whole, the model forward inside
it alone (the same call on the same cache), and ``generate``; then a torch.profiler table of a few
steps of each (top operators by device time and by CPU time).

    python bench/profile_dpopt_decode.py --random-weights --arch llama2-7b --model DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_dpopt import add_model_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap, dtype="bfloat16")
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=20)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench_dpopt import _demos, left_padded, random_backbone
    from models.backbones import load_backbone
    from models.device import resolve_device
    from tasks.methods.dp_opt.engine import CausalEngine
    from tasks.methods.dp_opt.templates import backward_body, backward_head

    dev = resolve_device(None)
    dtype = getattr(torch, args.dtype)
    bb = random_backbone(args.model, dev, dtype, args.arch) if args.random_weights else load_backbone(args.model, dev)
    bb.model.to(dtype)
    print(f"{bb.name} on {bb.device}, {dtype}, attention: {bb.model.config._attn_implementation}")
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=64)
    head = list(bb.tokenizer(backward_head("Classify the input text as positive or negative."),
                             add_special_tokens=True)["input_ids"])
    demos = _demos(5 * args.members)
    rows = [head + engine.ids(backward_body(demos[5 * j:5 * j + 5])) for j in range(args.members)]
    B = len(rows)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def engine_tokens(n, forward_only_times=None):
        state = engine.start(rows)
        tok = torch.zeros(B, dtype=torch.long)
        for _ in range(n):
            if forward_only_times is not None:  # the model call of step() alone, on a copy of its inputs
                mask = torch.cat([state["mask"], torch.ones((B, 1), dtype=torch.long)], dim=1)
                sync()
                t = time.perf_counter()
                with torch.no_grad():
                    out = bb.model(input_ids=tok.view(B, 1).to(dev), attention_mask=mask.to(dev),
                                   position_ids=state["next_pos"].view(B, 1).to(dev),
                                   past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
                sync()
                forward_only_times.append(time.perf_counter() - t)
                # the forward appended this token to the cache: continue from its output as step() would
                state["mask"], state["next_pos"] = mask, state["next_pos"] + 1
                state["cache"], state["logits"] = out.past_key_values, out.logits[:, -1, :].float().cpu()
            else:
                state = engine.step(state, tok)
        sync()

    ids, mask = left_padded(rows, engine.pad_id, dev)

    def generate(n):
        with torch.no_grad():
            bb.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=engine.pad_id)
        sync()

    def per_token(fn):
        fn(1)
        t = time.perf_counter()
        fn(1)
        t1 = time.perf_counter() - t  # prefill + 1 token
        t = time.perf_counter()
        fn(args.tokens + 1)
        return (time.perf_counter() - t - t1) / args.tokens  # the decode steps alone

    engine_tokens(2), generate(2)  # warm-up
    t_step, t_gen = per_token(engine_tokens), per_token(generate)
    fwd = []
    engine_tokens(args.tokens, fwd)
    fwd_ms = 1000 * sorted(fwd)[len(fwd) // 2]
    print(f"J={B} rows (longest {L}), per decoded token: engine.step {t_step * 1000:.1f} ms; its model forward "
          f"alone {fwd_ms:.1f} ms (median); generate {t_gen * 1000:.1f} ms; step / generate {t_step / t_gen:.2f}")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for name, fn in (("engine.step", lambda: engine_tokens(5)), ("generate", lambda: generate(5))):
        with profile(activities=acts) as prof:
            fn()
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        print(f"\n--- {name}, 5 tokens (prefill included), top by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
        print(f"--- {name}, top by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
