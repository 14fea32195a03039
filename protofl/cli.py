"""The ``protofl`` command: ``protofl --version``; ``protofl new <dir>``, which writes a Flower
app directory for the installed package; ``protofl run``, `flwr run --stream` whose exit status is
the run's (:mod:`protofl.run_command`).

``flwr run`` runs an app directory: a ``pyproject.toml`` that names the ServerApp and ClientApp and
carries the default run config. A checkout of protofl is one; a pip-installed protofl is not, so
``protofl new experiments`` writes one whose components are the installed package's and whose run
config is this version's defaults (every key, each method's table), to edit or override per run::

    pip install protofl
    protofl new experiments
    flwr run experiments --stream --run-config "method='fedproto'"

The directory holds no code: the apps come from the environment that runs ``flwr run`` (set
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``, as a checkout's ``setup.sh`` does, so that
Flower does not build an environment per run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import protofl

# Flower's limit for an app's name (flwr.supercore.constant.MAX_NAME_LENGTH)
MAX_APP_NAME = 32


def default_run_config() -> dict[str, Any]:
    """This version's default run config, flat (``fedproto.lambda``), in the checkout's order: the
    experiment's settings, then each method's options (their dataclasses' defaults)."""
    from protofl.settings import ExperimentSettings
    from protofl.strategies import METHODS, get_method

    config = {field.name.replace("_", "-"): field.default for field in dataclasses.fields(ExperimentSettings)
              if field.name != "options"}
    for method in METHODS:
        options = get_method(method)[0].options_class.run_config_defaults()
        config |= {f"{method}.{key}": value for key, value in options.items()}
    return config


def toml_value(value: Any) -> str:
    """A TOML literal for a run-config value (a bool, an int, a float or a string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    raise TypeError(f"a run-config value cannot be a {type(value).__name__}: {value!r}")


def app_name(directory: Path) -> str:
    """The app's name from its directory's: lowercase letters, digits and hyphens, at most 32."""
    name = re.sub(r"[^a-z0-9]+", "-", directory.resolve().name.lower()).strip("-")[:MAX_APP_NAME].strip("-")
    return name if name and name[0].isalpha() else "protofl-app"


def app_pyproject(name: str, run_config: Mapping[str, Any]) -> str:
    """The text of an app directory's pyproject.toml: protofl's components, ``run_config``."""
    top = {k: v for k, v in run_config.items() if "." not in k}
    tables: dict[str, dict[str, Any]] = {}
    for key, value in run_config.items():
        if "." in key:
            table, option = key.split(".", 1)
            tables.setdefault(table, {})[option] = value
    lines = [
        f"# A protofl app (written by `protofl new`, protofl {protofl.__version__}). Run it with",
        "#   flwr run <this directory> --stream",
        "# and change a key per run with --run-config \"method='fedproto' num-server-rounds=50\".",
        "# The ServerApp and ClientApp are the installed protofl package's: this directory holds no code.",
        "",
        "[project]",
        f'name = "{name}"',
        'version = "1.0.0"',
        'description = "Experiments with protofl, prototype-based federated learning on Flower"',
        'license = "Apache-2.0"',
        "# protofl and Flower come from the environment that runs `flwr run` (pip install protofl);",
        "# set FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 there, so that Flower builds no environment per run.",
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        'publisher = "protofl"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "protofl.server_app:app"',
        'clientapp = "protofl.client_app:app"',
        "",
        "# The run config (context.run_config): every key, at protofl's defaults.",
        "[tool.flwr.app.config]",
        *(f"{key} = {toml_value(value)}" for key, value in top.items()),
    ]
    for table, options in tables.items():
        lines += ["", f"[tool.flwr.app.config.{table}]", *(f"{k} = {toml_value(v)}" for k, v in options.items())]
    return "\n".join(lines) + "\n"


def new_app(directory: Path, force: bool = False) -> Path:
    """Write ``directory/pyproject.toml`` (the directory is created); an existing one is an error
    unless ``force``. Returns its path."""
    directory = Path(directory).expanduser()
    path = directory / "pyproject.toml"
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists already: choose another directory, or --force to replace it")
    directory.mkdir(parents=True, exist_ok=True)
    path.write_text(app_pyproject(app_name(directory), default_run_config()))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="protofl", description="protofl: prototype-based federated learning on Flower.",
        epilog="Run an app directory with: flwr run <dir> --stream (or protofl run <dir>, for scripts)",
    )
    parser.add_argument("--version", action="version", version=f"protofl {protofl.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command")
    commands.add_parser("run", add_help=False, help="`flwr run ... --stream`, exiting with the run's status "
                        "(0 only for a completed run); `protofl run --help`")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from protofl import run_command

        return run_command.main(argv[1:])
    new = commands.add_parser(
        "new", help="write a Flower app directory (pyproject.toml) that runs the installed protofl",
        description="Write <dir>/pyproject.toml: protofl's ServerApp and ClientApp and the default run config, "
                    "for `flwr run <dir> --stream`.",
    )
    new.add_argument("directory", type=Path)
    new.add_argument("--force", action="store_true", help="replace an existing pyproject.toml")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        path = new_app(args.directory, args.force)
    except FileExistsError as err:
        print(f"protofl new: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}\nrun it with: flwr run {args.directory} --stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
