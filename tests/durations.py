"""The slowest tests of a run, as the markdown tables of docs/test_timings.md.

    python -m pytest -q --junitxml=run.xml                    # (or -m "not slow")
    python tests/durations.py run.xml [--top 25] [--slow-ids slow.txt]

Reads pytest's JUnit XML (each test's setup + call + teardown seconds, as ``--durations``
adds them up per test) and prints the worker-summed seconds and the slowest tests, split
into the default and the ``slow`` set when ``--slow-ids`` lists the slow tests' ids
(``python -m pytest -q -n 0 --collect-only -m slow | grep ::``).
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET


def read(path: str) -> list[tuple[float, str]]:
    """``(seconds, test id)`` of every test case in a JUnit XML file."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        rows.append((float(case.get("time", 0.0)), f"{module}.py::{case.get('name')}"))
    return rows


def table(rows: list[tuple[float, str]], top: int) -> str:
    lines = ["| s | test |", "|---:|---|"]
    for seconds, test in sorted(rows, reverse=True)[:top]:
        lines.append(f"| {seconds:.1f} | `{test.removeprefix('tests/')}` |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--slow-ids", default=None, help="file of the slow set's test ids, one per line")
    args = ap.parse_args(argv)
    rows = read(args.junit)
    slow = set(open(args.slow_ids).read().split()) if args.slow_ids else set()
    groups = (
        {"all": rows}
        if not slow
        else {"default": [r for r in rows if r[1] not in slow], "slow": [r for r in rows if r[1] in slow]}
    )
    for name, group in groups.items():
        print(f"{name}: {len(group)} tests, {sum(s for s, _ in group):.0f} s summed over the workers\n")
        print(table(group, args.top) + "\n")


if __name__ == "__main__":
    main()
