"""Whether a run that writes metric samples is live: the facts the store keeps and the one rule that reads them.

The gear-shift controller only shifts a pipeline that is live now: a serving run that has not ended and
whose newest heartbeat and newest metric sample are fresh. A batch job never shifts (nothing in it
applies a shift), so its samples never trigger one. Times are epoch seconds (wall clock), not the
samples' own ``t_s`` clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe_dag.core.status import PipelineRunKind


@dataclass(frozen=True)
class PipelineLiveness:
    """What the store knows of one sample-writing run.

    Attributes:
        run_key: the run (``metric_samples.run_key``).
        kind: ``serve`` / ``batch``; None when the run never registered (an older writer: only the
            freshness of its samples tells whether it is live).
        ended_at_s: when it ended, epoch seconds; None while live (or never registered).
        heartbeat_at_s: its newest heartbeat, epoch seconds; None when never registered.
        newest_sample_id: row id of its newest metric sample; None without samples.
        newest_sample_t_s: that sample's ``t_s`` (seconds on the run's own clock).
        newest_sample_written_s: when that sample was written, epoch seconds.
        inline_control: the run decides its own shifts (a serve loop with inline control): the
            ``gear_shift_sensor`` does not follow it, so one decision is taken once.
        gear_key: the gear it served at its last heartbeat; None when never registered or not said.
    """

    run_key: str
    kind: str | None = None
    ended_at_s: float | None = None
    heartbeat_at_s: float | None = None
    newest_sample_id: int | None = None
    newest_sample_t_s: float | None = None
    newest_sample_written_s: float | None = None
    inline_control: bool = False
    gear_key: str | None = None

    def why_not_live(self, now_s: float, freshness_s: float,
                     consequence: str = "its samples never trigger a shift") -> str | None:
        """Why no shift may be taken on this run now, or None when it is live.

        Args:
            now_s: now, epoch seconds.
            freshness_s: the largest age (seconds) of the newest sample and of the newest heartbeat.
            consequence: what follows for the caller when the run is a batch job or has ended (the gear-shift
                sensor: no shift; the tide sensor: its rate leaves the online tide).

        Returns:
            One line naming the run and the reason (ended, a batch job, stale samples or heartbeat).
        """
        if self.kind == PipelineRunKind.BATCH:
            return f"run {self.run_key} is a batch job: {consequence}"
        if self.ended_at_s is not None:
            return f"run {self.run_key} ended {now_s - self.ended_at_s:.0f} s ago: {consequence}"
        if self.newest_sample_written_s is None:
            return f"run {self.run_key} has written no metric sample"
        age_s = now_s - self.newest_sample_written_s
        if age_s > freshness_s:
            return (f"samples of run {self.run_key} are stale: the newest was written {age_s:.0f} s ago, over the "
                    f"{freshness_s:g} s freshness bound (controller.sample_freshness_s)")
        if self.heartbeat_at_s is not None and now_s - self.heartbeat_at_s > freshness_s:
            return (f"run {self.run_key} is silent: its last heartbeat was {now_s - self.heartbeat_at_s:.0f} s ago, "
                    f"over the {freshness_s:g} s freshness bound (controller.sample_freshness_s)")
        return None
