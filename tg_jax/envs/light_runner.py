"""A light test runner for the namespace sandbox (stdlib only; run as `python -c SOURCE`).

Imports every test_*.py file under the given paths (default ".") and calls each
argument-free top-level test_* function; prints one line per failure and a summary
"N passed, M failed"; exits 0 iff nothing failed and something ran. No fixtures, no
plugins: it exists to show what a test run costs without pytest's start-up.
"""

import importlib.util
import inspect
import os
import sys
import traceback


def _files(paths):
    for path in paths:
        if os.path.isfile(path):
            yield path
        for top, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                if name.startswith("test_") and name.endswith(".py"):
                    yield os.path.join(top, name)


def _tests(path):
    name = "lt_" + path.strip("./").replace("/", "_")[:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for attr, fn in vars(module).items():
        if attr.startswith("test_") and inspect.isfunction(fn):
            if not inspect.signature(fn).parameters:
                yield f"{path}::{attr}", fn


def main(paths):
    sys.path.insert(0, os.getcwd())
    passed = failed = 0
    for path in _files(paths or ["."]):
        try:
            tests = list(_tests(path))
        except Exception:  # noqa: BLE001 - a broken test file is a failure, not a crash
            failed += 1
            print(f"FAILED {path} (import)\n{traceback.format_exc(limit=-1)}")
            continue
        for name, fn in tests:
            try:
                fn()
                passed += 1
            except Exception:  # noqa: BLE001
                failed += 1
                print(f"FAILED {name}\n{traceback.format_exc(limit=-1)}")
    print(f"{passed} passed, {failed} failed")
    return 0 if passed and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
