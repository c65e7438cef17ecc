"""One line per configuration field, read from the comment that documents it in its dataclass.

A field's description is its inline comment (`name: int = 1  # what it is`; when the formatter
wraps a long assignment over several lines, the comment inside it), else the comment lines right
above it (a `# --- section ---` rule is a heading, not a description). Keeping the text in the
source beside the field, as Megatron-Core's config dataclasses do, means one place to edit;
`overlap explain --list-keys` prints it next to the key. An inherited field's comment is in the
class that declares it (ModelConfig's architecture fields are `TransformerArchitecture`'s), so the
classes are read base first and a subclass that declares a field again has the last word.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import textwrap
import tokenize
from dataclasses import fields, is_dataclass


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """`{field name: description}` for the dataclass `cls` (fields without a comment are absent)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if is_dataclass(klass):
            docs.update(_declared_docs(klass))
    names = {f.name for f in fields(cls)}
    return {name: text for name, text in docs.items() if name in names}


@functools.cache
def _declared_docs(cls: type) -> dict[str, str]:
    """The descriptions of the fields declared in the body of `cls` itself."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line number (1-based, in `source`) -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
        ):
            code_lines.add(tok.start[0])
    spans = {
        node.target.id: range(node.lineno, node.end_lineno + 1)
        for node in ast.parse(source).body[0].body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    out = {}
    for name, span in spans.items():
        inline = [comments[row] for row in span if row in comments]
        if inline:
            out[name] = " ".join(inline)
            continue
        above = []
        row = span.start - 1
        while row in comments and row not in code_lines and not comments[row].startswith("---"):
            above.insert(0, comments[row])
            row -= 1
        if above:
            out[name] = " ".join(above)
    return out
