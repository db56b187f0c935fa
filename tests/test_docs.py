"""The README's and docs' Python examples and the public docstrings' examples run as written."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re

import pytest

import residual_store

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks():
    for path in DOC_FILES:
        for i, block in enumerate(CODE_BLOCK.findall(path.read_text())):
            yield pytest.param(block, id=f"{path.name}#{i}")


@pytest.mark.slow
@pytest.mark.parametrize("code", list(_blocks()))
def test_markdown_python_blocks_run(code):
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_example__"})


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "split", "backward", "context", "keypaths", "filters", "names", "logs", "partition", "pipeline",
        "store.schedule", "store.store", "store.budgets", "store.inspection", "orbax", "plan.request",
    ],
)
def test_internals_docstring_examples(name):
    public = name in ("pipeline", "orbax")
    module = importlib.import_module(f"residual_store.{name}" if public else f"residual_store._src.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_public_names_are_exported():
    for name in residual_store.__all__:
        assert hasattr(residual_store, name), name


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


HEADING = re.compile(r"^#{1,6} (.+)$", re.M)
FENCE = re.compile(r"```.*?```", re.S)


def _anchors(path: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped
    (hyphens and underscores kept), spaces as hyphens."""
    text = FENCE.sub("", path.read_text())
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in HEADING.findall(text)}


@pytest.mark.parametrize("path", DOC_FILES + [ROOT / "examples" / "README.md"], ids=lambda p: p.name)
def test_markdown_links_resolve(path):
    for target in LINK.findall(path.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = path.parent / file if file else path
        assert linked.exists(), f"{path.name}: broken link {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{path.name}: no heading {anchor!r} in {linked.name}"


@pytest.mark.slow
def test_api_reference_builds(tmp_path):
    import pdoc  # a test extra: missing, the test fails rather than skips

    pdoc.pdoc("residual_store", "residual_store_serializers", output_directory=tmp_path)
    html = (tmp_path / "residual_store.html").read_text()
    for name in residual_store.__all__:
        assert f'id="{name}"' in html, f"{name} missing from the API reference"
    assert (tmp_path / "residual_store_serializers.html").exists()


def test_internals_format_md_names_the_versions_this_library_writes():
    """docs/format.md's title and layout section name the store layout and manifest versions
    that the code writes (the title once said 3 where the layout is 2)."""
    from residual_store._src.store.disk.paths import STORE_FORMAT, STORE_VERSION
    from residual_store_serializers import FORMAT_VERSION

    text = (ROOT / "docs" / "format.md").read_text()
    title = re.match(r"# The on-disk format \(layout version (\d+), manifest version (\d+)\)\n", text)
    assert title and (int(title[1]), int(title[2])) == (STORE_VERSION, FORMAT_VERSION), text[:80]
    described = re.search(r"\*\*Version (\d+)\*\* \(the one this page describes\)", text)
    assert described and int(described[1]) == STORE_VERSION
    assert STORE_FORMAT.decode().strip() in text  # the marker file's bytes, as listed
    assert f"| `version` | int | `{FORMAT_VERSION}`;" in text  # the context manifest's field
    # and every sentence that names either version says the same (line 9 once said manifest 3)
    for kind, version in (("layout", STORE_VERSION), ("manifest", FORMAT_VERSION)):
        named = re.findall(rf"\*\*{kind}\*\*, version (\d+)", text)
        assert named and all(int(v) == version for v in named), (kind, named)


def test_the_readme_names_an_extra_for_each_accelerator_that_pyproject_defines():
    """The docs quote TPU runs: a TPU user finds what to install, as a GPU user does."""
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text()
    for extra, jax_extra in (("cuda12", "jax[cuda12]"), ("tpu", "jax[tpu]")):
        assert f"pip install -e '.[{extra}]'" in re.sub(r"\s+", " ", readme), extra
        pins = extras[extra]
        assert len(pins) == 1 and pins[0].startswith(jax_extra), pins
        assert pins[0].split("]")[1] == extras["cuda12"][0].split("]")[1]  # the same JAX pin
