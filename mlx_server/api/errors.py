"""API errors and their wire shapes (OpenAI's error object; other protocols add their own)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error a client caused or must know about; rendered in the route's protocol shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def openai_error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(openai_error_body(err), status_code=err.status)


def unauthorized() -> APIError:
    return APIError(401, "Unauthorized", type="authentication_error", code="unauthorized")


def status_error(status: int, message: str) -> APIError:
    """An error from the HTTP layer itself (unknown route, wrong method, body too large...)."""
    kinds = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    return APIError(status, message, type=kinds.get(status, "invalid_request_error"), code=codes.get(status))


def anthropic_error_body(err: APIError) -> dict:
    kinds = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
    kind = kinds.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response_for(path: str, err: APIError) -> JSONResponse:
    """The error in the shape of the protocol that owns `path`."""
    if path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(err), status_code=err.status)
    return error_response(err)


_TYPE_WORDS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _field_path(loc) -> str:
    """('body', 'messages', 0, 'content', 'list[...]', 1) -> 'messages[0].content[1]'."""
    path = ""
    for i, part in enumerate(loc):
        if part == "body" and not path:
            continue
        if isinstance(part, str) and i + 1 < len(loc) and loc[i + 1] == part:
            continue  # a content part's type tag before its same-named payload: text.text
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part.lower() in _TYPE_WORDS or part[:1].isupper():
            continue  # a union branch label, not a field
        else:
            path += f".{part}" if path else part
    return path


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors as one 400 that names the fields at fault."""
    if any(e["type"] == "json_invalid" for e in errors):
        detail = next(e for e in errors if e["type"] == "json_invalid").get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    # In a union, the branches whose type did not even match only add noise.
    specific = [e for e in errors if not e["type"].endswith("_type")] or errors
    seen, parts = set(), []
    for e in specific:
        path = _field_path(e["loc"])
        text = f"{path}: {e['msg']}" if path else f"request body: {e['msg']}"
        if text not in seen:
            seen.add(text)
            parts.append(text)
    first = _field_path(specific[0]["loc"]) or None
    return APIError(400, "; ".join(parts[:3]), param=first)
