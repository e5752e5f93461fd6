"""The method registry (issue 13, item 3): one library table that the CLI, the benchmarks and the tests read.

* The registry builds the very objects the CLI's table built before it (same reprs, so same numbers).
* Every option an entry declares has the builder's own default.
* A method registered from user code is listed, built by the CLI's parser, covered by the contract tests
  and runs under ``sparseattn ppl``; one from a third-party package arrives through an entry point.
* Duplicate names, broken plugins, unknown options and bad values are refused with one clear line.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import textwrap

import pytest
import typer
from typer.testing import CliRunner

from sparseattn import Dense, SegmentSearch, registry
from sparseattn.cli import app
from sparseattn.cli.method_specs import parse_method
from sparseattn.registry import MethodEntry, Option, OptionError, PluginError
from sparseattn.schedules.fixed import FixedSchedule
from sparseattn.testing import check_method
from sparseattn.selectors.recent import Recent
from sparseattn.summaries.exact import ExactScore

# -- the same objects as before the registry ------------------------------------------------------

#: ``repr(build_method(name, MethodOptions(**options)))`` recorded from the CLI's table before it moved
#: into the library (197 cases were compared; these are a representative handful). Segment searches
#: have since gained three fields whose defaults change nothing (``allocation``, ``refine``, ``rest``).
RECORDED = [
    ("dense", {}, "Dense(backend='torch')"),
    ("radar", {}, "SegmentSearch(summary=PerformerFeatures(n_features=4096, orthogonal=False, antithetic=True, seed=0, feature_dtype=torch.float32), selector=TopK(), schedule=AspectSchedule(aspect=4.0), top_k=64, sinks=1, window=1024, shared_kv_selection=False, budget=None, backend='auto', always=None, allocation=Uniform(), refine=None, rest=None)"),
    ("radar", {"budget": 512}, "SegmentSearch(summary=PerformerFeatures(n_features=4096, orthogonal=False, antithetic=True, seed=0, feature_dtype=torch.float32), selector=TopK(), schedule=AspectSchedule(aspect=4.0), top_k=64, sinks=1, window=128, shared_kv_selection=False, budget=512, backend='auto', always=None, allocation=Uniform(), refine=None, rest=None)"),
    ("radar+", {"budget": 1024}, "SegmentSearch(summary=Rerank(coarse=Centroid(), shortlist=16, factor=2.0, per_group=True), selector=TopK(), schedule=SqrtSchedule(aspect=8.0), top_k=512, sinks=4, window=0, shared_kv_selection=False, budget=1024, backend='auto', always=None, allocation=Uniform(), refine=None, rest=None)"),
    ("quest", {"top_k": 8}, "SegmentSearch(summary=MinMaxBound(), selector=TopK(), schedule=FixedSchedule(size=16), top_k=8, sinks=0, window=0, shared_kv_selection=False, budget=None, backend='auto', always=None, allocation=Uniform(), refine=None, rest=None)"),
    ("h2o", {"heavy_ratio": 0.25, "budget": 512}, "H2O(budget=512, heavy_ratio=0.25)"),
    ("streamingllm", {"budget": 1024}, "StreamingLLM(budget=1024, sinks=4)"),
    ("subgen-guarded", {"seed": 3, "budget": 512}, "SubGen(budget=512, window=32, sinks=0, cluster_samples=8, value_share=0.5, radius=0.0, seed=3, guard=True)"),
    ("radar-rerank", {"n_features": 256, "budget": 512}, "SegmentSearch(summary=Rerank(coarse=PerformerFeatures(n_features=256, orthogonal=False, antithetic=False, seed=0, feature_dtype=torch.float32), shortlist=16, factor=2.0, per_group=False), selector=TopK(), schedule=SqrtSchedule(aspect=1.0), top_k=64, sinks=0, window=0, shared_kv_selection=False, budget=512, backend='auto', always=None, allocation=Uniform(), refine=None, rest=None)"),
    ("snapkv-then-radar", {"budget": 1024}, "PrefillEviction(prefill=SnapKV(budget=4096, observation_window=32, kernel_size=5, pooling='max'), decode=SegmentSearch(summary=PerformerFeatures(n_features=4096, orthogonal=False, antithetic=True, seed=0, feature_dtype=torch.float32), selector=TopK(), schedule=AspectSchedule(aspect=4.0), top_k=64, sinks=1, window=256, shared_kv_selection=False, budget=1024, backend='auto', always=None, allocation=Uniform(), refine=None, rest=None))"),
    ("snapkv-then-radar", {"prefill_budget": 700, "observation_window": 16}, "PrefillEviction(prefill=SnapKV(budget=700, observation_window=16, kernel_size=5, pooling='max'), decode=SegmentSearch(summary=PerformerFeatures(n_features=4096, orthogonal=False, antithetic=True, seed=0, feature_dtype=torch.float32), selector=TopK(), schedule=AspectSchedule(aspect=4.0), top_k=64, sinks=1, window=1024, shared_kv_selection=False, budget=None, backend='auto', always=None, allocation=Uniform(), refine=None, rest=None))"),
]  # fmt: skip


@pytest.mark.parametrize("name,options,expected", RECORDED, ids=[f"{n}-{json.dumps(o)}" for n, o, _ in RECORDED])
def test_the_registry_builds_what_the_cli_table_built(name, options, expected):
    assert repr(registry.build(name, **options)) == expected
    assert repr(parse_method(f"{name}:" + ",".join(f"{k}={v}" for k, v in options.items()))[1]) == expected


@pytest.mark.parametrize("name", registry.names())
def test_every_declared_default_is_the_builders_own(name):
    entry = registry.get(name)
    parameters = inspect.signature(entry.build).parameters
    for option in entry.options:
        assert option.name in parameters, f"{name}: {option.name} is not a keyword of {entry.build}"
        assert option.default == parameters[option.name].default, f"{name}: {option.name}"
        assert isinstance(option.default, (option.type, type(None)))
        assert option.help


# -- a method registered from user code ------------------------------------------------------------


def RecentPages(budget: int | None = None, top_k: int = 4) -> SegmentSearch:
    """A user's policy: the most recent pages of 8 tokens (no scoring at all)."""
    return SegmentSearch(summary=ExactScore(), selector=Recent(), schedule=FixedSchedule(8), top_k=top_k, budget=budget)


USER = MethodEntry(
    "recent-pages",
    "the most recent pages of 8 tokens (registered by a test)",
    RecentPages,
    (Option("budget", int, None, "past KV tokens a step may attend"), Option("top_k", int, 4, "pages attended")),
)


@pytest.fixture
def user_method():
    registry.register(USER)
    yield USER.name
    registry.unregister(USER.name)


def test_a_method_registered_from_user_code_is_listed_and_built_by_the_cli(user_method):
    assert user_method in registry.names()
    label, method, given = parse_method(f"{user_method}:top_k=2", budget=512)
    assert (label, given) == ("recent-pages:top_k=2", {"top_k": 2})  # the spec's top_k: --budget does not apply
    assert method == RecentPages(top_k=2)
    assert parse_method(user_method, budget=64)[1] == RecentPages(budget=64)
    result = CliRunner().invoke(app, ["methods", "--all"], terminal_width=200)  # a new entry is experimental unless it says
    assert result.exit_code == 0 and "recent-pages" in result.output and "top_k (4)" in result.output


def test_a_method_registered_from_user_code_passes_the_contract_tests(user_method):
    # The same checks that run over every registered name at collection (tests/test_methods_budget.py).
    check_method(user_method)


def test_ppl_runs_a_method_registered_from_user_code(user_method, tmp_path):
    from sparseattn.hf import default_model_unavailable_reason

    reason = default_model_unavailable_reason()
    if reason:
        pytest.skip(reason)
    text = tmp_path / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(40)))
    args = ["ppl", "-m", user_method, "--budget", "32", "--text", str(text), "--prefill", "64", "--steps", "2"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "runs")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summaries = list((tmp_path / "runs").rglob("summary.json"))
    assert len(summaries) == 1 and "recent-pages" in str(summaries[0])
    assert json.loads(summaries[0].read_text())["ppl"] > 1


# -- what is refused -------------------------------------------------------------------------------


def test_a_name_is_registered_once(user_method):
    with pytest.raises(ValueError, match="method 'recent-pages' is already registered by tests?.test_registry|test_registry"):
        registry.register(MethodEntry(user_method, "another", Dense))
    with pytest.raises(ValueError, match="'radar' is already registered by sparseattn.methods.segment_search"):
        registry.register(MethodEntry("radar", "another radar", Dense))
    registry.register(USER)  # the same entry again: nothing to do
    with pytest.raises(ValueError, match="declares the option.* budget twice"):
        registry.register(MethodEntry("twice", "", Dense, (Option("budget", int, 1, "a"), Option("budget", int, 2, "b"))))


@pytest.mark.parametrize(
    "name,options,message",
    [
        ("lsh", {}, "unknown method 'lsh'; known methods: dense, radar, "),
        ("dense", {"budget": 5}, "dense does not take budget; it takes no options"),
        ("streamingllm", {"seed": 1}, "streamingllm does not take seed; it takes budget, sinks"),
        ("radar", {"top_k": 0}, "top_k 0 is out of range; allowed: an integer in [1, 2147483647]"),
        ("radar", {"top_k": 8.0}, "top_k 8.0 is out of range; allowed: an integer in [1, 2147483647]"),
        ("radar", {"sinks": True}, "sinks True is out of range; allowed: an integer in [0, 2147483647]"),
        ("h2o", {"heavy_ratio": 1.5}, "heavy_ratio 1.5 is out of range; allowed: a number in (0, 1)"),
        ("radar", {"budget": 8, "top_k": 4}, "give budget or top_k, not both: radar turns the budget into the segments"),
    ],
)
def test_bad_options_are_refused_with_the_messages_the_cli_gave(name, options, message):
    with pytest.raises(ValueError) as err:
        registry.build(name, **options)
    assert str(err.value).startswith(message)
    if options and name != "lsh":
        assert isinstance(err.value, OptionError)


def test_the_cli_spells_the_same_refusals_as_it_did():
    # Recorded from `parse_method` before the registry (issue 13, item 3).
    for spec, message in [
        ("dense:budget=5", "'dense:budget=5': dense does not take budget; it takes no options"),
        ("quest:page_size=0", "'quest:page_size=0': page_size 0 is out of range; allowed: an integer in [1, 2147483647]"),
        ("radar:top_k=x", "option top_k in 'radar:top_k=x' must be a int, got 'x'"),
        ("h2o:heavy_ratio=1.5", "'h2o:heavy_ratio=1.5': heavy_ratio 1.5 is out of range; allowed: a number in (0, 1)"),
    ]:
        with pytest.raises(typer.BadParameter) as err:
            parse_method(spec)
        assert err.value.format_message() == f"Invalid value for '--method': {message}"


# -- third-party packages: the sparseattn.methods entry point group ---------------------------------


@pytest.fixture
def plugins(monkeypatch, tmp_path):
    """Installs fake entry points: ``plugins({"name": "module:attr"}, module_source)``."""
    registry.names()  # the built-ins are in
    monkeypatch.setattr(registry, "_ENTRIES", dict(registry._ENTRIES))
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_plugin_errors", [])
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(points: dict[str, str], modules: dict[str, str]) -> None:
        for module, source in modules.items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        eps = [importlib.metadata.EntryPoint(n, v, registry.ENTRY_POINT_GROUP) for n, v in points.items()]

        def entry_points(**selection):
            assert selection == {"group": registry.ENTRY_POINT_GROUP}
            return eps

        monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)

    return install


PLUGIN = """
    from sparseattn import Dense
    from sparseattn.registry import MethodEntry, Option

    def DenseAgain(budget: int = 100):
        return Dense()

    ENTRY = MethodEntry("plugin-dense", "dense, from a plugin", DenseAgain, (Option("budget", int, 100, "ignored"),))
    MORE = [MethodEntry("plugin-a", "a", Dense), MethodEntry("plugin-b", "b", Dense)]
"""


def test_a_plugin_registers_its_methods_through_an_entry_point_on_first_lookup(plugins):
    plugins({"one": "sparseattn_fake_plugin:ENTRY", "several": "sparseattn_fake_plugin:MORE"}, {"sparseattn_fake_plugin": PLUGIN})
    assert "plugin-dense" not in registry._ENTRIES  # nothing is loaded before a lookup
    names = registry.names()
    assert names[-3:] == ["plugin-dense", "plugin-a", "plugin-b"]
    assert registry.build("plugin-dense", budget=5) == Dense()
    assert "entry point 'one'" in registry.get("plugin-dense").origin
    assert parse_method("plugin-dense", budget=64)[2] == {"budget": 64}


@pytest.mark.parametrize(
    "value,why",
    [
        ("sparseattn_no_such_plugin:ENTRY", "ModuleNotFoundError"),
        ("sparseattn_fake_plugin:MISSING", "AttributeError"),
        ("sparseattn_fake_plugin:DenseAgain", "TypeError"),  # a function, not a MethodEntry
    ],
)
def test_a_broken_plugin_is_named_in_a_clear_error(plugins, value, why):
    plugins({"broken": value}, {"sparseattn_fake_plugin": PLUGIN})
    import sparseattn.registry  # noqa: F401  (importing never loads plugins, so never fails)

    for _ in range(2):  # every lookup says so, not only the first
        with pytest.raises(PluginError, match=rf"entry point 'broken' \({value}\) of group 'sparseattn.methods' failed: {why}"):
            registry.names()
    result = CliRunner().invoke(app, ["ppl", "-m", "dense", "--steps", "1"])
    # On the command line it is a one-line usage error naming the entry point, not a traceback.
    assert result.exit_code == 2 and "entry point 'broken'" in result.output, result.output


def test_a_plugin_taking_a_built_in_name_is_refused_naming_both(plugins):
    plugins({"clash": "sparseattn_fake_clash:ENTRY"}, {"sparseattn_fake_clash": """
        from sparseattn import Dense
        from sparseattn.registry import MethodEntry
        ENTRY = MethodEntry("radar", "not radar", Dense)
    """})  # fmt: skip
    with pytest.raises(PluginError, match="entry point 'clash'.*'radar' is already registered by sparseattn.methods.segment_search"):
        registry.get("radar")


def test_a_range_closed_below_takes_its_low_end_where_the_part_does():
    """cap and prefilter_keep take 1 in the parts (PooledMass, Rerank), so their specs do too; below 1 is refused."""
    from sparseattn.registry import Range

    assert 1.0 in Range(1.0, 4.0, integer=False, closed=True) and 1.0 not in Range(1.0, 4.0, integer=False)
    assert str(Range(1.0, 4.0, integer=False, closed=True)) == "a number in [1, 4)"
    assert registry.parse("radar+adaptive:cap=1,prefilter=8,prefilter_keep=1", 512).options["cap"] == 1.0
    with pytest.raises(ValueError, match=r"cap 0.99 is out of range; allowed: a number in \[1, 1024\)"):
        registry.parse("radar+adaptive:cap=0.99", 512)
