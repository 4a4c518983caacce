"""Per-call, per-layer accounting of what a loader policy moved.

A `Recorder` is shared by every outgoing layer of one model. The episode loop opens a call,
policies add to the current call's per-layer counters, the loop closes the call. Counting is
host arithmetic on sizes the policy already knows: it adds no device synchronisation. A policy
whose counts live on the device (gather=device) defers them to the call's end, when the
logits have come back and reading them costs no stall.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass
class CallLedger:
    """One forward call. Lists are indexed by layer."""

    index: int
    phase: str  # "prefill" | "decode"
    tokens: int  # tokens fed to this call
    layers: int
    active_rows: list[int | None] = field(default_factory=list)  # None: the policy did not observe activity
    rows_copied: list[int] = field(default_factory=list)
    h2d_weight_bytes: list[int] = field(default_factory=list)
    h2d_index_bytes: list[int] = field(default_factory=list)
    d2h_bytes: list[int] = field(default_factory=list)  # activity readbacks
    rows_wasted: list[int] = field(default_factory=list)  # copied (forecast) but not active
    copy_wait_s: list[float] = field(default_factory=list)  # host blocked on readbacks/copies
    logits_d2h_bytes: int = 0  # recording: the call's last-position logits read back
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        n = self.layers
        self.active_rows = self.active_rows or [None] * n
        self.rows_copied = self.rows_copied or [0] * n
        self.h2d_weight_bytes = self.h2d_weight_bytes or [0] * n
        self.h2d_index_bytes = self.h2d_index_bytes or [0] * n
        self.d2h_bytes = self.d2h_bytes or [0] * n
        self.rows_wasted = self.rows_wasted or [0] * n
        self.copy_wait_s = self.copy_wait_s or [0.0] * n

    def to_dict(self) -> dict:
        return asdict(self)


class Recorder:
    """Collects CallLedgers; policies write into `current` during a forward call."""

    def __init__(self, layers: int, *, enabled: bool = True) -> None:
        self.layers = layers
        self.enabled = enabled  # off: calls are timed, per-layer accounting is skipped
        self.calls: list[CallLedger] = []
        self.current: CallLedger | None = None
        self.phase: str | None = None  # of the call in progress; policies may switch on it
        self.serial = 0  # calls begun since the model was built: a clock for caches
        self._deferred: list[Callable[[CallLedger], None]] = []

    def begin(self, *, phase: str, tokens: int) -> CallLedger:
        self.current = CallLedger(index=len(self.calls), phase=phase, tokens=tokens, layers=self.layers)
        self.phase = phase
        self.serial += 1
        self._deferred = []
        return self.current

    def defer(self, settle: Callable[[CallLedger], None]) -> None:
        """Call `settle(call)` when the current call ends (before it is appended), where it may
        `add` what the device counted during the call. Nothing is deferred when not recording."""
        if self.current is not None and self.enabled:
            self._deferred.append(settle)

    def end(self, *, wall_s: float, logits_d2h_bytes: int) -> None:
        call = self.current
        assert call is not None, "end() without begin()"
        call.wall_s = wall_s
        call.logits_d2h_bytes = logits_d2h_bytes
        for settle in self._deferred:
            settle(call)
        self._deferred = []
        self.calls.append(call)
        self.current = None
        self.phase = None

    def add(
        self,
        layer: int,
        *,
        active: int | None = None,
        rows: int = 0,
        weight_bytes: int = 0,
        index_bytes: int = 0,
        d2h_bytes: int = 0,
        wasted: int = 0,
        wait_s: float = 0.0,
    ) -> None:
        call = self.current
        if call is None or not self.enabled:  # outside an episode, or recording off: not charged
            return
        if active is not None:
            call.active_rows[layer] = active
        call.rows_copied[layer] += rows
        call.h2d_weight_bytes[layer] += weight_bytes
        call.h2d_index_bytes[layer] += index_bytes
        call.d2h_bytes[layer] += d2h_bytes
        call.rows_wasted[layer] += wasted
        call.copy_wait_s[layer] += wait_s
