"""Package mapping only (metadata lives in pyproject.toml).

The product layout keeps built-in patterns in ``patterns/`` and NKI codegen in ``codegen/`` at the top of the
repository, but installed import names must not be bare ``patterns``/``codegen``: they install as
``fusegraph.patterns`` and ``fusegraph.codegen``. Every folder with an ``__init__.py`` under them is a package
(one per op: ``patterns/<op>/``); their non-package data (each op's ``templates/*.j2``, ``codegen/templates/``) is
shipped by the package-data globs in pyproject.toml.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup


def package_dir() -> dict[str, str]:
    """The mapping declared in pyproject.toml's ``[tool.setuptools.package-dir]`` (tomllib needs Python 3.11)."""
    text = (Path(__file__).parent / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the table's simple '"name" = "folder"' lines
        table = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
        return dict(re.findall(r'^"([^"]+)"\s*=\s*"([^"]+)"', table, re.M))
    return tomllib.loads(text)["tool"]["setuptools"]["package-dir"]


#: the mapping is declared in pyproject.toml; here only the packages under each mapped folder are listed (every op
#: folder is one, so a new op needs no edit here)
MAPPED = package_dir()

packages = find_packages(include=["fusegraph", "fusegraph.*"])
for name, folder in MAPPED.items():
    if name != "fusegraph":
        packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages)
