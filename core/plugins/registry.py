"""Model plugins: pluggy hookspecs, entry-point discovery and the model registry.

A plugin is a module (or object) with ``@hookimpl`` functions, named by an entry point in the group
``pegainfer``. Our own plugins are declared the same way in our pyproject. Hooks hand the core what a
plugin offers through ``register`` callbacks, so the core validates every item and knows which plugin
sent it. Plugin modules must have no import-time side effects: they register names and lazy
``"module:Class"`` strings; heavy imports happen when a model is built.

Loading happens once per process (TP workers included). A plugin that fails to import, reports another
API version, misspells a hook or raises in a hook is skipped with a warning naming it and its package;
the others keep working. Two plugins registering the same model name is an error naming both packages.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import pluggy

from pegainfer.config.schema import ModelConfig
from pegainfer.errors import ConfigError, PegainferError, PluginError

PROJECT = "pegainfer"
ENTRY_POINT_GROUP = "pegainfer"
# Bumped when a hook or a contract changes incompatibly; a plugin built for another version is refused.
# 2: the MTP draft contract moved onto CausalLM, extra caches are keyed by name, tiny checkpoints are
# registered by their plugin (register_tiny_checkpoints).
PLUGIN_API_VERSION = 2
_API_CHANGES = {
    1: "version 2 moved the MTP draft contract onto CausalLM (num_mtp_layers, mtp_buffer_specs, mtp_forward), "
    "keys extra caches by name (caches[(layer, name)]) and adds register_tiny_checkpoints",
}
ALLOW_ENV = "PEGAINFER_PLUGINS"
BLOCK_ENV = "PEGAINFER_DISABLE_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class PluginWarning(UserWarning):
    """A plugin was skipped; the message names it, its package and why."""


class HookSpecs:
    """The hooks a plugin may implement. The core calls every hook with keyword arguments only."""

    @hookspec
    def pegainfer_plugin_api_version(self) -> int:  # type: ignore[empty-body]
        """Return the plugin API version the plugin was written for (optional; absent means current)."""

    @hookspec
    def register_models(self, register: Callable[[ModelRegistration], None]) -> None:
        """Call ``register(ModelRegistration(...))`` once per model the plugin provides."""

    @hookspec
    def register_config_dirs(self, register: Callable[[str], None]) -> None:
        """Call ``register("pkg://package.conf")`` for each Hydra config dir (holding ``model/<name>.yaml``)."""

    @hookspec(firstresult=True)
    def resolve_model(self, hf_config: dict[str, Any]) -> str | None:
        """Claim a checkpoint the registry did not match by architectures/model_type.

        Gets the parsed ``config.json``; returns a registered model name, or None to pass.
        """

    @hookspec
    def register_tiny_checkpoints(self, register: Callable[[TinyCheckpointBuilder], None]) -> None:
        """Call ``register(TinyCheckpointBuilder(...))`` for each tiny random architecture the plugin writes
        (its demo and the conformance suite's checkpoints: ``pegainfer.plugins.tiny_checkpoints``)."""

    @hookspec(firstresult=True)
    def make_executor(self, config: Any, registration: ModelRegistration) -> Any:
        """Build the ``pegainfer.executor.executor.Executor`` for ``config`` (an ``EngineConfig``) whose model is
        ``registration``, one of this plugin's own; None leaves it to the core (its local or
        tensor-parallel executor). Called only on the plugin that registered the model."""


@dataclass(frozen=True)
class ModelRegistration:
    """One model a plugin provides. ``plugin`` and ``package`` are filled in by the loader.

    ``name`` is the Hydra ``model=`` option; ``model_class`` and ``config_schema`` are ``"module:Class"``
    strings imported only when the model is built (``config_schema`` must subclass ``ModelConfig``).
    ``demo_checkpoint``, a ``"module:function"`` string, names ``function(folder)``, which writes the
    model's embedded tiny demo checkpoint into ``folder``: ``model=NAME`` with no ``model.path`` runs it.
    """

    name: str
    model_class: str
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    config_schema: str | None = None
    description: str = ""
    demo_checkpoint: str | None = None
    plugin: str = field(default="", compare=False)
    package: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Plugins often pass lists; keep the registration hashable and immutable.
        object.__setattr__(self, "architectures", _str_tuple(self.architectures, "architectures"))
        object.__setattr__(self, "model_types", _str_tuple(self.model_types, "model_types"))
        if not isinstance(self.name, str) or not _NAME.match(self.name) or self.name == "auto":
            raise PluginError(
                f"model name {self.name!r} is invalid: use letters, digits, '_', '.' or '-' ('auto' is reserved)"
            )
        for key in ("model_class", "config_schema", "demo_checkpoint"):
            value = getattr(self, key)
            if (value is not None or key == "model_class") and not (
                isinstance(value, str) and _TARGET.match(value)
            ):
                raise PluginError(
                    f"model {self.name!r}: {key} must be a 'module:Class' string, got {value!r}"
                )

    @property
    def origin(self) -> str:
        return f"plugin '{self.plugin}' (package {self.package})"

    def load_model_class(self) -> type:
        """Import and return the model class; a failure is a PluginError naming the plugin and package."""
        return self._import(self.model_class)

    def load_config_schema(self) -> type[ModelConfig]:
        """Import the pydantic schema of this model's ``model.*`` section (``ModelConfig`` when unset)."""
        if self.config_schema is None:
            return ModelConfig
        schema = self._import(self.config_schema)
        if not (isinstance(schema, type) and issubclass(schema, ModelConfig)):
            raise PluginError(
                f"model '{self.name}' from {self.origin}: config_schema {self.config_schema} "
                "is not a subclass of pegainfer.config.schema.ModelConfig"
            )
        return schema

    def load_demo_writer(self) -> Callable[[Any], Any]:
        """Import the function that writes this model's demo checkpoint (a PluginError when it has none)."""
        if self.demo_checkpoint is None:
            raise PluginError(
                f"model '{self.name}' from {self.origin} has no embedded demo checkpoint; give model.path"
            )
        return self._import(self.demo_checkpoint)

    def _import(self, target: str) -> Any:
        return import_target(target, f"model '{self.name}' from {self.origin}")


def import_target(target: str, who: str) -> Any:
    """The object a ``"module:attr"`` string names; a failure is a PluginError that starts with ``who``."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise PluginError(f"{who}: cannot import {target}: {type(exc).__name__}: {exc}") from exc
    return obj


@dataclass(frozen=True)
class TinyCheckpointBuilder:
    """A tiny random checkpoint a plugin can write, by ``architecture`` name (e.g. "qwen3_5_moe").

    ``config`` and ``tensors`` are ``"module:function"`` strings, imported when a checkpoint is written:
    ``config(vocab_size, **overrides) -> dict`` (config.json, rope keys in the legacy layout or already
    nested per attention kind) and ``tensors(config, generator) -> dict[str, Tensor]``. ``legacy_rope``
    (optional, ``"module:function"``) flattens a config whose nested ropes the default cannot. ``plugin``
    and ``package`` are filled in by the loader."""

    architecture: str
    config: str
    tensors: str
    legacy_rope: str | None = None
    plugin: str = field(default="", compare=False)
    package: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not _NAME.match(self.architecture):
            raise PluginError(f"tiny checkpoint architecture {self.architecture!r} is invalid")
        for key in ("config", "tensors", "legacy_rope"):
            value = getattr(self, key)
            if (value is not None or key != "legacy_rope") and not (
                isinstance(value, str) and _TARGET.match(value)
            ):
                raise PluginError(
                    f"tiny checkpoint {self.architecture!r}: {key} must be a 'module:function' string, got {value!r}"
                )

    def _import(self, target: str) -> Any:
        return import_target(
            target,
            f"tiny checkpoint '{self.architecture}' from plugin '{self.plugin}' (package {self.package})",
        )

    def load_config(self) -> Callable[..., dict[str, Any]]:
        return self._import(self.config)

    def load_tensors(self) -> Callable[..., dict[str, Any]]:
        return self._import(self.tensors)

    def load_legacy_rope(self) -> Callable[..., dict[str, Any]] | None:
        return None if self.legacy_rope is None else self._import(self.legacy_rope)


def _str_tuple(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
        raise PluginError(f"{what} must be a sequence of non-empty strings, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped, and why."""

    plugin: str
    package: str
    error: str


class ModelRegistry:
    """Every model the loaded plugins registered, by name and by what a checkpoint declares."""

    def __init__(
        self,
        registrations: Iterable[ModelRegistration],
        hook: Callable[[dict[str, Any]], str | None] | None = None,
        failures: Iterable[PluginFailure] = (),
    ) -> None:
        self._by_name = {reg.name: reg for reg in sorted(registrations, key=lambda r: r.name)}
        self._hook = hook
        self._failures = tuple(failures)

    def registrations(self) -> list[ModelRegistration]:
        """All registrations, sorted by name."""
        return list(self._by_name.values())

    def get(self, name: str) -> ModelRegistration:
        """The model registered as ``name``; unknown names are a ConfigError listing the known ones."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"unknown model '{name}'; {self.describe()}") from None

    def resolve(self, hf_config: dict[str, Any]) -> ModelRegistration:
        """Find the model for a checkpoint's parsed ``config.json``.

        Matches ``architectures`` first, then ``model_type`` (each also read from a VLM's ``text_config``),
        then asks the plugins' ``resolve_model`` hook. Nothing found, or two models claiming the same
        name, is a ConfigError that says what the checkpoint declares and what is installed.
        """
        if not isinstance(hf_config, dict):
            raise ConfigError(
                f"a checkpoint's config.json must hold a JSON object, got {type(hf_config).__name__}"
            )
        levels = [hf_config]
        if isinstance(hf_config.get("text_config"), dict):
            levels.append(hf_config["text_config"])
        architectures = [
            a for level in levels for a in (level.get("architectures") or []) if isinstance(a, str)
        ]
        model_types = [level["model_type"] for level in levels if isinstance(level.get("model_type"), str)]
        for attr, wanted in (("architectures", architectures), ("model_types", model_types)):
            for value in wanted:
                claims = [reg for reg in self._by_name.values() if value in getattr(reg, attr)]
                if len(claims) > 1:
                    who = ", ".join(f"'{reg.name}' ({reg.origin})" for reg in claims)
                    raise ConfigError(
                        f"{value} is claimed by several models: {who}; choose one with model=NAME"
                    )
                if claims:
                    return claims[0]
        name = self._hook(hf_config) if self._hook is not None else None
        if name is not None:
            return self.get(name)
        raise ConfigError(
            f"no installed plugin supports this checkpoint (architectures {architectures or 'none'}, "
            f"model_type {model_types[0] if model_types else 'none'}); {self.describe()}; "
            "pick one with model=NAME or install a plugin for it"
        )

    def describe(self) -> str:
        """A one-line summary of the installed models and of plugins that failed to load."""
        text = "installed models: " + (", ".join(self._by_name) or "none")
        failures = self.failures_note()
        return f"{text}; {failures}" if failures else text

    def failures_note(self) -> str:
        """Names the plugins that failed to load (empty when none did), for error messages."""
        if not self._failures:
            return ""
        names = ", ".join(f"'{f.plugin}' ({f.package})" for f in self._failures)
        return f"plugins that failed to load: {names} (see `pegainfer models`)"


@dataclass
class _LoadedPlugins:
    manager: pluggy.PluginManager
    registry: ModelRegistry
    config_dirs: list[str]
    failures: list[PluginFailure]
    tiny: dict[str, TinyCheckpointBuilder]


_state: _LoadedPlugins | None = None
# Re-entrant so that a plugin calling back into this module while being imported gets an error, not a hang.
_lock = threading.RLock()
_loading = False


def load_plugins(extra: Iterable[object] = (), *, entry_points: bool = True) -> pluggy.PluginManager:
    """Load the plugins once per process and return the PluginManager; later calls return the same one.

    ``extra`` plugin objects (modules or instances) are registered after the entry points, and
    ``entry_points=False`` skips discovery: both are for tests, after ``reset_plugins()``.
    """
    global _state, _loading
    with _lock:
        if _loading:
            raise PluginError(
                "a plugin used pegainfer.plugins.registry while being loaded; hook modules must not do work on import"
            )
        if _state is None:
            _loading = True
            try:
                _state = _load(list(extra), entry_points)
            finally:
                _loading = False
        elif extra:
            raise PluginError("plugins are already loaded; call reset_plugins() before passing extra plugins")
        return _state.manager


def get_model_registry() -> ModelRegistry:
    """The registry of every model the loaded plugins provide."""
    load_plugins()
    assert _state is not None
    return _state.registry


def tiny_checkpoint_builders() -> dict[str, TinyCheckpointBuilder]:
    """Every tiny architecture the loaded plugins write, by name."""
    load_plugins()
    assert _state is not None
    return dict(_state.tiny)


def config_search_path() -> list[str]:
    """Hydra search-path entries (``pkg://...`` or ``file://...``) the plugins registered, in load order."""
    load_plugins()
    assert _state is not None
    return list(_state.config_dirs)


def plugin_failures() -> list[PluginFailure]:
    """Plugins that were skipped in this process, with the reason."""
    load_plugins()
    assert _state is not None
    return list(_state.failures)


def reset_plugins() -> None:
    """Forget the loaded plugins so the next call loads them again (tests only)."""
    global _state
    with _lock:
        _state = None


def plugin_executor(config: Any, registration: ModelRegistration) -> Any:
    """The executor the plugin that registered ``registration`` builds for ``config``, or None."""
    manager = load_plugins()
    others = [p for p in manager.get_plugins() if manager.get_name(p) != registration.plugin]
    caller = manager.subset_hook_caller("make_executor", remove_plugins=others)
    try:
        return caller(config=config, registration=registration)
    except PegainferError:
        raise
    except Exception as exc:
        raise PluginError(
            f"the make_executor hook of {registration.origin} failed: {type(exc).__name__}: {exc}"
        ) from exc


def _entry_points() -> list[Any]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var, "").strip()
    return {name.strip() for name in raw.split(",") if name.strip()} if raw else None


def _load(extra: list[object], use_entry_points: bool) -> _LoadedPlugins:
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(HookSpecs)
    loader = _Loader(manager)
    if use_entry_points:
        allow, block = _env_names(ALLOW_ENV), _env_names(BLOCK_ENV) or set()
        points = _entry_points()
        for name in sorted((allow or set()) - {ep.name for ep in points}):
            _warn(f"{ALLOW_ENV} names '{name}', but no installed plugin has that entry point")
        for name in sorted(block - {ep.name for ep in points}):
            _warn(f"{BLOCK_ENV} names '{name}', but no installed plugin has that entry point")
        for ep in sorted(points, key=lambda ep: ep.name):
            if (allow is not None and ep.name not in allow) or ep.name in block:
                continue
            package = ep.dist.name if getattr(ep, "dist", None) is not None else "unknown package"
            try:
                obj = ep.load()
            except Exception as exc:
                loader.fail(ep.name, package, f"import of {ep.value} failed: {type(exc).__name__}: {exc}")
                continue
            loader.add(obj, ep.name, package)
    for obj in extra:
        name = getattr(obj, "__name__", type(obj).__name__)
        loader.add(obj, name, getattr(obj, "__package__", None) or "in-process")
    registry = ModelRegistry(loader.models.values(), _resolve_hook(manager), loader.failures)
    return _LoadedPlugins(manager, registry, loader.config_dirs, loader.failures, loader.tiny)


class _Loader:
    """Registers plugins one at a time, so a failure is attributed to the plugin that caused it."""

    def __init__(self, manager: pluggy.PluginManager) -> None:
        self.manager = manager
        self.models: dict[str, ModelRegistration] = {}
        self.config_dirs: list[str] = []
        self.failures: list[PluginFailure] = []
        self.tiny: dict[str, TinyCheckpointBuilder] = {}

    def fail(self, name: str, package: str, why: str) -> None:
        self.failures.append(PluginFailure(name, package, why))
        _warn(f"pegainfer plugin '{name}' (package {package}) was skipped: {why}")

    def add(self, obj: object, name: str, package: str) -> None:
        try:
            self.manager.register(obj, name=name)
        except Exception as exc:
            self.fail(name, package, f"{type(exc).__name__}: {exc}")
            return
        try:
            models, dirs, tiny = self._collect(obj, name, package)
        except Exception as exc:
            self.manager.unregister(obj)
            self.fail(name, package, f"{type(exc).__name__}: {exc}")
            return
        for reg in models:
            if reg.name in self.models:
                other = self.models[reg.name]
                raise PluginError(
                    f"model name '{reg.name}' is registered twice: by {other.origin} and by {reg.origin}; "
                    f"uninstall one, or disable one with {BLOCK_ENV}=<plugin>"
                )
            self.models[reg.name] = reg
        self.config_dirs.extend(d for d in dirs if d not in self.config_dirs)
        for builder in tiny:
            other = self.tiny.get(builder.architecture)
            if other is not None:
                raise PluginError(
                    f"tiny checkpoint architecture '{builder.architecture}' is registered twice: by plugin "
                    f"'{other.plugin}' ({other.package}) and by plugin '{name}' ({package})"
                )
            self.tiny[builder.architecture] = builder

    def _collect(
        self, obj: object, name: str, package: str
    ) -> tuple[list[ModelRegistration], list[str], list[TinyCheckpointBuilder]]:
        others = [p for p in self.manager.get_plugins() if p is not obj]
        # Catches misspelled hook names (they would otherwise be silently ignored).
        self.manager.check_pending()

        def call(hook: str, **kwargs: Any) -> list[Any]:
            return self.manager.subset_hook_caller(hook, remove_plugins=others)(**kwargs)

        versions = call("pegainfer_plugin_api_version")
        if any(v != PLUGIN_API_VERSION for v in versions):
            raise PluginError(
                f"plugin '{name}' (package {package}) was written for plugin API version {versions[0]}, "
                f"this pegainfer provides version {PLUGIN_API_VERSION}; upgrade the plugin or pegainfer"
                + "".join(f" ({_API_CHANGES[v]})" for v in sorted(set(versions)) if v in _API_CHANGES)
            )
        models: list[ModelRegistration] = []
        dirs: list[str] = []

        def register_model(reg: ModelRegistration) -> None:
            if not isinstance(reg, ModelRegistration):
                raise PluginError(f"register_models must be given ModelRegistration objects, got {reg!r}")
            models.append(replace(reg, plugin=name, package=package))

        def register_dir(path: str) -> None:
            if not isinstance(path, str) or not path:
                raise PluginError(f"register_config_dirs must be given a non-empty string, got {path!r}")
            dirs.append(path if "://" in path else f"file://{os.path.abspath(path)}")

        tiny: list[TinyCheckpointBuilder] = []

        def register_tiny(builder: TinyCheckpointBuilder) -> None:
            if not isinstance(builder, TinyCheckpointBuilder):
                raise PluginError(
                    f"register_tiny_checkpoints must be given TinyCheckpointBuilder objects, got {builder!r}"
                )
            tiny.append(replace(builder, plugin=name, package=package))

        call("register_models", register=register_model)
        call("register_config_dirs", register=register_dir)
        call("register_tiny_checkpoints", register=register_tiny)
        return models, dirs, tiny


def _resolve_hook(manager: pluggy.PluginManager) -> Callable[[dict[str, Any]], str | None]:
    def resolve(hf_config: dict[str, Any]) -> str | None:
        try:
            return manager.hook.resolve_model(hf_config=hf_config)
        except Exception as exc:
            raise PluginError(f"a plugin's resolve_model hook failed: {type(exc).__name__}: {exc}") from exc

    return resolve


def _warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, PluginWarning, stacklevel=3)
