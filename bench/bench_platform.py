"""Platform benchmarks (issue: quickstart pipeline).

    .venv/bin/python bench/bench_platform.py [--skip-quickstart] [--skip-smoke] [--skip-steps]

1. One DP-SGD soft-prompt optimizer step against one non-private step on the real MiniLM
   (batch 32 real SST-2 training texts, max_length 48, 10 prompt tokens). The trainer
   (``models.dp_prompt_training``) has no single-step function, so the two step bodies below
   copy ``_train_nonprivate`` and ``_train_dp`` line for line (one step each: micro-batching with
   ``physical_batch_size``, the per-sample shape check, clipping statistics, noise from a CPU
   generator, the finiteness check, the history row). The only difference: the batch is a
   fixed 32 rows instead of a Poisson sample (expected size 32), so both kinds see the same
   rows. The two kinds are interleaved (ABAB...): 3 warm-up + 15 timed steps each; medians.
   Requirement: DP / non-private <= 1.15.
2. ``privprompt run configs/smoke.yaml`` (twice: the second is the "warm" one) and
   ``privprompt run configs/quickstart.yaml``, each in a subprocess with a fresh
   ``PRIVPROMPT_HOME``. The CLI prints "wall time: X s (Y s model work, ...)"; X starts after
   the flow module is imported, so the subprocess wall time (interpreter start, imports, the
   embedded Prefect server, MLflow) is measured here too.
   overhead = (subprocess wall - model work) / subprocess wall. Requirements: quickstart
   overhead <= 10 %, smoke (warm) under 60 s.

SST-2 is read at run time from $PRIVPROMPT_DATA_ROOT/sst2 or /work/shared/data/sst2; nothing
is copied into the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BATCH, MAX_LEN, N_TOKENS = 32, 48, 10
WARMUP, TIMED = 3, 15
LABELS = ["negative", "positive"]
DESCRIPTIONS = {"negative": "a negative, bad movie review", "positive": "a positive, great movie review"}
LR, C, SIGMA = 0.05, 1.0, 0.7  # quickstart lr / max_grad_norm; sigma's value does not change the cost


def sst2_path() -> Path:
    root = os.environ.get("PRIVPROMPT_DATA_ROOT") or str(REPO.parent / "shared" / "data")
    return Path(root) / "sst2" / "train.jsonl"


def read_sst2(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    rows = [json.loads(line) for line in sst2_path().read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(rows)
    rows = rows[:n]
    return [r["text"] for r in rows], [LABELS.index(r["label"]) for r in rows]


# ------------------------------------------------------------------ 1. step timing


def bench_steps() -> dict:
    import torch
    import torch.nn.functional as F

    from models.classifiers import build_classifier, select_rows
    from models.dp_prompt_training import (
        DPConfig,
        PromptTrainingConfig,
        _check_per_sample_shape,
        _initial_prompt,
        _optimizer,
        per_sample_prompt_gradients,
    )
    from models.backbones import load_backbone

    t0 = time.perf_counter()
    bb = load_backbone("minilm")
    clf = build_classifier(bb, LABELS, DESCRIPTIONS)
    clf.eval()
    load_s = time.perf_counter() - t0
    n_batches = WARMUP + TIMED
    texts, labels = read_sst2(n_batches * BATCH)
    enc = clf.encode(texts, max_length=MAX_LEN)
    labels = torch.tensor(labels, dtype=torch.long)
    dev = clf.device
    batches = [torch.arange(i * BATCH, (i + 1) * BATCH) for i in range(n_batches)]

    tc = PromptTrainingConfig(n_tokens=N_TOKENS, lr=LR, batch_size=BATCH, max_length=MAX_LEN, seed=0)
    dp = DPConfig(noise_multiplier=SIGMA, max_grad_norm=C, sample_rate=BATCH / 8000)
    # two independent prompts/optimizers, same initialisation (as two trainer calls would have)
    p_np = _initial_prompt(clf, tc, None, 0)
    p_dp = _initial_prompt(clf, tc, None, 0)
    opt_np, opt_dp = _optimizer([p_np.weight], tc), _optimizer([p_dp.weight], tc)
    g_noise = torch.Generator().manual_seed(1)
    hist_np, hist_dp = [], []
    state = {"update_checked": False}

    def nonprivate_step(idx: torch.Tensor, step: int) -> None:  # = one step of _train_nonprivate
        opt_np.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for chunk in idx.split(tc.physical_batch_size):
            logits = clf(select_rows(enc, chunk), p_np.weight)
            loss = F.cross_entropy(logits.float(), labels[chunk].to(dev), reduction="sum")
            (loss / len(idx)).backward()
            loss_sum += float(loss.detach())
        opt_np.step()
        mean_loss = loss_sum / len(idx)
        hist_np.append({"step": step, "loss": mean_loss, "batch_size": len(idx)})

    def dp_step(idx: torch.Tensor, step: int) -> None:  # = one step of _train_dp (fixed idx)
        q, Cn, sigma = dp.sample_rate, dp.max_grad_norm, dp.noise_multiplier
        expected_batch = BATCH  # q * N with N = 8000
        shape = p_dp.weight.shape
        B = int(idx.numel())
        summed = torch.zeros(shape, device=dev)
        seen, losses, clipped, norm_sum = 0, [], 0, 0.0
        for chunk in idx.split(tc.physical_batch_size):
            grads, loss = per_sample_prompt_gradients(
                clf, select_rows(enc, chunk), labels[chunk], p_dp.weight, return_losses=True
            )
            _check_per_sample_shape(grads, int(chunk.numel()), shape)
            norms = grads.flatten(1).norm(dim=1)
            factor = (Cn / (norms + 1e-6)).clamp(max=1.0)
            summed += (grads * factor[:, None, None]).sum(0)
            seen += grads.shape[0]
            losses.append(loss)
            clipped += int((norms > Cn).sum())
            norm_sum += float(norms.sum())
        if seen != B:
            raise RuntimeError("per-sample gradients do not cover the batch")
        noise = torch.normal(0.0, sigma * Cn, size=tuple(shape), generator=g_noise).to(dev)
        grad = (summed + noise) / expected_batch
        moving = not state["update_checked"] and bool(grad.abs().max() > 0)
        before = p_dp.weight.detach().clone() if moving else None
        opt_dp.zero_grad(set_to_none=True)
        p_dp.weight.grad = grad.to(p_dp.weight.dtype)
        opt_dp.step()
        if not torch.isfinite(p_dp.weight).all():
            raise RuntimeError("prompt became non-finite")
        if before is not None:
            if torch.equal(before, p_dp.weight.detach()):
                raise RuntimeError("the prompt did not change")
            state["update_checked"] = True
        mean_loss = float(torch.cat(losses).mean()) if B else None
        hist_dp.append({"step": step, "loss": mean_loss, "batch_size": B,
                        "clipped_frac": clipped / B if B else None,
                        "mean_grad_norm": norm_sum / B if B else None})

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    t_np, t_dp = [], []
    for i, idx in enumerate(batches):  # ABAB..., same rows for both kinds
        for fn, ts in ((nonprivate_step, t_np), (dp_step, t_dp)):
            sync()
            t = time.perf_counter()
            fn(idx, i + 1)
            sync()
            if i >= WARMUP:
                ts.append(time.perf_counter() - t)
    m_np, m_dp = statistics.median(t_np), statistics.median(t_dp)
    return {
        "device": str(dev), "torch_threads": torch.get_num_threads(), "model_load_s": load_s,
        "seq_len": int(enc["input_ids"].shape[1]),
        "nonprivate_ms": [x * 1e3 for x in t_np], "dp_ms": [x * 1e3 for x in t_dp],
        "median_nonprivate_ms": m_np * 1e3, "median_dp_ms": m_dp * 1e3, "ratio": m_dp / m_np,
        "min_ratio": min(t_dp) / min(t_np),
        "last_loss_nonprivate": hist_np[-1]["loss"], "last_loss_dp": hist_dp[-1]["loss"],
        "clipped_frac_last": hist_dp[-1]["clipped_frac"],
    }


# ------------------------------------------------------------------ 2. CLI runs

WALL_RE = re.compile(r"wall time:\s*([\d.]+) s \(([\d.]+) s model work, ([\d.]+) s orchestration")


def run_cli(config: str, log_dir: Path, tag: str) -> dict:
    home = tempfile.mkdtemp(prefix=f"privprompt-bench-{tag}-")
    env = dict(os.environ, PRIVPROMPT_HOME=home)
    code = f"import sys, privprompt_cli; sys.exit(privprompt_cli.main(['run', {config!r}]))"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    (log_dir / f"{tag}.stdout").write_text(proc.stdout)
    (log_dir / f"{tag}.stderr").write_text(proc.stderr)
    out = {"config": config, "rc": proc.returncode, "subprocess_wall_s": wall, "home": home,
           "stdout": proc.stdout.strip().splitlines()}
    m = WALL_RE.search(proc.stdout)
    if proc.returncode != 0 or m is None:
        out["error"] = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return out
    cli_wall, work, orch = map(float, m.groups())
    out.update({"cli_wall_s": cli_wall, "model_work_s": work, "cli_orchestration_s": orch,
                "startup_s": wall - cli_wall, "overhead_s": wall - work, "overhead_ratio": (wall - work) / wall})
    return out


def show_cli(r: dict) -> None:
    print(f"\n--- {r['config']} (PRIVPROMPT_HOME={r['home']}) rc={r['rc']}")
    for line in r["stdout"]:
        print("   ", line)
    if "error" in r:
        print(f"  FAILED: {r['error']}")
        return
    print(f"  subprocess wall {r['subprocess_wall_s']:.1f} s = CLI wall {r['cli_wall_s']:.1f} s "
          f"+ start-up/imports {r['startup_s']:.1f} s; model work {r['model_work_s']:.1f} s")
    print(f"  overhead (subprocess wall - model work) = {r['overhead_s']:.1f} s = "
          f"{100 * r['overhead_ratio']:.1f} % of subprocess wall")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-quickstart", action="store_true")
    ap.add_argument("--skip-smoke", action="store_true")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--json", default=None, help="also write all numbers to this JSON file")
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="privprompt-bench-logs-"))
    print(f"nproc={os.cpu_count()}  loadavg={os.getloadavg()}  logs: {log_dir}")
    results: dict = {"nproc": os.cpu_count(), "loadavg_start": os.getloadavg()}

    if not args.skip_steps:
        s = bench_steps()
        results["steps"] = s
        print(f"\n[1] MiniLM step, B={BATCH} L={s['seq_len']} n_tokens={N_TOKENS}, device {s['device']}, "
              f"torch threads {s['torch_threads']} ({WARMUP} warm-up + {TIMED} timed each, interleaved)")
        print(f"  non-private: median {s['median_nonprivate_ms']:.1f} ms  "
              f"[{', '.join(f'{x:.0f}' for x in s['nonprivate_ms'])}]")
        print(f"  DP-SGD:      median {s['median_dp_ms']:.1f} ms  [{', '.join(f'{x:.0f}' for x in s['dp_ms'])}]")
        verdict = "pass" if s["ratio"] <= 1.15 else "MISS"
        print(f"  ratio DP/non-private = {s['ratio']:.3f} (limit 1.15: {verdict}); ratio of minima {s['min_ratio']:.3f}")

    if not args.skip_smoke:
        for tag in ("smoke-1", "smoke-2"):
            r = run_cli("configs/smoke.yaml", log_dir, tag)
            results[tag] = r
            show_cli(r)
        warm = results["smoke-2"]
        if "error" not in warm:
            print(f"  smoke (warm, 2nd run) subprocess wall {warm['subprocess_wall_s']:.1f} s "
                  f"(limit 60 s: {'pass' if warm['subprocess_wall_s'] < 60 else 'MISS'})")

    if not args.skip_quickstart:
        r = run_cli("configs/quickstart.yaml", log_dir, "quickstart")
        results["quickstart"] = r
        show_cli(r)
        if "error" not in r:
            print(f"  quickstart overhead {100 * r['overhead_ratio']:.1f} % "
                  f"(limit 10 %: {'pass' if r['overhead_ratio'] <= 0.10 else 'MISS'})")

    results["loadavg_end"] = os.getloadavg()
    print(f"\nloadavg at end: {results['loadavg_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
