"""Priority classes: the mapping to vLLM's values, the header that lowers a class, and its refusals."""

from __future__ import annotations

import pytest

from policies.errors import InvalidPriority
from policies.priority import CLASSES, TAKES_PRIORITY, VLLM_PRIORITY, band, request_class


def test_classes_map_to_vllm_values_lower_first_with_standard_zero() -> None:
    assert VLLM_PRIORITY == {"interactive": -1, "standard": 0, "batch": 1}
    # vLLM runs lower values first: the class order and the value order agree.
    assert sorted(CLASSES, key=VLLM_PRIORITY.__getitem__) == list(CLASSES)
    assert [band(c) for c in CLASSES] == [0, 1, 2]


@pytest.mark.parametrize(("tenant", "header", "expected"), [
    ("standard", None, "standard"), ("interactive", None, "interactive"), ("batch", None, "batch"),
    ("interactive", "standard", "standard"), ("interactive", "batch", "batch"), ("standard", "batch", "batch"),
    ("standard", "standard", "standard"), ("standard", " Batch ", "batch"),
])
def test_a_request_keeps_or_lowers_its_tenants_class(tenant: str, header: str | None, expected: str) -> None:
    assert request_class(tenant, header) == expected


@pytest.mark.parametrize(("tenant", "header"), [
    ("standard", "interactive"), ("batch", "standard"), ("batch", "interactive")])
def test_a_header_above_the_tenants_class_is_refused(tenant: str, header: str) -> None:
    with pytest.raises(InvalidPriority) as err:
        request_class(tenant, header)
    assert err.value.status == 400 and err.value.code == "invalid_priority"
    assert err.value.param == "x-kvgate-priority" and tenant in err.value.message


@pytest.mark.parametrize("header", ["urgent", "", "-1", "0", "high"])
def test_an_unknown_class_is_refused_without_echoing_it(header: str) -> None:
    with pytest.raises(InvalidPriority) as err:
        request_class("interactive", header)
    assert err.value.status == 400 and "interactive, standard, batch" in err.value.message
    if header:
        assert header not in err.value.message


def test_only_routes_whose_vllm_request_has_the_field_take_it() -> None:
    assert {"chat", "completions", "responses", "embeddings", "rerank", "score", "pooling",
            "classify"} == TAKES_PRIORITY
    assert not {"messages", "count_tokens", "tokenize", "transcriptions"} & TAKES_PRIORITY
