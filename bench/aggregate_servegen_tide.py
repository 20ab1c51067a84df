"""Rebuild flexpipe_dag/data/traces/servegen_tide_14d.csv from ServeGen's raw per-client chunks.

Usage: python bench/aggregate_servegen_tide.py [RAW_DIR] [OUT_CSV]
(default RAW_DIR ../shared/data/traces/servegen_m_small, OUT_CSV the bundled file). Prints the
window count and the daily peak / trough ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flexpipe_dag.workload.bundled import traces_dir
from flexpipe_dag.workload.tide import aggregate_servegen_rates, tide_from_frame


def main(argv: list[str]) -> int:
    raw = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "servegen_m_small"
    out = Path(argv[1]) if len(argv) > 1 else traces_dir() / "servegen_tide_14d.csv"
    frame = aggregate_servegen_rates(sorted(raw.glob("chunk-*-trace.csv")))
    frame.to_csv(out, index=False, float_format="%.6f")
    prof = tide_from_frame(frame).daily_profile()
    print(f"{len(frame)} windows of 600 s from {len(list(raw.glob('chunk-*-trace.csv')))} clients -> {out}")
    print(f"daily profile: peak {prof.max():.1f} req/s, trough {prof.min():.1f} req/s, ratio {prof.max() / prof.min():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
