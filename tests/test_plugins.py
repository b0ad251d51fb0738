"""The plugin system: discovery, isolation of broken plugins, env filters, API versions, the registry."""

from __future__ import annotations

import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pegainfer.config.schema import ModelConfig
from pegainfer.errors import ConfigError, PluginError
from pegainfer.plugins import registry as plugins
from pegainfer.plugins.registry import (
    ModelRegistration,
    PluginWarning,
    config_search_path,
    get_model_registry,
    hookimpl,
    load_plugins,
    plugin_failures,
    reset_plugins,
)

IN_TREE = ("qwen3_14b", "qwen35", "deepseek")


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(plugins.ALLOW_ENV, raising=False)
    monkeypatch.delenv(plugins.BLOCK_ENV, raising=False)
    reset_plugins()
    yield
    reset_plugins()


def make_plugin(
    name: str,
    models: tuple[ModelRegistration, ...] = (),
    *,
    api_version: int | None = None,
    resolve: Callable[[dict[str, Any]], str | None] | None = None,
    extra_hooks: dict[str, Callable[..., Any]] | None = None,
) -> types.ModuleType:
    """An in-memory plugin module with the given hooks."""
    module = types.ModuleType(name)

    def register_models(register: Callable[[ModelRegistration], None]) -> None:
        for reg in models:
            register(reg)

    module.register_models = hookimpl(register_models)  # type: ignore[attr-defined]
    if api_version is not None:
        module.pegainfer_plugin_api_version = hookimpl(lambda: api_version)  # type: ignore[attr-defined]
    if resolve is not None:

        def resolve_model(hf_config: dict[str, Any]) -> str | None:
            return resolve(hf_config)

        module.resolve_model = hookimpl(resolve_model)  # type: ignore[attr-defined]
    for hook, function in (extra_hooks or {}).items():
        setattr(module, hook, hookimpl(function))
    return module


def model(name: str, **kwargs: Any) -> ModelRegistration:
    return ModelRegistration(name=name, model_class="fake_module:FakeModel", **kwargs)


@dataclass
class FakeDist:
    name: str


@dataclass
class FakeEntryPoint:
    """Stands in for an importlib.metadata entry point of an installed distribution."""

    name: str
    target: object
    dist: FakeDist

    @property
    def value(self) -> str:
        return f"{self.name}.hooks"

    def load(self) -> object:
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


def use_entry_points(monkeypatch: pytest.MonkeyPatch, *points: FakeEntryPoint) -> None:
    monkeypatch.setattr(plugins, "_entry_points", lambda: list(points))


# -- the installed in-tree plugins ------------------------------------------------------------------


def test_in_tree_plugins_are_discovered_through_entry_points() -> None:
    registry = get_model_registry()
    for name in IN_TREE:
        reg = registry.get(name)
        # Each plugin is a distribution of its own, not part of the core's.
        assert (reg.plugin, reg.package) == (name, "pegainfer-" + name.replace("_", "-"))
        assert f"pkg://pegainfer_{name}.conf" in config_search_path()
    assert not [f for f in plugin_failures() if f.package.startswith("pegainfer-")]


@pytest.mark.parametrize(
    ("hf_config", "expected"),
    [
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "qwen3_14b"),
        ({"architectures": ["Qwen3_5MoeForConditionalGeneration"]}, "qwen35"),
        ({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"}, "deepseek"),
        ({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}, "deepseek_v4"),
        # model_type alone, when the architecture is unknown or absent
        ({"architectures": ["SomeFutureName"], "model_type": "deepseek_v3"}, "deepseek"),
        ({"model_type": "qwen3_5"}, "qwen35"),
        # architectures win over model_type
        ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "qwen3"}, "deepseek"),
        # a VLM config: only its text_config names the language model
        (
            {
                "architectures": ["SomeVLM"],
                "model_type": "some_vlm",
                "text_config": {"model_type": "qwen3_5_moe_text"},
            },
            "qwen35",
        ),
    ],
)
def test_registry_resolves_checkpoints(hf_config: dict[str, Any], expected: str) -> None:
    assert get_model_registry().resolve(hf_config).name == expected


def test_unresolvable_checkpoint_names_what_it_declares_and_what_is_installed() -> None:
    with pytest.raises(ConfigError) as info:
        get_model_registry().resolve({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    message = str(info.value)
    assert "LlamaForCausalLM" in message and "llama" in message
    assert all(name in message for name in IN_TREE)


def test_unknown_model_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown model 'llama'.*qwen35"):
        get_model_registry().get("llama")


def test_loading_is_idempotent() -> None:
    assert load_plugins() is load_plugins()
    with pytest.raises(PluginError, match="reset_plugins"):
        load_plugins(extra=[make_plugin("late")])


def test_hook_modules_import_nothing_heavy() -> None:
    code = (
        "import sys, pegainfer_qwen3_14b.hooks, pegainfer_qwen35.hooks, pegainfer_deepseek.hooks\n"
        "heavy = [m for m in ('torch', 'pegainfer_qwen3_14b.model', 'hydra') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- in-memory plugins --------------------------------------------------------------------------------


def test_resolve_model_hook_claims_what_nothing_else_matches() -> None:
    fake = make_plugin(
        "fake", (model("fake_lm"),), resolve=lambda cfg: "fake_lm" if cfg.get("fake_marker") else None
    )
    load_plugins(extra=[fake], entry_points=False)
    registry = get_model_registry()
    assert registry.resolve({"architectures": ["Whatever"], "fake_marker": True}).name == "fake_lm"
    with pytest.raises(ConfigError):
        registry.resolve({"architectures": ["Whatever"]})


def test_registrations_get_their_plugin_and_package(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(
        monkeypatch,
        FakeEntryPoint("a", make_plugin("a", (model("m_a", architectures=["ArchA"]),)), FakeDist("pkg-a")),
    )
    reg = get_model_registry().get("m_a")
    assert (reg.plugin, reg.package, reg.architectures) == ("a", "pkg-a", ("ArchA",))
    assert reg.origin == "plugin 'a' (package pkg-a)"


def test_duplicate_model_names_name_both_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(
        monkeypatch,
        FakeEntryPoint("a", make_plugin("a", (model("same"),)), FakeDist("pkg-a")),
        FakeEntryPoint("b", make_plugin("b", (model("same"),)), FakeDist("pkg-b")),
    )
    with pytest.raises(PluginError, match="'same'.*pkg-a.*pkg-b"):
        load_plugins()


def test_two_models_claiming_one_architecture_ask_the_user_to_choose() -> None:
    one = make_plugin("one", (model("m1", architectures=("Shared",)),))
    two = make_plugin("two", (model("m2", architectures=("Shared",)),))
    load_plugins(extra=[one, two], entry_points=False)
    with pytest.raises(ConfigError, match="claimed by several models.*model=NAME"):
        get_model_registry().resolve({"architectures": ["Shared"]})


def broken_cases() -> list[tuple[str, object]]:
    def raising_hook(register: Callable[[ModelRegistration], None]) -> None:
        raise RuntimeError("hook exploded")

    def bad_registration(register: Callable[[ModelRegistration], None]) -> None:
        register(model("Bad Name!"))

    def misspelled(register: Callable[[ModelRegistration], None]) -> None:
        raise AssertionError("never called")

    def reentrant(register: Callable[[ModelRegistration], None]) -> None:
        get_model_registry()

    broken_hook = make_plugin("broken")
    broken_hook.register_models = hookimpl(raising_hook)  # type: ignore[attr-defined]
    invalid = make_plugin("broken")
    invalid.register_models = hookimpl(bad_registration)  # type: ignore[attr-defined]
    calls_back = make_plugin("broken")
    calls_back.register_models = hookimpl(reentrant)  # type: ignore[attr-defined]
    return [
        ("ImportError: no module named 'missing_dep'", ImportError("no module named 'missing_dep'")),
        ("hook exploded", broken_hook),
        ("is invalid", invalid),
        ("register_modelz", make_plugin("broken", extra_hooks={"register_modelz": misspelled})),
        ("plugin API version 3", make_plugin("broken", (model("never"),), api_version=3)),
        ("while being loaded", calls_back),
    ]


@pytest.mark.parametrize(
    ("reason", "target"),
    broken_cases(),
    ids=["import", "hook", "registration", "misspelled", "api", "reentrant"],
)
def test_a_broken_plugin_is_skipped_with_a_warning_and_the_others_load(
    monkeypatch: pytest.MonkeyPatch, reason: str, target: object
) -> None:
    use_entry_points(
        monkeypatch,
        FakeEntryPoint("broken", target, FakeDist("pegainfer-broken")),
        FakeEntryPoint("good", make_plugin("good", (model("good_lm"),)), FakeDist("pegainfer-good")),
    )
    with pytest.warns(PluginWarning, match="'broken' \\(package pegainfer-broken\\)") as record:
        registry = get_model_registry()
    assert reason in str(record[0].message)
    assert [r.name for r in registry.registrations()] == ["good_lm"]
    assert [(f.plugin, f.package) for f in plugin_failures()] == [("broken", "pegainfer-broken")]
    assert "'broken' (pegainfer-broken)" in registry.describe()


def test_an_api_version_mismatch_is_a_plugin_error_naming_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(
        monkeypatch, FakeEntryPoint("future", make_plugin("future", api_version=3), FakeDist("pkg-future"))
    )
    with pytest.warns(PluginWarning):
        (failure,) = plugin_failures()
    assert failure.error.startswith("PluginError: plugin 'future' (package pkg-future)")
    assert "version 3" in failure.error and f"version {plugins.PLUGIN_API_VERSION}" in failure.error


def test_a_version_1_plugin_is_told_what_version_2_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(
        monkeypatch, FakeEntryPoint("old", make_plugin("old", api_version=1), FakeDist("pkg-old"))
    )
    with pytest.warns(PluginWarning):
        (failure,) = plugin_failures()
    assert "written for plugin API version 1" in failure.error
    assert "mtp_forward" in failure.error and "caches[(layer, name)]" in failure.error


def test_current_api_version_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(
        monkeypatch,
        FakeEntryPoint(
            "ok",
            make_plugin("ok", (model("ok_lm"),), api_version=plugins.PLUGIN_API_VERSION),
            FakeDist("pkg-ok"),
        ),
    )
    assert get_model_registry().get("ok_lm").plugin == "ok"


@pytest.mark.parametrize(
    ("allow", "block", "loaded"),
    [
        ("a,c", None, ["a_lm", "c_lm"]),
        (None, "b", ["a_lm", "c_lm"]),
        (" a ", "a", []),
        ("", "", ["a_lm", "b_lm", "c_lm"]),
    ],
)
def test_allow_and_block_env_vars(
    monkeypatch: pytest.MonkeyPatch, allow: str | None, block: str | None, loaded: list[str]
) -> None:
    use_entry_points(
        monkeypatch,
        *(FakeEntryPoint(n, make_plugin(n, (model(f"{n}_lm"),)), FakeDist(f"pkg-{n}")) for n in "abc"),
    )
    for var, value in ((plugins.ALLOW_ENV, allow), (plugins.BLOCK_ENV, block)):
        if value is not None:
            monkeypatch.setenv(var, value)
    assert [r.name for r in get_model_registry().registrations()] == loaded


def test_allow_list_naming_a_missing_plugin_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(monkeypatch)
    monkeypatch.setenv(plugins.ALLOW_ENV, "nosuch")
    with pytest.warns(PluginWarning, match="'nosuch'"):
        load_plugins()


def test_disable_list_naming_a_missing_plugin_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    use_entry_points(monkeypatch, FakeEntryPoint("a", make_plugin("a", (model("a_lm"),)), FakeDist("pkg-a")))
    monkeypatch.setenv(plugins.BLOCK_ENV, "a,nosuch")
    with pytest.warns(PluginWarning, match=f"{plugins.BLOCK_ENV} names 'nosuch'") as record:
        assert get_model_registry().registrations() == []
    assert not any("'a'" in str(w.message) for w in record)


def test_config_dirs_are_registered_in_order() -> None:
    def dirs(register: Callable[[str], None]) -> None:
        register("pkg://fake.conf")
        register("relative/conf")

    load_plugins(extra=[make_plugin("fake", extra_hooks={"register_config_dirs": dirs})], entry_points=False)
    path = config_search_path()
    assert path[0] == "pkg://fake.conf"
    assert path[1].startswith("file:///") and path[1].endswith("relative/conf")


# -- ModelRegistration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "model name"),
        ({"name": "auto"}, "reserved"),
        ({"model_class": "no_colon"}, "model_class"),
        ({"config_schema": "pkg.mod"}, "config_schema"),
        ({"architectures": "Qwen3ForCausalLM"}, "architectures"),
    ],
)
def test_invalid_registrations_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PluginError, match=match):
        ModelRegistration(**{"name": "ok", "model_class": "mod:Cls", **kwargs})


def test_lazy_imports_name_the_plugin_and_package_on_failure() -> None:
    reg = ModelRegistration(
        name="x",
        model_class="no_such_module_xyz:Model",
        config_schema="pegainfer.config.schema:CacheConfig",
        plugin="p",
        package="pkg-p",
    )
    with pytest.raises(
        PluginError, match="model 'x' from plugin 'p' \\(package pkg-p\\): cannot import no_such_module_xyz"
    ):
        reg.load_model_class()
    with pytest.raises(PluginError, match="not a subclass of pegainfer.config.schema.ModelConfig"):
        reg.load_config_schema()
    assert ModelRegistration(name="y", model_class="m:C").load_config_schema() is ModelConfig
    assert (
        ModelRegistration(name="z", model_class="pegainfer.config.schema:EngineConfig")
        .load_model_class()
        .__name__
        == "EngineConfig"
    )


def test_make_executor_hook_builds_the_executor_of_its_own_models_only(tiny_qwen3) -> None:
    """The plugin that registered a model may build its executor; no other plugin is asked."""
    from pegainfer.engine.llm import LLM
    from pegainfer.executor.executor import LocalExecutor

    class CountingExecutor(LocalExecutor):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.steps = 0

        def execute(self, batch: Any) -> Any:
            self.steps += 1
            return super().execute(batch)

    asked: list[str] = []

    def own(config: Any, registration: ModelRegistration) -> Any:
        asked.append(f"own:{registration.name}")
        return CountingExecutor(config)

    def other(config: Any, registration: ModelRegistration) -> Any:
        asked.append(f"other:{registration.name}")
        return None

    counted = ModelRegistration("counted_qwen3", "pegainfer_qwen3_14b.model:Qwen3ForCausalLM")
    load_plugins(
        extra=[
            make_plugin("counting", (counted,), extra_hooks={"make_executor": own}),
            make_plugin("bystander", (), extra_hooks={"make_executor": other}),
        ],
        entry_points=False,
    )
    from pegainfer.config.schema import EngineConfig

    config = EngineConfig(model=ModelConfig(name="counted_qwen3", path=str(tiny_qwen3)), device="cpu")
    llm = LLM.from_config(config)
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False)
    assert out[0].outputs[0].token_ids
    assert isinstance(llm.engine.executor, CountingExecutor) and llm.engine.executor.steps > 0
    assert asked == ["own:counted_qwen3"]


def test_make_executor_returning_something_else_names_the_plugin(tiny_qwen3) -> None:
    from pegainfer.config.schema import EngineConfig
    from pegainfer.executor.executor import build_executor

    broken = ModelRegistration("odd_qwen3", "pegainfer_qwen3_14b.model:Qwen3ForCausalLM")
    plugin = make_plugin("odd", (broken,), extra_hooks={"make_executor": lambda config, registration: 42})
    load_plugins(extra=[plugin], entry_points=False)
    config = EngineConfig(model=ModelConfig(name="odd_qwen3", path=str(tiny_qwen3)), device="cpu")
    with pytest.raises(PluginError, match="plugin 'odd'.*make_executor returned int"):
        build_executor(config)


def test_tiny_checkpoint_builders_come_from_the_plugins() -> None:
    from pegainfer.plugins.registry import TinyCheckpointBuilder, tiny_checkpoint_builders

    builders = tiny_checkpoint_builders()
    assert {"qwen3", "qwen3_5", "qwen3_5_moe", "deepseek_v3", "deepseek_v32", "deepseek_v4"} <= set(builders)
    assert builders["qwen3_5"].plugin == "qwen35" and builders["deepseek_v4"].legacy_rope
    reset_plugins()

    def two(register: Callable[[TinyCheckpointBuilder], None]) -> None:
        register(TinyCheckpointBuilder("same", "m:config", "m:tensors"))

    one = make_plugin("one", extra_hooks={"register_tiny_checkpoints": two})
    other = make_plugin("other", extra_hooks={"register_tiny_checkpoints": two})
    with pytest.raises(PluginError, match="'same' is registered twice: by plugin 'one'"):
        load_plugins(extra=[one, other], entry_points=False)


def test_a_tiny_builder_that_is_not_a_target_string_is_refused() -> None:
    from pegainfer.plugins.registry import TinyCheckpointBuilder

    with pytest.raises(PluginError, match="config must be a 'module:function' string"):
        TinyCheckpointBuilder("arch", "not a target", "m:tensors")
