"""GPU prices for capacity planning: the bundled example file, or the user's ``--price-file``.

A price file (YAML or JSON)::

    currency: USD                # optional, default USD
    as_of: "2024"                # optional: when the prices were read
    source: "where they come from"
    per_gpu_hour:                # price of one GPU for one hour, > 0 and finite
      A100-SXM-80GB: 5.12
      T4: 0.53

Every key of ``per_gpu_hour`` must be a GPU model of the datasheet catalog
(``flexpipe_dag/data/gpu_specs.yaml``, e.g. ``T4``, ``L4``, ``A100-SXM-80GB``). The bundled
``flexpipe_dag/data/gpu_prices.yaml`` holds *examples* (public on-demand list prices of one cloud,
provenance in the file), not a quote.
"""

from __future__ import annotations

import importlib.resources
import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from flexpipe_dag.core.catalog import gpu_catalog
from flexpipe_dag.core.errors import InputError, shown, validation_input_error
from flexpipe_dag.core.ids import PrintableText
from flexpipe_dag.core.user_yaml import load_user_document, load_user_yaml

#: The bundled example prices (package data).
BUNDLED_PRICE_FILE = "gpu_prices.yaml"
#: Largest price per GPU-hour accepted: a typo guard (the dearest cloud GPU lists near $15/h).
MAX_PRICE_PER_GPU_HOUR = 1e4
#: Smallest price per GPU-hour accepted: a typo guard too (the cheapest spot GPUs list near $0.05/h); at 1e-320 (a
#: subnormal float) the ILP's costs were not finite numbers.
MIN_PRICE_PER_GPU_HOUR = 1e-6

PricePerHour = Annotated[float, Field(ge=MIN_PRICE_PER_GPU_HOUR, le=MAX_PRICE_PER_GPU_HOUR, allow_inf_nan=False)]


class GpuPrices(BaseModel):
    """Prices per GPU-hour by catalog GPU model (validated: known types, finite, > 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: printed on terminals and in the Dagster UI: control characters (terminal escapes) are refused
    currency: PrintableText = Field("USD", min_length=1, max_length=12)
    as_of: PrintableText = Field("", max_length=40)
    source: PrintableText = Field("", max_length=400)
    per_gpu_hour: dict[str, PricePerHour] = Field(min_length=1)
    #: the file the prices were read from, for messages (``source`` is their provenance, not a file)
    _file: str = PrivateAttr("prices")

    def price(self, gpu_type: str) -> float:
        """Price of one ``gpu_type`` card for one hour, in :attr:`currency`.

        Raises:
            InputError: the file has no price for that type (the file and the types it has are named).
        """
        if gpu_type not in self.per_gpu_hour:
            raise InputError(self._file, f"per_gpu_hour.{gpu_type}",
                             f"no price for {gpu_type}; the file prices {', '.join(self.per_gpu_hour)}")
        return float(self.per_gpu_hour[gpu_type])


def parse_prices(data: Any, source: str) -> GpuPrices:
    """Validate a parsed price document.

    Raises:
        InputError: naming ``source``, the field (``per_gpu_hour`` ...) and what was expected.
    """
    if data is None:  # an empty file, or one holding only comments
        raise InputError(source, None, "the file holds no document; expected a mapping with per_gpu_hour")
    if not isinstance(data, dict):
        raise InputError(source, None, f"expected a mapping with per_gpu_hour, got {type(data).__name__}")
    table = data.get("per_gpu_hour")
    if isinstance(table, dict):
        catalog = gpu_catalog()
        for name, price in table.items():
            field = f"per_gpu_hour.{name}"
            if name not in catalog:
                raise InputError(source, field, f"unknown GPU type {shown(name)}; expected one of {', '.join(catalog)}")
            if isinstance(price, bool) or not isinstance(price, (int, float)):
                raise InputError(source, field, f"expected a price per GPU-hour (a number > 0), got {shown(price)}")
            # the range first: an integer too large for a float (10**400) makes math.isfinite raise OverflowError
            if not MIN_PRICE_PER_GPU_HOUR <= price <= MAX_PRICE_PER_GPU_HOUR or not math.isfinite(price):
                raise InputError(source, field, f"expected a price per GPU-hour > 0, from {MIN_PRICE_PER_GPU_HOUR:g} to "
                                                f"{MAX_PRICE_PER_GPU_HOUR:g}, got {shown(price)}")
    try:
        prices = GpuPrices.model_validate(data)
    except ValidationError as err:
        raise validation_input_error(source, err) from None
    prices._file = source
    return prices


def load_prices(path: str | Path | None = None) -> GpuPrices:
    """The prices in ``path`` (YAML or JSON), or the bundled examples when ``path`` is None.

    Raises:
        InputError: the file is missing, unreadable, not YAML / JSON, or a field is bad (file and
            field named: an unknown GPU type, a negative, zero, NaN or infinite price, an unknown key).
    """
    if path is None:
        text = importlib.resources.files("flexpipe_dag.data").joinpath(BUNDLED_PRICE_FILE).read_text()
        source = f"flexpipe_dag/data/{BUNDLED_PRICE_FILE}"
        return parse_prices(load_user_yaml(text, source), source)
    return parse_prices(load_user_document(path, "price file"), str(path))
