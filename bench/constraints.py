"""Print pip constraints for everything ``kvroute[test]`` pulls, at the versions installed here
(``make constraints > constraints.txt``): the project's dependencies followed through their own
requirements (extras and environment markers honoured), so a fresh ``make venv`` installs exactly
what the suite last ran with, and nothing installed by hand leaks in."""

from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

ROOT = "kvroute"
EXTRAS = ("test",)


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """{canonical name: installed version} of ``root``'s requirements, transitively."""
    pinned: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, want = todo.pop()
        if (name, want) in seen:
            continue
        seen.add((name, want))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a marker-excluded or optional requirement that is not installed
        if _canon(name) != ROOT:
            pinned[_canon(name)] = dist.version
        for spec in dist.requires or ():
            req = Requirement(spec)
            envs = [{"extra": e} for e in want] or [{"extra": ""}]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return pinned


def main() -> int:
    pins = closure(ROOT, EXTRAS)
    print("# kvroute[test] and everything it pulls, as last tested (make constraints regenerates this).")
    print(f"# Python {sys.version_info.major}.{sys.version_info.minor}.")
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
