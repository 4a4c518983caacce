"""How an attempt whose every planned episode came back ends: the one rule, shared by the
driver (service/screen.py ScreenRun.finish) and ingest (db/ingest.py), both of which seal or
take a whole archive. Pure Python over episode records (plain dicts)."""

from __future__ import annotations


def failure_line(episode: dict) -> str:
    """`episode 3 (packet): ValueError: ...`: a failed episode and its error, on one line."""
    error = str(episode.get("error") or "no error recorded").splitlines()
    return f"episode {episode.get('plan_index')} ({episode.get('condition')}): {error[0] if error else ''}"


def sealed_status(episodes: list[dict], *, screen_id: int) -> tuple[str, str | None]:
    """(status, error) of an attempt whose every planned episode came back and was sealed.

    `done` when at least one episode is ok: the screen ran, its failed episodes are counted
    (`screens show`, column `failed`), their verdicts fail closed, and `submit --wait` /
    `dispatch` say how many failed and exit 1. `failed` when every episode failed (or there
    were none): nothing was measured, so the screen did not run, whatever the verdicts say.
    Its archive is sealed and kept (it audits like a done one); it is not requeued, as the
    queue requeues only causes that were not the screen's (a worker that died, a full disk):
    an episode's own error is the screen's result, and `packbench screens retry` runs it again
    when the cause was passing."""
    if any(e.get("status") == "ok" for e in episodes):
        return "done", None
    first = failure_line(episodes[0]) if episodes else "the plan has no episodes"
    return "failed", (f"every episode failed ({len(episodes)} of {len(episodes)}); the first, {first}; fix that "
                      f"cause (each episode's error: `packbench screens show {screen_id} --json`) and submit the "
                      f"corrected protocol")
