"""RAPT (Li et al.): local d_X privatization of every token, prompt tuning on the privatized
tokens with a privatized-token reconstruction head, inference on privatized inputs.

The guarantee is LOCAL (metric, d_X) privacy of each text, with parameter η (``rapt.eta``): no
(ε, δ) claim about the dataset (``privacy.guarantee=ldp``). Labels are not privatized, as in the
paper. The privatization runs on the local side (``privatize``); the model side (``tune``,
``infer``) receives only the privatized ids, written to the run's outputs and read back from
there. The attacks read the unprivatized text: their numbers are audit statistics.
"""

from __future__ import annotations

from pathlib import Path

from typing import Literal

from pydantic import Field

from ..schema import Block
from . import register_method
from .base import Method, MethodPlan, Trained


class RaptConfig(Block):
    enabled: bool = False
    eta: float = Field(100.0, gt=0, description="d_X privacy parameter η (larger: less noise)")
    tuning: Literal["prompt", "prefix"] = Field("prompt", description="prompt: a soft prompt on the input "
                                                "embeddings; prefix: keys and values at every layer")
    reconstruction: bool = Field(True, description="the privatized-token reconstruction head (m plain tokens)")
    plain_tokens: int = Field(40, ge=1, description="m: plain tokens prepended before privatization")
    head_vocab: int = Field(7630, gt=0, description="|T|: most frequent public token ids the head predicts")
    n_tokens: int = Field(10, gt=0, description="soft-prompt / prefix length")
    steps: int = Field(200, gt=0)
    batch_size: int = Field(32, gt=0)
    lr: float = Field(3e-3, gt=0)
    attacks: bool = Field(True, description="inversion attacks on the privatized inputs and the model's states")


@register_method
class Rapt(Method):
    name = "rapt"
    config_class = RaptConfig
    label = "RAPT"
    supports_loss_mia = False  # its model only takes privatized inputs: the attacks below measure it

    def guarantee(self, cfg):
        return "none" if cfg.debug_seeded_dp_randomness else "ldp"

    def uses_public_data(self, cfg) -> bool:
        return self.settings(cfg).reconstruction

    def validate(self, cfg, published):
        block = self.settings(cfg)
        m = block.plain_tokens if block.reconstruction else 0
        if cfg.models.max_length < m + 2 + 8:
            raise ValueError(f"models.max_length={cfg.models.max_length} must hold RAPT's {m} plain tokens, "
                             "[CLS], [SEP] and the text (at least 8 text tokens)")

    def plan(self, cfg, n_train, delta):
        block = self.settings(cfg)
        guarantee = self.guarantee(cfg)
        return MethodPlan(self.name, guarantee, n_train, delta,
                          params={"rapt.eta": block.eta, "rapt.tuning": block.tuning,
                                  "rapt.reconstruction": str(block.reconstruction).lower(),
                                  "rapt.plain_tokens": block.plain_tokens if block.reconstruction else 0},
                          note="local d_X privacy of every text with η = rapt.eta (metric LDP); no (ε, δ) claim; "
                               "labels are not privatized")

    def prepare(self, ctx, progress=None):
        """The reconstruction head's vocabulary: the most frequent token ids of PUBLIC text."""
        block = self.settings(ctx.cfg)
        if not block.reconstruction:
            return {}
        from models.rapt.encoding import default_plain_ids
        from models.rapt.head import reconstruction_vocab
        from models.registry import load_backbone

        from .post import public_texts

        bb = load_backbone(ctx.cfg.models.local, seed=ctx.cfg.seed)
        texts = public_texts(ctx.cfg, ctx.paths.private)
        ids = bb.tokenizer(texts, add_special_tokens=False)["input_ids"]
        plain = default_plain_ids(bb.tokenizer, block.plain_tokens, ctx.cfg.seed)
        special = list(getattr(bb.tokenizer, "all_special_ids", []) or [])
        vocab = reconstruction_vocab(ids, plain, block.head_vocab, exclude_ids=special)
        return {"head_vocab": [int(i) for i in vocab], "public": ctx.cfg.public.name}

    # ---- the local side ----------------------------------------------------------------------
    def _plain(self, cfg, tokenizer):
        from models.rapt.encoding import default_plain_ids

        block = self.settings(cfg)
        return default_plain_ids(tokenizer, block.plain_tokens, cfg.seed) if block.reconstruction else []

    def privatize(self, cfg, texts: list[str], rng, out_path: Path):
        """Local: tokenize, privatize every plain and text token, write the ids to ``out_path``."""
        import torch

        from models.rapt.encoding import encode_rapt, privatize_encoding
        from models.rapt.privatize import BackbonePrivatizer
        from models.registry import load_backbone

        bb = load_backbone(cfg.models.local, seed=cfg.seed)
        plain = self._plain(cfg, bb.tokenizer)
        encoding = encode_rapt(bb.tokenizer, texts, plain, cfg.models.max_length)
        data = privatize_encoding(encoding, plain, BackbonePrivatizer(bb), self.settings(cfg).eta, rng)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": data.input_ids, "attention_mask": data.attention_mask, "text_mask": data.text_mask,
                    "plain_ids": list(data.plain_ids), "eta": data.eta, "replace_prob": data.replace_prob}, out_path)
        return data, encoding

    # ---- the model side: privatized ids only --------------------------------------------------
    @staticmethod
    def load_privatized(path: Path):
        import torch

        from models.rapt.encoding import PrivatizedEncoding

        d = torch.load(path)
        return PrivatizedEncoding(d["input_ids"], d["attention_mask"], d["text_mask"], tuple(d["plain_ids"]),
                                  d["eta"], d["replace_prob"])

    def _classifier(self, cfg, prompt, n_plain: int, head_vocab=None):
        from models.rapt.head import ReconstructionHead
        from models.rapt.model import RaptModel, build_task_head
        from models.registry import load_backbone

        bb = load_backbone(cfg.models.local, seed=cfg.seed)
        head = build_task_head(bb, list(cfg.data.labels), cfg.models.label_descriptions or None)
        import torch

        recon = ReconstructionHead(torch.tensor(head_vocab), bb.embed_dim) if head_vocab else None
        return RaptModel(bb, prompt, head, n_plain, recon)

    def tune(self, cfg, privatized_path: Path, labels: list[str], seed: int, head_vocab=None, progress=None):
        """The model side's tuning: reads only the privatized ids at ``privatized_path``."""
        import torch

        from models.rapt.model import train_rapt
        from models.registry import load_backbone
        from models.soft_prompt import PrefixPrompt, SoftPrompt

        from ..stages import label_indices

        block = self.settings(cfg)
        data = self.load_privatized(privatized_path)
        bb = load_backbone(cfg.models.local, seed=cfg.seed)
        kind = PrefixPrompt if block.tuning == "prefix" else SoftPrompt
        prompt = kind.init_from_vocab(bb, block.n_tokens, seed=seed)
        with torch.random.fork_rng(devices=[]):  # the head's initialisation, seeded (not DP randomness)
            torch.manual_seed(seed)
            model = self._classifier(cfg, prompt, data.n_plain, head_vocab)
        if progress is not None:
            progress(0, block.steps)
        train_rapt(model, data, label_indices(labels, cfg.data.labels), block.steps, block.batch_size, block.lr,
                   generator=torch.Generator().manual_seed(seed))
        if progress is not None:
            progress(block.steps, block.steps)
        return model, data

    def train(self, mctx, plan, rows, progress=None):
        cfg, block = mctx.cfg, self.settings(mctx.cfg)
        directory = mctx.output_dir or (mctx.paths.private / "rapt")
        path = directory / "rapt_privatized_train.pt"
        data, encoding = self.privatize(cfg, rows.texts, mctx.randomness.numpy(3), path)  # local side
        model, _ = self.tune(cfg, path, rows.labels, mctx.seed, mctx.prepared.get("head_vocab"), progress)
        metrics = {"rapt.replace_prob": data.replace_prob, "train.steps": block.steps}
        audit = self._attacks(model, data, encoding) if block.attacks else {}
        return Trained(model.prompt.weight.detach().cpu().clone(), None, block.steps, metrics, audit_metrics=audit)

    def _attacks(self, model, data, encoding) -> dict:
        """Inversion of the privatized inputs (= 1 − replacement by construction) and of the
        model's output states (nearest input embedding), on the text positions."""
        from models.rapt.attacks import _text_states, embedding_inversion_success, hidden_inversion_nn_success
        from models.rapt.privatize import BackbonePrivatizer

        inference = model.inference()
        index = BackbonePrivatizer(inference._backbone).index
        n = min(len(data), 300)
        sub, ids, mask = data.rows(slice(0, n)), encoding["input_ids"][:n], encoding["text_mask"][:n]
        hidden = _text_states(inference, sub, 32)
        return {"attack.inversion.success": embedding_inversion_success(sub.input_ids, ids, mask, index),
                "attack.inversion_hidden.success": hidden_inversion_nn_success(hidden, ids, mask, index)}

    def evaluate_published(self, ctx, prompt_path: str, mctx) -> float:
        """Inference on PRIVATIZED test inputs (the test texts are privatized locally first)."""
        from models.soft_prompt import PrefixPrompt, SoftPrompt

        from ..data import read_partition_split
        from ..prompts import load_prompt_file
        from ..stages import label_indices

        cfg = ctx.cfg
        texts, names = read_partition_split(ctx.part.test_path)
        path = ctx.output_dir / "rapt_privatized_test.pt"
        data, _ = self.privatize(cfg, texts, mctx.randomness.numpy(4), path)
        tensor = load_prompt_file(prompt_path)
        prompt = PrefixPrompt(tensor) if tensor.dim() == 4 else SoftPrompt(tensor.shape[0], tensor.shape[1], tensor)
        classifier = self._classifier(cfg, prompt, data.n_plain).inference()
        predictions = classifier.predict(self.load_privatized(path), batch_size=cfg.models.eval_batch_size)
        return float((predictions == label_indices(names, cfg.data.labels)).float().mean())
