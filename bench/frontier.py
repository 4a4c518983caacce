"""The frontier and fidelity verdicts of screen archives, as a short table (the report page's
frontier, core.report.frontier, in text): one row per condition, its tier, median decode ms per
token, the device memory it needed, and for an approximate condition its worst mean KL, worst
top-1 and fidelity verdict. bench/competitors_device.sh prints it after its screens.

    python -m bench.frontier archives/*.zip
"""

from __future__ import annotations

import sys


def _num(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"


def lines(path: str) -> list[str]:
    from packbench.core.report import frontier, read_screen

    screen = read_screen(path)
    view = frontier(screen)
    synth = screen.protocol.model.synth
    model = f"{synth.shape} profile {synth.profile}" if synth is not None else "a local checkpoint"
    out = [f"{path}: {screen.protocol.name} ({model}), memory {view['memory']}",
           f"  {'condition':24} {'tier':11} {'decode ms/tok':>13} {'memory MiB':>10} {'worst mean KL':>13} "
           f"{'worst top-1':>11}  fidelity"]
    for p in sorted(view["points"], key=lambda p: (p["tier"], p["decode_ms"] if p["decode_ms"] is not None else 1e9)):
        verdict = {None: "-", True: "PASS", False: "FAIL"}[p["fidelity_passed"]]
        memory = None if p["memory_bytes"] is None else p["memory_bytes"] / 2**20
        out.append(f"  {p['condition']:24} {p['tier']:11} {_num(p['decode_ms'], 13, 2)} {_num(memory, 10, 0)} "
                   f"{_num(p['fidelity_mean_kl_max'], 13, 5)} {_num(p['fidelity_top1_min'], 11, 3)}  {verdict}")
    return out


if __name__ == "__main__":
    for archive in sys.argv[1:]:
        print("\n".join(lines(archive)))
