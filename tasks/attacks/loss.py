"""Loss threshold on the audit pool (Yeom et al. 2018): a member's loss is lower. Its metrics are
``mia.loss_pool.*`` (the in-flow ``mia.loss`` is another attack, on other examples)."""

from __future__ import annotations

from . import Attack, register_attack


@register_attack
class LossAttack(Attack):
    name = "loss"
    default_position = 0

    def statistics(self, scoring):
        from models.scoring import per_example_loss

        return {"loss": -per_example_loss(scoring.classifier, scoring.encoded, scoring.labels, scoring.prompt,
                                          scoring.batch_size).numpy()}

    def scores(self, target, shadows):
        return {"loss_pool": target["loss"]}
