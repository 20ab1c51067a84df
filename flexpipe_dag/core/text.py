"""Text checks shared by every input surface (prompts files, the HTTP front door, the Batch API)."""

from __future__ import annotations

from typing import Any

#: What a field holding a lone surrogate is told (after its name): the same words on every input surface.
LONE_SURROGATE_PROBLEM = ("holds a lone UTF-16 surrogate (e.g. \\ud800), which is not Unicode text; "
                          "expected valid UTF-8 text")

def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where a parsed JSON value holds a string (or key) that is no Unicode text: a lone UTF-16
    surrogate such as ``"\\ud800"``, which JSON's escapes allow and UTF-8 cannot encode. The path is
    dotted as a client wrote it (``messages.0.content``; ``""`` is the value itself); None when all is text.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and lone_surrogate_path(key) is not None:
            return path or "(a key)"
        found = lone_surrogate_path(item, where)
        if found is not None:
            return found
    return None
