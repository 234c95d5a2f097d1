"""Validate our OpenAI-shaped output against OpenAI's own API description (tests/data/openai-openapi.json)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jsonschema import Draft202012Validator

SPEC = Path(__file__).parent / "data" / "openai-openapi.json"


def _or_null(node):
    """OpenAPI's `nullable: true` means "or null"; JSON Schema spells that with anyOf."""
    if isinstance(node, list):
        return [_or_null(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _or_null(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def _components() -> dict:
    return _or_null(json.loads(SPEC.read_text())["components"])


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": _components()})


def assert_valid(name: str, obj) -> None:
    errors = sorted(validator(name).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:5])
