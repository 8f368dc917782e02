"""The examples in the docstrings are part of the documentation: they must run as written."""

import doctest
import importlib

import pytest

import nbscaler.schedule

MODULES = ["__init__", "block", "pipeline", "schedulers", "timeline", "simulator", "geometry", "grid"]


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_run(module):
    mod = nbscaler.schedule if module == "__init__" else importlib.import_module(f"nbscaler.schedule.{module}")
    result = doctest.testmod(mod, extraglobs=vars(nbscaler.schedule), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
