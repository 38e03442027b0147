"""One-time methods' published prompts at two targets on the same queries as the dp_icl comparison (issue 38).

    python bench/endpoint_target.py --out docs/results/dp_icl/two_targets --queries 100 \
        --prompt dp_opt_seed0=RUN_ARTIFACTS/prompt/dp_opt.json --prompt dp_fewshot=…/prompt/dp_fewshot.json \
        --serve-model /tmp/smollm2_hf

Each published text prompt (a DP-OPT instruction, dp_fewshot's generated demonstrations: public outputs of
runs, read from their MLflow artifacts) and zero-shot (no prompt) answer the first ``--queries`` SST-2 test
sentences on
* the local target: SmolLM2-135M-Instruct in this process, the label whose first token has the larger
  next-token logit (the flows' scoring);
* the endpoint target: an OpenAI-compatible ``/v1/completions`` server reached over HTTP through the flows'
  client (models/prompts/endpoint.py) — ``transformers serve`` on a local folder of the same weights
  (``--serve-model``: it returns no log-probabilities, the label is read from the generated text), llama.cpp's
  server on SmolLM2's GGUF file itself (``--serve-gguf``, from ``llama-cpp-python[server]`` in ``--llama-python``:
  log-probabilities, and with ``--label-bias`` the labels' first token ids sent as logit_bias, so the one token
  generated is the label of largest log-probability, as the local target reads it), or any running server
  (``--base-url``); each started by this script is stopped by it.

    python bench/endpoint_target.py --task trec --queries 50 --serve-gguf --label-bias \
        --llama-python /tmp/llamavenv/bin/python --instruction dp_opt_eps1="Read the following" --out …

``--instruction NAME=TEXT``: a published DP-OPT instruction given by its text (as the run printed it).
Only the published prompt and public test sentences are sent; dp_icl cannot be a remote target (its every
prompt holds private rows). Every (prompt, target) is one MLflow run; the table and figure are built from them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXPERIMENT = "one_time_two_targets"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results/dp_icl/two_targets")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--task", default="sst2", help="sst2, trec or agnews (templates and labels of compare_dp_icl)")
    ap.add_argument("--prompt", action="append", default=[], metavar="NAME=PATH", help="a published prompt artifact")
    ap.add_argument("--instruction", action="append", default=[], metavar="NAME=TEXT",
                    help="a published DP-OPT instruction, by its text")
    ap.add_argument("--epsilon", action="append", default=[], metavar="NAME=EPS",
                    help="the ε its run published, for a prompt given by --instruction")
    ap.add_argument("--report-only", action="store_true", help="the table and figure again from MLflow")
    ap.add_argument("--serve-model", default=None, help="a local model folder to serve with transformers serve")
    ap.add_argument("--serve-gguf", action="store_true", help="serve SmolLM2's GGUF with llama.cpp's server")
    ap.add_argument("--llama-python", default=None, help="the interpreter holding llama-cpp-python[server]")
    ap.add_argument("--label-bias", action="store_true", help="send the labels' first token ids as logit_bias")
    ap.add_argument("--base-url", default=None, help="an OpenAI-compatible server already running")
    ap.add_argument("--model-name", default=None, help="the model name sent (default: --serve-model)")
    ap.add_argument("--tracking-uri", default="sqlite:////tmp/one_time_two_targets.db")
    ap.add_argument("--data-root", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    a = ap.parse_args()
    import mlflow
    import numpy as np

    from models.backbones import load_backbone
    from models.backbones import smollm2_gguf_path
    from models.prompts.endpoint import CompletionsClient, predict_labels, serve_folder, serve_gguf
    from models.prompts.text import TextPrompt
    from tasks.methodkit.causal_engine import CausalEngine
    from tasks.prompts import load_prompt_file

    from compare_dp_icl import TASKS

    TEMPLATE, LABELS = TASKS[a.task]["template"], TASKS[a.task]["labels"]
    test = [json.loads(line) for line in (Path(a.data_root) / a.task / "test.jsonl").read_text().splitlines()[:a.queries]]
    texts, truth = [r["text"] for r in test], [r["label"] for r in test]
    prompts = {"zero_shot": (None, {})}
    for name, path in (p.split("=", 1) for p in a.prompt):
        prompts[name] = (load_prompt_file(path), json.loads(Path(path).read_text()).get("metadata", {}))
    epsilons = dict(p.split("=", 1) for p in a.epsilon)
    for name, text in (p.split("=", 1) for p in a.instruction):
        prompts[name] = (TextPrompt(text), {"privacy.epsilon": epsilons[name]} if name in epsilons else {})
    mlflow.set_tracking_uri(a.tracking_uri)
    mlflow.set_experiment(EXPERIMENT)
    if a.report_only:
        return write(Path(a.out), mlflow, len(texts), a.task)
    bb = load_backbone("smollm2", device="cpu")
    engine = CausalEngine(bb.model, bb.tokenizer, max_batch=16)
    label_ids = [engine.ids(" " + label)[0] for label in LABELS]
    if a.serve_gguf:
        (proc, url), served = serve_gguf(smollm2_gguf_path(), alias="smollm2", python=a.llama_python), "smollm2"
        target_name = "endpoint (llama.cpp" + (", label bias)" if a.label_bias else ", log-probabilities)")
    else:
        proc, url = serve_folder(a.serve_model) if a.serve_model else (None, a.base_url)
        served = a.model_name or a.serve_model or "any"
        target_name = "endpoint (transformers serve)" if a.serve_model else f"endpoint ({url})"
    client = CompletionsClient(url, served, batch_size=16, timeout_s=300, top_logprobs=20 if a.serve_gguf else 5,
                               label_token_ids=label_ids if a.label_bias else None)
    results = []
    try:
        for name, (prompt, meta) in prompts.items():
            template = prompt.template(TEMPLATE) if prompt is not None else TEMPLATE
            filled = [template.replace("{text}", t) for t in texts]
            t0 = time.perf_counter()
            local = [LABELS[int(engine.last_logits([engine.ids(f)])[0][label_ids].argmax())] for f in filled]
            t1 = time.perf_counter()
            picks = predict_labels(client.complete(filled), [" " + label for label in LABELS], text_first=client.biased)
            t2 = time.perf_counter()
            remote = [LABELS[p] if p is not None else None for p in picks]
            for target, answers, wall in (("local SmolLM2", local, t1 - t0), (target_name, remote, t2 - t1)):
                acc = float(np.mean([x == y for x, y in zip(answers, truth)]))
                row = {"prompt": name, "target": target, "accuracy": acc, "unparsed": answers.count(None), "wall_s": wall}
                results.append(row)
                with mlflow.start_run(run_name=f"{a.task}:{name}@{target}"):
                    mlflow.log_params({"task": a.task, "prompt": name, "target": target, "queries": len(texts), **{
                        k: v for k, v in meta.items() if k.startswith("privacy.")}})
                    mlflow.log_metrics({"accuracy": acc, "unparsed": float(row["unparsed"]), "wall_s": wall})
                print(f"{name} @ {target}: {acc:.3f} ({row['unparsed']} unparsed, {wall:.0f} s)", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    write(Path(a.out), mlflow, len(texts), a.task)


def write(out: Path, mlflow, n: int, task: str) -> None:
    """The table and figure of ``task`` from MLflow's runs of this experiment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frame = mlflow.search_runs(experiment_names=[EXPERIMENT], order_by=["attributes.start_time ASC"])
    rows, epsilon = {}, {}
    for _, r in frame.iterrows():
        run_task = r.get("params.task")
        if (run_task if isinstance(run_task, str) else "sst2") != task:  # runs before --task were SST-2's
            continue
        rows[(r["params.prompt"], r["params.target"])] = (r["metrics.accuracy"], r["metrics.unparsed"])
        if isinstance(r.get("params.privacy.epsilon"), str):  # the prompt's own ε (zero-shot has none)
            epsilon[r["params.prompt"]] = float(r["params.privacy.epsilon"])
    names = list(dict.fromkeys(k[0] for k in rows))
    targets = list(dict.fromkeys(k[1] for k in rows))
    lines = ["| published prompt | ε | " + " | ".join(f"accuracy @ {t}" for t in targets) + " |",
             "|---|---:|" + "---:|" * len(targets)]
    for name in names:
        cells = [f"{rows[(name, t)][0]:.3f}" + (f" ({int(rows[(name, t)][1])} unparsed)" if rows[(name, t)][1] else "")
                 if (name, t) in rows else "–" for t in targets]
        lines.append(f"| {name} | {epsilon[name]:.3f} | " if name in epsilon else f"| {name} | 0 | ")
        lines[-1] += " | ".join(cells) + " |"
    out.mkdir(parents=True, exist_ok=True)
    table = "\n".join(lines)
    print(table)
    (out / f"table_{task}.md").write_text(f"{n} {task} test inputs (the dp_icl comparison's first queries)\n\n" + table + "\n")
    fig, ax = plt.subplots(figsize=(1.2 + 1.3 * len(names), 3.6))
    width = 0.8 / max(1, len(targets))
    for j, t in enumerate(targets):
        ax.bar([i + j * width for i in range(len(names))], [rows.get((nm, t), (0,))[0] for nm in names], width, label=t)
    ax.set_xticks([i + width * (len(targets) - 1) / 2 for i in range(len(names))], names, rotation=20, fontsize=7)
    ax.set_ylabel(f"accuracy ({n} {task} test inputs)"), ax.set_ylim(0, 1), ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"two_targets_{task}.png", dpi=120)


if __name__ == "__main__":
    main()
