"""/openapi.json says what the server accepts and answers, and schemathesis holds it to that:
generated valid and invalid requests for every operation, no 5xx, every answer as documented."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from conftest import ServerProcess

EXAMPLES = 25  # per operation and mode; bounded so the suite fits CI
# Not checked: that every schema-valid request is accepted. A request can be well-formed and
# still a 400: a prompt longer than the context, an image for a text-only model.


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    # A small context keeps every generated request cheap: long prompts are quick 400s.
    server = ServerProcess("--model", str(tiny_model_dir), "--ctx-size", "96", "--model-id", "tiny").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")
DEFAULT_LENGTH_FIELD = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens", "/v1/responses": "max_output_tokens"}


def keep_generation_short(case) -> None:
    """At most 8 new tokens per valid request: what is fuzzed is the input, not long outputs."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in LENGTH_FIELDS:
        if type(body.get(key)) is int and body[key] > 8:
            body[key] = 8
    field = DEFAULT_LENGTH_FIELD.get(case.operation.path)
    if field and not any(body.get(k) for k in LENGTH_FIELDS):
        body[field] = 8


def fuzz(operation, mode: schemathesis.GenerationMode, base_url: str) -> None:
    """Send EXAMPLES generated requests to one operation; schemathesis' checks raise on a mismatch."""

    @given(case=operation.as_strategy(mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        if mode == schemathesis.GenerationMode.POSITIVE:
            keep_generation_short(case)
        response = case.call_and_validate(base_url=base_url, timeout=60, excluded_checks=[positive_data_acceptance])
        assert response.status_code < 500, response.text

    run()


# schemathesis' own pytest integration does not run under pytest 9, so each operation is a
# Hypothesis test of its own, driven here.
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE], ids=str)
def test_every_operation_answers_as_documented_without_server_errors(api_schema, fuzz_server, mode):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in operations} >= {("POST", "/v1/chat/completions"), ("POST", "/v1/cancel")}
    for operation in operations:
        if mode == schemathesis.GenerationMode.NEGATIVE and not operation.body:
            continue  # no body: nothing a client can get wrong but the path, which any string fits
        fuzz(operation, mode, fuzz_server.url)


def test_openapi_documents_400_with_the_error_object_not_422(client):
    doc = client.get("/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat
    assert chat["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_openapi_documents_the_event_stream(client):
    doc = client.get("/openapi.json").json()
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}


def test_openapi_documents_auth_only_when_a_key_is_set(client, tiny_model_dir):
    assert "securitySchemes" not in client.get("/openapi.json").json()["components"]
    server = ServerProcess("--model", str(tiny_model_dir), "--api-key", "k").wait_ready()
    try:
        doc = httpx.get(server.url + "/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert "401" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]
        assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    finally:
        server.stop()
