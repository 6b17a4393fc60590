"""The structured-output fields of a request (either protocol) -> one StructuredOutputsParams.

Accepted, as OpenAI and vLLM name them:
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`
  (the schema is always enforced, whatever `strict` says);
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`;
- vLLM's older names: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of them may constrain a request. The constraint is parsed here (a schema, regex or
grammar that does not parse is refused with the parser's message and the field it came in), so a
bad one never reaches the engine; the grammar engine itself: sample/structured.py.
"""
from __future__ import annotations

from typing import Any

from specserve.sample.grammars import check_constraint
from specserve.sampling_params import StructuredOutputsParams
from specserve.server.validation import InputError

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _fail(message: str, param: str) -> InputError:
    return InputError("invalid_parameter", message, param=param)


def _from_response_format(rf: Any) -> dict[str, Any] | None:
    if not isinstance(rf, dict):
        raise _fail("response_format must be an object such as {\"type\": \"json_object\"}", "response_format")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _fail(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}",
                    "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise _fail("response_format of type json_schema needs a json_schema object: {\"name\": ..., "
                    "\"schema\": {...}}", "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _fail("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return {"json": schema}


def _from_structured_outputs(so: Any) -> dict[str, Any]:
    if not isinstance(so, dict):
        raise _fail("structured_outputs must be an object with one of " + ", ".join(STRUCTURED_KEYS),
                    "structured_outputs")
    unknown = sorted(k for k in so if k not in STRUCTURED_KEYS)
    if unknown:
        raise _fail(f"structured_outputs: {', '.join(unknown)} not supported; it takes one of "
                    + ", ".join(STRUCTURED_KEYS), "structured_outputs")
    return {k: v for k, v in so.items() if v is not None}


def _typed(fields: dict[str, Any], param: str) -> None:
    """Each constraint's value has the type it needs (the messages name the field)."""
    checks = {"json": (str, dict), "regex": (str,), "grammar": (str,), "json_object": (bool,), "choice": (list,)}
    for key, value in fields.items():
        if not isinstance(value, checks[key]) or (key != "json_object" and isinstance(value, bool)):
            want = {"json": "a JSON schema (an object, or its text)", "regex": "a string", "grammar": "a string",
                    "json_object": "true or false", "choice": "a list of strings"}[key]
            raise _fail(f"{param}: {key} must be {want}", param)


def structured_outputs_from(response_format: Any = None, structured_outputs: Any = None,
                            guided: dict[str, Any] | None = None) -> StructuredOutputsParams | None:
    """The request's constraint (None: unconstrained), or InputError naming the field at fault."""
    sources: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None:
        fields = _from_response_format(response_format)
        if fields is not None:
            sources.append(("response_format", fields))
    if structured_outputs is not None:
        sources.append(("structured_outputs", _from_structured_outputs(structured_outputs)))
    for name, value in (guided or {}).items():
        if value is not None:
            sources.append((name, {GUIDED_FIELDS[name]: value}))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise _fail(f"give one structured-output constraint, not several ({names})", sources[1][0])
    param, fields = sources[0]
    _typed(fields, param)
    try:
        constraint = StructuredOutputsParams(**fields)
    except ValueError as e:  # several keys in structured_outputs, or an empty choice
        raise _fail(str(e), param) from None
    try:
        check_constraint(constraint)
    except ValueError as e:
        raise _fail(f"{param}: {e}", param) from None
    return constraint
