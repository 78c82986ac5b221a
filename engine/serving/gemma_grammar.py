"""Gemma 4's tool calls as a grammar: a tool's JSON Schema written as rules over Gemma's own value
syntax (format_gemma.py reads it back), for `tool_choice` required or named.

A call is `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`; a string is text between two
`<|"|>` tokens; numbers, booleans and null are JSON's, so their schemas are embedded as `%json`
(bounds, enums and all); objects, lists and strings are written here. What is covered:
`type` (one or a list), `enum` and `const`, `properties` with `required` (the required
properties, in the schema's order: an optional one is left out, which the schema allows),
`items`, `anyOf` / `oneOf`, local `$ref`s (`#/$defs/...`, `#/definitions/...`), a string's
`maxLength` / `minLength`. A keyword that would constrain the value further and is not covered
(`pattern`, `format`, `minItems`, ...) is refused naming it, never ignored: an answer always
validates against the tool's schema. Descriptions and titles are free.

The special tokens are named `<%NAME%>` (engine.decoding.grammar puts in their ids).
"""

from __future__ import annotations

import json
import re
from typing import Any

CALL, END_CALL, QUOTE = "<%<|tool_call>%>", "<%<tool_call|>%>", '<%<|"|>%>'
FREE = {"description", "title", "examples", "default", "$comment", "additionalProperties", "$defs",
        "definitions", "$schema", "$id", "type", "enum", "const", "properties", "required", "items", "anyOf",
        "oneOf", "$ref", "maxLength", "minLength", "x-guidance"}
SCALARS = ("integer", "number", "boolean", "null")
MAX_RULES = 2000  # rules one call's grammar may take (a schema with many $refs inlined)
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class GemmaSchemaError(ValueError):
    """A schema this grammar cannot enforce; the message names what."""


def gemma_call_rules(tools: list[tuple[str, dict[str, Any]]], one: bool) -> list[str]:
    """Lark rules `calls` and `call` for (name, parameters schema) tools."""
    writer = _Writer()
    alternatives = [f'{CALL} {json.dumps("call:" + name)} {writer.value(schema, schema)} {END_CALL}'
                    for name, schema in tools]
    return ["calls: call" if one else "calls: call+", "call: " + " | ".join(alternatives), *writer.rules]


class _Writer:
    def __init__(self) -> None:
        self.rules: list[str] = []

    def _rule(self, body: str) -> str:
        if len(self.rules) >= MAX_RULES:
            raise GemmaSchemaError("the tool's schema is too large to write as Gemma's call syntax")
        name = f"g{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: object, root: dict[str, Any], seen: tuple[str, ...] = ()) -> str:
        """The rule name (or inline expression) of values that `schema` allows."""
        if schema is True or schema == {}:
            raise GemmaSchemaError("a value of any type cannot be written as Gemma's call syntax")
        if not isinstance(schema, dict):
            raise GemmaSchemaError("a schema that is not an object")
        for key in schema:
            if key not in FREE:
                raise GemmaSchemaError(f"the keyword '{key}'")
        if "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or ref in seen:
                raise GemmaSchemaError("a recursive or non-local $ref")
            return self.value(_resolve(root, ref), root, (*seen, ref))
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values:
                raise GemmaSchemaError("an empty enum")
            return self._rule(" | ".join(_literal(v) for v in values))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise GemmaSchemaError(f"an empty {key}")
                return self._rule(" | ".join(self.value(o, root, seen) for o in options))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._rule(" | ".join(self.value({**schema, "type": k}, root, seen) for k in kind))
        if kind in SCALARS:
            return "%json " + json.dumps({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            if not isinstance(low, int) or (high is not None and not isinstance(high, int)):
                raise GemmaSchemaError("a string length that is not a whole number")
            text = f"/(.|\\n){{{low},{high}}}/" if high is not None else f"/(.|\\n){{{low},}}/"
            return self._rule(f"{QUOTE} {text} {QUOTE}")
        if kind == "array":
            item = self.value(schema.get("items", {}), root, seen) if "items" in schema else None
            if item is None:
                raise GemmaSchemaError("a list without an items schema")
            return self._rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" or "properties" in schema:
            props = schema.get("properties", {})
            required = schema.get("required", [])
            if not isinstance(props, dict) or not isinstance(required, list):
                raise GemmaSchemaError("properties or required of the wrong type")
            parts = []
            for key in props:
                if key in required:
                    name = json.dumps(key + ":") if _KEY.fullmatch(key) else f'{QUOTE} {json.dumps(key)} {QUOTE} ":"'
                    parts.append(f"{name} {self.value(props[key], root, seen)}")
            missing = [k for k in required if k not in props]
            if missing:
                raise GemmaSchemaError(f"a required property without a schema ('{missing[0]}')")
            inner = ' "," '.join(parts)
            return self._rule(f'"{{" {inner} "}}"')
        raise GemmaSchemaError(f"the type {kind!r}")


def _literal(value: object) -> str:
    if isinstance(value, str):
        return f"{QUOTE} {json.dumps(value)} {QUOTE}" if value else f"{QUOTE} {QUOTE}"
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        return json.dumps(json.dumps(value))
    raise GemmaSchemaError("an enum of lists or objects")


def _resolve(root: dict[str, Any], ref: str) -> object:
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix):
            table = root.get(prefix[2:-1])
            name = ref[len(prefix):]
            if isinstance(table, dict) and name in table:
                return table[name]
    raise GemmaSchemaError(f"the $ref {ref[:60]!r}")
