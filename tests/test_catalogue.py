"""The catalogue: every method says what it is for and which engines run it; variants are options, not names.

* Each entry's category is one of the catalogue's, and the recommended method of each engine runs in it.
* An entry's ``engines`` is the truth: vLLM is declared exactly where the paged engine accepts the method.
* The names that were variants are aliases that build the very methods they built (same ``repr``, so the
  same numbers), warn once with what they are now, and take options laid over theirs.
* Choices and flags are typed and checked like numbers: a bad word is refused naming the allowed ones,
  and an option that would change nothing in the chosen variant is refused, not ignored.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from sparseattn import RadarPlus, RadarPlusAdaptive, RadarPlusMerged, RadarPlusPooled, registry
from sparseattn.allocations import PooledMass
from sparseattn.methods.layers import FirstLayers, SplitLayers
from sparseattn.vllm.paged import PagedPolicy

#: ``repr(registry.build(name, **options))`` of every name registered before the catalogue (27 methods,
#: each with its defaults and at budget 512), recorded before variants became options.
BEFORE = json.loads((Path(__file__).parent / "data" / "method-reprs-before-catalogue.json").read_text())


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_every_former_name_builds_the_method_it_built(key):
    name, options = key.split(":", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert repr(registry.build(name, **json.loads(options))) == BEFORE[key]


@pytest.mark.parametrize("name", registry.names())
def test_every_entry_has_a_category_and_its_declared_engines_are_the_truth(name):
    entry = registry.get(name)
    assert entry.category in registry.CATEGORIES
    method = registry.build(name, **({"budget": 512} if "budget" in entry.option_names else {}))
    try:
        PagedPolicy(method, name)
        runs_in_vllm = True
    except ValueError:
        runs_in_vllm = False
    assert ("vllm" in entry.engines) == runs_in_vllm, f"{name}: declared {entry.engines}"
    assert "transformers" in entry.engines  # the research engine runs every method


@pytest.mark.parametrize("engine", registry.ENGINES)
def test_each_engine_has_one_recommended_method_that_runs_in_it(engine):
    entry = registry.recommended(engine)
    assert entry.category == "recommended" and engine in entry.engines
    own = [e for e in map(registry.get, registry.names()) if e.category == "recommended" and e.engines == (engine,)]
    assert len(own) <= 1, "one engine-specific preset per engine"


def test_the_recommended_presets_are_plain_functions_exported_from_the_package():
    assert registry.recommended("transformers").build is RadarPlusAdaptive
    assert registry.recommended("vllm").build is RadarPlusAdaptive  # one preset for both engines


@pytest.mark.parametrize("old", sorted(registry.aliases()))
def test_an_alias_warns_once_with_what_it_is_now(old, monkeypatch):
    monkeypatch.setattr(registry, "_WARNED", set())
    now = registry.aliases()[old].spec
    with pytest.warns(FutureWarning, match=re.escape(f"{old!r} is now {now!r}")):
        registry.parse(old, budget=512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.parse(old, budget=512)  # once per name and process


def test_options_given_with_an_alias_are_laid_over_its_own():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        spec = registry.parse("radar+merged:merge=32,cap=3", budget=256)
    assert spec.name == "radar+" and spec.options["merge"] == 32 and spec.options["split"] == "pooled"
    assert spec.method.rest.per_block == 32 and spec.method.allocation == PooledMass(cap=3.0, floor=0.25)


def test_the_old_python_builders_are_the_options_of_radar_plus():
    assert RadarPlusPooled(budget=512) == RadarPlus(budget=512, aspect=16.0, split="pooled", bf16_centroids=True)
    merged = RadarPlus(budget=512, aspect=16.0, split="pooled", bf16_centroids=True, rest="merged", merge=16)
    assert RadarPlusMerged(budget=512) == merged
    adaptive = RadarPlusAdaptive(budget=512, bf16_centroids=True)
    assert isinstance(adaptive, SplitLayers) and adaptive.layers == 1 and adaptive.first == RadarPlusPooled(budget=512)
    assert adaptive.others.rest.per_block == 128
    assert RadarPlusAdaptive(budget=512).first == RadarPlus(budget=512, aspect=16.0, split="pooled")  # float32 centroids


def test_choices_and_flags_are_typed_from_the_spec():
    spec = registry.parse("radar+:split=pooled,bf16_centroids=yes,rest=merged,first_layers=2")
    assert spec.options == {"split": "pooled", "bf16_centroids": True, "rest": "merged", "first_layers": 2}
    assert isinstance(spec.method, FirstLayers) and spec.method.layers == 2
    assert spec.label == "radar+:bf16_centroids=True,first_layers=2,rest=merged,split=pooled"
    assert registry.parse({"method": "subgen", "guard": "true"}).method.guard is True


@pytest.mark.parametrize(
    "spec,words",
    [
        ("radar+:split=even", ["split", "'even'", "uniform, pooled, topp"]),
        ("radar+:bf16_centroids=maybe", ["bf16_centroids", "true or false", "'maybe'"]),
        ("radar+:rest=kept", ["rest", "'kept'", "dropped, merged"]),
        ("radar+:merge=16", ["merge", "rest='merged'"]),  # would change nothing with the rest dropped
        ("radar+:cap=3", ["cap", "pooled"]),  # would change nothing with a uniform split
        ("radar+:layer_factor=2", ["layer_factor", "first_layers"]),
        ("oracle-tokens:floor=0.5", ["floor", "pooled"]),
    ],
)
def test_a_bad_choice_or_an_option_that_would_change_nothing_is_refused(spec, words):
    with pytest.raises(ValueError) as caught:
        registry.parse(spec)
    assert all(w in str(caught.value) for w in words), str(caught.value)


def test_a_builder_default_is_written_once_and_read_by_the_registry():
    def build(budget: int | None = None, page: int = 8):
        return (budget, page)

    entry = registry.MethodEntry("pages-test", "a test", build, (registry.Option("page", int, help="tokens per page"),))
    assert registry._with_builder_defaults(entry).option("page").default == 8
    wrong = registry.MethodEntry("pages-test", "a test", build, (registry.Option("page", int, 16, "tokens per page"),))
    with pytest.raises(ValueError, match="declares default 16, its builder has 8"):
        registry.register(wrong)


@pytest.mark.parametrize("field,value,why", [("category", "best", "category 'best'"), ("engines", ("tgi",), "engines")])
def test_an_entry_with_an_unknown_category_or_engine_is_refused(field, value, why):
    entry = registry.MethodEntry("x-test", "a test", lambda: None, **{field: value})
    with pytest.raises(ValueError, match=why):
        registry.register(entry)
    assert "x-test" not in registry.names()


# -- sparseattn methods ----------------------------------------------------------------------------


def _methods(*args: str):
    from typer.testing import CliRunner

    from sparseattn.cli import app

    result = CliRunner().invoke(app, ["methods", *args], terminal_width=250)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_listing_puts_the_recommended_methods_first_and_experimental_ones_behind_all():
    out = _methods()
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert "recommended" in rows[0] and "radar+" in rows[0]
    order = [c for c in registry.CATEGORIES if any(f"│ {c}" in row for row in rows)]
    assert order == [c for c in registry.CATEGORIES if c != "experimental"]
    assert "radar+tokens" not in out and "radar+pooled" not in out
    everything = _methods("--all")
    assert "radar+tokens" in everything and "radar+pooled" in everything and "is now" in everything
    assert "recommended: transformers: radar+adaptive, vllm: radar+adaptive" in out


def test_the_listing_of_one_engine_shows_only_what_it_runs():
    rows = json.loads(_methods("--engine", "vllm", "--json", "--all"))["methods"]
    assert rows and all("vllm" in row["engines"] for row in rows)
    assert {row["name"] for row in rows} == {n for n in registry.names() if "vllm" in registry.get(n).engines}
    assert rows[0]["name"] == "radar+adaptive" and rows[0]["recommended_for"] == ["transformers", "vllm"]
    assert next(r for r in rows if r["name"] == "radar+")["options"]["split"]["choices"] == ["uniform", "pooled", "topp"]


@pytest.mark.parametrize(
    "name, key",
    [("OracleTokensPooled", 'oracle-tokens-pooled:{"budget": 512}'), ("OracleTokensPooledFirstLayers", 'oracle-tokens-pooled-layers:{"budget": 512}'),
     ("RadarPlusPooledFirstLayers", 'radar+pooled-layers:{"budget": 512}'), ("RadarPlusMergedAfterFirstLayers", 'radar+merged-after:{"budget": 512}')],
)  # fmt: skip
def test_the_former_python_builders_still_build_what_they_built_and_say_what_they_are_now(name, key):
    from sparseattn.methods import presets

    with pytest.warns(FutureWarning, match=f"{name} is now"):
        build = getattr(presets, name)
    assert repr(build(budget=512)) == BEFORE[key]
