"""YAML that users hand in (cluster profiles, control files, gears): read strictly.

PyYAML's ``safe_load`` takes the last of two equal keys without a word and expands aliases, so a
few hundred bytes of nested aliases (a "billion laughs" file) can take minutes and gigabytes to
read. User files need neither: a duplicate key and an alias are refused with the line they are
on, and nesting too deep for the parser is refused instead of crashing it.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node

from flexpipe_dag.core.errors import InputError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and duplicate mapping keys."""

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]  # PyYAML's stubs leave it untyped
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{event.anchor}) are not accepted in this file; write the value out",
                event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConstructorError(None, None, f"duplicate key {key!r}; each figure may appear once",
                                       key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_user_yaml(text: str, source: str) -> Any:
    """Parse ``text`` (YAML, so JSON too) from the user file ``source``.

    Returns:
        The document (``None`` for an empty one).

    Raises:
        InputError: not YAML, a duplicate key, an alias, or nesting too deep (``source`` named, with
            the line where the parser stopped).
    """
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = " ".join(filter(None, (exc.context, exc.problem))) or "cannot parse"
        raise InputError(source, None, f"not valid YAML/JSON: {problem}{where}") from None
    except yaml.YAMLError as exc:
        raise InputError(source, None, f"not valid YAML/JSON: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise InputError(source, None, "nested too deeply to read; expected a few levels of mappings") from None
