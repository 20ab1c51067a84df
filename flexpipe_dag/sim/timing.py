"""A table-driven :class:`~flexpipe_dag.core.timing.StageTimingModel`: per-stage linear costs given as data.

Useful when stage times were measured (fit ``fixed + per-unit`` lines to a profile) and in tests,
where exact stage times make the simulator's output checkable by hand.

Per stage ``i`` (all ms, one replica):

* ``prefill_ms(i, n)      = prefill_fixed_ms + prefill_per_token_ms * n``
* ``decode_ms(i, n, ctx)  = decode_fixed_ms + decode_per_seq_ms * n + decode_per_context_token_ms * ctx`` (``n`` sequences)
* ``transfer_ms(i, n)     = transfer_fixed_ms + transfer_per_token_ms * n`` for ``i`` < last, else 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd

from flexpipe_dag.core.errors import InputError, shown
from flexpipe_dag.workload.files import read_user_frame
from flexpipe_dag.workload.loaders import to_numeric


@dataclass(frozen=True)
class StageCosts:
    """Linear cost coefficients of one stage, milliseconds (see module docstring)."""

    prefill_fixed_ms: float = 0.0
    prefill_per_token_ms: float = 0.0
    decode_fixed_ms: float = 0.0
    decode_per_seq_ms: float = 0.0
    decode_per_context_token_ms: float = 0.0
    transfer_fixed_ms: float = 0.0
    transfer_per_token_ms: float = 0.0


COST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StageCosts))


class LinearStageTiming:
    """StageTimingModel from per-stage :class:`StageCosts` rows.

    Raises:
        InputError: no stages, or a negative / non-finite coefficient (names the stage and field).
    """

    def __init__(self, stages: Sequence[StageCosts], source: str = "<timing>"):
        if not stages:
            raise InputError(source, "stages", "expected at least one stage")
        for i, st in enumerate(stages):
            for name, v in asdict(st).items():
                if not (v >= 0 and v != float("inf")):
                    raise InputError(source, f"stages[{i}].{name}", f"got {v}; expected a finite value >= 0 ms")
        self.stages: tuple[StageCosts, ...] = tuple(stages)
        self.num_stages = len(self.stages)
        # flat tuples: the simulator calls these methods once per stage per iteration
        self._pf = tuple(s.prefill_fixed_ms for s in self.stages)
        self._pt = tuple(s.prefill_per_token_ms for s in self.stages)
        self._df = tuple(s.decode_fixed_ms for s in self.stages)
        self._ds = tuple(s.decode_per_seq_ms for s in self.stages)
        self._dc = tuple(s.decode_per_context_token_ms for s in self.stages)
        self._tf = tuple(s.transfer_fixed_ms for s in self.stages)
        self._tt = tuple(s.transfer_per_token_ms for s in self.stages)

    def prefill_ms(self, stage_index: int, num_tokens: int, num_prompts: int = 1) -> float:
        """Fixed + per-token time: linear in the tokens, the same however many prompts share them."""
        return self._pf[stage_index] + self._pt[stage_index] * num_tokens

    def decode_ms(self, stage_index: int, num_seqs: int, context_tokens: int) -> float:
        return self._df[stage_index] + self._ds[stage_index] * num_seqs + self._dc[stage_index] * context_tokens

    def step_ms(self, stage_index: int, prefill_tokens: int, num_prompts: int, num_seqs: int,
                context_tokens: int) -> float:
        """Prefill + decode: the linear model prices the two parts of a mixed step apart, by definition."""
        return self.prefill_ms(stage_index, prefill_tokens, num_prompts) + self.decode_ms(stage_index, num_seqs,
                                                                                          context_tokens)

    def transfer_ms(self, stage_index: int, num_tokens: int) -> float:
        if stage_index >= self.num_stages - 1:
            return 0.0
        return self._tf[stage_index] + self._tt[stage_index] * num_tokens

    @classmethod
    def uniform(cls, num_stages: int, **costs: float) -> LinearStageTiming:
        """``num_stages`` identical stages with the given :class:`StageCosts` fields."""
        return cls([StageCosts(**costs)] * num_stages)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, source: str = "<frame>") -> LinearStageTiming:
        """One row per stage (ordered by ``stage_index`` when present); missing cost columns are 0.

        Raises:
            InputError: unknown column, non-numeric value (a boolean too: ``True`` is no number of ms),
                stage_index not 0..n-1.
        """
        unknown = [c for c in frame.columns if c not in COST_FIELDS and c != "stage_index"]
        if unknown:
            raise InputError(source, unknown[0], f"unknown column; expected stage_index and any of {list(COST_FIELDS)}")
        if "stage_index" in frame.columns:
            idx = sorted(frame["stage_index"].tolist())
            if idx != list(range(len(frame))):
                raise InputError(source, "stage_index", f"got {idx}; expected 0..{len(frame) - 1} once each")
            frame = frame.sort_values("stage_index")
        rows = []
        for i, (_, row) in enumerate(frame.iterrows()):
            vals = {}
            for c in COST_FIELDS:
                if c in frame.columns:
                    v = to_numeric(pd.Series([row[c]])).iloc[0]  # a boolean is NaN here, not 1 / 0 ms
                    if pd.isna(v):
                        got = "an empty (or NaN / NA) cell" if pd.isna(row[c]) else shown(row[c])
                        raise InputError(source, f"row {i + 1}.{c}", f"got {got}; expected a number of ms")
                    vals[c] = float(v)
            rows.append(StageCosts(**vals))
        return cls(rows, source=source)

    @classmethod
    def from_csv(cls, path: str | Path) -> LinearStageTiming:
        """Read a measured table (CSV, one row per stage); see :meth:`from_frame`.

        Unlike :meth:`from_frame`, every cost column must be present: a measured table that leaves one out
        would price that cost at 0 ms without a word (write 0 where a cost does not apply).

        Raises:
            InputError: missing, not a regular file, over the trace size cap, empty, not UTF-8 or not
                CSV (:func:`~flexpipe_dag.workload.files.read_user_frame`), a cost column missing, or a bad row
                (named).
        """
        path = Path(path)
        if not path.exists():
            raise InputError(str(path), None, f"missing or empty; expected a CSV with columns {list(COST_FIELDS)}")
        frame = read_user_frame(path, f"stage timing table (CSV with columns {', '.join(COST_FIELDS)})")
        missing = [c for c in COST_FIELDS if c not in frame.columns]
        if missing:
            raise InputError(str(path), missing[0], f"missing column(s) {missing}; expected every cost column "
                                                    f"{list(COST_FIELDS)} (0 where a cost does not apply)")
        return cls.from_frame(frame, source=str(path))

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame([{"stage_index": i, **asdict(s)} for i, s in enumerate(self.stages)])
