"""The ``pegainfer`` console script: ``pegainfer <command> [key=value ...]``.

``generate`` and ``serve`` run through ``hydra.main`` so Hydra's own flags (``--help``, ``--cfg job``,
``--info``, shell completion) work; the primary configs keep Hydra from writing files or changing directory.
``bench serve`` is argparse-style: it drives any OpenAI-compatible server, not a config of ours.
Errors pegainfer raises on purpose print as one line: exit 2 for configuration errors, 1 otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from pegainfer.config.compose import (
    CONFIG_MODULE,
    HYDRA_VERSION_BASE,
    build_engine_config,
    build_prompt_config,
    build_sampling_params,
    build_server_config,
    hydra_error,
    install_search_path,
)
from pegainfer.errors import ConfigError, PegainferError
from pegainfer.plugins.registry import PluginWarning, get_model_registry, plugin_failures

USAGE = """\
usage: pegainfer <command> [key=value ...]

commands:
  generate   generate text for a prompt; no arguments runs the embedded demo model
             (pegainfer generate model.path=DIR prompt="..." max_tokens=32)
  serve      serve the OpenAI-compatible HTTP API; no arguments serves the embedded demo model
             (pegainfer serve model.path=DIR server.host=127.0.0.1 server.port=8000)
  bench      `pegainfer bench serve --url URL`: load-test a running OpenAI-compatible server
  models     list the installed models and the plugins that provide them (alias: plugins)

`pegainfer generate --help` (or `serve --help`) lists every config key; `--cfg job` prints the
composed config without running it; `pegainfer bench serve --help` lists the load client's options.
"""


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    _setup_logging()
    # A skipped plugin is already reported once through logging; don't print it twice.
    warnings.filterwarnings("ignore", category=PluginWarning)
    if args and args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if not args or args[0] not in COMMANDS:
        if args:
            print(f"error: unknown command '{args[0]}'", file=sys.stderr)
        print(USAGE, end="", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args[0]](args[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PegainferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the current ``sys.stderr``, which redirections and test runners swap after setup."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _setup_logging() -> None:
    # Only our own loggers: the root logger stays the embedding program's (and Hydra's, for --info).
    logger = logging.getLogger("pegainfer")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        # An ISO-like local timestamp first (the server's uvicorn lines carry the same one).
        handler.setFormatter(
            logging.Formatter(
                "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"
            )
        )
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def generate_command(args: list[str]) -> int:
    """``pegainfer generate [overrides]``: compose ``generate.yaml`` through hydra.main and run it."""
    return _hydra_command("generate", args, run_generate)


def serve_command(args: list[str]) -> int:
    """``pegainfer serve [overrides]``: compose ``serve.yaml`` and serve it until SIGTERM (exit 0)."""
    return _hydra_command("serve", args, run_serve)


def bench_command(args: list[str]) -> int:
    """``pegainfer bench serve --url URL ...``: the load client (argparse-style: it drives any server)."""
    if not args or args[0] in ("-h", "--help"):
        usage = "usage: pegainfer bench serve [--help] [options]\n\n  serve   load-test an OpenAI server"
        print(usage, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] != "serve":
        raise ConfigError(f"unknown bench command '{args[0]}'; the only one is 'serve'")
    from pegainfer.bench_serve import main as bench_serve_main

    return bench_serve_main(args[1:])


def _hydra_command(command: str, args: list[str], run: Callable[[DictConfig], None]) -> int:
    """Compose ``<command>.yaml`` through hydra.main (so --help, --cfg job and completion work) and run it."""
    if "-m" in args or "--multirun" in args:
        hint = "; give 'prompts=[...]' instead" if command == "generate" else ""
        raise ConfigError(f"pegainfer {command} does not support --multirun{hint}")
    install_search_path()
    saved_argv, saved_full_error = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    # hydra.main reads sys.argv; HYDRA_FULL_ERROR makes it raise instead of printing its own report,
    # so a composition error reaches us and prints as one line.
    sys.argv = [f"pegainfer {command}", *args]
    os.environ["HYDRA_FULL_ERROR"] = "1"
    GlobalHydra.instance().clear()
    # An exception leaving the task makes Hydra print its own report line, so the task hands errors back.
    errors: list[PegainferError] = []

    def task(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except PegainferError as exc:
            errors.append(exc)

    try:
        hydra.main(
            version_base=HYDRA_VERSION_BASE, config_path=f"pkg://{CONFIG_MODULE}", config_name=command
        )(task)()
    except (HydraException, OmegaConfBaseException) as exc:
        if saved_full_error == "1":
            raise
        raise hydra_error(exc) from None
    finally:
        sys.argv = saved_argv
        if saved_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_full_error
        GlobalHydra.instance().clear()
    if errors:
        raise errors[0]
    return 0


def _serve_other_rank(cfg: DictConfig) -> bool:
    """Under ``torchrun`` only rank 0 runs the command (the engine, the server); any other rank becomes a
    tensor-parallel worker of the same composed config. Returns whether this process was such a rank."""
    from pegainfer.executor.tp_launch import launched_by_torchrun, torchrun_rank

    if not launched_by_torchrun() or torchrun_rank() == 0:
        return False
    from pegainfer.executor.tp_worker import run_torchrun_rank

    run_torchrun_rank(build_engine_config(cfg))
    return True


def run_serve(cfg: DictConfig) -> None:
    """Serve the engine of a composed ``serve`` config over HTTP."""
    if _serve_other_rank(cfg):
        return
    engine_config = build_engine_config(cfg)
    server_config = build_server_config(cfg)
    from pegainfer.server.app import run_server  # heavy (torch, FastAPI): imported only when serving

    run_server(engine_config, server_config)


def run_generate(cfg: DictConfig) -> None:
    """Build the engine from a composed ``generate`` config and print each completion to stdout."""
    if _serve_other_rank(cfg):
        return
    engine_config = build_engine_config(cfg)
    sampling_params = build_sampling_params(cfg)
    prompt_config = build_prompt_config(cfg)
    from pegainfer.engine.llm import LLM  # heavy (torch): imported only when something is generated

    llm = LLM.from_config(engine_config)
    prompts = prompt_config.all_prompts
    try:
        if prompt_config.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sampling_params)
        else:
            outputs = llm.generate(prompts, sampling_params)
    finally:
        llm.engine.shutdown()  # tensor-parallel workers end with the command
    several = len(prompts) * sampling_params.n > 1
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            if several:
                print(f"--- prompt {i}, completion {completion.index} ---")
            print(completion.text)


def models_command(args: list[str]) -> int:
    """``pegainfer models``: a table of installed models, then the plugins that failed to load."""
    if args:
        raise ConfigError(f"pegainfer models takes no arguments, got {' '.join(args)}")
    header = ("MODEL", "ARCHITECTURES", "PLUGIN", "PACKAGE")
    rows = [
        (reg.name, ", ".join(reg.architectures) or "-", reg.plugin, reg.package)
        for reg in get_model_registry().registrations()
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print("(no models installed)")
    failures = plugin_failures()
    if failures:
        print("\nplugins that failed to load:")
        for failure in failures:
            print(f"  {failure.plugin} ({failure.package}): {failure.error}")
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "generate": generate_command,
    "serve": serve_command,
    "bench": bench_command,
    "models": models_command,
    "plugins": models_command,
}
