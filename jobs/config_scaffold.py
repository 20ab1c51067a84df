"""``dagster job scaffold_config`` for every job of this code location.

Dagster's config scaffolder (``dagster._cli.config_scaffolder.scaffold_type``, Dagster 1.13) knows
the scalars String, Int and Bool only. It fails with ``Do not know how to scaffold None`` on a
*scalar union*, which is what Dagster makes of a pythonic-config ``str`` / ``int`` / ``bool`` field
without a default (``StringSource`` / ``IntSource`` / ``BoolSource``: ``batch_inference``'s
``job_key``, ``gear_shift``'s ``to_gear_id``) and of its own filesystem IO manager's ``base_dir``
(every asset job), and with a ``KeyError`` on a ``Float`` without a default.

:func:`install` wraps it: a scalar union scaffolds as its scalar side, a Float as ``0.0``, and every
other type is left to Dagster. ``definitions.py`` installs it when it is loaded by the Dagster CLI
(which imports the scaffolder before it loads the code location); nothing else changes.
"""

from __future__ import annotations

import sys
from typing import Any

#: The scaffolder's module; patched only when something (the Dagster CLI) has imported it.
SCAFFOLDER_MODULE = "dagster._cli.config_scaffolder"
#: Placeholder of each scalar in a scaffold (Dagster's own for String, Int and Bool).
SCALAR_PLACEHOLDERS: dict[str, Any] = {"String": "", "Int": 0, "Bool": True, "Float": 0.0}


def install(force_import: bool = False) -> bool:
    """Wrap Dagster's ``scaffold_type`` (once) so scalar unions and Floats scaffold; returns whether it is installed.

    Args:
        force_import: import the scaffolder if it is not loaded yet (tests); by default only an
            already imported one is patched, so loading the code location does not pull in Dagster's CLI.
    """
    module: Any = sys.modules.get(SCAFFOLDER_MODULE)
    if module is None and force_import:
        import importlib

        module = importlib.import_module(SCAFFOLDER_MODULE)
    if module is None:
        return False
    if getattr(module.scaffold_type, "flexpipe_wrapped", False):
        return True
    from dagster._config import ConfigTypeKind

    dagster_scaffold_type = module.scaffold_type

    def scaffold_type(config_type, skip_non_required: bool = True):
        """Dagster's ``scaffold_type``, plus scalar unions (as their scalar) and Float scalars."""
        if config_type.kind == ConfigTypeKind.SCALAR_UNION:
            return scaffold_type(config_type.scalar_type, skip_non_required)
        if config_type.kind == ConfigTypeKind.SCALAR and config_type.given_name in SCALAR_PLACEHOLDERS:
            return SCALAR_PLACEHOLDERS[config_type.given_name]
        return dagster_scaffold_type(config_type, skip_non_required)

    scaffold_type.flexpipe_wrapped = True  # type: ignore[attr-defined]
    module.scaffold_type = scaffold_type  # the scaffolder recurses through this module attribute
    return True
