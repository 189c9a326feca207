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


CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_install_line_fetches_the_cpu_build_of_torch():
    """PyPI's torch on Linux is the CUDA build (several GB): every way the README and the docs say
    to install the package, and both conda environments, take torch from PyTorch's CPU index."""
    lines = [(path.name, line) for path in DOCS for line in path.read_text().splitlines()
             if re.search(r"pip install\b.*-e\s", line)]
    extras = {m for _, line in lines for m in re.findall(r'-e\s+"?\.(\[[a-z,]+\])?', line)}
    assert {"[lab]", "[test]", "[grade]"} <= extras, lines  # each way in is checked
    missing = [f"{name}: {line.strip()}" for name, line in lines if CPU_INDEX not in line]
    assert not missing, missing
    for env in (ROOT / "environment.yml", ROOT / "binder" / "environment.yml"):
        pips = [d["pip"] for d in yaml.safe_load(env.read_text())["dependencies"] if isinstance(d, dict)]
        assert CPU_INDEX in pips[0], f"{env}: its pip section needs the option line {CPU_INDEX!r}"
    assert CPU_INDEX in (ROOT / ".ci" / "run").read_text()


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_links_resolve():
    """The README is the front door: the reference moved to docs/, and every link to it (file and
    section) still lands."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert any(target == "docs/reference.md" for target, _ in links)
    assert any(target == "docs/architecture.md" for target, _ in links)
    for target, anchor in links:
        if target.startswith("http"):
            continue
        path = ROOT / target
        assert path.exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{target}#{anchor}"
    assert len(readme) < 20_000, "the README is the front door; the reference lives in docs/"
    for section in ("## Set-up", "## Quick start", "## The lessons", "## For teachers"):
        assert section in readme


def test_the_readmes_commands_do_not_clash_when_run_in_order():
    """The checkpoint examples run top to bottom: no --save-dir is written twice by a run that
    does not resume from it (the save dir would be refused), and no --resume comes before its save."""
    text = (ROOT / "docs" / "reference.md").read_text()
    saved = {}  # save dir -> the step its latest checkpoint is at
    for line in text.splitlines():
        if not line.startswith("minitrain train"):
            continue
        save = re.search(r"--save-dir (\S+)", line)
        resume = re.search(r"--resume (\S+)", line)
        given = re.search(r"--steps (\d+)", line)
        steps = int(given.group(1)) if given else 20  # the default
        if resume and "$" not in resume.group(1):
            assert resume.group(1) in saved, f"resumes from {resume.group(1)} before any run saved it: {line}"
            assert steps > saved[resume.group(1)], f"nothing left to train: {line}"
        if save:
            if resume is None or resume.group(1) != save.group(1):
                assert save.group(1) not in saved, f"{save.group(1)} saved twice: {line}"
            saved[save.group(1)] = steps


MINE_PROBE = """
import os, pathlib
def pytest_sessionstart(session):
    mine = os.environ["MINITRAIN_MINE"]
    pathlib.Path(os.environ["MINE_PROBE_OUT"]).write_text(f"{mine}\\n{os.path.isdir(mine)}")
"""


def test_a_test_session_removes_its_scratch_folder_for_kept_functions(tmp_path):
    """conftest.py makes a ``minitrain-mine-*`` folder for the functions passing checks keep (so
    they do not land in the repository), and removes it when the session ends."""
    import os
    import subprocess
    import sys
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "mine_probe.py").write_text(MINE_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "MINITRAIN_MINE"}
    env.update(TMPDIR=str(tmp), MINE_PROBE_OUT=str(tmp_path / "seen"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "mine_probe", "tests/test_config_files.py::test_the_three_package_lists_agree"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    mine, existed = (tmp_path / "seen").read_text().splitlines()
    assert mine.startswith(str(tmp / "minitrain-mine-")) and existed == "True"  # made for the session
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("minitrain-mine-")]  # and removed
