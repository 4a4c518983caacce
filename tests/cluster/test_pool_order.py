"""The replies a pool hands the dispatcher keep each worker's call order (core/pool.py, cluster/pool.py)."""

from packbench.cluster.pool import RayPool
from packbench.core.pool import in_worker_order
from packbench.core.settings import Settings


def worker(call: str) -> str:
    return call[0]  # "a1" went to worker "a"


def test_a_later_call_waits_for_an_earlier_one_to_the_same_worker():
    calls = ["a0", "b0", "a1", "a2", "b1"]
    # a2 reported before a1 (the runtime saw its result first): a2 waits; b's calls go on.
    assert in_worker_order(calls, {"a0", "a2", "b1"}, worker_of=worker) == ["a0"]
    assert in_worker_order(calls, {"a2", "b0", "b1"}, worker_of=worker) == ["b0", "b1"]
    assert in_worker_order(calls, {"a1", "a2", "b1"}, worker_of=worker) == []  # a0 and b0 still out


def test_everything_back_comes_in_the_order_it_went_out():
    calls = ["b0", "a0", "a1", "b1"]
    assert in_worker_order(calls, set(calls), worker_of=worker) == calls
    assert in_worker_order(calls, set(), worker_of=worker) == []


class Runtime:
    """Stands in for the `ray` module: its first `wait` reports a worker's second call ready
    before its first (what Ray may do when both results are in), the next `wait` the first."""

    class exceptions:
        class RayActorError(Exception):
            pass

    def __init__(self, first_seen: list[str]) -> None:
        self.first_seen = first_seen
        self.waits = 0

    def wait(self, refs, *, num_returns, timeout):
        self.waits += 1
        if self.waits == 1:
            ready = [r for r in self.first_seen if r in refs][:num_returns]
        else:
            ready = list(refs)[:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(self, ref):
        return ref


def test_the_ray_pool_hands_a_look_ahead_episode_over_after_the_one_before_it():
    pool = RayPool(Settings())
    pool.ray = Runtime(first_seen=["episode 2"])
    pool._calls = {"episode 1": ("worker", "tag 1"), "episode 2": ("worker", "tag 2")}  # refs, in call order
    assert [reply.value for reply in pool.wait(0.2)] == ["episode 1", "episode 2"]
    assert pool.in_flight() == 0
