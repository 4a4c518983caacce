"""Fingerprints of the tiny profile checkpoints' weights, for tests/engine/test_synth.py: per
tensor its mean, its standard deviation and 8 values at fixed positions, in float64.

Frozen protocols name profiles `opt`, `opt2` and `opt3`, so a change in the drawing code that
moved their weights must show. Exact bytes cannot pin that across machines: a matrix product's
last bit follows the CPU's instruction set (CI's machine and a developer's drew these checkpoints
1 ulp apart in places), so the test compares the fingerprints to 1e-4 of each tensor's standard
deviation, which a changed draw exceeds by orders of magnitude.

    python tests/data/synth_fingerprints.py     # rewrite synth_fingerprints.json (after a deliberate change)
"""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
FILE = HERE / "synth_fingerprints.json"
CASES = {f"tiny/{p}/seed0": dict(shape="tiny", dtype="float32", seed=0, profile=p) for p in ("opt", "opt2", "opt3")}
POSITIONS = 8


def fingerprint(path: Path) -> dict[str, list[float]]:
    """{tensor name: [mean, std, value at each of POSITIONS evenly spaced flat indices]}."""
    out = {}
    for name, t in sorted(load_file(path / "model.safetensors").items()):
        flat = t.double().flatten()
        picks = torch.linspace(0, flat.numel() - 1, POSITIONS).round().long()
        out[name] = [float(flat.mean()), float(flat.std()) if flat.numel() > 1 else 0.0, *flat[picks].tolist()]
    return out


def draw(case: str, where: Path) -> Path:
    from packbench.engine.synth import synth_checkpoint

    return synth_checkpoint(where / case.replace("/", "-"), **CASES[case])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        prints = {case: fingerprint(draw(case, Path(tmp))) for case in CASES}
    FILE.write_text(json.dumps(prints, indent=0, sort_keys=True) + "\n")
    print(f"wrote {FILE}")


if __name__ == "__main__":
    main()
