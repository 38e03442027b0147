"""dp_fewshot (Tang et al., ICLR 2024): DP synthetic demonstrations for in-context learning; see
the package docstring for the mechanism and its neighbouring relation."""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ...methodkit.token_budget import clip_words
from ...schema import Block
from .. import register_method
from ..base import (Extras, Mechanism, MethodPlan, MethodSpec, Trained, Traits, budget, check_classifier,
                    dp_unless_debug, settings_of)

NEIGHBOURING = "add/remove one record (text and label); it lands in one subset of one (label, demo) group"


class DPFewShotConfig(Block):
    enabled: bool = Field(False, description="run as a baseline beside the published method")
    instruction: str | None = Field(None, description="instruction before the demonstrations (default: "
                                                      "'Classify the input text as <labels>.')")
    demos_per_label: int = Field(2, gt=0, description="D: demonstrations generated per label")
    subsets: int = Field(8, gt=0, description="M: disjoint private subsets voting on each demonstration")
    shots: int = Field(2, gt=0, description="N: at most this many private rows in each subset's prompt")
    max_new_tokens: int = Field(24, gt=0, description="T: tokens (DP queries) per demonstration, all charged")
    public_top_k: int = Field(100, ge=0, description="the query's domain: the public prompt's top-k next "
                                                     "tokens (0: the whole vocabulary)")


def default_instruction(cfg) -> str:
    labels = list(cfg.data.labels)
    names = labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " or " + labels[-1]
    return f"Classify the input text as {names}."


def generation_head(instruction: str) -> str:
    """The shared head of every generation prompt (encoded once, its KV reused)."""
    return f"{instruction}\nExamples, each a label and a text with that label:\n\n"


def subset_body(texts: list[str], label: str, clip=clip_words) -> str:
    """A subset's demonstrations, each text cut by ``clip`` (default: 48 words; a run also cuts each
    to the public token budget of :func:`demo_token_budget`)."""
    return "".join(f"Label: {label}\nText: {clip(t)}\n\n" for t in texts)


def label_header(label: str) -> str:
    """The open slot where a demonstration of ``label`` is generated."""
    return f"Label: {label}\nText:"


def demo_token_budget(engine, cfg, block, instruction: str) -> int | None:
    """Tokens each private text of a subset's prompt may take (None: the model states no bounded
    context): the shared head, ``shots`` demonstrations in their template, the label's open slot and
    ``max_new_tokens`` generated tokens always fit the model's context, whatever a record's length.
    Public (the model, the labels, the settings); settings that leave no room are refused."""
    from ...methodkit.token_budget import JUNCTION, SEAM, model_context, text_budget

    context = model_context(engine.model)
    if context is None:
        return None
    labels = list(cfg.data.labels)
    head = len(engine.tok(generation_head(instruction), add_special_tokens=True, verbose=False)["input_ids"])
    tail = max(len(engine.ids(label_header(label))) for label in labels) + block.max_new_tokens
    # a demo's template tokenized alone, + SEAM: inside a body the next demo's "Label" splits the closing
    # "\n\n" into two tokens on byte-level BPEs (one token per inner junction), + one spare
    overhead = max(len(engine.ids(subset_body([""], label))) for label in labels) + SEAM
    return text_budget(context, head + tail + JUNCTION, block.shots, overhead,
                       f"dp_fewshot: shots={block.shots}, max_new_tokens={block.max_new_tokens} and the instruction")


def icl_prompt(instruction: str, demos: list[tuple[str, str]]) -> str:
    """The published prompt: the instruction and the demonstrations in the ICL baseline's format."""
    return "\n\n".join([instruction] + [f"Input: {x}\nOutput: {y}" for x, y in demos if x])


def target_model(cfg, prepared) -> str:
    return cfg.models.target_name


class DPFewShot(Mechanism):
    def guarantee(self, cfg):
        return dp_unless_debug(cfg)

    def preflight(self, cfg, prepared) -> None:
        from ...methodkit.causal_engine import causal_engine_for

        engine = causal_engine_for(cfg)  # a causal local LM (one-line ConfigError otherwise)
        block = settings_of(cfg, self)
        demo_token_budget(engine, cfg, block, block.instruction or default_instruction(cfg))  # room for a demo
        check_classifier(cfg, cfg.models.target_name, "models.target")

    def plan(self, cfg, n_train, delta, epsilon=None):
        from privacy import accountant as acct

        from .events import generation_event

        block = settings_of(cfg, self)
        epsilon = budget(cfg, epsilon)
        sigma = acct.calibrate_noise_multiplier(epsilon, delta, 1.0, block.max_new_tokens)
        event = generation_event(sigma, block.max_new_tokens)
        guarantee = self.guarantee(cfg)
        return MethodPlan(
            self.spec.name, guarantee, n_train, delta, event=event if guarantee == "dp" else None,
            params={"dpfewshot.noise_multiplier": sigma, "dpfewshot.sensitivity": "sqrt(2) per query (one subset's "
                    "distribution)", "dpfewshot.neighbouring": NEIGHBOURING,
                    "dpfewshot.demos_per_label": block.demos_per_label, "dpfewshot.subsets": block.subsets,
                    "dpfewshot.shots": block.shots, "dpfewshot.max_new_tokens": block.max_new_tokens,
                    "dpfewshot.public_top_k": block.public_top_k},
            settings={"noise_multiplier": sigma},
            note="each (label, demonstration) group: T Gaussian queries on its own disjoint subsets (parallel "
                 "composition across groups); after publication, queries cost nothing")

    def train(self, mctx, plan, rows, progress=None):
        from models.prompts import TextPrompt

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        instruction = block.instruction or default_instruction(cfg)
        demos, stats = _Generator(mctx, block, instruction, plan.settings["noise_multiplier"]).run(rows, progress)
        from .events import generation_event

        # the method's own event (the plan handed to train may be the run's, whose event also holds
        # the released sizes: the door composes those itself)
        event = (generation_event(plan.settings["noise_multiplier"], block.max_new_tokens)
                 if plan.guarantee == "dp" else None)
        order = [(demos[label][d], label) for d in range(block.demos_per_label) for label in cfg.data.labels]
        copies = sum(1 for x, _ in order if len(x) >= 20 and any(x in t for t in rows.texts))
        return Trained(TextPrompt(icl_prompt(instruction, order)), event, int(stats["dpfewshot.queries"]), stats,
                       audit_metrics={"audit.leakage.exact_copies": float(copies)})


DP_FEWSHOT = register_method(MethodSpec(
    name="dp_fewshot", config_class=DPFewShotConfig, mechanism=DPFewShot(), prompt_kind="text",
    label="DP few-shot generation",
    # what the neighbour harness checks (neighbour_stats.py): each group's sum of distributions
    traits=Traits(neighbour_statistics=("dp_fewshot_sums",),
                  test_settings={"demos_per_label": 1, "subsets": 2, "shots": 1, "max_new_tokens": 3,
                                 "public_top_k": 20}),
    extras=Extras(published_model=target_model)))


class _Generator:
    """Every (label, demonstration) group of a run: its subsets from the secret keyed partition,
    its tokens from ``distribution_vote`` with the run's secret noise stream."""

    def __init__(self, mctx, block, instruction: str, sigma: float):
        from ...methodkit.causal_engine import causal_engine_for

        self.cfg, self.block = mctx.cfg, block
        self.engine = causal_engine_for(mctx.cfg)
        self.key = mctx.randomness.numpy(1).bytes(32)   # the partition's secret key
        self.noise = mctx.randomness.numpy(2)           # the aggregate's secret noise
        self.sigma = sigma
        self.prefix = self.engine.encode_prefix(generation_head(instruction))
        self.text_tokens = demo_token_budget(self.engine, mctx.cfg, block, instruction)  # public, per text

    def clip(self, text: str) -> str:
        """A private text within 48 words and the public token budget: a function of the text alone."""
        from ...methodkit.token_budget import clip_text

        return clip_text(self.engine, text, self.text_tokens)

    def vote(self, distributions) -> int:
        from privacy.mechanisms import distribution_vote

        return distribution_vote(distributions, self.sigma, self.noise)

    def run(self, rows, progress=None) -> tuple[dict[str, list[str]], dict[str, float]]:
        from .generate import generate_demo
        from ...methodkit.keyed_partition import keyed_subsets

        block, engine, labels = self.block, self.engine, list(self.cfg.data.labels)
        M, D = block.subsets, block.demos_per_label
        demos: dict[str, list[str]] = {label: [] for label in labels}
        stats = {"dpfewshot.queries": 0, "dpfewshot.tokens": 0, "dpfewshot.demos_nonempty": 0}
        for li, label in enumerate(labels):
            parts = keyed_subsets(rows.texts, rows.labels, label, self.key, D * M, block.shots)
            for d in range(D):
                group = parts[d * M:(d + 1) * M]
                # every subset is run, an empty one on the public empty body, and only the non-empty ones
                # vote: the forward passes (the published runtime) no longer count how many subsets a
                # label's rows fill (24 → 96 passes for 1 → 16 rows of a label)
                bodies = [engine.ids(subset_body([rows.texts[i] for i in part], label, self.clip)) for part in group]
                voting = np.array([bool(part) for part in group], dtype=bool)
                out = generate_demo(engine, self.prefix, bodies, engine.ids(label_header(label)),
                                    block.max_new_tokens, block.public_top_k,
                                    lambda distributions, voting=voting: self.vote(distributions[voting]))
                text = " ".join(engine.tok.decode(out.tokens, skip_special_tokens=True).split())
                demos[label].append(text)
                stats["dpfewshot.queries"] += out.queries
                stats["dpfewshot.tokens"] += len(out.tokens)
                stats["dpfewshot.demos_nonempty"] += int(bool(text))
                if progress is not None:
                    progress(li * D + d + 1, len(labels) * D)
        return demos, {k: float(v) for k, v in stats.items()}
