"""The front door (issue 36): the README's size and its commands' agreement with .ci/run, the
documentation site (every page in the nav, the reference pages generated from the code, the
site built strictly), the library face importable from the top without torch, the packages'
picture on the architecture page, and no import circle in bench/. In-process or one short
process each: the quick tier (tests/conftest.py's QUICK_FILES)."""

import ast
import importlib.util
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT

DOCS = ROOT / "docs"


def readme_blocks(kind: str) -> list[str]:
    """The README's fenced blocks marked `<!-- readme-test: KIND -->` on the line before."""
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"<!-- readme-test: {kind} -->\n```bash\n(.*?)```", text, re.S)


def test_readme_is_short_and_keeps_its_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "bash launch.sh recipes/3d.yaml" in text and 'pytest -q -m "not slow"' in text
    assert len(readme_blocks("ci")) == 2 and len(readme_blocks("run")) == 1


def test_readme_install_and_test_commands_are_what_ci_runs():
    """The install block's commands are .ci/run's lines (launch.sh's run: test_parity_3d_recipe);
    the test block's commands are .ci/run's `pytest -q` and its quick tier."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    install, tests = readme_blocks("ci")
    for command in (c.strip() for c in install.strip().split("&&")):
        assert command in ci or command == "bash launch.sh recipes/3d.yaml", command
    commands = [line.split("#")[0].strip() for line in tests.strip().splitlines()]
    assert commands == ['pytest -q -m "not slow"', "pytest -q"] and "pytest -q" in ci


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return [p for item in nav for p in nav_pages(item)]


def test_every_page_is_in_the_nav():
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages, f"add to mkdocs.yml's nav: {set(pages) - set(nav)}; missing: {set(nav) - set(pages)}"


def test_reference_pages_are_generated_from_the_code():
    """docs/reference/{commands,metrics,errors}.md are what docs/gen_reference.py makes
    (`python docs/gen_reference.py` rewrites them)."""
    cmd = [sys.executable, "docs/gen_reference.py", "--check"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metrics_reference_lists_exactly_the_keys_training_writes():
    gen = _gen()
    written, documented = gen.written_metric_keys(), set(gen.METRICS)
    assert written == documented, f"undocumented: {written - documented}; not written: {documented - written}"
    from dtensor3d.training.metrics import TB_TAGS

    assert set(TB_TAGS) <= documented


def test_commands_reference_names_every_command_and_flag():
    from dtensor3d.__main__ import _parser

    text = (DOCS / "reference" / "commands.md").read_text()
    sub = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, parser in sub.choices.items():
        assert f"## `{name}`" in text
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}`" in text, (name, flag)


@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="mkdocs not installed: pip install -e '.[docs]'")
def test_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        ["mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_library_face_is_importable_from_the_top_without_torch():
    code = (
        "import sys, dtensor3d\n"
        "assert 'torch' not in sys.modules\n"
        "names = ['setup', 'train_step', 'parallelize', 'build_mesh', 'load_recipe']\n"
        "assert set(names) <= set(dir(dtensor3d))\n"
        "assert dtensor3d.load_recipe('recipes/debug.yaml').parallelism.dp == 1\n"
        "assert 'torch' not in sys.modules\n"
        "from dtensor3d.training.train import setup, train_step\n"
        "assert dtensor3d.setup is setup and dtensor3d.train_step is train_step\n"
        "assert callable(dtensor3d.parallelize) and callable(dtensor3d.build_mesh)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_architecture_page_shows_each_package_as_its_docstring_says():
    """Each package's job: the first paragraph of its __init__ docstring, at most two lines,
    is its row on the architecture page."""
    page = " ".join((DOCS / "architecture.md").read_text().split())
    for init in sorted((ROOT / "dtensor3d").glob("*/__init__.py")):
        first = ast.get_docstring(ast.parse(init.read_text())).split("\n\n")[0]
        assert len(first.splitlines()) <= 2, f"{init}: the job in two lines"
        row = f"| `{init.parent.name}` | {' '.join(first.split())} |"
        assert row in page, f"docs/architecture.md's packages table: {row}"


def test_bench_has_no_import_circle():
    """bench/ scripts import shared code from bench/common.py, which imports no other bench script."""
    scripts = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
        graph[name] = found & set(scripts)
    assert not graph["common"], graph["common"]

    def reach(name: str, seen: set[str]) -> set[str]:
        for dep in graph[name] - seen:
            seen.add(dep)
            reach(dep, seen)
        return seen

    for name in graph:
        assert name not in reach(name, set()), f"bench import circle through {name}"


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).exists() for link in links), [lk for lk in links if not (ROOT / lk).exists()]
