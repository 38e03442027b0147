"""Length grouping: the optimal split, rows back in order, and the same outputs and per-example
gradients as one padded call (soft prompts and prefixes, encoder and causal LM, RAPT)."""

import itertools

import pytest
import torch

from models.classifiers import build_classifier
from models.length_groups import in_length_groups, length_groups
from models.backbones import load_backbone
from models.soft_prompt import PrefixPrompt, SoftPrompt

TEXTS = ["good", "a truly dreadful film , slow and long and without any reason to exist at all , sadly",
         "fine", "it was great fun from the first minute to the last one", "bad", "ok then",
         "the plot goes nowhere but the actors carry it with charm and wit to a warm ending", "meh"]


def _cost(groups, lengths, overhead):
    return sum(len(g) * int(lengths[g].max()) + overhead for g in groups)


def test_length_groups_is_the_cheapest_contiguous_split():
    lengths = torch.tensor([3, 40, 3, 12, 5, 40, 12, 4, 3, 39])
    for overhead in (0, 10, 50, 1000):
        groups = length_groups(lengths, overhead)
        assert sorted(torch.cat(groups).tolist()) == list(range(len(lengths)))  # every row once
        values = sorted(set(lengths.tolist()))
        best = min(  # every split of the sorted distinct lengths into contiguous ranges
            sum(int((lengths <= hi).sum() - (lengths <= lo).sum()) * hi + overhead
                for lo, hi in zip((0,) + cuts, cuts + (values[-1],)))
            for k in range(len(values)) for cuts in itertools.combinations(values[:-1], k))
        assert _cost(groups, lengths, overhead) == best
    assert len(length_groups(lengths, 10**9)) == 1  # splitting never pays
    assert len(length_groups(lengths, 0)) == len(set(lengths.tolist()))
    assert len(length_groups(torch.tensor([7] * 5), 0)) == 1


def test_call_overhead_by_device_and_width(monkeypatch):
    from models.length_groups import call_overhead

    monkeypatch.delenv("PRIVPROMPT_LENGTH_GROUP_OVERHEAD", raising=False)
    assert call_overhead("cpu") == 256 and call_overhead("cuda") == 8192
    assert call_overhead("cpu", 384) == 271 and call_overhead("cpu", 576) == 256  # MiniLM, SmolLM2
    assert call_overhead("cpu", 32) > 10_000  # a tiny test model: one call
    monkeypatch.setenv("PRIVPROMPT_LENGTH_GROUP_OVERHEAD", "7")
    assert call_overhead("cuda", 32) == 7


def test_in_length_groups_puts_rows_back_in_order_and_pads_widths():
    lengths = torch.tensor([2, 9, 2, 9, 5])
    calls = []

    def run(rows):
        rows = torch.arange(5) if rows is None else rows
        calls.append(rows.tolist())
        width = int(lengths[rows].max())
        return rows.float().reshape(-1, 1, 1).expand(-1, width, 2) + 1  # row id + 1 at every position

    monkey = pytest.MonkeyPatch()
    monkey.setenv("PRIVPROMPT_LENGTH_GROUP_OVERHEAD", "0")
    out = in_length_groups(lengths, run)
    monkey.undo()
    assert len(calls) == 3 and out.shape == (5, 9, 2)
    assert torch.equal(out[:, 0, 0], torch.arange(5).float() + 1)
    assert float(out[0, 2:].abs().sum()) == 0.0 and float(out[1, 8, 0]) == 2.0  # short rows zero-padded


@pytest.mark.parametrize("family,kind", [("tiny-bert", "soft"), ("tiny-llama", "soft"), ("tiny-llama", "prefix"),
                                         ("tiny-bert", "prefix")])
def test_grouped_forward_equals_one_call_with_per_example_gradients(family, kind, monkeypatch):
    bb = load_backbone(family, seed=0)
    clf = build_classifier(bb, ["negative", "positive"])
    enc = clf.encode(TEXTS, max_length=40)
    prompt = (SoftPrompt.init_from_vocab(bb, 3, seed=0) if kind == "soft" else PrefixPrompt.init_from_vocab(bb, 3, seed=0))
    w = prompt.weight.detach()
    y = torch.tensor([0, 1] * 4, device=bb.device)  # the backbone's device (CUDA when present)

    def outputs():
        per = w.unsqueeze(0).repeat(len(TEXTS), *[1] * w.dim()).requires_grad_(True)  # per-example copies
        logits = clf(enc, per)
        grad, = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y, reduction="sum"), per)
        return logits.detach(), grad, clf(enc, w).detach()  # and a shared prompt

    monkeypatch.setenv("PRIVPROMPT_LENGTH_GROUP_OVERHEAD", str(10**9))  # one padded call
    ref = outputs()
    monkeypatch.setenv("PRIVPROMPT_LENGTH_GROUP_OVERHEAD", "0")  # a group per distinct length
    assert len(length_groups(enc["attention_mask"].sum(1), 0)) > 3
    got = outputs()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # each example's gradient is its own: a per-example loop agrees
    for i in range(len(TEXTS)):
        one = w.clone().requires_grad_(True)
        row = {k: v[i:i + 1] for k, v in enc.items()}
        g, = torch.autograd.grad(torch.nn.functional.cross_entropy(clf(row, one), y[i:i + 1], reduction="sum"), one)
        torch.testing.assert_close(got[1][i], g, rtol=1e-4, atol=1e-5)
