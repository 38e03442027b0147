"""Public token budgets for private texts in a causal LM's prompts (dp_icl, dp_fewshot, DP-OPT).

A private text is bounded by 48 whitespace words, but a "word" can be any number of tokens (a URL,
base64, a CJK sentence without spaces). On a model with learned absolute positions (GPT-2 family)
a prompt past the context raises an IndexError; on a RoPE model it grows without bound (time,
memory). Either way one record would decide whether a run crashes: a noiseless test of that
record. So every private text in such a prompt is cut to a PUBLIC token budget — computed from the
model's context and the method's settings only (:func:`text_budget`), never from the data — and
each cut depends on the text alone (:func:`clip_tokens`), never on the other records: a long
record changes its own prompt and nothing else.
"""

from __future__ import annotations

WORDS = 48               # the word clip every private text gets first
HUGE_CONTEXT = 1 << 20   # a context above this many positions counts as unbounded (no token clip)
MIN_TEXT_TOKENS = 4      # a budget below this leaves no useful room for a text: the settings are refused
JUNCTION = 4             # tokens kept free where a text meets its template (tokenisation across the seam)
SEAM = 2                 # tokens kept free where one templated demo meets the next, and in a forward prompt


def model_context(model, unbounded_above: int | None = HUGE_CONTEXT) -> int | None:
    """The positions ``model`` can take (``max_position_embeddings`` / ``n_positions``), or None when
    it states none or it is above ``unbounded_above`` (None: any stated limit counts)."""
    cfg = getattr(model, "config", None)
    context = next((v for v in (getattr(cfg, "max_position_embeddings", None), getattr(cfg, "n_positions", None))
                    if isinstance(v, int) and v > 0), None)
    if context is None or (unbounded_above is not None and context > unbounded_above):
        return None
    return context


def clip_words(text: str, limit: int = WORDS) -> str:
    return " ".join(text.split()[:limit])


def clip_tokens(engine, text: str, limit: int) -> str:
    """``text`` cut to its first ``limit`` tokens (unchanged when it fits). The cut is decoded back to
    text; should that re-encode longer (a split multi-byte character), it is cut one token shorter
    until it fits — a function of ``text`` and ``limit`` alone."""
    ids = engine.ids(text)
    if len(ids) <= limit:
        return text
    for keep in range(limit, 0, -1):
        cut = engine.tok.decode(ids[:keep])
        if len(engine.ids(cut)) <= limit:
            return cut
    return ""


def clip_text(engine, text: str, tokens: int | None, words: int = WORDS) -> str:
    """The word clip, then the token budget (None: the word clip only)."""
    text = clip_words(text, words)
    return text if tokens is None else clip_tokens(engine, text, tokens)


def template_tokens(engine, template: str, tails=("",)) -> int:
    """Tokens ``template`` takes around its ``{text}`` (with the longest of ``tails`` after it): its two sides
    counted apart — joined without the text they can tokenize as one word (a WordPiece word of over 100
    characters is one [UNK]) where around a text they are many."""
    before, after = template.split("{text}", 1)
    return len(engine.ids(before)) + max(len(engine.ids(after + tail)) for tail in tails)


def text_budget(context: int | None, fixed: int, texts: int, overhead: int, what: str) -> int | None:
    """Tokens each of ``texts`` private texts may take so that ``fixed`` tokens (shared head, tail,
    generated tokens) and ``texts`` × (the text's template, ``overhead`` tokens, + the text) fit
    ``context`` (None: no budget). Public: the model and the settings only. Settings that leave
    fewer than ``MIN_TEXT_TOKENS`` per text are refused with one line (``what`` names them)."""
    if context is None:
        return None
    budget = (context - fixed - texts * (overhead + JUNCTION)) // max(1, texts)
    if budget < MIN_TEXT_TOKENS:
        from ..errors import ConfigError

        raise ConfigError(f"{what} leave no room for a private text in models.local's context of {context} tokens "
                          f"({budget} tokens each, at least {MIN_TEXT_TOKENS} needed); lower them")
    return budget
