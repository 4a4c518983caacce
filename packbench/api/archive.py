"""Reading one raw archive without a database (what `packbench audit --archive` and `report` read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packbench.core.record import EPISODE_FIELDS, token_count, value_at
from packbench.core.report import ScreenData, plan_positions, read_screen, runtime_ratios, serving_rows
from packbench.core.serving import episode_serving, previous_conditions
from packbench.api.frames import Records

# The per-call ledger and a failed episode's traceback stay in `Archive.screen`: too large for a
# row. Every other field of core/record.py is a column.
ROW_FIELDS = tuple(f for f in EPISODE_FIELDS if f.name not in ("calls", "traceback"))


@dataclass(frozen=True)
class Archive:
    """An archive as read (`core.report.ScreenData` in `screen`): its protocol, manifest, the
    worker's environment, verdicts and episode records, and the problems `verify()` found."""

    screen: ScreenData

    @property
    def path(self) -> Path:
        return self.screen.path

    @property
    def protocol(self):
        """The typed protocol it ran (`core.protocol.Protocol`)."""
        return self.screen.protocol

    @property
    def problems(self) -> tuple[str, ...]:
        """What `ArchiveReader.verify` found: () for an intact archive."""
        return self.screen.problems

    @property
    def source(self) -> dict:
        """The source freeze the worker recorded (git commit, dirty, package version)."""
        return dict(self.screen.manifest.get("source_freeze") or {})

    def episodes(self) -> Records:
        """One row per archived episode: every core/record.py field by name (None where the
        record lacks it), plus `repetition` (its plan repetition)."""
        rows = []
        for ep in self.screen.episodes:
            row = {f.name: value_at(ep.record, f.path) for f in ROW_FIELDS}
            row["n_tokens"] = token_count(ep.record.get("tokens"))
            rows.append(row)
        return Records(rows, context=[{"repetition": ep.repetition} for ep in self.screen.episodes])

    def verdicts(self) -> Records:
        """The archive's verdicts as the driver computed them (verdicts.json)."""
        return Records(dict(v) for v in self.screen.verdicts)

    def serving(self) -> Records:
        """One row per condition with its tier: TTFT, TPOT, ITL p50/p90/p99, decode tokens/s, the
        wall and what lies outside its calls, the steady and once-per-episode decode call, and the
        episodes beyond 3 IQR (docs/metrics.md); what `packbench results` and the report show."""
        return Records(serving_rows(self.screen))

    def episode_serving(self) -> Records:
        """One row per finished episode: plan_index, condition, role, previous (the condition the
        worker ran before it) and its serving figures (core.serving.episode_serving)."""
        prev = previous_conditions([e.record for e in self.screen.episodes])
        rows = []
        for e in self.screen.episodes:
            f = episode_serving(e.record)
            if f is not None:
                rows.append({"plan_index": e.index, "condition": e.condition, "role": e.record.get("role"),
                             "previous": prev.get(e.index), **f})
        return Records(rows)

    def runtime_ratios(self) -> Records:
        """Per condition against its runtime control: the frozen gate's summed-walls reading beside
        the ratio of medians with its paired interval, the outliers and whether the two disagree."""
        return Records(runtime_ratios(self.screen))

    def positions(self) -> dict:
        """The plan-position check (core.serving.position_check): positions, flagged, blocks."""
        return plan_positions([self.screen])


def read_archive(path: str | Path) -> Archive:
    """Read the archive at `path` (no database). An archive with no readable protocol, or with
    verdicts not of the archive format, raises `core.errors.ArchiveError`; anything less lands in
    `Archive.problems`."""
    return Archive(read_screen(Path(path)))
