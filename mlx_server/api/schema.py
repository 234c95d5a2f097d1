"""Pydantic building blocks shared by the Anthropic and Responses request schemas."""

from __future__ import annotations

import typing
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Tag


class Lenient(BaseModel):
    """Unknown fields are accepted and ignored; types are strict (`"stream": "yes"` is a 400)."""

    model_config = ConfigDict(extra="allow", strict=True)


def by_type(*models: type[BaseModel], default: str | None = None):
    """A union of models told apart by their `type` literal (`default` when a dict has none).

    Tags are the class names: error paths skip capitalised union labels (api/errors.py), so a
    bad field reads `messages[0].content[1].id`, not `...content[1].tool_use.id`.
    """
    tags = {}
    for model in models:
        for value in typing.get_args(model.model_fields["type"].annotation):
            if isinstance(value, str):
                tags[value] = model.__name__

    def tag_of(value):
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    expected = ", ".join(f"'{t}'" for t in tags)
    return Annotated[
        Union[tuple(Annotated[m, Tag(m.__name__)] for m in models)],
        Discriminator(tag_of, custom_error_type="invalid_tag", custom_error_message=f"type must be one of {expected}"),
    ]
