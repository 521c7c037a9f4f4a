"""Fuzzing the server against its own OpenAPI schema (schemathesis): every route, generated and mutated bodies,
paths and headers. No request may get a 5xx, and every reply must match the schema."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.serve.rl import _NCCL_ROUTES

from ..helpers.server import LiveServer

EXAMPLES = int(os.environ.get("VERISPEC_FUZZ_EXAMPLES", "10"))  # per route (the default tier's short run)
LONG = 300  # per route, the slow tier's run (3,520 cases when last counted: 140 answered 2xx, 3,380 4xx, no 5xx)


STATUSES: Counter = Counter()  # the cases run, by status class (printed at the end: run with -s to see it)


@pytest.fixture(scope="module")
def api(tiny_target):
    gen = SpeculativeGenerator(tiny_target, config=SpecConfig(draft="none"))
    with LiveServer(gen, max_batch=4, max_queue=64, enable_weight_updates=True) as s:
        yield schemathesis.openapi.from_url(s.url + "/openapi.json")
    print(f"\nfuzzed {sum(STATUSES.values())} cases: {dict(sorted(STATUSES.items()))}")


# TRL's NCCL routes answer 501 and nothing else, by design (test_rl.py checks that): the one 5xx the server means
schema = schemathesis.pytest.from_fixture("api").exclude(path=list(_NCCL_ROUTES))


def _check(case) -> None:
    response = case.call_and_validate(checks=[not_a_server_error, response_schema_conformance])
    STATUSES[f"{response.status_code // 100}xx"] += 1


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_route_answers_a_5xx_or_off_its_schema(case):
    _check(case)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=LONG, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_route_answers_a_5xx_or_off_its_schema_long(case):
    _check(case)
