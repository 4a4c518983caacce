"""dense-stream's stream ordering, seen on the CPU. The CPU twin's copies are synchronous, so
it cannot tell whether fc2 of layer l waits for layer l's copy. Here the CUDA calls the policy
makes (torch.cuda.Stream / Event / stream / current_stream) are replaced by recording fakes
and the copy stream is a fake too: each copy still runs (in place on the CPU), and the log
shows what a GPU would be told. The promise: every copy waits for the compute stream's queued
work before it overwrites a workspace, is recorded as an event on the copy stream after it is
issued, and the compute stream waits for exactly that event before fetch hands the workspace
to fc2."""

import contextlib

import pytest
import torch

from packbench.engine.ledger import Recorder
from packbench.engine.policies.base import HostWeights
from packbench.engine.policies.dense import DenseStream

HIDDEN, FFN = 8, 32


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "FakeEvent") -> None:
        self.log.append(("wait_event", self.name, event.n))


@pytest.fixture
def cuda_log(monkeypatch):
    """The fakes in place of torch.cuda's stream calls; yields (log, copy stream)."""
    log: list = []
    compute = FakeStream("compute", log)
    current = [compute]

    class FakeEvent:
        count = 0

        def __init__(self):
            FakeEvent.count += 1
            self.n = FakeEvent.count

        def record(self, stream=None):
            log.append(("record", (stream or current[-1]).name, self.n))

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return log, FakeStream("copy", log), current


@pytest.mark.parametrize("layers", [1, 2, 5])
def test_fc2_waits_for_its_own_layers_copy_event(cuda_log, layers):
    log, copy, current = cuda_log
    host = HostWeights([torch.full((HIDDEN, FFN), float(l + 1)) for l in range(layers)], pin=False)
    recorder = Recorder(layers)
    policy = DenseStream()
    policy.activate(host, torch.device("cpu"), recorder)
    policy.buffers.copy = copy  # as on CUDA: the copies go to a stream of their own
    original = policy.copy_layer

    def copy_layer(layer, workspace):
        log.append(("copy", current[-1].name, layer))
        original(layer, workspace)

    policy.copy_layer = copy_layer
    for _ in range(2):  # two calls: the second reuses workspaces the first's fc2 read
        recorder.begin(phase="decode", tokens=1)
        for layer in range(layers):
            policy.before_layer(layer)
            log.append(("fetch", layer))
            weight = policy.fetch(layer, torch.zeros(1, FFN))
            log.append(("fc2", layer))
            assert torch.equal(weight, host.original[layer])
        recorder.end(wall_s=0.0, logits_d2h_bytes=0)
        calls = [i for i, e in enumerate(log) if e[0] == "copy"]
        for layer in range(layers):
            at = max(i for i, e in enumerate(log) if e == ("copy", "copy", layer))  # this call's copy
            # before the copy: the copy stream waits for all compute queued so far
            assert log[at - 1] == ("wait_stream", "copy", "compute"), log[at - 1]
            # after it: its event, recorded on the copy stream
            kind, where, event = log[at + 1]
            assert (kind, where) == ("record", "copy")
            # fc2 of this layer comes after the compute stream waited for that very event
            fc2 = max(i for i, e in enumerate(log) if e == ("fc2", layer))
            fetch = max(i for i, e in enumerate(log) if e == ("fetch", layer))
            assert ("wait_event", "compute", event) in log[fetch:fc2], (layer, log[fetch:fc2])
        assert calls  # copies were issued on the copy stream, never on compute
        assert all(e[1] == "copy" for e in log if e[0] == "copy")
