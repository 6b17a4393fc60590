"""Constraints as the front end sees them (torch-free, so the API server and the client import it
cheaply): the cache key of a constraint, and `check_constraint`, which parses its schema / regex /
grammar with xgrammar (imported on first use) to refuse a bad one with a message. The engine side,
compiling and masking, is structured.py."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache

from specserve.sampling_params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per engine (a JSON schema's is tens of KB)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and checks with "Check failed: ...:")
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")

Constraint = tuple[str, str]  # (kind, text): the cache key of a constraint


def constraint_key(c: StructuredOutputsParams) -> Constraint:
    """(kind, text) naming the constraint: its cache key. A schema dict is keyed by its JSON text, keys
    in the dict's order (the order of `properties` is the order the output keeps)."""
    if c.json is not None:
        return "json", c.json if isinstance(c.json, str) else json.dumps(c.json)
    if c.json_object:
        return "json", JSON_OBJECT_SCHEMA
    if c.regex is not None:
        return "regex", c.regex
    if c.choice is not None:
        return "grammar", choice_grammar(c.choice)
    return "grammar", c.grammar


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices)


_WHAT = {"json": "invalid JSON schema", "regex": "invalid regex", "grammar": "invalid grammar"}


def _parse(key: Constraint):
    """The constraint as an xgrammar Grammar (tokenizer-free), or ValueError naming the problem."""
    import xgrammar as xgr

    kind, text = key
    try:
        if kind == "json":
            # one canonical layout (", " and ": " separators, no free whitespace): a free-whitespace
            # grammar lets small models spend max_tokens on newlines before the first key
            return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{_WHAT[kind]}: {_clean(e)}") from None


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _check(key: Constraint) -> None:
    _parse(key)


def check_constraint(c: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem ("invalid regex: ...") if the constraint's schema / regex /
    grammar is invalid (cached: a constraint seen before costs a dict lookup)."""
    _check(constraint_key(c))


def _clean(error: BaseException) -> str:
    text = str(error).strip()
    return _LOCATION.sub("", text.splitlines()[0]) if text else type(error).__name__
