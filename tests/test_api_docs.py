"""docs/index.md is the public API in one place (the README says so): every public name, every
public method of the public classes, every parameter of the public callables with its default,
and the public modules. These tests keep it so as the code changes."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest

import residual_store as rs

ROOT = pathlib.Path(__file__).resolve().parents[1]
INDEX = (ROOT / "docs" / "index.md").read_text()
HEADINGS = {m[1]: m[2] for m in re.finditer(r"^### `rs\.(\w+)(.*?)`", INDEX, re.M)}

CALLABLES = ["split", "backward", "Store", "enable_compilation_cache", "flush_on_sigterm", "plan", "explain", "plan_of",
             "device_profile"]
CLASSES = [rs.Store, rs.Split, rs.ResidualContext, rs.Plan, rs.PlanOptions]
MODULES = ["residual_store.pipeline", "residual_store.orbax"]


def _rendered(fn: object) -> str:
    """``fn``'s signature as the headings write it: names and defaults, no annotations."""
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is inspect.Parameter.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}".replace("'", '"'))
    return "(" + ", ".join(parts) + ")"


@pytest.mark.parametrize("name", rs.__all__)
def test_every_public_name_is_in_the_api_page(name):
    assert re.search(rf"`rs\.{name}\b", INDEX), f"docs/index.md does not name rs.{name}"


@pytest.mark.parametrize("name", CALLABLES)
def test_every_public_callable_has_a_heading_with_its_whole_signature(name):
    assert name in HEADINGS, f"docs/index.md has no heading ### `rs.{name}(...)`"
    heading = HEADINGS[name].split(" -> ")[0]
    assert heading == _rendered(getattr(rs, name)), f"rs.{name}: the heading says {heading}"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_public_method_is_named(cls):
    missing = [
        name for name, _ in inspect.getmembers(cls)
        if not name.startswith("_") and not re.search(rf"`[^`]*\b{name}\b[^`]*`", INDEX)
    ]
    assert not missing, f"docs/index.md does not name these public members of rs.{cls.__name__}: {missing}"


@pytest.mark.parametrize("module", MODULES)
def test_the_public_modules_are_named(module):
    assert f"`{module}`" in INDEX


def test_the_check_of_signatures_sees_a_missing_parameter():
    def f(a, b=1, *, c="x"):
        return a

    assert _rendered(f) == '(a, b=1, *, c="x")'
    assert _rendered(f) != "(a, b=1)"
