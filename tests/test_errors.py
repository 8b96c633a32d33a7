"""The errors tree is complete: every exception class nvpair defines is in it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import nvpair
from nvpair import errors
from nvpair.errors import CommandError, NvpairError


def _exception_classes() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(nvpair.__path__, "nvpair."):
        if info.name.startswith("nvpair.sim") or info.name == "nvpair.__main__":
            continue  # the simulators are a program of their own
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found.append(obj)
    return found


def test_every_exception_is_an_nvpair_error_and_in_the_tree() -> None:
    classes = _exception_classes()
    assert len(classes) >= 15  # the walk found the package's modules
    tree = errors.__doc__ or ""
    for cls in classes:
        drawn = re.search(rf"^[ |+-]*{cls.__name__} ", tree, re.MULTILINE)
        assert drawn, f"{cls.__module__}.{cls.__name__} is not drawn in errors.py's tree"
        if cls is not CommandError:
            assert issubclass(cls, NvpairError), f"{cls.__module__}.{cls.__name__}"


def test_command_error_stays_a_bug_past_the_config_check() -> None:
    """The boundary reports a non-NvpairError with its traceback: a CommandError after the
    config check is one (tests/test_lifecycle.py, a runner bug)."""
    assert not issubclass(CommandError, NvpairError) and issubclass(CommandError, ValueError)
