"""The one table of numeric dtypes FlexPipe plans and computes in.

Each dtype has a canonical name (what gears, calibrations and the CLI carry), the other spellings
accepted for it (torch's, e.g. ``float16``), its bytes per element, the bytes per element of the
activations and KV cache that go with weights in it, and the name of the matching ``torch`` dtype
as a string (no torch import here; the runtime does ``getattr(torch, torch_name)``).

``int8`` and ``int4`` are weight-only quantisation formats: the planner sizes weights with them, but
the KV cache and activations stay 16-bit and the runtime does not compute in them (no torch name).

API:
    * :data:`DTYPES`: the table, in the order the CLI and error messages list it.
    * :data:`DTYPE_NAMES`: the canonical names, same order.
    * :func:`lookup_dtype`: a name or alias -> its :class:`DType`; :class:`InputError` otherwise.
    * :func:`canonical_dtype`: a name or alias -> its canonical name.
    * :func:`dtype_bytes`: bytes per element of a dtype.
    * :func:`compute_dtype`: like :func:`lookup_dtype`, for a dtype the runtime computes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from flexpipe_dag.core.errors import InputError, shown


@dataclass(frozen=True)
class DType:
    """One numeric dtype.

    Attributes:
        name: canonical name (``fp32``, ``bf16``, ``fp16``, ``int8``, ``int4``).
        bytes_per_element: bytes one element takes (0.5 for int4; quantisation scales not counted).
        activation_bytes: bytes per element of the activations and the KV cache when the weights
            are in this dtype: 4 for fp32, else 2 (quantised weights keep a 16-bit KV cache).
        torch_name: the ``torch`` attribute of the matching dtype (``"float32"``), or ``None`` for a
            weight-only format the runtime does not compute in.
        aliases: other accepted spellings of the name.
    """

    name: str
    bytes_per_element: float
    activation_bytes: float
    torch_name: str | None
    aliases: tuple[str, ...] = ()


#: Every dtype, in the order the CLI and the error messages list them.
DTYPES: Final[tuple[DType, ...]] = (
    DType("fp32", 4.0, 4.0, "float32", ("float32",)),
    DType("bf16", 2.0, 2.0, "bfloat16", ("bfloat16",)),
    DType("fp16", 2.0, 2.0, "float16", ("float16",)),
    DType("int8", 1.0, 2.0, None),
    DType("int4", 0.5, 2.0, None),
)
#: The canonical names, in table order.
DTYPE_NAMES: Final[tuple[str, ...]] = tuple(d.name for d in DTYPES)
#: Every accepted spelling (canonical names and aliases) -> its dtype.
_BY_NAME: Final[dict[str, DType]] = {n: d for d in DTYPES for n in (d.name, *d.aliases)}


def _accepted(dtypes: tuple[DType, ...]) -> str:
    names = ", ".join(d.name for d in dtypes)
    aliases = ", ".join(a for d in dtypes for a in d.aliases)
    return f"{names} (or {aliases})" if aliases else names


def lookup_dtype(name: str, source: str | None = None, field: str | None = "dtype") -> DType:
    """The dtype called ``name`` (a canonical name or an alias).

    Raises:
        InputError: ``name`` is not a known dtype; the error names ``source`` and ``field`` and
            lists the accepted names.
    """
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise InputError(source, field, f"unknown dtype {shown(name)}; expected one of {_accepted(DTYPES)}") from None


def canonical_dtype(name: str, source: str | None = None, field: str | None = "dtype") -> str:
    """The canonical name of ``name`` (``float16`` -> ``fp16``); :class:`InputError` if unknown."""
    return lookup_dtype(name, source, field).name


def dtype_bytes(name: str, source: str | None = None, field: str | None = "dtype") -> float:
    """Bytes per element of ``name``; :class:`InputError` if unknown."""
    return lookup_dtype(name, source, field).bytes_per_element


def compute_dtype(name: str, source: str | None = None, field: str | None = "dtype") -> DType:
    """The dtype called ``name``, which the runtime must be able to compute in (it has a torch name).

    Raises:
        InputError: ``name`` is unknown, or a weight-only format (``int8``, ``int4``).
    """
    dtype = lookup_dtype(name, source, field)
    if dtype.torch_name is None:
        computable = tuple(d for d in DTYPES if d.torch_name is not None)
        raise InputError(source, field, f"dtype {shown(name)} is a weight-only planning format the runtime does not "
                                        f"compute in; expected one of {_accepted(computable)}")
    return dtype
