"""Comparing machines: the same frozen protocol screened on several machines, verdict by verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

from packbench.core.errors import PackbenchError
from packbench.core.text import show


@dataclass(frozen=True)
class MachineColumn:
    """One screen of the protocol: its latest done attempt and where it ran."""

    screen_id: int
    attempt: int
    machine: str  # host / GPU #index
    node: str  # the Ray node id it ran on (an embedded Ray has a new one per run: not a machine)
    model_sha256: str | None = None  # what it measured (a digest of every checkpoint file)
    host: str | None = None  # the machine: its host name


@dataclass(frozen=True)
class VerdictRow:
    gate: str
    condition: str
    phase: str
    # One per column: (passed, value, interval_lo, interval_hi), None: not judged.
    cells: tuple[tuple[bool, float | None, float | None, float | None] | None, ...]
    agree: bool  # every machine that judged it gave the same verdict (and every machine judged it)


@dataclass(frozen=True)
class MachineComparison:
    protocol: str
    protocol_sha256: str
    columns: tuple[MachineColumn, ...]
    rows: tuple[VerdictRow, ...]
    skipped: tuple[str, ...] = field(default_factory=tuple)  # screens without a done attempt, and why

    @property
    def same_weights(self) -> bool:
        """Every machine measured the same checkpoint bytes (unknown digests are not a match)."""
        digests = {c.model_sha256 for c in self.columns}
        return len(digests) <= 1 and None not in digests

    @property
    def agree(self) -> bool:
        return all(r.agree for r in self.rows)

    @property
    def hosts(self) -> list[str]:
        """The distinct machines (host names) the screens ran on, in column order."""
        return list(dict.fromkeys(c.host or "?" for c in self.columns))


def compare_machines(store, protocol: str) -> MachineComparison:
    """Every screen of `protocol` (name or SHA-256 prefix) with a done attempt, side by side:
    per gate, condition and phase each machine's verdict and value, and whether they agree.
    Machines are hosts (`MachineComparison.hosts`): three screens on one host are one machine."""
    screens = store.list_screens(protocol=protocol)
    shas = {s.protocol_sha256 for s in screens}
    if not screens:
        raise PackbenchError(f"no screen of protocol {show(protocol)}; list them with `packbench screens list`")
    if len(shas) > 1:
        raise PackbenchError(f"--protocol {show(protocol)} matches {len(shas)} frozen protocols "
                             f"({', '.join(sorted(s[:12] for s in shas))}); give a longer SHA-256 prefix")
    columns, verdicts, skipped = [], [], []
    for s in sorted(screens, key=lambda s: s.id):
        done = [a for a in store.attempts(s.id) if a.status == "done"]
        if not done:
            skipped.append(f"screen {s.id}: {s.status}, no done attempt")
            continue
        a = done[-1]
        m = store.machine(a.machine_id) if a.machine_id is not None else None
        where = f"{m.host if m else '?'} / {a.gpu_name} #{a.gpu_index}"
        columns.append(MachineColumn(s.id, a.number, where, a.node, a.model_sha256, m.host if m else None))
        verdicts.append({(v.gate, v.condition, v.phase): (v.passed, v.value, *(v.interval or (None, None)))
                         for v in store.verdicts(a.id)})
    keys = sorted({k for vs in verdicts for k in vs})
    rows = []
    for k in keys:
        cells = tuple(vs.get(k) for vs in verdicts)
        judged = {c[0] for c in cells if c is not None}
        rows.append(VerdictRow(*k, cells=cells, agree=len(judged) == 1 and None not in cells))
    return MachineComparison(screens[0].protocol, screens[0].protocol_sha256, tuple(columns), tuple(rows),
                             tuple(skipped))
