"""Schema 4: a new protocol's synthetic model is the calibrated profile; every protocol frozen
before it (a uniform `sparsity`) keeps its body, its hash and the weights it generates."""

import pytest
import yaml

from packbench.core.errors import ProtocolError
from packbench.core.protocol import expand, freeze, validate
from packbench.core.registry import DEFAULT_PROFILE, PROFILES, SynthArgumentError, synth_spec
from tests.core.test_protocol_schema3 import ROOT


def protocol(synth: dict, **changes) -> dict:
    data = yaml.safe_load((ROOT / "protocols" / "quickstart.yaml").read_text())
    data.pop("schema")
    data["model"] = {"synth": synth}
    data.update(changes)
    return {k: v for k, v in data.items() if v is not None}


TINY = {"shape": "tiny", "dtype": "float32", "seed": 0}


def test_a_new_synth_without_sparsity_is_the_calibrated_profile_written_out():
    frozen = freeze(protocol(TINY, schema=7))
    assert frozen.body["model"] == {"synth": {**TINY, "profile": DEFAULT_PROFILE}}
    assert frozen.body["schema"] == 2  # schema 4 is never frozen: its default is written out
    assert expand(frozen.body).model.synth.as_dict() == {**TINY, "profile": "opt"}
    assert validate(frozen.body) == frozen.body  # a frozen body validates to itself
    assert freeze(protocol({**TINY, "profile": "opt"})).sha256 == frozen.sha256  # said or defaulted: one hash


def test_schema_8_means_opt2_and_every_older_synth_keeps_its_body_and_hash():
    """A synth without profile is opt2 in schema 8 (written out: the body says 2); the same
    file declaring schema 4 to 7 still means opt, with the hash it always had."""
    eight = freeze(protocol(TINY, schema=8))
    assert eight.body["model"] == {"synth": {**TINY, "profile": "opt2"}} and eight.body["schema"] == 2
    assert freeze(protocol({**TINY, "profile": "opt2"}, schema=4)).sha256 == eight.sha256  # said: any schema >= 4
    older = {freeze(protocol(TINY, schema=s)).sha256 for s in (4, 5, 6, 7)}
    assert older == {freeze(protocol({**TINY, "profile": "opt"})).sha256} and eight.sha256 not in older


def test_schema_9_means_opt3_and_schema_8_keeps_opt2():
    """In schemas 9 and 10 a synth without profile is opt3, written out (the body says 2, as schema 8's
    did), so a schema-8 file keeps its body and hash (catches a default that moved under an old schema,
    or a body that says 9)."""
    nine, ten = freeze(protocol(TINY, schema=9)), freeze(protocol(TINY, schema=10))
    assert nine.sha256 == ten.sha256 and nine.body["model"] == {"synth": {**TINY, "profile": "opt3"}}
    assert nine.body["schema"] == 2 and expand(nine.body).model.synth.profile == "opt3"
    assert freeze(protocol({**TINY, "profile": "opt3"}, schema=4)).sha256 == nine.sha256  # said: any schema >= 4
    eight = freeze(protocol(TINY, schema=8))
    assert eight.sha256 == freeze(protocol({**TINY, "profile": "opt2"})).sha256 != nine.sha256


def test_schema_11_means_opt4_and_schema_10_keeps_opt3():
    """From schema 11 (the newest: a file without `schema:`) a synth without profile is opt4, written out
    (the body says 2), so a schema-9 or -10 file keeps opt3 with its body and hash (catches a default that
    moved under an old schema, or a body that says 11)."""
    newest, eleven = freeze(protocol(TINY)), freeze(protocol(TINY, schema=11))
    assert newest.sha256 == eleven.sha256 and newest.body["model"] == {"synth": {**TINY, "profile": "opt4"}}
    assert newest.body["schema"] == 2 and expand(newest.body).model.synth.profile == "opt4"
    assert freeze(protocol({**TINY, "profile": "opt4"}, schema=4)).sha256 == newest.sha256  # said: any schema >= 4
    older = {freeze(protocol(TINY, schema=s)).sha256 for s in (9, 10)}
    assert older == {freeze(protocol({**TINY, "profile": "opt3"})).sha256} and newest.sha256 not in older


def test_a_uniform_sparsity_freezes_as_every_older_schema_froze_it():
    uniform = {**TINY, "sparsity": 0.94}
    new = freeze(protocol(uniform))
    assert freeze(protocol(uniform, schema=3)).sha256 == new.sha256  # schema 2 differs only by packet's gather
    assert new.body["model"]["synth"] == {**uniform, "hot_fraction": 0.0, "hot_bias": 0.0}
    assert expand(new.body).model.synth.profile is None


def test_older_schemas_still_require_a_sparsity():
    with pytest.raises(ProtocolError, match=r"`model.synth.sparsity`: is required"):
        validate(protocol(TINY, schema=3))
    # ... but read a frozen body holding a profile (it says schema 2)
    body = freeze(protocol(TINY)).body
    assert validate({**body, "schema": 2}) == body


@pytest.mark.parametrize("synth, fragment", [
    ({**TINY, "profile": "opt", "sparsity": 0.9},
     "`model.synth.sparsity`: 0.9 is not allowed with profile 'opt' (a profile sets the activation statistics itself"),
    ({**TINY, "profile": "opt", "hot_bias": 0.0}, "`model.synth.hot_bias`: 0.0 is not allowed with profile 'opt'"),
    ({**TINY, "profile": "llama"}, "`model.synth.profile`: 'llama' is not allowed; use one of opt"),
    ({**TINY, "profile": ["opt"]}, "`model.synth.profile`: ['opt'] is not allowed"),
])
def test_a_bad_profile_is_one_line_naming_the_field(synth, fragment):
    with pytest.raises(ProtocolError) as e:
        validate(protocol(synth))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_the_cli_spelling_of_a_bad_profile():
    with pytest.raises(SynthArgumentError) as e:
        synth_spec(**TINY, profile="opt", sparsity=0.5)
    assert e.value.line("--sparsity").startswith("--sparsity 0.5 is not allowed with profile 'opt'")


def test_every_profile_covers_every_shape_and_its_densities_average_to_the_target():
    from packbench.core.registry import SYNTH_SHAPES

    for name, p in PROFILES.items():
        for shape in SYNTH_SHAPES:
            d = p.layer_densities(shape)
            assert abs(sum(d) / len(d) - p.density[shape]) < 1e-12, (name, shape)
            assert d[-1] / d[0] == pytest.approx(p.layer_ratio if len(d) > 1 else 1.0)


def test_schema4_phase_switched_gathers_on_the_device_and_older_bodies_keep_the_host():
    conditions = [{"policy": "dense-stream"}, {"policy": "phase-switched"}]
    new = freeze(protocol({**TINY, "sparsity": 0.94}, conditions=conditions))
    assert new.body["conditions"][1]["params"] == {"gather": "device"}
    old = freeze(protocol({**TINY, "sparsity": 0.94}, conditions=conditions, schema=3))
    assert old.body["conditions"][1]["params"] == {}  # omitted: the host gather schemas 1-3 froze
    assert expand(old.body).condition("phase-switched").resolved_params == {"gather": "host"}
    assert expand(new.body).condition("phase-switched").resolved_params == {"gather": "device"}
