"""Every ``Example:`` in the package's docstrings runs (doctest), so the examples users copy stay true.

Examples that need data, a GPU or DALI are marked ``# doctest: +SKIP``; the rest run on the CPU.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lightning_gpuopt

MODULES = sorted(m.name for m in pkgutil.walk_packages(lightning_gpuopt.__path__, "lightning_gpuopt."))


def test_every_module_is_collected():
    assert {"lightning_gpuopt.data.hdf5", "lightning_gpuopt.data.loader", "lightning_gpuopt.cli"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(verbose=False)
    failures = []
    for test in doctest.DocTestFinder().find(module, name):
        result = runner.run(test, out=failures.append)
        assert result.failed == 0, "".join(failures)
