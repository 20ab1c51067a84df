"""The closed sets of values the store keeps in string columns: statuses, actions, kinds.

Each is an :class:`enum.StrEnum`, so a member compares equal to its string and readers of plain
strings keep working. The store checks every write with :func:`checked` and derives the column
comments from the enums (:func:`column_comment`), so the schema lists every value the code writes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from flexpipe_dag.core.errors import InputError


class ShiftEventAction(StrEnum):
    """``shift_events.action``: what the controller decided."""

    SHIFT = "shift"  # move the pipeline to another gear
    HOLD = "hold"  # stay (stored when a shift was considered and declined)


class ShiftEventStatus(StrEnum):
    """``shift_events.status``: where a decision stands.

    ``decided`` -> ``requested`` (a ``gear_shift`` run asked the serving run the decision was taken
    on) -> ``applying`` (that serving run took it) -> ``done``, ``rolled_back`` or ``failed``; a
    request no live serving run took before its deadline becomes ``expired``. A declined decision is
    stored as ``declined`` and stays so.
    """

    DECIDED = "decided"
    DECLINED = "declined"
    REQUESTED = "requested"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    APPLYING = "applying"
    EXPIRED = "expired"


#: The shift statuses a ``gear_shift`` run waits for: the serving process is finished with the event (or none
#: took it in time).
TERMINAL_SHIFT_STATUSES: tuple[ShiftEventStatus, ...] = (
    ShiftEventStatus.DONE, ShiftEventStatus.ROLLED_BACK, ShiftEventStatus.FAILED, ShiftEventStatus.EXPIRED)


class PipelineRunKind(StrEnum):
    """``pipeline_runs.kind``: what a run that writes metric samples is."""

    SERVE = "serve"  # a serving run: it applies shifts addressed to it
    BATCH = "batch"  # an offline batch job: it never shifts, so its samples never trigger a shift


class InferenceJobKind(StrEnum):
    """``inference_jobs.kind``: what a job serves."""

    BATCH = "batch"  # offline prompts, admitted by the tide sensor when online load leaves room
    ONLINE = "online"  # the requests of a serving run


class InferenceJobStatus(StrEnum):
    """``inference_jobs.status``.

    ``queued`` (created) -> ``admitted`` (the tide sensor launched a run) -> ``running`` ->
    ``paused`` (the tide rose; resumable) | ``done`` | ``failed`` | ``cancelled`` (a Batch API batch
    cancelled by its client: nothing more is submitted, finished results are kept) | ``expired`` (a Batch API batch
    whose completion window passed before every line was served: finished results are kept, the other lines are
    answered ``batch_expired``).
    """

    QUEUED = "queued"
    ADMITTED = "admitted"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


#: Job statuses whose work is still to be served: a Batch API batch in one of them is claimed and served by a server.
RUNNABLE_JOB_STATUSES: tuple[str, ...] = (InferenceJobStatus.QUEUED.value, InferenceJobStatus.ADMITTED.value,
                                          InferenceJobStatus.RUNNING.value)
#: Job statuses of a job that has not ended: runnable, or paused (the tide admits it again). A Batch API batch in one
#: of them still reads its input file and may still be cancelled or failed.
UNFINISHED_JOB_STATUSES: tuple[str, ...] = (*RUNNABLE_JOB_STATUSES, InferenceJobStatus.PAUSED.value)
#: Job statuses of a job that has ended: a Batch API batch in one of them has its output and error files (and its
#: result rows may be pruned once they have expired).
ENDED_JOB_STATUSES: tuple[str, ...] = (InferenceJobStatus.DONE.value, InferenceJobStatus.CANCELLED.value,
                                       InferenceJobStatus.FAILED.value, InferenceJobStatus.EXPIRED.value)


#: The key of an inference job's config that marks an OpenAI Batch API batch: the front door serves it
#: on its live pipeline (the tide sensor pauses and admits it, but launches no ``batch_inference`` run).
API_BATCH_CONFIG_KEY = "openai_batch"


class RequestResultStatus(StrEnum):
    """``request_results.status``: a ``done`` request is skipped when its job runs again."""

    DONE = "done"
    FAILED = "failed"


class HealthFailure(StrEnum):
    """``health_tags.failure``: why a gear was tagged unhealthy."""

    OOM = "oom"
    TIMEOUT = "timeout"
    CRASHED_STAGE = "crashed_stage"
    HEALTH_CHECK = "health_check"
    REFUSED = "refused"
    WRONG_OUTPUT = "wrong_output"


class SampleSource(StrEnum):
    """``metric_samples.source``: who emitted a metric sample."""

    SIM = "sim"  # the simulator
    LIVE = "live"  # the live pipeline


def column_comment(enum: type[StrEnum]) -> str:
    """The SQL column comment for a column holding ``enum``: every value, ``a | b | c``."""
    return " | ".join(member.value for member in enum)


E = TypeVar("E", bound=StrEnum)


def checked(enum: type[E], value: str, where: str, field: str) -> E:
    """``value`` as a member of ``enum``.

    Raises:
        InputError: ``where`` and ``field`` named; ``value`` is none of the enum's values (they are listed).
    """
    try:
        return enum(value)
    except ValueError:
        raise InputError(where, field, f"{value!r} is not a {enum.__name__}; expected one of "
                         f"{', '.join(member.value for member in enum)}") from None
