"""service/compare.py `compare_machines` over an in-process stand-in for the store: which attempt
speaks for a screen, when a verdict row agrees, and when the machines measured the same weights,
each as its docstring states it (the CLI's end-to-end cases: tests/cli/test_compare_machines.py)."""

from types import SimpleNamespace

from packbench.service.compare import compare_machines

SHA = "ab" * 32


class Store:
    """What compare_machines reads: screens of one protocol, their attempts (in number order), the
    machines they ran on and each attempt's verdicts."""

    def __init__(self, screens: dict[int, list[tuple[str, str | None, list[tuple]]]]) -> None:
        # screen id -> its attempts: (status, model digest, verdicts as (gate, condition, passed, value))
        self._screens, self._attempts, self._verdicts = [], {}, {}
        for sid, attempts in screens.items():
            self._screens.append(SimpleNamespace(id=sid, status="done", protocol="p", protocol_sha256=SHA))
            self._attempts[sid] = []
            for number, (status, digest, verdicts) in enumerate(attempts, 1):
                aid = 100 * sid + number
                self._attempts[sid].append(SimpleNamespace(
                    id=aid, number=number, status=status, machine_id=sid, gpu_name="H200", gpu_index=0,
                    node=f"node-{sid}", model_sha256=digest))
                self._verdicts[aid] = [SimpleNamespace(gate=g, condition=c, phase="all", passed=p, value=v,
                                                       interval=None) for g, c, p, v in verdicts]

    def list_screens(self, *, protocol):
        return list(self._screens)

    def attempts(self, screen_id):
        return list(self._attempts[screen_id])

    def machine(self, machine_id):
        return SimpleNamespace(host=f"lab-{machine_id}")

    def verdicts(self, attempt_id):
        return list(self._verdicts[attempt_id])


FAITHFUL = ("faithfulness", "packet", True, 0.0)


def test_a_screen_speaks_by_its_latest_done_attempt():
    """MachineColumn: "its latest done attempt". A screen retried after a done attempt (a retry of
    a done screen) is compared by its second one. Catches the planted bug "compare machines: the
    first done attempt, not the latest"."""
    store = Store({1: [("done", "a" * 64, [("faithfulness", "packet", False, 3e-3)]), ("done", "a" * 64, [FAITHFUL])],
                   2: [("failed", None, []), ("done", "a" * 64, [FAITHFUL])]})
    out = compare_machines(store, "p")
    assert [(c.screen_id, c.attempt) for c in out.columns] == [(1, 2), (2, 2)]
    assert [(r.gate, r.cells, r.agree) for r in out.rows] == [("faithfulness", ((True, 0.0, None, None),) * 2, True)]
    assert out.agree and out.same_weights


def test_a_verdict_one_machine_did_not_judge_is_a_disagreement():
    """VerdictRow.agree: "every machine that judged it gave the same verdict (and every machine
    judged it)". Catches the planted bug "compare machines: a verdict one machine did not judge
    agrees"."""
    acquisition = ("acquisition", "packet", True, 0.16)
    out = compare_machines(Store({1: [("done", "a" * 64, [FAITHFUL, acquisition])],
                                  2: [("done", "a" * 64, [FAITHFUL])]}), "p")
    assert [(r.gate, r.cells, r.agree) for r in out.rows] == [
        ("acquisition", ((True, 0.16, None, None), None), False),
        ("faithfulness", ((True, 0.0, None, None),) * 2, True)]
    assert not out.agree


def test_an_unknown_checkpoint_digest_is_not_the_same_weights():
    """same_weights: "unknown digests are not a match", even when every digest is unknown.
    Catches the planted bug "compare machines: unknown checkpoint digests match"."""
    def same(*digests):
        return compare_machines(Store({i: [("done", d, [FAITHFUL])] for i, d in enumerate(digests, 1)}), "p").same_weights

    assert (same("a" * 64, "a" * 64), same("a" * 64), same("a" * 64, "b" * 64)) == (True, True, False)
    assert (same(None, None), same(None), same("a" * 64, None)) == (False, False, False)
