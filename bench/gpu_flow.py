"""Flow runs end to end on a GPU machine (issue 39): the helpers bench/gpu_flow.sh calls.

    python bench/gpu_flow.py record STATE_DIR OUT.json     # every MLflow run of the state folder: params, metrics, tags
    python bench/gpu_flow.py llama7b DIR [--layers N] [--hidden H] [--logit-scale S] [--embed-scale E]
                                                           # a Llama-2-7B-shaped model
                                                           # with random weights (bf16), saved
    python bench/gpu_flow.py minilm-fp16 SRC DST           # MiniLM's safetensors in fp16 (to carry it under the size limit)
    python bench/gpu_flow.py minilm-fp32 SRC DST           # back to float32 on the GPU machine

Random weights are said so wherever their numbers are reported: a random 7B model measures the
time and memory of the run, not its accuracy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def record(state_dir: str, out: str) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{Path(state_dir) / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    runs = []
    for exp in client.search_experiments():
        for r in client.search_runs([exp.experiment_id], max_results=1000):
            runs.append({"experiment": exp.name, "run_id": r.info.run_id, "name": r.info.run_name,
                         "status": r.info.status, "start": r.info.start_time, "end": r.info.end_time,
                         "params": r.data.params, "metrics": r.data.metrics,
                         "tags": {k: v for k, v in r.data.tags.items() if not k.startswith("mlflow.log-model")}})
    Path(out).write_text(json.dumps(runs, indent=1, sort_keys=True))
    print(f"{len(runs)} MLflow runs written to {out}")


def llama7b(folder: str, layers: int = 32, hidden: int = 4096, logit_scale: float = 1.0,
            embed_scale: float = 1.0) -> None:
    """Llama-2-7B's shape (hidden 4096, 32 heads, MLP 11008, 32 layers) with the MiniLM tokenizer's
    vocabulary (30,522: the tokenizer is copied beside it), random weights, bf16.

    ``logit_scale`` multiplies the output head: a random model's next-token distributions are nearly
    uniform over 30,522 tokens, so DP-OPT's members, each sampling one token, never agree and every
    LimitedDomain query answers ⊥ (two ⊥ end a candidate after 2 queries); sharpened, each member
    samples near its argmax. ``embed_scale`` multiplies the input embeddings: in a random pre-norm
    model the last position's state is a mix of random attention averages over each member's own
    demos, so sharpened members still disagree (on a 32-layer model, 5 of 16 agreed); with embeddings
    ×1000 the residual stream is the last token's embedding, which every member shares (16 of 16).
    Together: the votes concentrate, a candidate runs its tokens, and the generation's time at the
    paper's scale can be measured — the compute per query is unchanged; the text means nothing."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from models.backbones import minilm_path

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11008 // 4096, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=32, max_position_embeddings=4096, vocab_size=30522, pad_token_id=0,
                      bos_token_id=101, eos_token_id=102, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        if logit_scale != 1.0:
            with torch.no_grad():
                model.lm_head.weight.mul_(logit_scale)
        if embed_scale != 1.0:
            with torch.no_grad():
                model.model.embed_tokens.weight.mul_(embed_scale)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
    tok.save_pretrained(folder)
    for f in ("vocab.txt",):
        if (minilm_path() / f).exists():
            shutil.copy(minilm_path() / f, Path(folder) / f)
    print(f"random Llama-2-7B-shaped model: {n / 1e9:.2f} B parameters, {layers} layers, bf16, saved to {folder}")


def minilm_cast(src: str, dst: str, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(src)
    dt = getattr(torch, dtype)
    save_file({k: (v.to(dt) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}, dst,
              metadata={"format": "pt"})
    print(f"{len(tensors)} tensors → {dtype}: {dst}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    cmd, *args = sys.argv[1:]
    if cmd == "record":
        record(*args)
    elif cmd == "llama7b":
        opts = dict(zip(args[1::2], args[2::2]))  # --layers N --hidden H (smaller shapes: checks on CPU)
        llama7b(args[0], int(opts.get("--layers", 32)), int(opts.get("--hidden", 4096)),
                float(opts.get("--logit-scale", 1.0)), float(opts.get("--embed-scale", 1.0)))
    elif cmd == "minilm-fp16":
        minilm_cast(args[0], args[1], "float16")
    elif cmd == "minilm-fp32":
        minilm_cast(args[0], args[1], "float32")
    else:
        raise SystemExit(__doc__)
