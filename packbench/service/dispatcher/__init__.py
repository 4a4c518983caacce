"""The dispatcher: drains the database queue onto a pool of GPU workers (`packbench dispatch`).

Plain Python over a `WorkerPool` (pool.py): `cluster/pool.py` runs it on Ray, tests on an
in-process fake (tests/service/fake_pool.py). The database is the record and the queue; the
pool is the transport and the placement engine.

- One worker per GPU of the cluster (or `workers`), kept across screens: a worker keeps its
  loaded checkpoint for the next screen of the same model (`model_state` warm/cold).
- Each idle worker claims one screen (`Store.claim_screen`: atomic, a lease). Screens run
  concurrently, one per worker; a screen's episodes run in plan order on its worker, submitted
  one ahead (and the next one handed out before the driver persists the one that came back)
  so the worker never waits for the driver. The pool's `wait` returns as soon as any call is back.
- A worker whose screen has handed out its last episodes claims its next screen at once (the
  `next` of its slot): the new archive is opened and the load is queued on the same worker
  behind those episodes, so claim, archive creation and load overlap the screen's end. The
  claim ignores the slot's own running attempt in node checks (shared_node, exclusive_node):
  the two screens run one after the other on one worker, never side by side.
- Leases are renewed every third of their length; a renewal refused means the screen was
  cancelled (stop after the episode in flight, attempt `cancelled`) or the attempt was reaped
  as lost (stop touching it). Expired leases of any dispatcher are reaped here too, except those
  of a live dispatcher on this host (its process exists: it renews them once it can); a
  dispatcher on this host whose process is gone loses its leases at once.
- A worker that dies fails its attempt with a cause naming it, and the screen is requeued
  (up to its max_attempts); a replacement worker is started. A worker that owes an episode's
  reply past `Settings.episode_timeout_s`, or a load's past `Settings.load_timeout_s`, is hung:
  it is killed and lost the same way, its attempt's cause saying it timed out (rules.py
  `overdue` decides).
- SIGINT/SIGTERM: stop claiming, give every held attempt back (`interrupted`, requeued), exit.
- The database down (`DatabaseUnavailable`, after the Store's own retries): a one-shot
  dispatcher stops (`fatal`); `follow` waits it out however long it lasts (`Outage`): no new
  claims or episodes, the episodes in flight go to their archives without rows, one probe per
  backoff step (doubling up to a cap), one line when the wait starts and one when it ends.
  When the database answers: reconcile the rows its archives hold (service/reconcile.py),
  renew its leases (an attempt reaped meanwhile ends as lost), do the writes it deferred, in
  order, reconcile the archives on this host of attempts that ended since the outage began,
  and continue, reaping no other dispatcher's lease for one lease length.
- The archive's storage refuses a write (`ArchiveStorageError`: a full disk, a read-only mount):
  the screen that hit it fails (requeued while it has attempts left); nothing more is claimed,
  held screens are given back, and `fatal` says why (`packbench dispatch` exits 74).

The pool's own retries are off (Ray: max_restarts=0, max_task_retries=0): ordering comes from
the database, never from the transport's retries (with max_task_retries > 0, Ray 2.60 ran
retried calls out of submission order in 3 of 3 runs, and retried a call that kills its actor
until the restart budget was gone).

One owner of the state: `Dispatcher` (loop.py) makes one `State` (state.py) and hands it to each
part, which keeps nothing else that changes; each part reacts to one kind of event and has its
own tests (tests/service/):

- `Claims` (claims.py): idle workers and look-ahead claims;
- `Lifecycle` (lifecycle.py): a claimed screen starts, its load and episodes come back, it ends;
- `Upkeep` (upkeep.py): leases, reaping, heartbeat on a clock;
- `OutageWatch` (outage.py): the database goes down and comes back;
- `Fleet` (fleet.py): workers placed, lost, replaced;
- rules.py: the pure decisions (silent dispatchers, unplaceable screens, probe delays).
"""

from packbench.service.dispatcher.loop import Dispatcher

__all__ = ["Dispatcher"]
