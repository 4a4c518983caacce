"""Every numeric protocol field swept with hostile values (0, -1, 2**63, 2**64, 1e308, nan, inf,
the string "12", true, []) through `protocol validate`, `protocol plan` and `submit` with the
embedded defaults (the database packbench.db of the folder): a value the field cannot honour is
one line naming the field and its allowed range, exit 2, no traceback and nothing queued; a
value it can honour (listed per field) passes all three. allowance_mib 2**63, a policy count of
2**63 (an OverflowError in numpy at run time), a seed past torch's 64 bits, a hot_bias that
synthesises infinite weights and a Ray resource past Ray's fixed point used to validate."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml

from in_process import run_packbench

VALUES = [0, -1, 2**63, 2**64, 1e308, math.nan, math.inf, "12", True, []]

OPT = {"name": "sweep", "model": {"path": "TINY"}, "dtype": "float32",
       "prompts": {"generator": {"seed": 0, "count": 2}}, "prefix_tokens": 8, "continuation_tokens": 4,
       "conditions": [{"name": "dense-stream", "policy": "dense-stream"},
                      {"name": "rr", "policy": "row-retention", "params": {"rows_per_layer": 16}},
                      {"name": "se", "policy": "sparse-extents", "params": {"block_rows": 8}}],
       "reference": "dense-stream", "warmups": 1, "allowance_mib": 64, "repetitions": 1,
       "placement": {"resources": {"fast_nvme": 1}},
       "gates": {"faithfulness": {"tolerance": 0.0},
                 "acquisition": {"control": "dense-stream", "max_ratio": 0.5},
                 "runtime": {"control": "dense-stream", "max_ratio": 2.0, "confidence": 0.95, "resamples": 1000,
                             "seed": 0},
                 "useful_latency": {"max_first_episode_s": 60, "max_cold_start_s": 60}}}
SYNTH = {**OPT, "model": {"synth": {"shape": "tiny", "dtype": "float32", "seed": 0, "sparsity": 0.5,
                                    "hot_fraction": 0.1, "hot_bias": 1.0}}}
MOE = {**OPT, "model": {"synth": {"shape": "mixtral-tiny", "dtype": "float32", "seed": 0, "layers": 2}},
       "conditions": [{"name": "dense-stream", "policy": "dense-stream"},
                      {"name": "lru", "policy": "expert-cache", "params": {"capacity": 2}}]}
QUANT = {**OPT, "conditions": [{"name": "dense-stream", "policy": "dense-stream"},
                               {"name": "q", "policy": "quantized", "params": {"method": "int8-weight-only"}}],
         "gates": {"faithfulness": {}, "fidelity": {"max_mean_kl": 1.0, "min_top1": 0.5, "min_divergence_step": 1}}}

HUGE_FLOATS = {2**63, 2**64, 1e308}
# field -> (base protocol, the sweep's values the field can honour)
FIELDS = {
    "allowance_mib": (OPT, set()),
    "prefix_tokens": (OPT, set()),
    "continuation_tokens": (OPT, set()),
    "repetitions": (OPT, set()),
    "batch": (OPT, set()),
    "warmups": (OPT, set()),  # 0 leaves the reference nothing to reproduce itself against
    "prompts.generator.count": (OPT, set()),
    "prompts.generator.seed": (OPT, {0}),
    "conditions.1.params.rows_per_layer": (OPT, set()),
    "conditions.2.params.block_rows": (OPT, set()),
    "placement.resources.fast_nvme": (OPT, set()),
    # Thresholds: any finite bound >= 0 is a gate (a huge one always passes).
    "gates.faithfulness.tolerance": (OPT, {0} | HUGE_FLOATS),
    "gates.acquisition.max_ratio": (OPT, {0} | HUGE_FLOATS),
    "gates.runtime.max_ratio": (OPT, HUGE_FLOATS),
    "gates.runtime.confidence": (OPT, set()),
    "gates.runtime.resamples": (OPT, set()),
    "gates.runtime.seed": (OPT, {0}),
    "gates.useful_latency.max_first_episode_s": (OPT, HUGE_FLOATS),
    "gates.useful_latency.max_cold_start_s": (OPT, HUGE_FLOATS),
    "gates.fidelity.max_mean_kl": (QUANT, {0} | HUGE_FLOATS),
    "gates.fidelity.min_top1": (QUANT, {0}),
    "gates.fidelity.min_divergence_step": (QUANT, {0}),
    "model.synth.seed": (SYNTH, {0}),
    "model.synth.sparsity": (SYNTH, set()),
    "model.synth.hot_fraction": (SYNTH, {0}),
    "model.synth.hot_bias": (SYNTH, {0, -1}),
    "moe:model.synth.layers": (MOE, set()),
    "moe:model.synth.seed": (MOE, {0}),
    "moe:conditions.1.params.capacity": (MOE, {0}),
}


def with_value(base: dict, path: str, value, tiny: Path) -> dict:
    body = copy.deepcopy(base)
    if body["model"].get("path") == "TINY":
        body["model"]["path"] = str(tiny)
    keys = path.split(":")[-1].split(".")
    node = body
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    node[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = value
    return body


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder with the embedded default database (packbench.db) at the newest schema."""
    path = tmp_path_factory.mktemp("embedded")
    r = run_packbench("db", "upgrade", env={}, cwd=path)
    assert r.returncode == 0, r.stderr
    return path


def queued(folder: Path) -> int:
    from packbench.db.store import Store

    with Store(f"sqlite:///{folder / 'packbench.db'}") as store:
        return len(store.list_screens())


@pytest.mark.parametrize("field", list(FIELDS))
def test_every_hostile_value_of_a_numeric_protocol_field_is_one_line_naming_it(field, folder, tiny, monkeypatch):
    monkeypatch.delenv("PACKBENCH_DB_URL", raising=False)  # submit's embedded default: ./packbench.db
    base, honoured = FIELDS[field]
    leaf = field.split(".")[-1]
    for value in VALUES:
        path = folder / "p.yaml"
        path.write_text(yaml.safe_dump(with_value(base, field, value, tiny)))
        # True == 1 and 0 == False in a set: only an int or float value is honoured.
        usable = type(value) in (int, float) and value in honoured
        for command in (["protocol", "validate"], ["protocol", "plan"], ["submit"]):
            before = queued(folder)
            r = run_packbench(*command, str(path), env={}, cwd=folder)
            case = (field, value, command)
            assert "Traceback" not in r.stderr + r.stdout, case
            if usable:
                assert r.returncode == 0, (case, r.stderr)
                continue
            lines = r.stderr.strip().splitlines()
            # Catches a bound that is missing (exit 0: the value validated, or was queued) and an
            # error that does not say which field to fix.
            assert r.returncode == 2 and len(lines) == 1, (case, r.returncode, r.stderr)
            assert lines[0].startswith("error: ") and leaf in lines[0], (case, lines[0])
            assert queued(folder) == before, case


# ----------------------------------------------------------------------------- CLI numbers

CLI_VALUES = ["0", "-1", str(2**63), str(2**64), "1e308", "nan", "inf", "true", "[]"]


@pytest.fixture(scope="module")
def traces(tiny, tmp_path_factory) -> dict[str, Path]:
    """An OPT and an MoE trace of one short episode each (`model stats --trace`)."""
    from packbench.engine.moe.synth import synth_moe

    base = tmp_path_factory.mktemp("traces")
    moe = synth_moe(base / "moe", shape="mixtral-tiny", seed=0, dtype="float32")
    out = {}
    for unit, model in (("row", tiny), ("expert", moe)):
        out[unit] = base / f"{unit}.trace"
        r = run_packbench("model", "stats", str(model), "--prefix", "8", "--continuation", "3", "--count", "1",
                          "--trace", str(out[unit]), env={}, cwd=base)
        assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("unit, policy, param, honoured", [
    ("expert", "expert-cache", "capacity", {"0"}),
    ("row", "row-retention", "rows_per_layer", set()),
    ("row", "sparse-extents", "block_rows", set()),
])
def test_simulate_policy_numbers_at_their_extremes_are_one_line_naming_them(traces, tmp_path, unit, policy, param,
                                                                            honoured):
    for value in CLI_VALUES:
        r = run_packbench("simulate", str(traces[unit]), "--policy", f"{policy}:{param}={value}", env={}, cwd=tmp_path)
        assert "Traceback" not in r.stderr + r.stdout, value
        if value in honoured:
            assert r.returncode == 0, (value, r.stderr)
            continue
        lines = r.stderr.strip().splitlines()
        # Catches a capacity of 2**63 that simulate replayed (the protocol refuses it).
        assert r.returncode == 2 and len(lines) == 1 and param in lines[0], (value, r.returncode, r.stderr)


@pytest.mark.parametrize("args, option", [
    (["model", "synth", "--shape", "mixtral-tiny", "--out", "out", "--layers"], "--layers"),
    (["model", "stats", "TINY", "--count"], "--count"),
])
def test_cli_numbers_at_their_extremes_are_one_line_naming_the_option(tiny, tmp_path, args, option):
    for value in CLI_VALUES:
        r = run_packbench(*[str(tiny) if a == "TINY" else a for a in args], value, env={}, cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and option in lines[0], (value, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr and not (tmp_path / "out").exists(), value
