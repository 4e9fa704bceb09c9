"""The ranges of torch and Python that the project claims agree wherever they are named:
requirements.txt's floors, the pins that CI tests (requirements-oldest.txt,
requirements-newest.txt), pyproject.toml's requires-python and classifiers, the sentence of
README.md and docs/running.md, and the columns of docs/versions.md (which `make versions`
writes from real runs)."""

import re

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version


def _requirements(name):
    lines = (ROOT / name).read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def _floor(requirement):
    """The version of a `name>=X` requirement's bound."""
    (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return Version(bound)


def _minor(version):
    version = Version(str(version))
    return f"{version.major}.{version.minor}"


def _claimed_pythons():
    text = (ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text)
    return sorted(found, key=lambda version: int(version.split(".")[1]))


def _newest_torch():
    """The newest torch that requirements-newest.txt pins, for any Python."""
    return max(Version(str(pin.specifier).lstrip("=")) for pin in
               _requirements("requirements-newest.txt") if pin.name == "torch")


def _sentence_ranges(path):
    """The torch range and the Python range that a page's sentence names ("torch 2.4 to 2.15",
    "Python 3.10 to 3.14")."""
    text = " ".join((ROOT / path).read_text().split())
    torch_range = re.search(r"torch (\d+\.\d+) to (\d+\.\d+)", text)
    python_range = re.search(r"Python (3\.\d+) to (3\.\d+)", text)
    assert torch_range and python_range, f"{path} names no torch or no Python range"
    return torch_range.groups(), python_range.groups()


def test_the_oldest_pins_are_the_floors():
    """requirements-oldest.txt, which CI tests, pins each package at requirements.txt's floor
    (the floor's release, or a patch of it)."""
    oldest = {pin.name: Version(str(pin.specifier).lstrip("=")) for pin in
              _requirements("requirements-oldest.txt")}
    for requirement in _requirements("requirements.txt"):
        floor = _floor(requirement)
        pinned = oldest[requirement.name]
        assert pinned.release[:len(floor.release)] == floor.release, (requirement, pinned)


def test_the_newest_pins_are_allowed():
    for pin in _requirements("requirements-newest.txt"):
        allowed = {r.name: r.specifier for r in _requirements("requirements.txt")}
        if pin.name in allowed:
            version = str(pin.specifier).lstrip("=")
            assert SpecifierSet(str(allowed[pin.name])).contains(version), pin


def test_pyproject_claims_one_unbroken_range_of_pythons():
    text = (ROOT / "pyproject.toml").read_text()
    lowest = re.search(r'requires-python = ">=(3\.\d+)"', text)[1]
    claimed = _claimed_pythons()
    assert claimed[0] == lowest
    minors = [int(version.split(".")[1]) for version in claimed]
    assert minors == list(range(minors[0], minors[-1] + 1)), claimed


@pytest.mark.parametrize("page", ["README.md", "docs/running.md"])
def test_the_pages_name_the_ranges_that_requirements_and_pyproject_set(page):
    (torch_low, torch_high), (python_low, python_high) = _sentence_ranges(page)
    floor = [r for r in _requirements("requirements.txt") if r.name == "torch"][0]
    assert torch_low == _minor(_floor(floor))
    assert torch_high == _minor(_newest_torch())
    claimed = _claimed_pythons()
    assert (python_low, python_high) == (claimed[0], claimed[-1])


def test_the_versions_table_has_a_column_for_every_claimed_release():
    """docs/versions.md: a column for each torch minor from the floor to the newest pinned, and
    for each claimed Python (the torch columns' own Python is theirs)."""
    text = (ROOT / "docs" / "versions.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| program |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")][1:]
    torch_minors = [_minor(c.split()[1]) for c in columns if c.startswith("torch ")]
    pythons = [c.split()[1] for c in columns if c.startswith("Python ")]
    floor = _minor(_floor([r for r in _requirements("requirements.txt")
                           if r.name == "torch"][0]))
    newest = _minor(_newest_torch())
    major, low = map(int, floor.split("."))
    high = int(newest.split(".")[1])
    assert torch_minors == [f"{major}.{minor}" for minor in range(low, high + 1)]
    torch_columns_python = re.search(r"newest patch, on Python (3\.\d+)", " ".join(text.split()))
    assert torch_columns_python, "docs/versions.md does not say which Python the torch columns use"
    assert sorted([*pythons, torch_columns_python[1]], key=lambda v: int(v.split(".")[1])) \
        == _claimed_pythons()
