"""Kimi-K2.5's tool declarations: OpenAI tools written as a TypeScript namespace.

Kimi-K2.5 was trained on tools declared as TypeScript function types, not as the JSON of the
request. Its checkpoint builds that text in Python (`tool_declaration_ts.py`, called by
`tokenization_kimi.py`) and hands it to the chat template as `tools_ts_str`; checkpoint code
never runs here, so this module writes the same text:

    # Tools

    ## functions
    namespace functions {
    // Get the weather.
    type get_weather = (_: {
      city: string,
      // Default: "celsius"
      unit?: "celsius" | "fahrenheit"
    }) => any;
    }

Required fields come first, each group sorted by name; descriptions, constraints and
defaults become `//` comments; `integer` is `number`; local `$defs` become interfaces and
`$ref` "#" names the root `parameters` interface. A schema the format cannot express raises
`ToolDeclarationError`; the template then declares the tools as compact JSON instead, as the
checkpoint's tokenizer does when its encoder fails.
"""

from __future__ import annotations

import json
from typing import Any

INDENT = "  "
# the schema keywords kept as a comment on a field, by the field's type
SCALAR_CONSTRAINTS = {
    "string": ("maxLength", "minLength", "pattern"),
    "number": ("maximum", "minimum"),
    "integer": ("maximum", "minimum"),
}
ARRAY_CONSTRAINTS = ("minItems", "maxItems")
# the members of a `"type": [...]` list
TYPE_LIST_NAMES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "null": "null",
    "object": "{}",
    "array": "Array<any>",
}
ROOT_INTERFACE = "parameters"  # what `$ref: "#"` names: the function's own parameters


class ToolDeclarationError(ValueError):
    """A tool schema the TypeScript declaration cannot express."""


def sort_keys_deep(value: Any) -> Any:
    """Dicts with their keys sorted, at every depth (the checkpoint's tokenizer sorts the
    tools so before declaring them, which orders `$defs` and the JSON fallback)."""
    if isinstance(value, dict):
        return {k: sort_keys_deep(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


def comment(text: Any, indent: str = "") -> str:
    """A description as `//` lines (an empty line stays empty)."""
    if not isinstance(text, str):
        raise ToolDeclarationError(f"a description must be text, not {type(text).__name__}")
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Defs:
    """The `$defs` of one function, in the order they were met, and whether the schema
    refers to its own root."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.root_referenced = False

    def add(self, defs: Any) -> None:
        if not defs:
            return
        if not isinstance(defs, dict):
            raise ToolDeclarationError("$defs must be an object")
        self.schemas.update(defs)

    def name_of(self, ref: Any) -> str:
        if ref == "#":
            self.root_referenced = True
            return ROOT_INTERFACE
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.split("/")[-1]
            if name not in self.schemas:
                raise ToolDeclarationError(f"$ref {ref} names no definition")
            return name
        raise ToolDeclarationError(f"$ref {ref!r} is not local ('#' or '#/$defs/NAME')")


class _Type:
    """One schema node: its TypeScript text, and the comment lines a field of this type
    carries (description, then constraints)."""

    def __init__(self, schema: dict[str, Any], constraint_keys: tuple[str, ...] = ()) -> None:
        self.description = schema.get("description", "")
        self.constraints = {k: schema[k] for k in constraint_keys if k in schema}

    def text(self, indent: str) -> str:
        raise NotImplementedError

    def doc(self, indent: str) -> str:
        lines = []
        if self.description:
            lines.append(comment(self.description, indent))
        if self.constraints:
            pairs = ", ".join(f"{k}: {v}" for k, v in sorted(self.constraints.items()))
            lines.append(f"{indent}// {pairs}")
        return "".join(line + "\n" for line in lines)


class _Scalar(_Type):
    def __init__(self, name: Any, schema: dict[str, Any] | None = None) -> None:
        if not isinstance(name, str):
            raise ToolDeclarationError(f"a type must be a name, not {name!r}")
        super().__init__(schema or {}, SCALAR_CONSTRAINTS.get(name, ()))
        self.name = name

    def text(self, indent: str) -> str:
        return "number" if self.name == "integer" else self.name


class _Field:
    def __init__(self, name: str, type_: _Type, optional: bool, default: Any) -> None:
        self.name, self.type, self.optional, self.default = name, type_, optional, default

    def text(self, indent: str) -> str:
        notes = self.type.doc(indent)
        if self.default is not None:
            if isinstance(self.default, (int, float, bool)):
                shown = repr(self.default)  # Python's spelling: True, 1.0
            else:
                shown = json.dumps(self.default, ensure_ascii=False)
            notes += f"{indent}// Default: {shown}\n"
        mark = "?" if self.optional else ""
        return f"{notes}{indent}{self.name}{mark}: {self.type.text(indent)}"


class _Object(_Type):
    def __init__(self, schema: Any, defs: _Defs) -> None:
        if not isinstance(schema, dict):
            raise ToolDeclarationError("an object schema must be an object")
        super().__init__(schema)
        self.fields: list[_Field] = []
        self.extra: Any = None  # additionalProperties: None, True, False or a type
        if not schema:
            return
        if "$defs" in schema:
            defs.add(schema["$defs"])
        extra = schema.get("additionalProperties")
        self.extra = parse_schema(extra, defs) if isinstance(extra, dict) else extra
        if "properties" not in schema:
            return
        props = schema["properties"]
        if not isinstance(props, dict):
            raise ToolDeclarationError("properties must be an object")
        required = schema.get("required", [])
        optional = set(props) - set(required)
        self.fields = [
            _Field(
                name,
                parse_schema(prop, defs),
                name in optional,
                prop.get("default") if isinstance(prop, dict) else None,
            )
            for name, prop in props.items()
        ]

    def text(self, indent: str) -> str:
        inner = indent + INDENT
        ordered = sorted((f for f in self.fields if not f.optional), key=lambda f: f.name)
        ordered += sorted((f for f in self.fields if f.optional), key=lambda f: f.name)
        parts = [f.text(inner) for f in ordered]
        if self.extra is not None:
            if self.extra is True:
                extra = "any"
            elif self.extra is False:
                extra = "never"
            elif isinstance(self.extra, _Type):
                extra = self.extra.text(inner)
            else:
                raise ToolDeclarationError(f"additionalProperties {self.extra!r} is not a schema")
            parts.append(f"{inner}[k: string]: {extra}")
        if not parts:
            return "{}"
        return "{\n" + ",\n".join(parts) + "\n" + indent + "}"


class _Array(_Type):
    def __init__(self, schema: dict[str, Any], defs: _Defs) -> None:
        super().__init__(schema, ARRAY_CONSTRAINTS)
        items = schema.get("items")
        self.item = parse_schema(items, defs) if items else _Scalar("any")

    def text(self, indent: str) -> str:
        inner = indent + INDENT
        item_doc = self.item.doc(inner)
        if item_doc:  # the item's comments need lines of their own
            return f"Array<\n{item_doc}{inner}{self.item.text(inner)}\n{indent}>"
        return f"Array<{self.item.text(indent)}>"


class _Enum(_Type):
    def __init__(self, schema: dict[str, Any]) -> None:
        super().__init__(schema)
        values = schema["enum"]
        if not isinstance(values, list):
            raise ToolDeclarationError("enum must be a list")
        self.values = values
        if "type" in schema:
            _check_enum_type(schema["type"], values)

    def text(self, indent: str) -> str:
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in self.values)


def _check_enum_type(declared: Any, values: list[Any]) -> None:
    """The enum's values must be of its declared type (one type, or one type and null)."""
    if isinstance(declared, list):
        if len(declared) == 1:
            declared = declared[0]
        elif len(declared) == 2 and "null" in declared:
            declared = declared[0] if declared[0] != "null" else declared[1]
        else:
            raise ToolDeclarationError(f"an enum of type {declared} cannot be declared")
    kinds = {"string": str, "number": (int, float), "integer": int, "boolean": bool}
    want = kinds.get(declared) if isinstance(declared, str) else None
    if want is None:
        return
    for v in values:
        if v is not None and not isinstance(v, want):
            raise ToolDeclarationError(f"enum value {v!r} is not of type {declared}")


class _AnyOf(_Type):
    def __init__(self, schema: dict[str, Any], defs: _Defs) -> None:
        super().__init__(schema)
        options = schema["anyOf"]
        if not isinstance(options, list):
            raise ToolDeclarationError("anyOf must be a list")
        self.options = [parse_schema(s, defs) for s in options]

    def text(self, indent: str) -> str:
        return " | ".join(o.text(indent) for o in self.options)


class _TypeList(_Type):
    def __init__(self, schema: dict[str, Any]) -> None:
        super().__init__(schema)
        unknown = [t for t in schema["type"] if t not in TYPE_LIST_NAMES]
        if unknown:
            raise ToolDeclarationError(f"type {unknown[0]!r} cannot be part of a type list")
        self.names = [TYPE_LIST_NAMES[t] for t in schema["type"]]

    def text(self, indent: str) -> str:
        return " | ".join(self.names)


class _Ref(_Type):
    def __init__(self, schema: dict[str, Any], defs: _Defs) -> None:
        super().__init__(schema)
        self.name = defs.name_of(schema["$ref"])

    def text(self, indent: str) -> str:
        return self.name


def parse_schema(schema: Any, defs: _Defs) -> _Type:
    """One JSON-schema node; the keywords are tried in the reference encoder's order."""
    if isinstance(schema, bool):
        return _Scalar("any" if schema else "null")
    if not isinstance(schema, dict):
        raise ToolDeclarationError(f"{schema!r} is not a JSON schema")
    if "$ref" in schema:
        return _Ref(schema, defs)
    if "anyOf" in schema:
        return _AnyOf(schema, defs)
    if "enum" in schema:
        return _Enum(schema)
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, list):
            return _TypeList(schema)
        if kind == "object":
            return _Object(schema, defs)
        if kind == "array":
            return _Array(schema, defs)
        return _Scalar(kind, schema)
    if not schema:
        return _Scalar("any")
    raise ToolDeclarationError(f"{json.dumps(schema)[:80]} has no type")


def function_declaration(function: dict[str, Any]) -> str:
    """One function: its interfaces, its description, its type."""
    defs = _Defs()
    root = _Object(function.get("parameters") or {}, defs)
    interfaces = []
    if defs.root_referenced:
        # the fields in their declared order, as the reference writes this interface
        body = ",\n".join(f.text(INDENT) for f in root.fields)
        interfaces.append(f"interface {ROOT_INTERFACE} {{" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in list(defs.schemas.items()):  # definitions found from here on: ignored
        if not isinstance(schema, dict):
            raise ToolDeclarationError(f"$defs.{name} must be a schema object")
        note = schema.get("description", "")
        head = comment(note) + "\n" if note else ""
        interfaces.append(f"{head}interface {name} {parse_schema(schema, defs).text('')}")
    name = function.get("name", "function")
    params = ROOT_INTERFACE if defs.root_referenced else root.text("")
    description = function.get("description")
    parts = [
        "\n".join(interfaces),
        comment(description) if description else "",
        f"type {name} = (_: {params}) => any;",
    ]
    return "\n".join(p for p in parts if p)


def typescript_tool_declarations(tools: list[dict[str, Any]] | None) -> str:
    """The `tools_ts_str` of Kimi-K2.5's chat template for these OpenAI tools ('' when none
    is a function). Raises ToolDeclarationError for a schema it cannot express."""
    try:
        functions = [
            function_declaration(tool["function"])
            for tool in tools or []
            if isinstance(tool, dict) and tool.get("type") == "function" and tool.get("function")
        ]
    except (TypeError, AttributeError, KeyError) as e:  # a schema of the wrong shape
        raise ToolDeclarationError(f"a tool schema has the wrong shape: {e}") from e
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
