"""A fidelity verdict judged on a synthetic checkpoint not calibrated for robustness says so
(terminal table, screen JSON, report page)."""

from packbench.cli.summary import fidelity_caveat, verdict_table

FIDELITY = {"gate": "fidelity", "condition": "int8", "phase": "all", "passed": False, "value": 0.01,
            "threshold": 0.002, "detail": "mean KL 0.01 (bound <= 0.002)"}
RUNTIME = {**FIDELITY, "gate": "runtime", "passed": True, "detail": None}


def test_the_caveat_rides_with_fidelity_verdicts_on_uncalibrated_synthetic_checkpoints():
    opt = {"shape": "opt-2.7b", "dtype": "float16", "seed": 0, "profile": "opt"}
    caveat = fidelity_caveat(opt, [RUNTIME, FIDELITY])
    assert "not calibrated for robustness" in caveat and "profile opt, opt-2.7b" in caveat
    # listed only where measured within the targets: opt2 at opt-125m (CPU), not at opt-2.7b (the H200 missed)
    assert fidelity_caveat({**opt, "shape": "opt-125m", "profile": "opt2"}, [FIDELITY]) is None
    assert "profile opt2, opt-2.7b" in fidelity_caveat({**opt, "profile": "opt2"}, [FIDELITY])
    # opt3: opt-2.7b met every target on the H200; opt-13b missed int4 per-channel (1.9x real OPT's)
    assert fidelity_caveat({**opt, "profile": "opt3"}, [FIDELITY]) is None
    assert "profile opt3, opt-13b" in fidelity_caveat({**opt, "shape": "opt-13b", "profile": "opt3"}, [FIDELITY])
    # opt4: every target met on the H200 at opt-1.3b to opt-13b (and opt-125m on the CPU); tiny is not a real shape
    for shape in ("opt-125m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b"):
        assert fidelity_caveat({**opt, "shape": shape, "profile": "opt4"}, [FIDELITY]) is None, shape
    assert "profile opt4, tiny" in fidelity_caveat({**opt, "shape": "tiny", "profile": "opt4"}, [FIDELITY])
    assert fidelity_caveat(opt, [RUNTIME]) is None  # no fidelity verdict: nothing to qualify
    assert fidelity_caveat(None, [FIDELITY]) is None  # a real checkpoint (model.path)
    assert verdict_table([FIDELITY], caveat=caveat).splitlines()[-1] == f"fidelity: {caveat}"
    assert "fidelity:" not in verdict_table([FIDELITY])


def test_the_report_page_prints_it_under_the_verdicts():
    from types import SimpleNamespace

    from packbench.cli.report_page import verdict_section
    from packbench.core.protocol.spec import SynthSpec

    synth = SynthSpec(shape="opt-13b", dtype="float16", seed=0, profile="opt")
    s = SimpleNamespace(verdicts=[FIDELITY], protocol=SimpleNamespace(
        model=SimpleNamespace(synth=synth), conditions=[], dtype="float16"))
    html = verdict_section(s)
    assert "not calibrated for robustness" in html and "profile opt, opt-13b" in html
