"""Auditing: re-read raw archives (here, or fanned out over the cluster), compare, record each audit.

The audit's own result is always returned, even when recording it fails (a read-only
database, say): the outcome then says why it was not recorded.
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from packbench.core.audit import AuditReport, audit_archive
from packbench.core.canonical import sha256_hex
from packbench.core.errors import ArchiveError, PackbenchError
from packbench.core.record import STORED_FIELDS
from packbench.core.settings import Settings
from packbench.core.text import show

MAX_THREADS = 4096  # past any host's cores: a larger recorded count is not taken


@dataclass(frozen=True)
class AuditOutcome:
    report: AuditReport | None  # None: the archive was readable nowhere (`error`)
    archive_path: Path
    screen_id: int | None
    attempt_number: int | None
    node: str  # where the audit ran (a Ray node id, or this host)
    recorded: bool  # the audit row reached the database
    record_error: str | None  # why it did not, when it did not
    error: str | None = None
    host: str | None = None  # the host the audit ran on (its name; `node` may be a Ray node id)
    attempt_status: str | None = None  # the database's word for the audited attempt (done, failed, ...)
    # An attempt that did not finish and left no archive (or an empty file): nothing to audit.
    no_archive: str | None = None

    @property
    def where(self) -> str:
        return host_and_node(self.host or self.node, self.node)

    @property
    def agrees(self) -> bool:
        return self.report is not None and self.report.agrees

    @property
    def unfinished(self) -> bool:
        """An attempt that is still running, failed, was interrupted, lost or cancelled, whose
        evidence is all consistent: no archive at all, or a partial one whose every member
        checks, its archived episodes either in the database as archived or without a row yet
        (a driver stopped in a database outage: `packbench db reconcile` inserts them).
        Reported as such; it is what the attempt left (so far), not a disagreement."""
        if not _unfinished(self.attempt_status) and self.attempt_status != "running":
            return False
        if self.report is not None and (self.report.partial or self.report.rows_pending):
            return True
        return self.no_archive is not None and self.attempt_status != "running"

    @property
    def result(self) -> str | None:
        """What the database keeps and `--json` says: `partial` for an unfinished attempt's
        archive whose every member checks (what the attempt left, not a disagreement), else the
        report's own `agree` or `disagree`; None with no report."""
        if self.report is None:
            return None
        return "partial" if self.unfinished else self.report.record["result"]


def host_and_node(host: str, node: str | None) -> str:
    """`vm`, or `vm (Ray node 9fd8380a)`: where an audit ran, the host named by its name in
    every audit line (a Ray node id is added, never put in its place)."""
    return host if not node or node == host else f"{host} (Ray node {node[:8]})"


def verdict_dicts(rows) -> list[dict]:
    """StoredVerdicts (db.records) in the gates' own dict form (what the auditor compares), with
    the episodes each was computed from and its detail: before, those two columns were never
    compared, so a database verdict whose detail (what `results` and `screens show` print) or
    episode list had been changed audited AGREE."""
    return [{"gate": v.gate, "condition": v.condition, "phase": v.phase, "passed": v.passed, "value": v.value,
             "threshold": v.threshold, "interval": list(v.interval) if v.interval is not None else None,
             "episodes": list(v.episodes), "detail": v.detail}
            for v in rows]


def protocol_sha256(store, screen_id: int) -> str:
    """The SHA-256 of the protocol the database's screen names (what its archive must have run).
    A protocol row that is gone, or whose stored body does not hash to its SHA-256, is named as
    such instead, so the audit disagrees rather than stopping or agreeing."""
    protocol_id = store.screen(screen_id).protocol_id
    try:
        row = store.protocol(protocol_id)
    except PackbenchError:
        return f"(none: the database lacks protocol row {protocol_id})"
    body_sha = sha256_hex(row.canonical_json.encode("utf-8"))
    if body_sha != row.sha256:
        return f"{row.sha256} (whose stored body hashes to {body_sha})"
    return row.sha256


def episode_dicts(rows) -> list[dict]:
    """EpisodeRows as the auditor compares them: id, attempt_id and every stored field of
    `core.record`, tokens as a list."""
    return [{"id": e.id, "attempt_id": e.attempt_id,
             **{f.name: list(getattr(e, f.name)) if f.type is list else getattr(e, f.name) for f in STORED_FIELDS}}
            for e in rows]


def audit_file(path: Path, *, on_ray: bool = False, settings: Settings | None = None,
               trust: list[bytes] | None = None, max_mib: int | None = None) -> AuditOutcome:
    """Audit an archive alone: no database needed or touched. With `trust` (raw Ed25519
    public keys) its detached signature must be valid and by one of them (core.provenance)."""
    settings = settings or Settings()
    if on_ray and trust is None:
        from packbench.cluster.audit import audit_on_cluster

        report = audit_on_cluster(Path(path), settings=settings, **({"max_mib": max_mib} if max_mib else {}))
    else:
        report = audit_archive(Path(path), trust=trust, max_mib=max_mib)
    return AuditOutcome(report, Path(path), None, None, platform.node(), False, None, host=platform.node())


def select_screens(store, refs: list[str], *, all_screens: bool = False, since: datetime | None = None,
                   protocol: str | None = None) -> list[int]:
    """Screen ids to audit: the given ids (or `latest`), or every screen that ran (optionally
    since a date, or of one protocol: name or SHA-256 prefix), oldest first."""
    if refs and (all_screens or since or protocol):
        given = ", ".join(n for n, v in (("--all", all_screens), ("--since", since), ("--protocol", protocol)) if v)
        raise PackbenchError(f"screen ids and {given} both select screens, and {given} would go unheeded: "
                             f"give the ids alone, or {given} without ids")
    if refs:
        return [store.screen(r).id for r in refs]
    if not (all_screens or since or protocol):
        raise PackbenchError("say what to audit: screen ids, `latest`, --all, --since DATE or --protocol SHA")
    screens = store.list_screens(protocol=protocol)
    if protocol is not None and not screens:  # a mistyped name audited nothing and exited 0
        raise PackbenchError(f"no screen of protocol {show(protocol)} (a name or SHA-256 prefix); "
                       f"`packbench screens list` shows each screen's protocol")
    out = []
    for s in screens:
        attempt = store.latest_attempt(s.id)
        if attempt is None or (since is not None and attempt.started_at < since):
            continue
        out.append(s.id)
    return sorted(out)


def audit_screens(store, screen_ids: list[int], *, on_ray: bool = False, settings: Settings | None = None,
                  archive: Path | None = None, concurrency: int = 8, other_node: bool | None = None,
                  repeat: int = 1, max_mib: int | None = None, progress=None) -> list[AuditOutcome]:
    """Audit the latest attempt of each screen against the database and record every audit.

    With `on_ray` the audits fan out over the cluster (cluster/audit.py): at most
    `concurrency` at once, on a node other than the producer's when `other_node` (default:
    when the cluster has several nodes), each `repeat` times on distinct nodes.
    """
    settings = settings or Settings()
    jobs, started, early = [], datetime.now(timezone.utc), []
    for screen_id in screen_ids:
        attempt = store.latest_attempt(screen_id)
        if attempt is None:
            raise PackbenchError(f"screen {screen_id} has not run yet; run `packbench dispatch` first")
        path = Path(archive or attempt.archive_path)
        if _unfinished(attempt.status) and path.is_file() and path.stat().st_size == 0:  # a full disk's first write
            early.append(AuditOutcome(None, path, screen_id, attempt.number, platform.node(), False, None,
                                      attempt_status=attempt.status, no_archive=_left(attempt, "an empty archive file")))
            continue
        compare = dict(expected_sha256=attempt.archive_sha256, db_verdicts=verdict_dicts(store.verdicts(attempt.id)),
                       db_episodes=episode_dicts(store.episodes(attempt.id)),
                       expected_protocol_sha256=protocol_sha256(store, screen_id),
                       expected_model_sha256=attempt.model_sha256,
                       target=str(screen_id),  # an archive over the bound names `packbench audit <id> --max-mib N`
                       **_signed_by(store, attempt))  # on Ray too: else a signed attempt's digest differs
        if max_mib is not None:
            compare["max_mib"] = max_mib
        jobs.append((screen_id, attempt, path, compare))
    if on_ray:
        from packbench.cluster.audit import AuditJob, fan_out

        done = fan_out([AuditJob(key=i, path=str(path), producer_node=attempt.node or None, compare=compare)
                        for i, (_, attempt, path, compare) in enumerate(jobs)],
                       settings=settings, concurrency=concurrency, other_node=other_node, repeat=repeat,
                       progress=progress)
        results = [(jobs[d.job.key], d.report, d.node, d.host, d.error) for d in done]
        kind = "ray"
    else:
        if repeat > 1:
            raise PackbenchError("--repeat runs audits on distinct nodes; add --ray")
        results = [(job, *_audit_local(job)) for job in jobs]
        kind = "local"
    outcomes = []
    for (screen_id, attempt, path, _), report, node, host, error in results:
        if report is None:  # no file here (or on any node)
            outcomes.append(AuditOutcome(None, path, screen_id, attempt.number, node, False, None, error, host=host,
                                         attempt_status=attempt.status,
                                         no_archive=_left(attempt, f"no archive at {path}") if _unfinished(attempt.status)
                                         else None))
            continue
        outcome = AuditOutcome(report, path, screen_id, attempt.number, node, True, None, host=host,
                               attempt_status=attempt.status)
        try:  # the machine is the host the audit ran on, as a re-execution records it
            store.put_audit(attempt_id=attempt.id, archive_sha256=report.record["archive_sha256"], digest=report.digest,
                            result=outcome.result, problems=report.problems, machine=host,
                            started_at=started, finished_at=datetime.now(timezone.utc), node=node, kind=kind)
        except PackbenchError as e:
            outcome = dataclasses.replace(outcome, recorded=False, record_error=str(e))
        outcomes.append(outcome)
    order = {screen_id: i for i, screen_id in enumerate(screen_ids)}
    return sorted(early + outcomes, key=lambda o: order[o.screen_id])


def _unfinished(status: str | None) -> bool:
    """An attempt that failed, was interrupted, lost or cancelled (not done, not running; None: not known)."""
    return status not in (None, "done", "running")


def _left(attempt, what: str) -> str:
    """`attempt 1 failed and left no archive at X (its error)`: why there is nothing to audit."""
    return f"attempt {attempt.number} {attempt.status} and left {what}" + (f" ({attempt.error})" if attempt.error else "")


def _audit_local(job) -> tuple[AuditReport | None, str, str, str | None]:
    """(report, node, host, error) of one job here; an archive missing here is this job's error, not
    the end of every other audit."""
    _, _, path, compare = job
    try:
        return audit_archive(path, **compare), platform.node(), platform.node(), None
    except ArchiveError as e:
        return None, platform.node(), platform.node(), str(e)


@dataclass(frozen=True)
class ReexecuteOutcome:
    """A re-execution audit (core/reexecute.py): `record` is the audit record (its digest is
    `digest`); `static` the static audit it stands on; `medians` the per-condition walls."""

    screen_id: int | None
    archive_path: Path
    static: AuditReport
    record: dict
    digest: str
    node: str
    host: str
    medians: dict
    seconds: float
    recorded: bool = False
    record_error: str | None = None
    timing_problems: tuple[str, ...] = ()  # the problems that are medians out of tolerance, and only those
    busy_hosts: tuple[str, ...] = ()  # which run's host was busy or shared (the archived, the re-run), and how

    @property
    def agrees(self) -> bool:
        return self.record["result"] == "agree"

    @property
    def disagrees(self) -> bool:
        """A problem was found (a partial re-execution, some episodes not judged, is not one)."""
        return self.record["result"] == "disagree"

    @property
    def unjudged(self) -> list[str]:
        """Episodes not judged: their archived placement does not fit the re-executing device."""
        return self.record.get("unjudged") or []

    @property
    def exact_agrees(self) -> bool:
        """Everything but the times agreed: logits, tokens, every byte, the static audit."""
        return len(self.problems) == len(self.timing_problems)

    @property
    def problems(self) -> list[str]:
        return self.record["problems"]


def archived_threads(environment: dict) -> int | None:
    """The host thread count an archive's worker recorded (worker.json's environment), or None
    where it recorded none that a worker could take (an older or forged archive: the re-run then
    uses the deployment's own count)."""
    threads = environment.get("threads")
    return threads if type(threads) is int and 1 <= threads <= MAX_THREADS else None


def reexecute_archive(path: Path, *, k: int, seed: int = 0, settings: Settings | None = None,
                      static: AuditReport | None = None, model_dir: str | None = None, progress=lambda msg: None,
                      screen_id: int | None = None, time_factor: float | None = None) -> ReexecuteOutcome:
    """Re-run K drawn episodes of an archive on a worker of its accelerator type and compare
    (core/reexecute.py). `static`: the archive's static audit when the caller ran one (against
    the database); otherwise one runs here. A static audit that disagrees is reported with the
    re-execution's findings; an unreadable or incomplete archive is not re-executed."""
    from packbench.cluster.reexecute import run_drawn
    from packbench.core import reexecute as rx

    settings = settings or Settings()
    time_factor = rx.TIME_FACTOR if time_factor is None else time_factor
    if time_factor < 1:
        raise PackbenchError(f"--time-factor {time_factor:g} must be at least 1 (a factor either way)")
    path = Path(path)
    static = static or audit_archive(path)
    if static.unreadable or not static.complete or static.record.get("protocol_sha256") is None:
        raise PackbenchError(f"{path} cannot be re-executed: its static audit did not get through it "
                             f"({(static.problems or ['incomplete'])[0]}); run `packbench audit` on it first")
    try:
        archived = rx.read_archived(path)
        statuses = {i: r.get("status") for i, r in archived.records.items() if isinstance(r, dict)}
        drawn = rx.draw(archived.protocol, archived.entries, statuses, k, seed)
        accelerator = archived.environment.get("gpu") or ""
        if not isinstance(accelerator, str):
            raise ValueError("worker.json's environment names no GPU as text")
        threads = archived_threads(archived.environment)
    except (PackbenchError, KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        first = static.problems[0] if static.problems else f"{type(e).__name__}: {e}"
        raise PackbenchError(f"{path} cannot be re-executed: its plan or records are malformed ({first}); "
                             f"the static audit (`packbench audit --archive`) names what is wrong") from None
    progress(f"drew episodes {', '.join(map(str, drawn.episodes))} (seed {seed}) of {len(archived.entries)}")
    if threads is not None:
        # Logits computed on the host (a CPU worker's, host-experts' on a GPU worker) can depend
        # on the thread count (engine/worker.py): the re-run uses the archive's, whatever
        # --worker-threads says.
        progress(f"re-executing on the archive's {threads} host thread(s)")
        settings = dataclasses.replace(settings, worker_threads=threads)
    placements = rx.archived_placements(archived.records, [*drawn.warmups, *drawn.episodes])
    if placements:
        progress(f"re-running the archived placement of {len(placements)} competitor episode(s) (their offload "
                 f"section), not one chosen again at this worker's device memory")
    rerun = run_drawn(archived.protocol_body, model_dir if model_dir is not None else archived.model_dir,
                      entries=archived.entries, prompts=archived.prompts, runs=list(drawn.episodes),
                      warmups=list(drawn.warmups), reference_twice=drawn.reference_twice, accelerator=accelerator,
                      settings=settings, progress=progress,
                      model_sha256=archived.start.get("model_sha256") if isinstance(archived.start, dict) else None,
                      placements=placements)
    problems = [f"static audit: {p}" for p in static.problems]
    if threads is not None and rerun.env.get("threads") != threads:
        problems.append(f"the re-execution worker ran {rerun.env.get('threads')} thread(s), the archive {threads}: "
                        f"host arithmetic can differ by thread count, so a logits mismatch below may be that")
    problems += rx.compare_start(archived.start, rerun.start)
    if rerun.reference_again is not None:
        first = rerun.records[drawn.reference_twice]
        if (first.get("tokens") != rerun.reference_again.get("tokens")
                or not rx.same_logits(first.get("logits"), rerun.reference_again.get("logits"))):
            problems.append(f"the reference ({archived.protocol.reference}) does not reproduce itself on the "
                            f"re-execution worker: no exactness can be judged there (docs/engine.md, attention path)")
    walls: dict[str, tuple[list[float], list[float]]] = {}
    for entry in archived.entries:
        rec = archived.records.get(entry["index"])
        if isinstance(rec, dict) and rec.get("status") == "ok" and entry["role"] == "scored":
            walls.setdefault(entry["condition"], ([], []))[0].append(float(rec["wall_s"]))
    logits = rx.read_logits(path, drawn.episodes, batch=archived.protocol.batch)
    not_judged = []
    for i in drawn.episodes:
        again = rerun.records[i]
        why = rx.unjudged(i, archived.records[i], again)
        if why is not None:  # the archived placement does not fit this device: nothing to compare it with
            not_judged.append(why)
            continue
        try:
            problems += rx.compare_episode(i, archived.records[i], logits[i], again)
        except Exception as e:  # a hostile record reached a path no check foresaw: a problem, not a crash
            problems.append(f"episode {i}: the archived record cannot be compared ({type(e).__name__}); it is "
                            f"malformed")
        if again.get("status") == "ok" and archived.records[i].get("role") == "scored":
            walls.setdefault(again["condition"], ([], []))[1].append(float(again["wall_s"]))
    time_problems, medians = rx.compare_times(walls, time_factor)
    problems += time_problems
    record = rx.reexecution_record(archive_sha256=static.record.get("archive_sha256"),
                                   protocol_sha256=static.record.get("protocol_sha256"), seed=seed, k=k, drawn=drawn,
                                   problems=problems, accelerator=accelerator, time_factor=time_factor,
                                   placements=len(placements), not_judged=not_judged)
    return ReexecuteOutcome(screen_id, path, static, record, rx.record_digest(record),
                            rerun.env.get("node_id") or platform.node(), rerun.env.get("host") or platform.node(),
                            medians, rerun.seconds, timing_problems=tuple(time_problems),
                            busy_hosts=_busy_hosts(archived.records.values(), rerun.records.values()))


def _busy_hosts(archived, rerun) -> tuple[str, ...]:
    """Lines naming a busy or shared host: of the archived run, of the re-run (their times then
    say less about the method)."""
    from packbench.core.dispersion import noisy_host
    from packbench.core.report import shared_host

    out = []
    for name, records in (("archived run", list(archived)), ("re-run", list(rerun))):
        records = [r for r in records if isinstance(r, dict)]
        noisy, shared = noisy_host(records), shared_host(records)
        if noisy["episodes"]:
            out.append(f"the {name}'s host was busy with other processes in {len(noisy['episodes'])} of "
                       f"{len(records)} episodes (up to {noisy['worst']:.2g} cores)")
        if shared["episodes"]:
            out.append(f"the {name}'s host was shared with other packbench workers in {len(shared['episodes'])} "
                       f"of {len(records)} episodes")
    return tuple(out)


def reexecute_screens(store, screen_ids: list[int], *, k: int, seed: int = 0, settings: Settings | None = None,
                      archive: Path | None = None, progress=lambda msg: None,
                      time_factor: float | None = None) -> list[ReexecuteOutcome]:
    """Re-execute the latest attempt of each screen (its static audit against the database
    first) and record each as an audit of kind `reexecute`; the outcome is returned even when
    recording fails (`record_error`)."""
    settings = settings or Settings()
    outcomes = []
    for screen_id in screen_ids:
        attempt = store.latest_attempt(screen_id)
        if attempt is None:
            raise PackbenchError(f"screen {screen_id} has not run yet; run `packbench dispatch` first")
        path = Path(archive or attempt.archive_path)
        started = datetime.now(timezone.utc)
        static = audit_archive(path, expected_sha256=attempt.archive_sha256,
                               db_verdicts=verdict_dicts(store.verdicts(attempt.id)),
                               db_episodes=episode_dicts(store.episodes(attempt.id)), target=str(screen_id),
                               expected_protocol_sha256=protocol_sha256(store, screen_id),
                               expected_model_sha256=attempt.model_sha256, **_signed_by(store, attempt))
        screen = store.screen(screen_id)
        out = reexecute_archive(path, k=k, seed=seed, settings=settings, static=static, progress=progress,
                                model_dir=screen.model_dir, screen_id=screen_id, time_factor=time_factor)
        try:
            store.put_audit(attempt_id=attempt.id, archive_sha256=static.record["archive_sha256"], digest=out.digest,
                            result=out.record["result"], problems=out.problems, machine=out.host,
                            started_at=started, finished_at=datetime.now(timezone.utc), node=out.node,
                            kind="reexecute")
            out = dataclasses.replace(out, recorded=True)
        except PackbenchError as e:
            out = dataclasses.replace(out, record_error=str(e))
        outcomes.append(out)
    return outcomes


def _signed_by(store, attempt) -> dict:
    """An audit of a signed attempt (local or on Ray) also checks its signature, against the key the database
    says signed it (a database row and an archive rewritten together would still be caught)."""
    if getattr(attempt, "signer_key_id", None) is None:
        return {}
    keys = [bytes.fromhex(s.public_key) for s in store.signers() if s.key_id == attempt.signer_key_id]
    return {"trust": keys}


def repeat_disagreements(outcomes: list[AuditOutcome]) -> list[str]:
    """Screens whose repeated audits gave different digests (each must reproduce the others)."""
    digests: dict[int, set[str]] = {}
    for o in outcomes:
        if o.report is not None and o.screen_id is not None:
            digests.setdefault(o.screen_id, set()).add(o.report.digest)
    return [f"screen {s}: repeated audits gave {len(d)} different digests" for s, d in sorted(digests.items())
            if len(d) > 1]
