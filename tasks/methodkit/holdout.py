"""What a prompt predicts on the private holdout: the scoring that the no-prompt comparison
(``tasks/no_prompt.py``) and a private selection (``tasks/selection.py``) release counts of, with
noise. Exact and private: only those noisy counts leave."""

from __future__ import annotations


def holdout_predictions(method, mctx, prompt, rows):
    """The label index ``prompt`` (None: no prompt) predicts for each private holdout row of
    ``rows`` on the model ``method`` trained it on (a numpy array). Any prompt kind (soft, prefix,
    text) is scored on ``method.extras.source_model``'s frozen classifier with
    :func:`models.scoring.row_wise_logits`: a row's prediction is a function of that row alone
    (batches of public row-own shapes, each checked bit for bit, on an accelerator and for an encoder
    on a CPU; else one row per pass). Batched as evaluation batches, it would depend on its
    neighbours by float rounding (padding, length groups, BLAS blocking: logits moved by up to 2e-6
    on MiniLM when one record was added before them), and a row near a tie could flip — one added
    record moving a second count, a sensitivity above the 1 the noise is calibrated for."""
    from models.scoring import row_wise_logits

    from .classifiers import input_length, prompted

    cfg = mctx.cfg
    model = method.extras.source_model(cfg, mctx.prepared)
    clf, forward_prompt = prompted(cfg, model, prompt)
    return row_wise_logits(clf, rows.texts, input_length(cfg, model, clf), forward_prompt).argmax(dim=1).numpy()
