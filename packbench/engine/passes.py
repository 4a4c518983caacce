"""Separate passes (a protocol's `passes: separate`, schema 7): one episode run twice.

The timing pass runs with the ledger recorder and the memory and energy sampler off: its wall,
per-call times and first logit are the episode's times. The recording pass runs the same
episode again with both on (the policy made afresh, so it starts from the same state): its
per-layer counts, memory peaks, trace and energy are the episode's. Every exact policy and
competitor is deterministic, so the two must give the same tokens and bit-identical logits; the
bytes the timing pass moved are the ones the recording pass counted. A difference fails the
episode (`PassMismatch`), never passes it.

Why a merged ledger: the gates, the database and the auditor read one record whose times are
the timing pass's and whose counts are the recording pass's, so they judge as for one pass.
What the recording pass took itself stays in the record's `passes` (core/passes.py checks it).
"""

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from packbench.engine.episode import EpisodeOutput
from packbench.engine.ledger import Recorder


class PassMismatch(RuntimeError):
    """The timing and recording passes of one episode differ: neither is the episode."""

    def __init__(self, message: str, passes: dict) -> None:
        super().__init__(message)
        self.passes = passes  # both walls, kept in the failed record


def first_difference(timing: EpisodeOutput, recording: EpisodeOutput) -> str | None:
    """Where the two passes first differ (calls, tokens, logits bit for bit), or None."""
    if len(timing.calls) != len(recording.calls):
        return f"the timing pass made {len(timing.calls)} calls, the recording pass {len(recording.calls)}"
    a, b = np.asarray(timing.logits), np.asarray(recording.logits)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"logits of shape {a.shape} in the timing pass, {b.shape} in the recording pass"
    # (calls, vocab) at batch 1, (B, calls, vocab) for a batch: compare bit patterns per call
    calls_axis = a.ndim - 2
    rows_a, rows_b = (np.ascontiguousarray(np.moveaxis(x, calls_axis, 0)).reshape(x.shape[calls_axis], -1)
                      .view(np.uint8) for x in (a, b))
    differ = np.flatnonzero((rows_a != rows_b).any(axis=1))
    if differ.size:
        return f"call {int(differ[0])}: logits differ between the timing and recording passes"
    if timing.tokens != recording.tokens:
        return "tokens differ between the timing and recording passes"
    return None


def pass_figures(timing: EpisodeOutput, recording: EpisodeOutput) -> dict:
    """What the record's `passes` holds: both walls and the recording pass's call times (the
    timing pass's are the ledger's)."""
    return {"timing_wall_s": timing.wall_s, "recording_wall_s": recording.wall_s,
            "recording_call_s": [c.wall_s for c in recording.calls]}


def merged(timing: EpisodeOutput, recording: EpisodeOutput) -> EpisodeOutput:
    """The episode as recorded: the recording pass's ledger counts, memory and logits, each
    call's time and the wall and first logit from the timing pass."""
    calls = [replace(r, wall_s=t.wall_s) for t, r in zip(timing.calls, recording.calls)]
    return replace(recording, calls=calls, wall_s=timing.wall_s, first_logit_at=timing.first_logit_at,
                   decode_graph=timing.decode_graph)


def two_passes(run: Callable[[], EpisodeOutput], *, recorder: Recorder, fresh: Callable[[], None],
               sampler) -> tuple[EpisodeOutput, dict, dict]:
    """Run the episode (`run`) timed with `recorder` and `sampler` off, then `fresh()` (the
    policy made anew) and again recorded; (merged output, the sampler's summary, passes).
    Raises PassMismatch when the passes differ."""
    enabled = recorder.enabled
    recorder.enabled = False
    try:
        timing = run()
    finally:
        recorder.enabled = enabled
    fresh()
    sampler.start()
    recording = run()
    sampled = sampler.stop()
    passes = pass_figures(timing, recording)
    why = first_difference(timing, recording)
    if why is not None:
        raise PassMismatch(why, passes)
    return merged(timing, recording), sampled, passes
