"""The docstring examples of every kernel file (and of the small modules that have one) run as doctests, so a
person copying one file has a working example (CPU: the kernels run in the interpreter, see conftest.py)."""
import doctest
import importlib

import pytest

MODULES = ["mtp_triton.kernels.accept", "mtp_triton.kernels.drafting", "mtp_triton.kernels.kv_append",
           "mtp_triton.kernels.tree_attention", "mtp_triton.tree"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0
