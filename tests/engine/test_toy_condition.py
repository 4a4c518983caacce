"""A new condition kind lands from one file: this one. `pieces` copies each layer's outgoing
weight in `pieces` column ranges (exact, like dense-stream, one transfer per range). Its
declaration (`ConditionKind`: parameter, default, refusal, tier, byte estimate) and its runtime
(`LoaderRuntime` over the policy below) are entered in the two tables, and nothing else is
touched: the protocol validates it, the plan and the estimate include it, the worker runs it on
the CPU, the archive holds it and the auditor agrees. A kind that needed an edit anywhere else
(a name branch in the schema, the estimate or the worker) fails here."""

import pytest
import torch

from cpu_screen import archive_screen
from packbench.core.audit import audit_archive
from packbench.core.conditions import CONDITIONS
from packbench.core.conditions.base import CallInputs, ConditionKind, IntParam
from packbench.core.errors import ProtocolError
from packbench.core.estimate import Activity, ModelShape, estimate
from packbench.core.plan import plan
from packbench.core.protocol import freeze
from packbench.engine.conditions import RUNTIMES
from packbench.engine.conditions.base import LoaderRuntime
from packbench.engine.ledger import Recorder
from packbench.engine.policies.base import HostWeights, nbytes, zeroed_workspace


class Pieces:
    """Every outgoing row every call, copied in `pieces` column ranges of (hidden, ffn)."""

    name = "pieces"
    starts_early = False

    def __init__(self, *, pieces: int = 2) -> None:
        self.pieces = KIND.params["pieces"].check("pieces", pieces)
        self.workspace: torch.Tensor | None = None

    def activate(self, host: HostWeights, device: torch.device, recorder: Recorder) -> None:
        self.host, self.recorder = host, recorder
        self.workspace = zeroed_workspace(host, device)

    def deactivate(self) -> None:
        self.workspace = None

    def before_layer(self, layer: int) -> None:
        pass  # pieces: everything is copied in fetch

    def fetch(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        src = self.host.original[layer]
        for cols in torch.arange(src.shape[1]).tensor_split(self.pieces):
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            self.workspace[:, lo:hi].copy_(src[:, lo:hi])
            self.recorder.add(layer, rows=hi - lo, weight_bytes=nbytes(src[:, lo:hi]))
        return self.workspace

    def device_bytes(self) -> int:
        return 0 if self.workspace is None else nbytes(self.workspace)

    def pinned_bytes(self) -> int:
        return 0


def h2d_bytes(params, call: CallInputs) -> float:
    return call.dense()  # every row of every layer, whatever the pieces


KIND = ConditionKind(name="pieces", summary="every outgoing row, copied in column ranges",
                     params={"pieces": IntParam(minimum=1, default=2)}, h2d_bytes=h2d_bytes)
RUNTIME = LoaderRuntime(policy=Pieces)


@pytest.fixture(scope="module")
def registered():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CONDITIONS, "pieces", KIND)
        mp.setitem(RUNTIMES, "pieces", RUNTIME)
        yield


def raw_protocol(tiny, **params) -> dict:
    return {
        "name": "toy-kind", "model": {"path": str(tiny)}, "dtype": "float32",
        "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 16, "continuation_tokens": 4,
        "conditions": [{"policy": "dense-stream"}, {"name": "thirds", "policy": "pieces", "params": params}],
        "reference": "dense-stream", "allowance_mib": 4800,
        "gates": {"faithfulness": {"tolerance": 0.0}, "acquisition": [{"control": "dense-stream", "max_ratio": 1.0}]},
    }


def test_unregistered_the_kind_is_refused_naming_the_field(tiny):
    with pytest.raises(ProtocolError, match=r"conditions\[1\]\.policy"):
        freeze(raw_protocol(tiny, pieces=3))


def test_the_kinds_refusal_and_default_come_from_its_declaration(registered, tiny):
    with pytest.raises(ProtocolError, match=r"conditions\[1\]\.params\.pieces`: 0 is not an integer in \[1, "):
        freeze(raw_protocol(tiny, pieces=0))
    with pytest.raises(ProtocolError, match=r"conditions\[1\]\.params\.chunks.*takes pieces"):
        freeze(raw_protocol(tiny, chunks=2))
    assert freeze(raw_protocol(tiny)).body["conditions"][1]["params"] == {"pieces": 2}  # the default, frozen in


def test_the_plan_and_the_estimate_include_it(registered, tiny):
    body = freeze(raw_protocol(tiny, pieces=3)).body
    assert {e["condition"] for e in plan(body)} == {"dense-stream", "thirds"}
    rows = {r["condition"]: r for r in estimate(body, shape=ModelShape.of("tiny"), activity=Activity(sparsity=0.94))
            ["conditions"]}
    assert rows["thirds"]["bound"] == "about" and rows["thirds"]["policy"] == "pieces"
    assert rows["thirds"]["decode_call_bytes"] == rows["dense-stream"]["decode_call_bytes"] == 2 * 256 * 64 * 4


@pytest.fixture(scope="module")
def screen(registered, tiny, tmp_path_factory):
    """The toy's screen on the CPU, archived as the driver archives one."""
    path = tmp_path_factory.mktemp("toy-screen") / "screen.zip"
    _, episodes, verdicts = archive_screen(freeze(raw_protocol(tiny, pieces=3)), tiny, path)
    return episodes, verdicts, path


def test_the_worker_runs_it_exactly_and_charges_its_ranges(screen):
    episodes, verdicts, _ = screen
    toy = [e for e in episodes if e["condition"] == "thirds"]
    assert toy and all(e["status"] == "ok" and e["tier"] == "exact" for e in toy), [e.get("error") for e in toy]
    assert all(c["rows_copied"] == [256, 256] for e in toy for c in e["calls"])  # three ranges, every row
    assert all(e["memory"]["policy_device_bytes"] == 64 * 256 * 4 for e in toy)  # its workspace
    faithful = {v["condition"]: v for v in verdicts if v["gate"] == "faithfulness"}
    assert faithful["thirds"]["passed"], faithful["thirds"]
    assert all(v["passed"] for v in verdicts), [v for v in verdicts if not v["passed"]]


def test_its_archive_audits_agree(screen):
    *_, path = screen
    report = audit_archive(path)
    assert report.agrees, report.record["problems"]
