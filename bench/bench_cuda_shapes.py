"""Fresh shapes vs repeated shapes on CUDA, DP-OPT's engine (a diagnostic beside bench_dpopt.py).

Every decoded token, and every DP-OPT query, runs the model on shapes it has not run before (the key/
value length grows by one; length buckets change). PyTorch's cuDNN attention (scaled_dot_product_attention's
preferred kernel for bfloat16/float16 on Hopper) builds an execution plan per new shape. This times
the same work twice, on fresh shapes and then again on the same (now seen) shapes, with
scaled_dot_product_attention free to pick cuDNN ("default") and with cuDNN attention switched off
("no-cudnn": flash / memory-efficient / math). The no-cudnn runs come first, so that their fresh
shapes are fresh for cuDNN's plan cache too.

    python bench/bench_cuda_shapes.py --random-weights --arch llama2-7b --model DIR --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
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
    ap.add_argument("--members", type=int, default=16, help="OPT ensemble size")
    ap.add_argument("--tokens", type=int, default=20, help="OPT tokens")
    ap.add_argument("--J", type=int, default=205, help="DP-OPT query size")
    ap.add_argument("--queries", type=int, default=5, help="DP-OPT queries (one more token each)")
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_dpopt import _demos, left_padded, random_backbone
    from models.backbones import load_backbone
    from models.device import resolve_device
    from tasks.methods.dp_opt.engine import CausalEngine
    from tasks.methods.dp_opt.generate import ensemble_generate
    from tasks.methods.dp_opt.templates import backward_body, backward_head

    dev = resolve_device(None)
    dtype = getattr(torch, args.dtype)
    bb = random_backbone(args.model, dev, dtype, args.arch) if args.random_weights else load_backbone(args.model, dev)
    bb.model.to(dtype)
    print(f"{bb.name} on {bb.device} ({torch.cuda.get_device_name(dev)}), {dtype}, torch {torch.__version__}")
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=args.max_batch)
    head_text = backward_head("Classify the input text as positive or negative.")
    head = list(bb.tokenizer(head_text, add_special_tokens=True)["input_ids"])
    demos = _demos(5 * max(args.J, args.members))
    bodies = [engine.ids(backward_body(demos[5 * j:5 * j + 5])) for j in range(max(args.J, args.members))]
    prefix = engine.encode_prefix(head_text)
    words = engine.ids(" Classify the review by its overall sentiment and answer with one word only please")
    never = {-1}

    def sync():
        torch.cuda.synchronize(dev)

    def opt(members):
        sync()
        t = time.perf_counter()
        r = ensemble_generate(engine, head, bodies[:members], args.tokens, eos_ids=never)
        sync()
        return 1000 * (time.perf_counter() - t) / len(r.tokens)

    def queries(offset):
        out = []
        for q in range(args.queries):
            suffixes = [b + words[:offset + q + 1] for b in bodies[:args.J]]
            sync()
            t = time.perf_counter()
            engine.last_logits(suffixes, prefix)
            sync()
            out.append(time.perf_counter() - t)
        return out

    every = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    no_cudnn = [b for b in every if b != SDPBackend.CUDNN_ATTENTION]
    # warm-up of everything but the measured shapes (kernels, allocator): other sizes
    with sdpa_kernel(every):
        ensemble_generate(engine, head, bodies[:3], 2, eos_ids=never)
        engine.last_logits([b + words[:1] for b in bodies[:8]], prefix)
    rows = []
    for name, backends, members, offset in (("no-cudnn", no_cudnn, args.members, 0),
                                            ("default", every, args.members - 1, 2 * args.queries)):
        # the default backend gets other shapes than no-cudnn ran (one member fewer; other suffix lengths)
        with sdpa_kernel(backends):
            o_fresh, o_seen = opt(members), opt(members)
            q_fresh, q_seen = queries(offset), queries(offset)
        rows.append((name, members, o_fresh, o_seen, q_fresh, q_seen))
        print(f"{name}: OPT J={members}, {args.tokens} tokens: fresh shapes {o_fresh:.1f} ms/token, the same shapes "
              f"again {o_seen:.1f} ms/token; DP-OPT J={args.J} (max_batch {args.max_batch}), {args.queries} queries, "
              f"one token longer each: fresh {statistics.median(q_fresh):.3f} s/query "
              f"[{', '.join(f'{x:.2f}' for x in q_fresh)}], the same again {statistics.median(q_seen):.3f} s/query "
              f"[{', '.join(f'{x:.2f}' for x in q_seen)}]", flush=True)
    print("\n| attention | OPT fresh ms/token | OPT seen ms/token | DP-OPT fresh s/query | DP-OPT seen s/query |")
    print("|---|---:|---:|---:|---:|")
    for name, members, o_fresh, o_seen, q_fresh, q_seen in rows:
        print(f"| {name} (OPT J={members}) | {o_fresh:.1f} | {o_seen:.1f} | {statistics.median(q_fresh):.3f} | "
              f"{statistics.median(q_seen):.3f} |")


if __name__ == "__main__":
    main()
