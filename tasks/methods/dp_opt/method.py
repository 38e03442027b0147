"""DP-OPT (Hong et al. 2024) and its baselines: a local causal LM writes a DISCRETE prompt.

* ``dp_opt``: Algorithm 1/2 — per token a fresh Poisson subsample of the generation rows at rate
  q = J·k/n, each sampled row joining one of the J members (meta-prompts) on its own, so one
  record changes at most one member's demos and so at most one vote (moved, added or removed:
  the neighbours LimitedDomain is proved for); backward template with x, y and ŷ from the forward
  pass; each member proposes its next token; the vote histogram goes through LimitedDomain (ε0,
  δ0; ⊥ retries once, two ⊥ end the prompt); N candidates and the initial instruction (public: it
  costs nothing and the run never publishes below it; ``prompt.source`` says which won); DP-argmax
  on the correct-counts of the WHOLE holdout (one record moves each count by at most one; disjoint from generation: parallel
  composition). Generation stops before the target ε would be exceeded. δ defaults to
  min(1e-5, 1/(10n)) like every method (the paper's δ = 1/n permits publishing a record).
* ``opt``: the same ensemble with demos drawn once per prompt and a plain majority vote (ε = ∞);
  the initial instruction competes in its selection too.
* ``dln1``: one meta-prompt per candidate, sampled; selection (the initial instruction among the
  candidates) by validation log-likelihood.
* ``icl``: the initial instruction with k class-balanced demos (private text: never published).
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field, model_validator

from ...schema import Block
from .. import register_method
from ..base import Choice, Extras, Mechanism, MethodPlan, MethodSpec, Trained, Traits, budget, dp_unless_debug, settings_of


class OptConfig(Block):
    enabled: bool = Field(False, description="run as a baseline beside the published method")
    instruction: str | None = Field(None, description="initial instruction (default: the paper's Table 6 for "
                                                      "sst2/trec)")
    meta_prompts: int = Field(32, gt=0, description="J: meta-prompts (ensemble members) per token")
    demos: int = Field(5, gt=0, description="k: demos per meta-prompt (dp_opt: expected demos per member, "
                                            "each sampled record joins one member; at most 2k shown)")
    max_new_tokens: int = Field(30, gt=0)
    candidates: int = Field(4, gt=0, description="N: candidate prompts, one selected on validation rows")
    temperature: float = Field(0.0, ge=0, description="proposal temperature of each member (0: greedy)")

    @model_validator(mode="before")
    @classmethod
    def _no_validation_size(cls, data):
        if isinstance(data, dict) and "validation_size" in data:
            raise ValueError("validation_size was removed: a subset of the holdout picked by size depends on "
                             "every record, so the selection scores the whole holdout; size it with "
                             "data.holdout_fraction")
        return data


class DPOptConfig(OptConfig):
    epsilon0: float = Field(1.8, gt=0, description="ε0 of each LimitedDomain token query")
    delta0: float = Field(5e-7, gt=0, lt=1, description="δ0 of each LimitedDomain token query")
    k_bar: int = Field(10, gt=0, description="LimitedDomain's k̄")


class ICLConfig(Block):
    enabled: bool = False
    instruction: str | None = None
    demos: int = Field(5, gt=0, description="class-balanced demos in the prompt")


def _instruction(cfg, block) -> str:
    from .templates import initial_instruction

    return block.instruction or initial_instruction(cfg.data.name)


def _generation_rate(block, n: int) -> float:
    q = block.meta_prompts * block.demos / n
    if q > 1:
        from ...errors import ConfigError

        raise ConfigError(f"dp_opt needs meta_prompts × demos = {block.meta_prompts * block.demos} ≤ the "
                          f"{n} generation rows (Poisson rate q = J·k/n ≤ 1)")
    return q


def member_demos(rng: np.random.Generator, n: int, q: float, members: int, cap: int,
                 units: np.ndarray | None = None) -> list[np.ndarray]:
    """One query's meta-prompts from ``n`` rows: each row draws its own pair of uniforms (u, v)
    from ``rng`` (the run's secret sampling stream); it is sampled when u < q (Poisson at rate q,
    what the accountant assumes), joins member ⌊u/q·J⌋ (uniform over the J ``members``), and v
    orders a member's rows, of which the first ``cap`` are its demos. A member without rows
    casts no vote (its entry is empty). So a row's part depends on its own draws only: adding or removing one record
    changes at most one member's demos — one vote moved, added or removed, the neighbours
    LimitedDomain is proved for. (Cutting one shuffled subsample into groups of k, as before,
    let one record shift every later group.)

    ``units`` ((n,) unit index 0..U-1 per row, a user privacy unit): the UNITS draw (u, v), each
    sampled unit joins one member with all its rows (ordered by the unit's v, then by row), so
    adding or removing a whole unit changes at most one member's demos — one vote per unit."""
    if units is not None:
        units = np.asarray(units, dtype=np.int64)
        n_units = int(units.max()) + 1 if units.size else 0
        uu = rng.random((n_units, 2))
        joined_units = uu[:, 0] < q
        joined = np.flatnonzero(joined_units[units])
        unit_member = np.minimum((uu[:, 0] / q * members).astype(np.int64), members - 1)
        member = unit_member[units[joined]]
        order = np.lexsort((joined, uu[units[joined], 1], member))  # by member, then the unit's v, then row
        bounds = np.searchsorted(member[order], np.arange(members + 1))
        return [joined[order[bounds[j]:bounds[j + 1]]][:cap] for j in range(members)]
    u = rng.random((n, 2))
    joined = np.flatnonzero(u[:, 0] < q)
    member = np.minimum((u[joined, 0] / q * members).astype(np.int64), members - 1)
    order = np.lexsort((u[joined, 1], member))  # by member, then by v
    bounds = np.searchsorted(member[order], np.arange(members + 1))
    return [joined[order[bounds[j]:bounds[j + 1]]][:cap] for j in range(members)]


def _worst_case_queries(block) -> int:
    """Per candidate, each token takes at most two queries (one ⊥ retry), plus a final ⊥ pair."""
    return block.candidates * (2 * block.max_new_tokens + 2)


def _selection_epsilon(target: float, fits) -> float:
    """The DP-argmax's ε: the target, lowered by PLD grid steps until ``fits(ε)`` — the run's whole
    event (generation ∥ selection) within the target by the accountant that answers for it. Alone,
    the selection is answered by min(PLD, RDP); in parallel with the generation, whose RDP is
    unproven, by PLD alone, whose (pessimistic, discretised) answer for a pure-ε mechanism can sit
    one grid step above it (ε = 0.92904 answered 0.92909 on the 1e-4 grid: a plan the check against
    its target refused at ε = 1 and 3)."""
    epsilon = float(target)
    for _ in range(50):
        if fits(epsilon):
            return epsilon
        epsilon -= 1e-4 * max(1.0, target)
    raise RuntimeError(f"dp_opt: no DP-argmax ε within {target:g} on the accountant's grid")


def _events(block, q: float, queries: int, selection_epsilon: float):
    from .events import generation_event, run_event, selection_event

    generation = generation_event(block.epsilon0, block.delta0, q, max(1, queries))
    return run_event(generation, selection_event(selection_epsilon))


def check_text_method(cfg, generates: bool) -> None:
    """A discrete-prompt method's checks that need no private data: the local model is a causal
    LM (methods that generate) and the label words " <label>" have distinct first tokens on it
    (the forward pass scores them); the target's classifier builds for the evaluation."""
    from ...errors import ConfigError
    from ..base import check_classifier, explain_classifier_error

    if generates:
        from .text_prompts import engine_for, label_words

        engine = engine_for(cfg)
        ids = []
        for word in label_words(cfg):
            toks = engine.ids(word)
            if not toks:
                raise ConfigError(explain_classifier_error(ValueError(f"label word {word!r} gives no tokens"),
                                                           cfg.models.local, "models.local"))
            ids.append(toks[0])
        if len(set(ids)) != len(ids):
            raise ConfigError(f"data.labels on models.local={cfg.models.local!r}: the label words "
                              f"{label_words(cfg)!r} share a first token ({ids}); the forward pass scores each "
                              "label by its first token: rename the labels (data.label_map) so they differ")
    check_classifier(cfg, cfg.models.target_name, "models.target")


def check_token_room(cfg, name: str, block, rows: int) -> None:
    """Before any private read: on a model with a bounded context, a meta-prompt of ``rows`` demos
    and the forward pass (under the initial instruction, and under a candidate of ``max_new_tokens``
    tokens) leave room for a private text; one line naming the settings otherwise."""
    from ...errors import ConfigError
    from ...methodkit.token_budget import MIN_TEXT_TOKENS
    from .templates import eval_prefix
    from .text_prompts import engine_for, forward_text_budget, meta_text_budget

    engine = engine_for(cfg)
    instruction = _instruction(cfg, block)
    meta_text_budget(engine, cfg, instruction, rows, block.max_new_tokens, name)
    bare = forward_text_budget(engine, cfg, None)
    if bare is None:
        return
    room = min(forward_text_budget(engine, cfg, instruction),
               bare - len(engine.ids(eval_prefix("x"))) - block.max_new_tokens)
    if room < MIN_TEXT_TOKENS:
        raise ConfigError(f"{name}: the instruction or max_new_tokens={block.max_new_tokens} leave no room for a text "
                          f"in the forward template within models.local's context ({room} tokens); shorten them")


def target_model(cfg, prepared) -> str:
    return cfg.models.target_name


TEXT_EXTRAS = Extras(published_model=target_model)


class _TextMethod(Mechanism):
    """A discrete prompt generated by an ensemble of the local LM (the spec's prompt kind: text),
    selected on the holdout (``uses_validation``), used on ``models.target``."""

    rows_per_demo = 1  # a meta-prompt holds up to rows_per_demo × demos private rows

    def preflight(self, cfg, prepared) -> None:
        check_text_method(cfg, generates=True)
        block = settings_of(cfg, self)
        check_token_room(cfg, self.spec.name, block, self.rows_per_demo * block.demos)

    def chosen(self, mctx, plan, metrics: dict) -> Choice:
        """The run record says whether the published prompt is a generated candidate or the
        initial instruction, or no instruction at all (``prompt.source``: generated | initial | none)."""
        from .text_prompts import PROMPT_SOURCE, source_of

        source = source_of(metrics)
        if source is None:
            return Choice()
        # a baseline beside the published method says it under its own name (one parent, one param each)
        name = self.spec.name
        key = PROMPT_SOURCE if name == mctx.cfg.method else f"audit.baseline.{name}.{PROMPT_SOURCE}"
        return Choice({key: source}, {}, {PROMPT_SOURCE: source})

    def _select_rows(self, rows, seed):
        """(generation rows, selection rows): the partition's train and its WHOLE holdout. No
        subset by size (it would depend on every record): one record changes each candidate's
        correct-count by at most one. Audit shadows, which have no holdout, split their pool."""
        from .text_prompts import split_validation

        return split_validation(rows, 0.2, seed)


class DPOpt(_TextMethod):
    rows_per_demo = 2  # each member shows at most 2k of its Poisson-sampled rows

    def guarantee(self, cfg):
        return dp_unless_debug(cfg)

    def plan(self, cfg, n_train, delta, epsilon=None):
        from privacy import accountant as acct

        block = settings_of(cfg, self)
        epsilon = budget(cfg, epsilon)
        q = _generation_rate(block, n_train)
        affordable = acct.max_limited_domain_queries(epsilon, delta, block.epsilon0,
                                                     block.delta0, q, limit=_worst_case_queries(block))
        if affordable < 1:
            from ...errors import ConfigError

            raise ConfigError(f"dp_opt: ε={epsilon:g} at δ={delta:g} affords no LimitedDomain "
                              f"query with ε0={block.epsilon0:g}, δ0={block.delta0:g}, q={q:.4g}")
        guarantee = self.guarantee(cfg)
        selection_epsilon = _selection_epsilon(
            epsilon, lambda s: acct.spend(_events(block, q, affordable, s), delta).epsilon <= epsilon)
        settings = {"sample_rate": q, "max_queries": affordable, "selection_epsilon": selection_epsilon}
        return MethodPlan(
            self.spec.name, guarantee, n_train, delta,
            event=_events(block, q, affordable, selection_epsilon) if guarantee == "dp" else None,
            params={"dpopt.eps0": block.epsilon0, "dpopt.delta0": block.delta0, "dpopt.sample_rate": q,
                    "dpopt.max_queries": affordable, "dpopt.meta_prompts": block.meta_prompts,
                    "dpopt.demos": block.demos, "dpopt.candidates": block.candidates,
                    "dpopt.max_new_tokens": block.max_new_tokens,
                    "dpopt.selection_epsilon": selection_epsilon,
                    **({"dpopt.sampled": "units", "dpopt.selection_count": "mean correct per unit"}
                       if cfg.data.user_unit else {})},
            settings=settings,
            note="generation (LimitedDomain on Poisson subsamples of the training rows) and DP-argmax selection "
                 "(on the disjoint holdout rows) compose in parallel")

    def train(self, mctx, plan, rows, progress=None):
        from .templates import backward_head
        from privacy.mechanisms import dp_argmax

        from .text_prompts import correct_counts, engine_for, source_metric, with_initial

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        gen, val = self._select_rows(rows, mctx.seed)
        engine = engine_for(cfg)
        instruction = _instruction(cfg, block)
        # secret DP streams: sampling, the mechanisms, the members' sampled proposals
        sampling, mechanism, proposing = (mctx.randomness.numpy(i) for i in (1, 2, 3))
        proposer = _Proposer(engine, cfg, block, instruction, gen, sampling, mechanism, plan.settings["sample_rate"])
        out = proposer.candidates(engine.encode_prefix(backward_head(instruction)), plan.settings["max_queries"],
                                  proposing, progress)
        # the initial instruction is always a candidate (public: the same DP-argmax event), so the
        # selection can publish it when every generated one scores worse
        candidates = with_initial(out["candidates"], instruction)
        if len(candidates) > 1:
            counts = correct_counts(engine, cfg, candidates, val.texts, val.labels, _unit_array(cfg, val))
            chosen = candidates[dp_argmax(counts, plan.settings["selection_epsilon"], mechanism)]
        else:  # nothing generated: the (data-independent) initial instruction is the only candidate
            chosen = instruction
        from models.prompts import TextPrompt

        queries = out["queries"]
        event = (_events(block, plan.settings["sample_rate"], queries, plan.settings["selection_epsilon"])
                 if plan.guarantee == "dp" else None)
        # how many distinct training rows the meta-prompts drew: nearly the exact n_train, so it stays
        # in the private history (a review found it published beside ε)
        return Trained(TextPrompt(chosen), event, queries, {**_train_metrics(out), **source_metric(chosen, instruction)},
                       [{"forward_rows": len(proposer.yhat)}],
                       audit_metrics=_leakage(cfg, out["candidates"], gen.texts, progress))


class _Proposer:
    """DP-OPT's generation side: meta-prompts of Poisson-sampled demos (each row labelled ŷ under the
    initial instruction the first time it is drawn), next tokens by LimitedDomain top-1 over the
    members' proposals."""

    def __init__(self, engine, cfg, block, instruction: str, gen, sampling, mechanism, q: float):
        from .text_prompts import meta_text_budget

        self.engine, self.cfg, self.block, self.instruction, self.gen = engine, cfg, block, instruction, gen
        self.sampling, self.mechanism, self.q = sampling, mechanism, q
        self.gen_units = _unit_array(cfg, gen)
        # forward pass (ŷ: the label each row gets under the initial instruction), computed the first
        # time a row is drawn into a meta-prompt: ŷ of a row depends on that row alone, so this is the
        # same mechanism as labelling every row up front, without the rows that are never drawn
        self.yhat: dict[int, str] = {}
        # each private text of a meta-prompt (at most 2k rows) within a public token budget
        self.text_tokens = meta_text_budget(engine, cfg, instruction, 2 * block.demos, block.max_new_tokens)

    def label_new(self, idx) -> None:
        """ŷ of the rows of ``idx`` not labelled yet, each a function of that row alone
        (``rowwise``): batched as :meth:`CausalEngine.last_logits` batches, a row's ŷ could flip at a
        near-tie with its companions (float rounding with padding) and, cached, move a vote of a later
        query that one of them is not in."""
        from .text_prompts import predictions

        new = sorted({int(i) for i in idx} - self.yhat.keys())
        self.yhat.update(zip(new, predictions(self.engine, self.cfg, self.instruction,
                                              [self.gen.texts[i] for i in new], rowwise=True)))

    def demos_of(self, idx) -> list[tuple[str, str, str]]:
        gen = self.gen
        self.label_new(idx)
        return [(gen.texts[i], gen.labels[i], self.yhat[int(i)]) for i in idx]

    def draw_bodies(self) -> list[list[int]]:
        from .text_prompts import body_ids

        block = self.block
        members = [idx for idx in member_demos(self.sampling, len(self.gen), self.q, block.meta_prompts,
                                               2 * block.demos, self.gen_units) if idx.size]
        self.label_new(np.concatenate(members) if members else [])  # the query's new rows in one pass
        return [body_ids(self.engine, self.demos_of(idx), self.text_tokens) for idx in members]

    def select(self, counts: np.ndarray):
        from privacy.mechanisms import limited_domain_top1

        return limited_domain_top1(counts, self.block.epsilon0, self.block.delta0, self.mechanism,
                                   k_bar=self.block.k_bar, l0_sensitivity=2, domain_size=len(counts))

    def candidates(self, prefix, budget: int, proposing, progress) -> dict:
        """Up to ``block.candidates`` instructions within ``budget`` LimitedDomain queries, and
        the generation's counts (queries, bottoms, tokens, stop reasons)."""
        import torch

        from .generate import dp_generate
        from .text_prompts import decode

        block = self.block
        used = {"queries": 0}
        candidates, bottoms, tokens, stops = [], 0, 0, {}

        def new_generator():  # fresh per query, from the secret stream
            return torch.Generator().manual_seed(int(proposing.integers(2**63)))
        for c in range(block.candidates):
            out = dp_generate(self.engine, prefix, self.draw_bodies, self.select,
                              lambda n: used["queries"] + n <= budget, block.max_new_tokens,
                              temperature=block.temperature, new_generator=new_generator,
                              progress=None if progress is None else
                              (lambda t, total, c=c: progress(c * total + t, block.candidates * total)))
            used["queries"] += out.queries
            bottoms, tokens = bottoms + out.bottoms, tokens + len(out.tokens)
            stops[out.stop_reason] = stops.get(out.stop_reason, 0) + 1
            text = decode(self.engine, out.tokens)
            if text:
                candidates.append(text)
            if out.stop_reason == "budget":
                break
        return {"candidates": candidates, "queries": used["queries"], "bottoms": bottoms, "tokens": tokens,
                "stops": stops}


def _train_metrics(out: dict) -> dict:
    queries, candidates = out["queries"], out["candidates"]
    return {"dpopt.queries": queries, "dpopt.bottoms": out["bottoms"],
            "dpopt.bottom_rate": out["bottoms"] / queries if queries else 0.0, "dpopt.tokens": out["tokens"],
            "dpopt.candidates_nonempty": len(candidates), "dpopt.fallback_initial": float(not candidates),
            **{f"dpopt.stops.{k}": v for k, v in out["stops"].items()}}


def _unit_array(cfg, rows) -> np.ndarray | None:
    """(n,) unit index per row with a user privacy unit (None: every row is its own unit); rows
    without units under a user unit are refused (their ε would be per record)."""
    if not cfg.data.user_unit:
        return None
    index = rows.unit_index()
    if index is None:
        raise RuntimeError(f"data.privacy_unit is {cfg.data.privacy_unit!r} but DP-OPT's rows carry no units")
    return np.asarray(index[0], dtype=np.int64)


def _leakage(cfg, candidates: list[str], private_texts: list[str], progress=None) -> dict[str, float]:
    """Exact and near copies of private training texts in the generated candidates (local)."""
    from .leakage import leakage_report
    from models.backbones import load_backbone

    if not candidates:
        return {"audit.leakage.exact_copies": 0.0, "audit.leakage.prompts": 0.0}
    return leakage_report(candidates, private_texts, load_backbone("minilm"), progress=progress)


def _fixed_bodies(engine, cfg, block, rows, instruction, seed, how_many):
    """Non-private baselines: demos drawn once per prompt (seeded), bodies for ``how_many`` members."""
    from .text_prompts import body_ids, meta_text_budget, predictions

    rng = np.random.default_rng(seed)
    idx = rng.choice(len(rows), size=min(len(rows), how_many * block.demos), replace=False)
    texts, labels = [rows.texts[i] for i in idx], [rows.labels[i] for i in idx]
    yhat = predictions(engine, cfg, instruction, texts)
    demos = list(zip(texts, labels, yhat))
    tokens = meta_text_budget(engine, cfg, instruction, block.demos, block.max_new_tokens, "opt")
    return [body_ids(engine, demos[g * block.demos:(g + 1) * block.demos], tokens)
            for g in range(len(demos) // block.demos)]


class Opt(_TextMethod):
    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta, epsilon=None):
        return MethodPlan(self.spec.name, "none", n_train, delta, note="OPT: non-private ensemble generation (ε = ∞)")

    def _generate(self, mctx, rows, members: int, temperature: float):
        import torch

        from .generate import ensemble_generate
        from .templates import backward_head

        from .text_prompts import decode, engine_for

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        engine = engine_for(cfg)
        instruction = _instruction(cfg, block)
        head = list(engine.tok(backward_head(instruction), add_special_tokens=True)["input_ids"])
        generator = torch.Generator().manual_seed(mctx.seed)
        out = []
        for c in range(block.candidates):
            bodies = _fixed_bodies(engine, cfg, block, rows, instruction, mctx.seed * 1000 + c, members)
            if bodies:
                res = ensemble_generate(engine, head, bodies, block.max_new_tokens, temperature, generator)
                text = decode(engine, res.tokens)
                if text:
                    out.append(text)
        return engine, out, instruction

    def train(self, mctx, plan, rows, progress=None):
        from models.prompts import TextPrompt

        from .text_prompts import correct_counts, source_metric, with_initial

        block = settings_of(mctx.cfg, self)
        gen, val = self._select_rows(rows, mctx.seed)
        engine, generated, instruction = self._generate(mctx, gen, block.meta_prompts, block.temperature)
        candidates = with_initial(generated, instruction)  # the initial instruction always competes
        best = candidates[int(np.argmax(correct_counts(engine, mctx.cfg, candidates, val.texts, val.labels)))]
        return Trained(TextPrompt(best), None, len(candidates),
                       {"opt.candidates": len(candidates), **source_metric(best, instruction)},
                       audit_metrics=_leakage(mctx.cfg, generated, gen.texts, progress))


class DLN1(Opt):
    def plan(self, cfg, n_train, delta, epsilon=None):
        return MethodPlan(self.spec.name, "none", n_train, delta, note="DLN-1: non-private (ε = ∞)")

    def train(self, mctx, plan, rows, progress=None):
        from models.prompts import TextPrompt

        from .text_prompts import label_loglik, source_metric, with_initial

        block = settings_of(mctx.cfg, self)
        gen, val = self._select_rows(rows, mctx.seed)
        # one meta-prompt per candidate, sampled (Algorithm 3), selection by log-likelihood; the
        # initial instruction always competes
        engine, generated, instruction = self._generate(mctx, gen, 1, max(block.temperature, 0.7))
        candidates = with_initial(generated, instruction)
        best = candidates[int(np.argmax(label_loglik(engine, mctx.cfg, candidates, val.texts, val.labels)))]
        return Trained(TextPrompt(best), None, len(candidates),
                       {"dln1.candidates": len(candidates), **source_metric(best, instruction)},
                       audit_metrics=_leakage(mctx.cfg, generated, gen.texts, progress))


class ICL(Mechanism):
    def preflight(self, cfg, prepared) -> None:
        check_text_method(cfg, generates=False)

    def guarantee(self, cfg):
        return "none"

    def plan(self, cfg, n_train, delta, epsilon=None):
        return MethodPlan(self.spec.name, "none", n_train, delta,
                          note="ICL: private demos in the prompt; no guarantee, never published")

    def train(self, mctx, plan, rows, progress=None):
        from models.prompts import TextPrompt

        from ...methodkit.token_budget import clip_words

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        rng = np.random.default_rng(mctx.seed)
        per_label = math.ceil(block.demos / len(cfg.data.labels))
        picked = []
        for label in cfg.data.labels:  # class-balanced
            idx = [i for i, l in enumerate(rows.labels) if l == label]
            picked += list(rng.choice(idx, size=min(per_label, len(idx)), replace=False))
        picked = [int(i) for i in rng.permutation(picked)[: block.demos]]
        demos = "\n\n".join(f"Input: {clip_words(rows.texts[i])}\nOutput: {rows.labels[i]}" for i in picked)
        instruction = (block.instruction or _instruction(cfg, block)) + "\n\n" + demos
        return Trained(TextPrompt(instruction), None, 0, {"icl.demos": len(picked)})


# a unit's rows join one member per query (one vote per unit), and the selection scores each unit by
# its rows' mean correctness (at most one per unit per candidate); what the neighbour harness checks
# (neighbour_stats.py): the votes and the DP-argmax's counts. Its DP-argmax already chooses among the
# generated instructions, the initial one and none (the empty instruction) on the holdout: a second
# comparison would spend ε for what it decided
DP_OPT = register_method(MethodSpec(
    name="dp_opt", config_class=DPOptConfig, mechanism=DPOpt(), prompt_kind="text", label="DP-OPT",
    traits=Traits(uses_validation=True, unit_level=True, compares_with_no_prompt=True,
                  neighbour_statistics=("dp_opt_votes", "dp_opt_selection_counts"),
                  test_settings={"meta_prompts": 2, "demos": 2, "max_new_tokens": 3, "candidates": 2,
                                 "epsilon0": 4.0, "delta0": 1e-8}),
    extras=TEXT_EXTRAS))
_OPT_TRAITS = Traits(uses_validation=True, test_settings={"meta_prompts": 2, "demos": 2, "max_new_tokens": 3,
                                                          "candidates": 2})
OPT = register_method(MethodSpec(name="opt", config_class=OptConfig, mechanism=Opt(), prompt_kind="text",
                                 label="OPT (ε = ∞)", traits=_OPT_TRAITS, extras=TEXT_EXTRAS))
DLN_1 = register_method(MethodSpec(name="dln1", config_class=OptConfig, mechanism=DLN1(), prompt_kind="text",
                                   label="DLN-1", traits=_OPT_TRAITS, extras=TEXT_EXTRAS))
ICL_BASELINE = register_method(MethodSpec(name="icl", config_class=ICLConfig, mechanism=ICL(), prompt_kind="text",
                                          label="ICL (5 demos)", traits=Traits(test_settings={"demos": 2}),
                                          extras=TEXT_EXTRAS))
