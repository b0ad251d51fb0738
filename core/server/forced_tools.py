"""``tool_choice`` that forces calls: ``"required"`` (at least one call, of any offered tool) or
``{"type": "function", "function": {"name": ...}}`` (exactly that function). The answer is generated
under a JSON schema (structured outputs), so it is the call by construction, whatever form the model's
template teaches:

- a named function: the answer is its arguments, an object following the function's ``parameters``;
- ``"required"``: the answer is a list of ``{"name": ..., "parameters": {...}}`` items, each item one of
  the offered tools with its own parameters (one item only with ``parallel_tool_calls: false``).

Contract: :func:`forced_schema` gives the schema for a request (None when nothing is forced) and raises
``RequestError`` naming ``tool_choice`` for a choice that cannot be honoured; :func:`forced_calls` turns
the finished answer into OpenAI's ``tool_calls`` (None when a cut answer is no complete list).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pegainfer.errors import RequestError

PARAM = "tool_choice"


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The offered functions by name (OpenAI's ``{"type": "function", "function": {...}}`` entries)."""
    functions = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError("each tool needs a function with a name", param="tools")
        functions[function["name"]] = function
    return functions


def forced_name(tool_choice: Any) -> str | None:
    """The function a ``tool_choice`` object names; None for the string choices."""
    if isinstance(tool_choice, str):
        return None
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError('tool_choice must be {"type": "function", "function": {"name": ...}}', param=PARAM)
    return function["name"]


def forces_calls(tool_choice: Any) -> bool:
    """Whether a ``tool_choice`` forces calls (once the request is validated: "required" or a function)."""
    return tool_choice is not None and tool_choice not in ("none", "auto")


def forced_schema(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> dict[str, Any] | None:
    if not forces_calls(tool_choice):
        return None
    if isinstance(tool_choice, str) and tool_choice != "required":
        raise RequestError("tool_choice must be 'none', 'auto', 'required' or a named function", param=PARAM)
    functions = _functions(tools)
    if not functions:
        raise RequestError("tool_choice forces a call, but no tools are offered", param=PARAM)
    name = forced_name(tool_choice)
    if name is not None:
        if name not in functions:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", param=PARAM)
        return {**_parameters(functions[name]), "x-guidance": LENIENT}
    # Each function's parameters move under the root's $defs (its own $defs with them), their local refs
    # rewritten to point there: a "#/$defs/X" or a recursive "#" keeps meaning what it meant in the tool.
    defs = {
        f"tool{i}": _relocated(_parameters(f), f"#/$defs/tool{i}") for i, f in enumerate(functions.values())
    }
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [fname]},
                "parameters": {"$ref": f"#/$defs/tool{i}"},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, fname in enumerate(functions)
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs, "x-guidance": LENIENT}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


#: A tool's parameters may use JSON Schema keywords the grammar cannot enforce (uniqueItems, not...):
#: they are left unenforced rather than failing the request.
LENIENT = {"lenient": True}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


def _relocated(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` ("#...") made relative to ``base`` (where it will sit)."""
    if isinstance(schema, dict):
        return {
            key: base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _relocated(value, base)
            for key, value in schema.items()
        }  # fmt: skip
    if isinstance(schema, list):
        return [_relocated(value, base) for value in schema]
    return schema


def forced_calls(text: str, tool_choice: Any) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of a forced answer. A named function's call keeps the text as its
    arguments even when cut short (as OpenAI's answers cut by ``max_tokens`` do); a cut ``"required"``
    list is no calls (None)."""
    name = forced_name(tool_choice)
    if name is not None:
        return [_call(name, text)]
    try:
        items = json.loads(text)
    except ValueError:
        return None
    # The grammar makes this shape; a stop string cutting the answer could leave some other valid JSON.
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
    ):
        return None
    return [_call(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)) for item in items]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
