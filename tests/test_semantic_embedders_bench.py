"""The embedder comparison's decisions: the calibrated threshold and how a pair is decided.

Everything here builds its own small data; nothing reads ../shared/data and no model runs.
"""

from __future__ import annotations

import numpy as np

from bench.semantic_embedders import PairSet, accepted, calibrate


def _pairs(n: int, labels: list[int], exact: list[bool] | None = None, rules: list[bool] | None = None) -> PairSet:
    texts = [f"question {i}" for i in range(n)]
    return PairSet("synthetic", texts, texts, np.array(labels), np.array(exact or [False] * n),
                   np.array(rules or [True] * n))


def test_threshold_is_the_lowest_that_keeps_false_hits_within_one_percent() -> None:
    rng = np.random.default_rng(0)
    s = _pairs(400, [0] * 300 + [1] * 100)
    cos = np.concatenate([rng.uniform(0.5, 0.99, 300), rng.uniform(0.8, 1.0, 100)])
    t = calibrate(s, cos)
    assert int((accepted(s, cos, t) & (s.label == 0)).sum()) == 3  # 1% of 300
    negatives = np.sort(cos[:300])[::-1]
    # One notch lower admits the fourth-highest negative: over budget.
    assert int((accepted(s, cos, negatives[3]) & (s.label == 0)).sum()) == 4


def test_rules_and_exact_repeats_enter_the_budget_as_the_cache_decides() -> None:
    # 100 negatives: one false hit allowed. Negative 0 is an exact repeat (served whatever the
    # threshold) and uses it up; negative 1, the most similar, fails a rule and never counts.
    labels = [0] * 100 + [1] * 10
    exact = [True] + [False] * 109
    rules = [True, False] + [True] * 108
    s = _pairs(110, labels, exact, rules)
    cos = np.concatenate([[0.2, 0.99], np.linspace(0.5, 0.9, 98), np.full(10, 0.95)])
    t = calibrate(s, cos)
    assert 0.9 < t <= 0.95
    got = accepted(s, cos, t)
    assert got[0] and not got[1] and got[100:].all()
    assert s.rates(got)[:2] == (1.0, 0.01)
    # Without the rules the rule-failing negative is what the threshold has to stop.
    assert calibrate(s, cos, rules=False) > 0.99


def test_pairs_are_decided_on_the_caches_texts() -> None:
    rows = [{"a": "How do I learn Python?", "b": "How do I learn  Python?\r\n", "label": 1},
            {"a": "How do I learn python?", "b": "How do I learn java?", "label": 0},
            {"a": "What is the best way to learn French?", "b": "what is the best way to learn french", "label": 1}]
    s = PairSet.of("built", rows)
    assert s.exact.tolist() == [False, False, False]
    assert s.rules.tolist() == [True, False, True]  # python / java: the content rule
    # Not an exact repeat, yet the embedder sees one text: whitespace collapsed, case folded.
    assert s.a[0] == s.b[0] == "how do i learn python?"
