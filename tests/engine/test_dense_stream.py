"""dense-stream's double buffer on the CPU (the twin of test_dense_stream_cuda.py): the same
schedule as on CUDA, with in-place copies; the ledger a call charges is the single-stream one."""

import pytest
import torch

from packbench.engine.ledger import Recorder
from packbench.engine.policies.base import HostWeights
from packbench.engine.policies.dense import DenseStream, copies_ahead

HIDDEN, FFN = 8, 32


def host_of(layers: int) -> HostWeights:
    """Layer l's weight is all l + 1: any copy landing in the wrong place shows."""
    return HostWeights([torch.full((HIDDEN, FFN), float(l + 1)) for l in range(layers)], pin=False)


@pytest.mark.parametrize("layers", [1, 2, 3, 6])
def test_each_layer_is_copied_once_a_call_before_its_fetch_into_a_free_workspace(layers):
    issued: list[int] = []
    for layer in range(layers):
        for ahead in copies_ahead(layer, layers):
            # The workspace ahead % 2 was last read by fc2 of ahead - 2, already queued; never
            # the one the current layer is about to read (unless it is this layer's own copy).
            assert ahead - 2 <= layer - 1 and (ahead % 2 != layer % 2 or ahead == layer)
            issued.append(ahead)
        assert layer in issued  # issued by this layer's fc1 at the latest
    assert issued == list(range(layers))


def run_call(policy: DenseStream, recorder: Recorder, layers: int, *, early: bool = True) -> None:
    recorder.begin(phase="decode", tokens=1)
    b = policy.buffers
    for layer in range(layers):
        if early:
            policy.before_layer(layer)
            assert torch.equal(b.of(layer), torch.full((HIDDEN, FFN), float(layer + 1)))  # landed already
            if layer + 1 < layers:  # and the next layer's is in the other workspace
                assert torch.equal(b.of(layer + 1), torch.full((HIDDEN, FFN), float(layer + 2)))
        weight = policy.fetch(layer, torch.zeros(1, FFN))
        assert weight is b.workspaces[layer % 2]
        assert torch.equal(weight, policy.host.original[layer])
    assert b.landed == {}  # every copy issued in the call was used in the call
    recorder.end(wall_s=0.0, logits_d2h_bytes=0)


@pytest.mark.parametrize("layers", [1, 2, 5])
def test_double_buffer_alternates_and_charges_what_single_stream_did(layers):
    host, recorder = host_of(layers), Recorder(layers)
    policy = DenseStream()
    policy.activate(host, torch.device("cpu"), recorder)
    assert policy.buffers.copy is None and policy.device_bytes() == 2 * HIDDEN * FFN * 4
    run_call(policy, recorder, layers)
    run_call(policy, recorder, layers)
    run_call(policy, recorder, layers, early=False)  # a caller that never calls before_layer
    for call in recorder.calls:  # what one copy per layer at fetch charged: ffn rows, whole weights
        assert call.rows_copied == [FFN] * layers
        assert call.h2d_weight_bytes == [HIDDEN * FFN * 4] * layers
        assert call.active_rows == [None] * layers
        assert call.h2d_index_bytes == call.d2h_bytes == call.rows_wasted == [0] * layers
    policy.deactivate()
    assert policy.buffers is None and policy.device_bytes() == 0


def test_join_leaves_nothing_to_wait_for():
    """The graph capture's rejoin: on the CPU there is no stream to join, only the bookkeeping."""
    host, recorder = host_of(3), Recorder(3)
    policy = DenseStream()
    policy.activate(host, torch.device("cpu"), recorder)
    recorder.begin(phase="decode", tokens=1)
    policy.before_layer(0)
    policy.join(None)  # no copy stream: nothing issued needs a wait
    assert policy.buffers.landed == {0: None, 1: None} and policy.buffers.tail is None
    assert torch.equal(policy.fetch(0, torch.zeros(1, FFN)), host.original[0])


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_the_engine_issues_every_copy_a_layer_ahead(mode, tiny):
    """Both decoders call before_layer at fc1 (stock's fc1 pre-hook, the static decoder's
    post): fetch never has to fall back to copying on the spot."""
    from packbench.engine.episode import run_episode
    from packbench.engine.model import CpuFirstModel

    model = CpuFirstModel(tiny, dtype=torch.float32, device=torch.device("cpu"))
    model.use("dense-stream")
    policy, fetched = model.slot.policy, []
    fetch = policy.fetch

    def checked(layer, h):
        fetched.append(layer in policy.buffers.landed)
        return fetch(layer, h)

    policy.fetch = checked
    out = run_episode(model, [2, 11, 12, 13], continuation=3, mode=mode)
    assert len(fetched) == 3 * model.recorder.layers and all(fetched)
    assert [c.rows_copied for c in out.calls] == [[model.host.shape[1]] * model.recorder.layers] * 3
