"""Schemathesis against the admin OpenAPI document: no input makes the admin API answer 5xx."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.support.stack import Stack, start_stack

TOKEN = "fuzz-admin-token"


@pytest.fixture(scope="module")
def fuzz_stack() -> Iterator[Stack]:
    s = start_stack(2, admin_token=TOKEN, tenants=[{"name": "acme", "api_keys": ["sk-acme-1"]}])
    yield s
    s.close()


def test_admin_api_never_answers_5xx(fuzz_stack: Stack) -> None:
    assert fuzz_stack.admin is not None
    schema = schemathesis.openapi.from_url(fuzz_stack.admin.url + "/openapi.json",
                                           headers={"Authorization": f"Bearer {TOKEN}"})
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 18
    seen: dict[int, int] = {}

    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: Any) -> None:
            response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.method, case.formatted_path, response.status_code,
                                                response.text[:300])

        check()
    assert any(200 <= code < 300 for code in seen) and any(400 <= code < 500 for code in seen)
