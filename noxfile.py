"""Nox sessions: `nox -l` lists them; e.g. `nox -s core`, `nox -s "plugin(name='qwen35')"`, `nox -s gpu`.

Every session installs torch first, pinned (PEGAINFER_TORCH_SPEC overrides the pin, e.g. for a CUDA
build on a GPU machine), so resolving `.[test]` never pulls a different torch. A plugin's session installs
the core and that one plugin (as a built package, so its package data must ship) and runs its own tests.
"""

from __future__ import annotations

import os

import nox

PLUGINS = ["qwen3_14b", "qwen35", "deepseek"]
TORCH_SPEC = os.environ.get("PEGAINFER_TORCH_SPEC", "torch==2.13.0")

# `gpu` needs a CUDA machine, so a bare `nox` runs the others.
nox.options.sessions = ["lint", "core", "plugin", "third_party"]


def install(session: nox.Session, *extra: str) -> None:
    session.install(TORCH_SPEC)
    session.install("-e", ".[test]", *extra)


def all_plugins() -> list[str]:
    return [arg for name in PLUGINS for arg in ("-e", f"./plugins/{name}")]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.install("ruff~=0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def core(session: nox.Session) -> None:
    """The core tests (tests/ but the third-party folder), with every in-tree plugin installed: the demo,
    the engine and the server tests drive real models."""
    install(session, *all_plugins())
    session.run("pytest", "tests", "--ignore=tests/third_party", *session.posargs)


@nox.session
@nox.parametrize("name", PLUGINS)
def plugin(session: nox.Session, name: str) -> None:
    """One plugin's tests (plugins/<name>/tests), with only the core and that plugin installed."""
    install(session, f"./plugins/{name}")
    session.run("pytest", f"plugins/{name}/tests", *session.posargs)


@nox.session
def third_party(session: nox.Session) -> None:
    """Installs the toy and the broken plugin as real packages (not editable: package data must ship)."""
    install(session, "./tests/fake_plugin", "./tests/broken_plugin")
    session.run("pytest", "tests/third_party", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The tests marked `gpu`; run it on a CUDA machine with a CUDA torch in PEGAINFER_TORCH_SPEC."""
    install(session, *all_plugins())
    session.run("pytest", "-m", "gpu", *session.posargs)
