"""Package mapping only (metadata lives in pyproject.toml).

The product layout keeps built-in patterns in ``patterns/`` and NKI codegen in ``codegen/`` at the top of the
repository, but installed import names must not be bare ``patterns``/``codegen``: they install as
``fusegraph.patterns`` and ``fusegraph.codegen``. Every folder with an ``__init__.py`` under them is a package
(one per op: ``patterns/<op>/``); their non-package data (each op's ``templates/*.j2``, ``codegen/templates/``) is
shipped by the package-data globs in pyproject.toml.
"""
from setuptools import find_packages, setup

MAPPED = {"fusegraph.patterns": "patterns", "fusegraph.codegen": "codegen"}

packages = find_packages(include=["fusegraph", "fusegraph.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir={"fusegraph": "fusegraph", **MAPPED})
