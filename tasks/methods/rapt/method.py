"""RAPT (Li et al.): local d_X privatization of every token, prompt tuning on the privatized
tokens with a privatized-token reconstruction head, inference on privatized inputs.

The guarantee is LOCAL (metric, d_X) privacy of each text, with parameter η (``rapt.eta``): no
(ε, δ) claim about the dataset (``privacy.guarantee=ldp``). Labels are not privatized, as in the
paper. The privatization runs on the local side (``privatize``); the model side (``tune``,
``infer``) receives only the privatized ids, written to the run's outputs and read back from
there. Each draw of private text actually made is a release, recorded in the ledger under its own
entry with its η before it is made (η adds up over the draws a text is in); a stored draw read
again is not. The attacks and the replacement share read the unprivatized text: their numbers
are audit statistics (``audit.*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from ...schema import Block
from ...state import digest_key
from .. import register_method
from ..base import Extras, Mechanism, MethodPlan, MethodSpec, Report, Trained, Traits, settings_of
from .report import METRICS, SECTIONS


class RaptConfig(Block):
    enabled: bool = False
    eta: float = Field(100.0, gt=0, description="d_X privacy parameter η (larger: less noise)")
    tuning: Literal["prompt", "prefix"] = Field("prompt", description="prompt: a soft prompt on the input "
                                                "embeddings; prefix: keys and values at every layer")
    reconstruction: bool = Field(True, description="the privatized-token reconstruction head (m plain tokens)")
    plain_tokens: int = Field(40, ge=1, description="m: plain tokens prepended before privatization")
    reconstruction_weight: float = Field(1.0, ge=0, description="λ in loss = task + λ · reconstruction (the "
                                         "paper's eq. 10: 1)")
    head_vocab: int = Field(7630, gt=0, description="|T|: most frequent public token ids the head predicts")
    n_tokens: int = Field(10, gt=0, description="soft-prompt / prefix length")
    steps: int = Field(200, gt=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(3e-3, gt=0)
    attacks: bool = Field(True, description="inversion attacks on the privatized inputs and the model's states")


def draw_once(shared: Path, encoding, draw, load, save):
    """The shared privatized draw at ``shared``: made once, then reused. Variants of a sweep may run
    at the same time (Dask workers): the draw is made under a lock, so two of them can never
    publish two independent privatizations of the same private text (which would weaken the
    local guarantee, as two noisy views of a token are)."""
    from ...state import made_once

    shape = tuple(encoding["input_ids"].shape)
    return made_once(shared, draw, load, save, usable=lambda data: tuple(data.input_ids.shape) == shape)


def draw_path(mctx, prefix: str, fields: dict, private_texts: list[str] | None = None) -> Path:
    """Where the draw keyed by ``fields`` (config values) is shared. A draw of PRIVATE texts is
    keyed also by their keyed fingerprint (HMAC with the installation secret: a changed source is
    never served an old draw, and without the key the name confirms no guess about a text) and by
    where its randomness came from: made from the secret source it is the released mechanism
    output (outputs side); made from seeded streams (a debug run, an audit shadow: no guarantee,
    nothing published) it stays on the private side and a released run never reuses it. Draws of
    public text (seeded, nothing private) are on the outputs side."""
    side = mctx.paths.root / "outputs"
    if private_texts is not None:
        from ...data import fingerprint
        from ...state import installation_secret

        seeded = bool(mctx.randomness.seeded)
        fields = {**fields, "randomness": "seeded" if seeded else "secret", "texts": fingerprint(
            private_texts, [""] * len(private_texts), installation_secret(mctx.paths.private))}
        side = mctx.paths.private if seeded else side
    return side / "rapt-draws" / f"{prefix}-{digest_key(fields)}.pt"


def text_tokens_per_record(cfg, block) -> int:
    """At most this many text tokens of one record are privatized per draw (the encoding's length
    less [CLS], [SEP] and the plain tokens): a public bound from the config."""
    return max(0, cfg.models.max_length - 2 - (block.plain_tokens if block.reconstruction else 0))


def unit_bounds(cfg, block) -> dict:
    """RAPT's local guarantee summed over tokens, per record and per privacy unit (issue 28): each
    privatized token is η·d_X-private, and d_X composes additively, so one draw of a record is
    η·Σ_t d(x_t, x'_t)-private over its at most T = :func:`text_tokens_per_record` tokens
    (``rapt.ldp_eta_tokens_per_record`` = η·T, the multiplier of the largest per-token embedding
    distance), and a unit of at most k records (``data.max_records_per_unit``) η·T·k
    (``rapt.ldp_eta_tokens_per_unit``; unbounded without a cap). Labels and lengths are not
    privatized (no bound covers them). Public numbers only: T and k come from the config, never
    from the data."""
    tokens = text_tokens_per_record(cfg, block)
    params = {"rapt.ldp_tokens_per_record": tokens, "rapt.ldp_eta_tokens_per_record": block.eta * tokens}
    if cfg.data.user_unit:
        k = cfg.data.max_records_per_unit
        params["rapt.ldp_eta_tokens_per_unit"] = (block.eta * tokens * k if k is not None
                                                  else "unbounded (no data.max_records_per_unit)")
        params["rapt.unit_claim"] = "none (d_X bound per unit only)"
    return params


def run_label(cfg) -> str:
    """A RAPT run's name in comparisons: its tuning, with the reconstruction head and its weight."""
    block = cfg.methods.rapt
    if not block.reconstruction:
        return f"rapt[{block.tuning}]"
    weight = "" if block.reconstruction_weight == 1.0 else f" λ={block.reconstruction_weight:g}"
    return f"rapt[{block.tuning}+reconstruction{weight}]"


def ldp_level(params: dict) -> float | None:
    """A RAPT run's local-DP level: its η."""
    eta = params.get("rapt.eta")
    return None if eta is None else float(eta)


def uses_public_data(cfg) -> bool:
    block = cfg.methods.rapt
    return block.reconstruction or block.attacks  # the head's vocabulary; the attacks' public side


def validate(cfg, published: bool) -> None:
    m = cfg.methods.rapt.plain_tokens  # every draw carries the plain tokens (shared by the variants)
    if cfg.models.max_length < m + 2 + 8:
        raise ValueError(f"models.max_length={cfg.models.max_length} must hold RAPT's {m} plain tokens, "
                         "[CLS], [SEP] and the text (at least 8 text tokens)")


class Rapt(Mechanism):
    def guarantee(self, cfg):
        return "none" if cfg.debug_seeded_dp_randomness else "ldp"

    def plan(self, cfg, n_train, delta, epsilon=None):
        block = settings_of(cfg, self)
        guarantee = self.guarantee(cfg)
        return MethodPlan(self.spec.name, guarantee, n_train, delta,
                          params={"rapt.eta": block.eta, "rapt.tuning": block.tuning,
                                  "rapt.reconstruction": str(block.reconstruction).lower(),
                                  "rapt.plain_tokens": block.plain_tokens if block.reconstruction else 0,
                                  "rapt.reconstruction_weight": block.reconstruction_weight if block.reconstruction
                                  else 0.0, **unit_bounds(cfg, block)},
                          note="local d_X privacy of every token with η = rapt.eta (metric LDP) per draw; no "
                               "(ε, δ) claim; labels and text lengths are not privatized; each draw is a release "
                               "in the ledger, and η adds up over the draws a text is in (privprompt ledger)"
                               + ("" if not cfg.data.user_unit else
                                  f"; privacy unit {cfg.data.privacy_unit!r}: no formal unit-level claim — the "
                                  "d_X bound composes over a person's tokens (rapt.ldp_eta_tokens_per_unit), "
                                  "nothing more is stated"))

    def preflight(self, cfg, prepared) -> None:
        """The local model loads and its task head builds (label words' first tokens told apart, or
        cosine to label descriptions), before any draw is recorded or budget reserved."""
        from .model import build_task_head
        from models.backbones import ModelLoadError, load_backbone

        from ...errors import ConfigError
        from ..base import check_positions, explain_classifier_error

        bb = load_backbone(cfg.models.local, seed=cfg.seed, placement=cfg.models.placement_of(cfg.models.local))
        try:
            build_task_head(bb, list(cfg.data.labels), cfg.models.label_descriptions or None)
        except ModelLoadError:
            raise
        except (ValueError, KeyError, IndexError) as exc:
            raise ConfigError(explain_classifier_error(exc, cfg.models.local, "models.local")) from None
        check_positions(cfg, bb.max_positions, settings_of(cfg, self).n_tokens, cfg.models.local, "models.local")

    def prepare(self, ctx, progress=None):
        """The reconstruction head's vocabulary: the most frequent token ids of PUBLIC text."""
        block = settings_of(ctx.cfg, self)
        if not uses_public_data(ctx.cfg):
            return {}
        from .encoding import default_plain_ids
        from .head import reconstruction_vocab
        from models.backbones import load_backbone

        from ...data import public_texts

        bb = load_backbone(ctx.cfg.models.local, seed=ctx.cfg.seed,
                           placement=ctx.cfg.models.placement_of(ctx.cfg.models.local))
        texts = public_texts(ctx.cfg, ctx.paths.private)
        ids = bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
        plain = default_plain_ids(bb.tokenizer, block.plain_tokens, ctx.cfg.seed)
        special = list(getattr(bb.tokenizer, "all_special_ids", []) or [])
        vocab = reconstruction_vocab(ids, plain, block.head_vocab, exclude_ids=special)
        return {"head_vocab": [int(i) for i in vocab], "public": ctx.cfg.public.name}

    # ---- the local side ----------------------------------------------------------------------
    def _plain(self, cfg, tokenizer):
        from .encoding import default_plain_ids

        return default_plain_ids(tokenizer, settings_of(cfg, self).plain_tokens, cfg.seed)

    # ---- the model side: privatized ids only --------------------------------------------------
    @staticmethod
    def load_privatized(path: Path):
        import torch

        from .encoding import PrivatizedEncoding

        d = torch.load(path)
        return PrivatizedEncoding(d["input_ids"], d["attention_mask"], d["text_mask"], tuple(d["plain_ids"]),
                                  d["eta"])

    def _classifier(self, cfg, prompt, n_plain: int, head_vocab=None, reconstruction_weight: float = 1.0):
        from .head import ReconstructionHead
        from .model import RaptModel, build_task_head
        from models.backbones import load_backbone

        bb = load_backbone(cfg.models.local, seed=cfg.seed, placement=cfg.models.placement_of(cfg.models.local))
        head = build_task_head(bb, list(cfg.data.labels), cfg.models.label_descriptions or None)
        import torch

        recon = ReconstructionHead(torch.tensor(head_vocab), bb.embed_dim) if head_vocab else None
        return RaptModel(bb, prompt, head, n_plain, recon, reconstruction_weight)

    def tune(self, cfg, privatized_path: Path, labels: list[str], seed: int, head_vocab=None, progress=None):
        """The model side's tuning: reads only the privatized ids at ``privatized_path``."""
        import torch

        from .model import train_rapt
        from models.backbones import load_backbone
        from models.soft_prompt import PrefixPrompt, SoftPrompt

        from ...methodkit.classifiers import label_indices

        block = settings_of(cfg, self)
        data = self.load_privatized(privatized_path)
        bb = load_backbone(cfg.models.local, seed=cfg.seed, placement=cfg.models.placement_of(cfg.models.local))
        kind = PrefixPrompt if block.tuning == "prefix" else SoftPrompt
        prompt = kind.init_from_vocab(bb, block.n_tokens, seed=seed)
        with torch.random.fork_rng(devices=[]):  # the head's initialisation, seeded (not DP randomness)
            torch.manual_seed(seed)
            model = self._classifier(cfg, prompt, data.n_plain, head_vocab, block.reconstruction_weight)
        def report(step, _losses):  # steps only: the losses are exact statistics of private data
            if progress is not None and ((step + 1) % 10 == 0 or step + 1 == block.steps):
                progress(step + 1, block.steps)

        train_rapt(model, data, label_indices(labels, cfg.data.labels), block.steps, block.batch_size, block.lr,
                   generator=torch.Generator().manual_seed(seed), on_step=report)
        return model, data

    def shared_draw(self, mctx, texts: list[str], split: str, stream: int, out_path: Path):
        """Local: the privatized ids of ``texts`` for this run, written to ``out_path``; returns
        (privatized, original encoding).

        One draw per (texts, data, seed, model, max_length, η, m, split, randomness), always with
        the m plain tokens, shared by the variants that differ only in tuning (prompt / prefix),
        reconstruction and its weight: a variant without reconstruction drops the plain positions
        of the same draw (post-processing). See :func:`draw_path` for where it is kept."""
        from .encoding import encode_rapt, privatize_encoding, without_plain
        from .privatize import BackbonePrivatizer
        from models.backbones import load_backbone

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        bb = load_backbone(cfg.models.local, seed=cfg.seed, placement=cfg.models.placement_of(cfg.models.local))
        plain = self._plain(cfg, bb.tokenizer)
        encoding = encode_rapt(bb.tokenizer, texts, plain, cfg.models.max_length)
        # a split with no text token at all (exactly empty, or every text empty after tokenization) is
        # privatized and tuned on like any other (nothing to draw: the tuning sees no row): refusing it
        # on the exact rows would be a 0-vs-1 test of one record outside ε
        shared = draw_path(mctx, split, {
            "data": cfg.data.model_dump(mode="json"), "data_root": cfg.data_root, "seed": cfg.seed,
            "model": cfg.models.local, "max_length": cfg.models.max_length, "eta": block.eta, "plain": plain,
            "split": split, "n": len(texts)}, private_texts=texts)

        def draw():
            return privatize_encoding(encoding, plain, BackbonePrivatizer(bb), block.eta, mctx.randomness.numpy(stream))

        def released_draw():
            # every draw actually made is a release, in the ledger before it is made, under its own
            # entry (a fresh id per draw: one made afresh after its file was removed is a second
            # release, and η adds up); a stored draw loaded again is no new release
            import secrets

            mctx.paths.open_ledger().record_ldp(  # the run's ledger: the state folder's, or the team's by URL
                mctx.dataset_key, f"rapt-draw:{shared.stem}:{secrets.token_hex(8)}",
                f"rapt: d_X draw of {len(texts)} {split} texts at η = {block.eta:g} ({shared.name})", eta=block.eta)
            return draw()

        if not mctx.randomness.seeded and mctx.dataset_key is None:
            raise RuntimeError("a released RAPT draw needs the dataset's ledger key (MethodContext.dataset_key)")
        data = draw_once(shared, encoding, draw if mctx.randomness.seeded else released_draw, self.load_privatized,
                         self._save)
        if not block.reconstruction:
            data, encoding = without_plain(data, encoding)
        self._save(data, out_path)
        return data, encoding

    @staticmethod
    def _save(data, path: Path) -> None:
        import torch

        from ...state import make_private_dir, private_file

        make_private_dir(path.parent)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"input_ids": data.input_ids, "attention_mask": data.attention_mask, "text_mask": data.text_mask,
                    "plain_ids": list(data.plain_ids), "eta": data.eta}, tmp)
        private_file(tmp).replace(path)

    def train(self, mctx, plan, rows, progress=None):
        from .encoding import replaced_share

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        directory = mctx.output_dir or (mctx.paths.private / "rapt")
        path = directory / "rapt_privatized_train.pt"
        data, encoding = self.shared_draw(mctx, rows.texts, "train", 3, path)  # local side
        head_vocab = mctx.prepared.get("head_vocab") if block.reconstruction else None  # (the attacks use it too)
        model, _ = self.tune(cfg, path, rows.labels, mctx.seed, head_vocab, progress)
        # audit statistics (they read the unprivatized text; the ledger lists them as non-private uses)
        audit = {}
        if bool(encoding["text_mask"].any()):  # (no text token: an exactly empty split has no statistic to audit)
            audit["audit.rapt.replace_prob"] = replaced_share(encoding, data)  # local: reads the original ids
        if block.attacks and audit:
            audit.update(self._attacks(mctx, model, data, encoding))
        return Trained(model.prompt.weight.detach().cpu().clone(), None, block.steps, {"train.steps": block.steps},
                       audit_metrics=audit)

    ATTACK_ROWS = 300

    def _attacks(self, mctx, model, data, encoding) -> dict:
        """Audit statistics (they read the unprivatized text): inversion of the privatized inputs
        (= 1 − replacement by construction), inversion of the model's output states (nearest input
        embedding, and an MLP inverter trained on PUBLIC text privatized the same way), and
        attribute inference of the source domain (SST-2-like private reviews vs the public texts,
        both privatized) from pooled representations, beside the majority-class rate."""
        import numpy as np
        import torch

        from .attacks import (attribute_inference, embedding_inversion_success, hidden_inversion_attack,
                                         pooled_text_states, text_states)
        from .encoding import encode_rapt, privatize_encoding
        from .privatize import BackbonePrivatizer

        from ...data import public_texts

        cfg, block = mctx.cfg, settings_of(mctx.cfg, self)
        inference = model.inference()
        bb = inference._backbone
        privatizer = BackbonePrivatizer(bb)
        n = min(len(data), self.ATTACK_ROWS)
        sub, ids, mask = data.rows(slice(0, n)), encoding["input_ids"][:n], encoding["text_mask"][:n]
        out = {"audit.attack.inversion.success": embedding_inversion_success(sub.input_ids, ids, mask, privatizer.index)}
        plain = list(data.plain_ids)
        public = public_texts(cfg, mctx.paths.private)[:n]
        pub_enc = encode_rapt(bb.tokenizer, public, plain, cfg.models.max_length)
        # public text: its privatization needs no secret randomness (seeded), so the variants of
        # a sweep share one (made once, like the private draws)
        pub = draw_once(draw_path(mctx, "public", {
            "public": cfg.public.model_dump(mode="json"), "seed": cfg.seed, "model": cfg.models.local,
            "max_length": cfg.models.max_length, "eta": block.eta, "plain": plain, "n": n}), pub_enc,
                        lambda: privatize_encoding(pub_enc, plain, privatizer, block.eta,
                                                   np.random.default_rng(cfg.seed)), self.load_privatized, self._save)
        g = torch.Generator().manual_seed(cfg.seed)
        states = text_states(inference, sub), text_states(inference, pub)  # once, for both attacks
        inv = hidden_inversion_attack(inference, sub, ids, pub, pub_enc["input_ids"], privatizer.index,
                                      torch.tensor(mctx.prepared["head_vocab"]), generator=g, states=states)
        out["audit.attack.inversion_hidden.success"] = inv["nn_success"]
        out["audit.attack.inversion_hidden.learned_success"] = inv["learned_success"]
        feats = torch.cat([pooled_text_states(states[0], sub.text_mask), pooled_text_states(states[1], pub.text_mask)])
        attr = attribute_inference(feats, [0] * len(sub) + [1] * len(pub), generator=g)
        out["audit.attack.attribute.success"] = attr["success"]
        out["audit.attack.attribute.majority_rate"] = attr["majority_rate"]
        return out

    def evaluate_published(self, ctx, prompt_path: str, mctx) -> float:
        """Inference on PRIVATIZED test inputs (the test texts are privatized locally first)."""
        from models.soft_prompt import PrefixPrompt, SoftPrompt

        from ...data import read_partition_split
        from ...prompts import load_prompt_file
        from ...methodkit.classifiers import label_indices

        cfg = ctx.cfg
        texts, names = read_partition_split(ctx.part.test_path)
        # released (outputs side) only when made from the secret source, like the training draw
        path = (ctx.private_run_dir if mctx.randomness.seeded else ctx.output_dir) / "rapt_privatized_test.pt"
        data, _ = self.shared_draw(mctx, texts, "test", 4, path)
        tensor = load_prompt_file(prompt_path)
        prompt = PrefixPrompt(tensor) if tensor.dim() == 4 else SoftPrompt(tensor.shape[0], tensor.shape[1], tensor)
        classifier = self._classifier(cfg, prompt, data.n_plain).inference()
        predictions = classifier.predict(self.load_privatized(path), batch_size=cfg.models.eval_batch_size)
        return float((predictions == label_indices(names, cfg.data.labels)).float().mean())


_RAPT = Rapt()
RAPT = register_method(MethodSpec(
    name="rapt", config_class=RaptConfig, mechanism=_RAPT, label="RAPT",
    # its model only takes privatized inputs: the attacks of the mechanism measure it
    traits=Traits(supports_loss_mia=False,
                  test_settings={"plain_tokens": 4, "head_vocab": 60, "n_tokens": 2, "steps": 2, "batch_size": 4}),
    report=Report(METRICS, SECTIONS, run_label=run_label, ldp_level=ldp_level),
    extras=Extras(validate=validate, uses_public_data=uses_public_data, evaluate_published=_RAPT.evaluate_published)))
