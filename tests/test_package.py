"""protofl as a package: its version, `protofl new`'s app directory, pyproject.toml's ranges against
constraints.txt's pins, and (slow) a wheel and an sdist built from the checkout (`python -m build`),
each installed into a fresh virtual environment over the pinned dependencies, then `protofl
--version`, `protofl new` and `protofl run` of the new app directory from the wheel's; and (slow) the
wheel with the dependencies pip resolves from the package index, running the README's main job."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from native import (SUPERLINK_LIMIT, free_port, kill_trees, missed_startup_limits, pids_with_argument,
                    start_local_superlink)
from test_tracking import assert_same_points, expected_points, mlflow_metrics, tensorboard_scalars

import protofl
from protofl.cli import app_name, default_run_config, main, new_app
from protofl.settings import ExperimentSettings, default_run_config as checkout_run_config, flatten

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_one_and_protofl_version_prints_it(capsys):
    assert PYPROJECT["project"]["version"] == protofl.__version__ == importlib.metadata.version("protofl")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"protofl {protofl.__version__}\n"


def test_protofl_new_writes_the_checkouts_app_with_every_default(tmp_path):
    path = new_app(tmp_path / "My Experiments_2026")
    app = tomllib.loads(path.read_text())
    assert app["project"]["name"] == "my-experiments-2026" and app["project"]["dependencies"] == []
    assert app["tool"]["flwr"]["app"]["components"] == PYPROJECT["tool"]["flwr"]["app"]["components"]
    config = flatten(app["tool"]["flwr"]["app"]["config"])
    assert config == checkout_run_config(ROOT / "pyproject.toml") == default_run_config()
    assert list(config) == list(checkout_run_config(ROOT / "pyproject.toml"))  # the same order
    ExperimentSettings.from_run_config(config)
    with pytest.raises(FileExistsError, match="--force"):
        new_app(tmp_path / "My Experiments_2026")
    assert main(["new", str(tmp_path / "My Experiments_2026")]) == 1
    assert main(["new", "--force", str(tmp_path / "My Experiments_2026")]) == 0


def pins() -> dict[str, Version]:
    found = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, pinned = line.split("==")
            found[canonicalize_name(name)] = Version(pinned)
    return found


def test_the_ranges_admit_only_what_ci_runs():
    """pyproject.toml's rule: flwr exactly the pinned series; every other requirement with a pin at
    least the pin's release series, its upper bound only where a known break exists or CI cannot
    install a newer series (listed here)."""
    pinned = pins()
    project = PYPROJECT["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    known_breaks = {"mkdocs": "<2",  # the theme and mkdocstrings are MkDocs 1 plugins
                    # newer series on PyPI that CI cannot install (its pip takes these from local files)
                    "torch": "<2.15", "torchvision": "<0.30"}
    checked = set()
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name == "protofl":
            continue  # an extra naming others
        assert name in pinned, f"{requirement} has no pin in constraints.txt: CI runs no version of it"
        version = pinned[name]
        assert version in requirement.specifier, f"{requirement} refuses the pin {version}"
        series = f"{version.major}.{version.minor}"
        lower = {s.version for s in requirement.specifier if s.operator == ">="}
        upper = {str(s) for s in requirement.specifier if s.operator != ">="}
        assert lower == {series}, f"{requirement}: the lower bound must be the pin's series, >={series}"
        if name == "flwr":
            assert upper == {f"<{version.major}.{version.minor + 1}"}, f"{requirement}: flwr is the pinned series only"
        else:
            assert upper == ({known_breaks[name]} if name in known_breaks else set()), f"{requirement}: which break?"
        checked.add(name)
    assert {"flwr", "torch", "numpy", "flwr-datasets", "mkdocs", "wandb"} <= checked


def test_an_app_name_is_one_flower_accepts():
    assert app_name(Path("/x/Runs 2026")) == "runs-2026"
    assert app_name(Path("/x/2026")) == "protofl-app" and app_name(Path("/x/___")) == "protofl-app"
    assert len(app_name(Path("/x/" + "a" * 50))) == 32


# --- built, installed, run ------------------------------------------------------------------------


def fresh_venv(directory: Path) -> Path:
    """A new virtual environment whose python finds the pinned dependencies in this one's
    site-packages (a path line: its .pth files, among them the editable protofl's, are not read),
    with Flower's commands as its own scripts. Returns its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True, timeout=120)
    bin_dir = directory / "bin"
    python = bin_dir / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "protofl-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for entry in importlib.metadata.distribution("flwr").entry_points.select(group="console_scripts"):
        script = bin_dir / entry.name
        script.write_text(f"#!{python}\nimport sys\nfrom {entry.module} import {entry.attr}\nsys.exit({entry.attr}())\n")
        script.chmod(0o755)
    return bin_dir


def install(bin_dir: Path, artifact: Path) -> None:
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", str(artifact)], check=True, capture_output=True, timeout=300)


def run_in(bin_dir: Path, command: list[str], cwd: Path, env: dict | None = None, timeout: float = 120):
    env = {**(env or os.environ), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel built from the checkout (`python -m build`), once for this module's tests."""
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


def run_past_startup_limits(bin_dir: Path, command: list[str], cwd: Path, env: dict, runs: Path, timeout: float):
    """``command`` (a run of the app), once more when its first try missed one of the startup limits
    (native.py): after Flower's, with the SuperLink started as Flower starts it and waited for (the run
    finds it); after Ray's, from an empty ``runs`` (the run directory it had begun)."""
    run = run_in(bin_dir, command, cwd, env, timeout=timeout)
    missed = missed_startup_limits(run.stdout + run.stderr)
    if run.returncode == 0 or not missed:
        return run
    print(f"{command[0]} run: missed a startup limit ({missed[0]}); running again")
    if SUPERLINK_LIMIT in missed:
        start_local_superlink(bin_dir, env, cwd, timeout=300)
    shutil.rmtree(runs, ignore_errors=True)
    return run_in(bin_dir, command, cwd, env, timeout=timeout)


@pytest.mark.slow
def test_the_built_wheel_and_sdist_install_and_run_the_app_they_write(tmp_path, dist):
    version = protofl.__version__
    wheel, sdist = dist / f"protofl-{version}-py3-none-any.whl", dist / f"protofl-{version}.tar.gz"

    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "protofl/cli.py", "protofl/tracking.py"} <= names
    assert not any(name.startswith((".venv/", ".flwr/", "runs/")) for name in names)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"protofl-{version}.dist-info/METADATA").decode()
        entry_points = archive.read(f"protofl-{version}.dist-info/entry_points.txt").decode()
    assert f"protofl-{version}.dist-info/licenses/LICENSE" in names and "protofl/server_app.py" in names
    assert not any(name.startswith(("tests/", "benchmarks/")) for name in names)
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Intended Audience :: Science/Research" in metadata
    for extra in ("tensorboard", "mlflow", "wandb", "tracking"):
        assert f"Provides-Extra: {extra}" in metadata
    assert "protofl = protofl.cli:main" in entry_points and "protofl-supernode = protofl.supernode:main" in entry_points

    # the sdist installs (built from source) and answers
    from_sdist = fresh_venv(tmp_path / "venv-sdist")
    install(from_sdist, sdist)
    answer = run_in(from_sdist, ["protofl", "--version"], tmp_path)
    assert answer.stdout == f"protofl {version}\n", answer.stderr

    # the wheel installs, writes an app directory, and its `protofl run` runs it
    bin_dir = fresh_venv(tmp_path / "venv")
    install(bin_dir, wheel)
    code = "import json, protofl, sys; print(json.dumps([protofl.__file__, sys.path]))"
    module, path = json.loads(run_in(bin_dir, ["python", "-c", code], tmp_path).stdout)
    assert module.startswith(str(tmp_path / "venv")) and str(ROOT) not in path  # the wheel's, not the checkout's
    assert run_in(bin_dir, ["protofl", "--version"], tmp_path).stdout == f"protofl {version}\n"
    created = run_in(bin_dir, ["protofl", "new", "experiments"], tmp_path)
    assert created.returncode == 0 and (tmp_path / "experiments" / "pyproject.toml").is_file(), created.stderr

    home = tmp_path / "flwr-home"
    env = os.environ | {
        "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    run_config = f"num-server-rounds=2 output-dir='{tmp_path / 'runs'}' run-name='installed' tracker='tensorboard,mlflow'"
    try:
        run = run_past_startup_limits(bin_dir, ["protofl", "run", "experiments", "--run-config", run_config,
                                                "--federation-config", "num-supernodes=3 client-resources-num-cpus=1"],
                                      tmp_path, env, tmp_path / "runs", timeout=540)
    finally:
        kill_trees(pids_with_argument(str(home)))  # the managed SuperLink and what it started
    assert not pids_with_argument(str(home))
    assert run.returncode == 0 and run.stdout.strip().endswith(" finished:completed"), (
        run.stdout[-3000:] + run.stderr[-3000:])
    directory = tmp_path / "runs" / "installed"
    results = json.loads((directory / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2] and results["rounds"][1]["global_accuracy"] > 0.5
    assert results["run_config"]["method"] == "fedavg"  # the app's defaults
    # the main job's rounds, read back through TensorBoard's reader and MLflow's client
    want = expected_points(results)
    assert_same_points(tensorboard_scalars(directory / "tensorboard"), want)
    assert_same_points(mlflow_metrics(results), want)


def directory_bytes(directory: Path) -> int:
    return sum(path.lstat().st_size for path in directory.rglob("*") if not path.is_symlink() and path.is_file())


def installed_from_pips_resolution(python: str, wheel: Path, workdir: Path, env: dict) -> tuple[dict, str]:
    """Install ``wheel`` with the dependencies pip resolves for it from the package index into the
    venv of ``python``: pip resolves (`pip install --dry-run --report`, with the user's pip
    configuration and the newest versions the ranges allow), then uv installs exactly the files pip
    chose, nothing resolved again (`uv pip install --no-deps`, each file by its URL: pip would
    install the same files one at a time, several minutes on 2 cores). Returns ({name: version}
    that pip chose, a line on the times)."""
    report = workdir / "pip-report.json"
    resolving = time.monotonic()
    resolved = subprocess.run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--report", str(report),
                               str(wheel)], capture_output=True, text=True, env=env, timeout=900)
    assert resolved.returncode == 0, resolved.stdout[-3000:] + resolved.stderr[-3000:]
    resolve_seconds = time.monotonic() - resolving
    chosen = json.loads(report.read_text())["install"]
    pinned = workdir / "pips-choice.txt"
    pinned.write_text("".join(f"{item['metadata']['name']} @ {item['download_info']['url']}\n" for item in chosen))
    uv = Path(sys.executable).parent / "uv"  # flwr's dependency, pinned in constraints.txt
    installing = time.monotonic()
    installed = subprocess.run([str(uv), "pip", "install", "--no-config", "--no-deps", "--python", python,
                                "--cache-dir", str(workdir / "uv-cache"), "-r", str(pinned)],
                               capture_output=True, text=True, env=env, cwd=workdir, timeout=1800)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    shutil.rmtree(workdir / "uv-cache", ignore_errors=True)
    versions = {canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"]) for item in chosen}
    return versions, f"pip resolved in {resolve_seconds:.0f} s, uv installed in {time.monotonic() - installing:.0f} s"


@pytest.mark.slow
def test_the_wheel_with_what_pip_resolves_from_the_index_runs_the_main_job(tmp_path, dist):
    """What a user who installs the wheel gets: a fresh virtual environment with the wheel and the
    dependencies pip resolves from the package index (the newest versions pyproject.toml's ranges
    allow; on the build machines torch and torchvision stop at the local cap), installed from the
    files pip chose (:func:`installed_from_pips_resolution`), nothing of this venv in reach, and the
    README's main job from the app `protofl new` writes: FedAvg on digits, 10 SuperNodes with 1 CPU
    each, 20 rounds. Prints what pip chose, the times and the venv's size; the venv (several GB:
    CUDA torch) is deleted at the end."""
    started = time.monotonic()
    wheel = dist / f"protofl-{protofl.__version__}-py3-none-any.whl"
    venv = tmp_path / "venv-index"
    bin_dir, python = venv / "bin", str(venv / "bin" / "python")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"VIRTUAL_ENV": str(venv), "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}
    # uv installs no bytecode (pip compiles every module at install): the first import of a module
    # writes it, as in a user's venv (below, once, before the main job's processes start)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    home = tmp_path / "flwr-home"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        # as ./setup.sh does; Python 3.11's bundled pip is 23.2
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True, capture_output=True,
                       env=env, timeout=300)
        pips_choice, install_times = installed_from_pips_resolution(python, wheel, tmp_path, env)
        code = ("import importlib.metadata as m, json; "
                "print(json.dumps([[d.name, d.version] for d in m.distributions()]))")
        listed = run_in(bin_dir, [python, "-c", code], tmp_path, env)
        assert listed.returncode == 0, listed.stderr
        versions = {canonicalize_name(name): Version(version) for name, version in json.loads(listed.stdout)}
        chosen = f"\npip chose ({install_times}):\n" + "".join(f"{n}=={v}\n" for n, v in sorted(versions.items()))
        print(chosen)
        assert {name: versions.get(name) for name in pips_choice} == pips_choice, chosen  # what pip chose, all of it
        assert set(versions) - set(pips_choice) <= {"pip", "setuptools"}, chosen  # and the fresh venv's own
        for requirement in map(Requirement, PYPROJECT["project"]["dependencies"]):
            assert versions[canonicalize_name(requirement.name)] in requirement.specifier, f"{requirement}{chosen}"
        checked = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, env=env, timeout=120)
        assert checked.returncode == 0, checked.stdout + chosen
        # the main job's modules, the SuperLink's among them (flower-superlink's entry point), imported
        # once here: their bytecode is written for its processes. That compiles thousands of modules:
        # beside CI's other sessions (a load of 13 on 2 cores) it took over 120 s
        code = ("import json, sys, flwr, flwr.simulation, flwr.superlink.cli, protofl, protofl.client_app, "
                "protofl.server_app; print(json.dumps([flwr.__file__, protofl.__file__, sys.path]))")
        *modules, path = json.loads(run_in(bin_dir, [python, "-c", code], tmp_path, env, timeout=600).stdout)
        assert all(module.startswith(str(venv)) for module in modules), modules
        assert sysconfig.get_paths()["purelib"] not in path and str(ROOT) not in path  # the index's, not the pins'
        created = run_in(bin_dir, ["protofl", "new", "main-job"], tmp_path, env)
        assert created.returncode == 0, created.stderr

        env |= {
            "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        }
        run_config = f"output-dir='{tmp_path / 'runs'}' run-name='main-job'"  # the app's defaults otherwise
        running = time.monotonic()
        try:
            federation = "num-supernodes=10 client-resources-num-cpus=1 client-resources-num-gpus=0.0"
            run = run_past_startup_limits(bin_dir, ["flwr", "run", "main-job", "--stream", "--run-config", run_config,
                                                    "--federation-config", federation],
                                          tmp_path, env, tmp_path / "runs", timeout=900)
        finally:
            kill_trees(pids_with_argument(str(home)))  # the managed SuperLink and what it started
        run_seconds = time.monotonic() - running
        assert not pids_with_argument(str(home))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + chosen
        results = json.loads((tmp_path / "runs" / "main-job" / "results.json").read_text())
        config = results["run_config"]
        assert (config["method"], config["dataset"], config["num_server_rounds"]) == ("fedavg", "digits", 20)
        assert [r["round"] for r in results["rounds"]] == list(range(1, 21))
        summary = results["summary"]
        # the pins give GM final 0.944-0.947, PM final 0.964-0.966 (docs/results/main-job.md)
        assert summary["global_accuracy"]["final"] > 0.9 and summary["personalized_accuracy"]["final"] > 0.9, \
            f"{summary}{chosen}"
        print(f"flwr {versions['flwr']}, torch {versions['torch']}: the main job in {run_seconds:.0f} s, GM final "
              f"{summary['global_accuracy']['final']:.4f}, PM final {summary['personalized_accuracy']['final']:.4f}; "
              f"{install_times}, the venv {directory_bytes(venv) / 2**30:.2f} GiB; "
              f"{time.monotonic() - started:.0f} s in all")
    finally:
        kill_trees(pids_with_argument(str(home)))
        shutil.rmtree(venv, ignore_errors=True)
