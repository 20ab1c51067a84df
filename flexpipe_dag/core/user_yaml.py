"""YAML and JSON that users hand in (cluster profiles, control files, gears, model configs): read strictly.

PyYAML's ``safe_load`` takes the last of two equal keys without a word and expands aliases, so a
few hundred bytes of nested aliases (a "billion laughs" file) can take minutes and gigabytes to
read. User files need neither. :func:`load_user_yaml` refuses, with the line they are on:

* any alias (``*name``): a user file writes its values out;
* a duplicate mapping key (the later value would silently win);
* nesting deeper than :data:`MAX_NESTING_DEPTH` levels (before the parser's recursion runs out);
* any tag but the YAML 1.2 core schema's (``!!str``, ``!!int``, ``!!float``, ``!!bool``, ``!!null``,
  ``!!map``, ``!!seq``): ``!!binary``, ``!!timestamp``, ``!!set``, ``!!omap``, ``!!pairs``, merge keys
  (``<<``) and local ``!tags`` are refused. An unquoted date (``2024-01-01``) reads as a string.

Numbers follow YAML 1.2 as well as 1.1: ``1e9`` and ``-2.5E-3`` are floats (PyYAML alone reads
``1e9`` as a string); YAML 1.1's ``yes`` / ``on`` are still booleans, and the pydantic models that
take the document refuse a boolean where a number belongs.

:func:`load_user_json` does the same for JSON: duplicate keys and ``NaN`` / ``Infinity`` are
refused, and nesting too deep for the parser is an error, not a crash. Every failure (including a
``MemoryError`` or ``RecursionError`` inside the parser) is one :class:`~flexpipe_dag.core.errors.InputError` naming the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node
from yaml.resolver import Resolver

from flexpipe_dag.core.errors import InputError, one_line, shown
from flexpipe_dag.core.user_files import MAX_JSON_BYTES, MAX_YAML_BYTES, read_user_text

#: Deepest nesting of mappings / lists a user file may have (real files use a handful of levels).
MAX_NESTING_DEPTH = 64
_FLOAT_TAG = "tag:yaml.org,2002:float"
#: The tags a user file may hold, written or implied: YAML 1.2's core schema.
CORE_TAGS = frozenset(f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "map", "seq"))
# YAML 1.2 core-schema floats, plus YAML 1.1's forms PyYAML already knows (1_000.5, .inf, .nan, 60:30.5)
_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                          |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                          |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                          |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
                          |[-+]?\.(?:inf|Inf|INF)
                          |\.(?:nan|NaN|NAN))$""", re.X)


class _StrictChecks(Composer, SafeConstructor):
    """The checks of a strict loader: aliases, duplicate mapping keys, nesting deeper than
    :data:`MAX_NESTING_DEPTH` and tags outside the core schema are refused (composed in Python)."""

    _depth = 0

    if TYPE_CHECKING:  # the event source: PyYAML's Parser, or libyaml's CParser
        def check_event(self, *choices: Any) -> bool: ...
        def peek_event(self) -> Any: ...

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{one_line(event.anchor, 40)}) are not accepted in this file; write the value "
                            "out", event.start_mark)
        if self._depth >= MAX_NESTING_DEPTH:
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_NESTING_DEPTH} levels; expected a few levels of mappings",
                event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        if node.tag not in CORE_TAGS:
            tag = node.tag.removeprefix("tag:yaml.org,2002:")
            raise ConstructorError(None, None, f"tag {shown(tag, 80)} is not accepted in this file; expected plain "
                                               "strings, numbers, booleans, null, mappings and lists",
                                   node.start_mark)
        return super().construct_object(node, deep=deep)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key (a list or mapping used as a key): PyYAML says so below
                continue
            if duplicate:
                raise ConstructorError(None, None, f"duplicate key {shown(key, 80)}; each figure may appear once",
                                       key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _StrictLoader(_StrictChecks, yaml.SafeLoader):
    """SafeLoader with :class:`_StrictChecks` (pure Python: its errors name the line and column)."""


# resolvers are per class: keep SafeLoader's core-schema ones (no timestamp, merge or value), with the float
# pattern widened to YAML 1.2's
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _FLOAT_TAG and tag in CORE_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver(_FLOAT_TAG, _FLOAT_RE, list("-+0123456789."))

#: The loader a valid file is read with: :class:`_StrictLoader`'s checks over libyaml's scanner and
#: parser where PyYAML has it (events from C, composed and constructed in Python): several times faster
#: on a large inventory. A file it refuses is read again by :class:`_StrictLoader` for its message.
_VALID_FILE_LOADER: Any = _StrictLoader
if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _FastStrictLoader(_StrictChecks, CParser, Resolver):
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    _FastStrictLoader.yaml_implicit_resolvers = _StrictLoader.yaml_implicit_resolvers
    _VALID_FILE_LOADER = _FastStrictLoader


def load_user_yaml(text: str, source: str) -> Any:
    """Parse ``text`` (YAML, so JSON too) from the user file ``source``.

    Returns:
        The document (``None`` for an empty one).

    Raises:
        InputError: not YAML, a duplicate key, an alias, or nesting deeper than
            :data:`MAX_NESTING_DEPTH` (``source`` named, with the line where the parser stopped).
    """
    if _VALID_FILE_LOADER is not _StrictLoader:
        try:
            return yaml.load(text, Loader=_VALID_FILE_LOADER)  # a strict safe loader
        except (yaml.YAMLError, RecursionError, MemoryError, ValueError):
            pass  # read again below, for PyYAML's own message with its line and column
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = " ".join(filter(None, (exc.context, exc.problem))) or "cannot parse"
        raise InputError(source, None, f"not valid YAML/JSON: {one_line(problem, 300)}{where}") from None
    except yaml.YAMLError as exc:
        raise InputError(source, None, f"not valid YAML/JSON: {one_line(' '.join(str(exc).split()), 300)}") from None
    except (RecursionError, MemoryError):
        raise InputError(source, None, "nested too deeply or too large to read; expected a few levels of "
                                       "mappings") from None
    except ValueError as exc:  # e.g. an integer beyond Python's digit limit for int()
        raise InputError(source, None, f"not valid YAML/JSON: {one_line(str(exc), 200)}") from None


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {shown(key, 80)}; each figure may appear once")
        out[key] = value
    return out


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows; expected a finite number")


class NonFiniteConstant:
    """A ``NaN`` / ``Infinity`` / ``-Infinity`` read with ``load_user_json(constants=True)``: a value no field
    check accepts (not a float, so not mistaken for a missing value; not a string), shown by its name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def load_user_json(text: str, source: str, *, constants: bool = False) -> Any:
    """Parse ``text`` as JSON from the user file ``source``: duplicate keys, ``NaN`` / ``Infinity`` refused.

    Args:
        constants: read ``NaN`` / ``Infinity`` as a :class:`NonFiniteConstant` instead of refusing the
            document (for callers that check every field themselves and name the bad one, as the prompts
            reader does).

    Returns:
        The document.

    Raises:
        InputError: not JSON (with the line and column), a duplicate key, a non-finite constant, or
            nesting deeper than the parser's recursion allows (``source`` named).
    """
    try:
        if constants:
            return json.loads(text, object_pairs_hook=_refuse_duplicates, parse_constant=NonFiniteConstant)
        return json.loads(text, object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise InputError(source, None, f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except (RecursionError, MemoryError):
        raise InputError(source, None, "nested too deeply or too large to read; expected a few levels of objects") from None
    except ValueError as exc:
        raise InputError(source, None, f"not valid JSON: {one_line(str(exc), 300)}") from None


def load_user_document(path: str | Path, what: str) -> Any:
    """Read and parse the user file ``path``: JSON when it ends in ``.json``, else YAML.

    The file is read with a size cap (:data:`~flexpipe_dag.core.user_files.MAX_JSON_BYTES` for JSON,
    :data:`~flexpipe_dag.core.user_files.MAX_YAML_BYTES` for YAML) and parsed by :func:`load_user_json`
    or :func:`load_user_yaml`.

    Args:
        path: the file.
        what: what it should hold, for messages (``"cluster profile"``).

    Raises:
        InputError: an empty path, missing, not a regular file, over the cap, not UTF-8, or not valid
            JSON / YAML (file named).
    """
    if str(path) == "":  # Path("") is ".", the working directory: the user named no file
        raise InputError(None, None, f"an empty file name; expected the path of a {what}")
    path = Path(path)
    is_json = path.suffix.lower() == ".json"
    what = f"{what} ({'JSON' if is_json else 'YAML or JSON'})"
    text = read_user_text(path, MAX_JSON_BYTES if is_json else MAX_YAML_BYTES, what=what)
    return load_user_json(text, str(path)) if is_json else load_user_yaml(text, str(path))
