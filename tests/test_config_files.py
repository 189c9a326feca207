"""pyproject.toml, environment.yml and binder/ list the same packages; CI runs the README's command."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def normalise(requirements) -> dict:
    out = {}
    for req in requirements:
        req = req.strip()
        if not req or req.startswith("-"):  # pip options (-e ., --extra-index-url ...)
            continue
        name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", req).groups()
        out[name.lower().replace("_", "-")] = spec.replace(" ", "")
    return out


def conda_pip_section(path: Path) -> dict:
    env = yaml.safe_load(path.read_text())
    pips = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pips) == 1, f"{path}: expected one pip: section"
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert any(d.startswith("python") for d in conda) and "pip" in conda
    return normalise(pips[0])


def test_the_three_package_lists_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = normalise(project["dependencies"] + project["optional-dependencies"]["lab"])
    assert "torch" in expected and "jupyterlab" in expected
    assert conda_pip_section(ROOT / "environment.yml") == expected
    assert conda_pip_section(ROOT / "binder" / "environment.yml") == expected


def test_torch_pin_keeps_a_fresh_install_on_the_2_13_cpu_build():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = normalise(project["dependencies"])["torch"]
    assert "<2.14" in spec, "an open range resolves to a multi-GB CUDA build of torch 2.14"


def test_root_environment_and_binder_install_the_package():
    assert "-e ." in yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"][-1]["pip"]
    post = (ROOT / "binder" / "postBuild").read_text()
    assert "pip install" in post and "-e ." in post


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    assert test_cmd.splitlines()[-1] in (ROOT / ".ci" / "run").read_text()
