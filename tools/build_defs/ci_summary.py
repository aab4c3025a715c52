"""Prints CI's closing line, `N passed, N failed, N skipped`, from a Bazel build-event file and test XMLs.

A test target counts its pytest cases; a target that failed without a readable XML (a timeout, a crash,
a build failure) counts as one failure. Exits non-zero if anything failed or nothing ran.
"""

from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ElementTree

_PASSING = {"PASSED", "FLAKY"}


def _case_counts(xml_path: pathlib.Path) -> tuple[int, int, int] | None:
    """(passed, failed, skipped) test cases in one JUnit XML file, or None if unreadable."""
    try:
        root = ElementTree.parse(xml_path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    passed = failed = skipped = 0
    for case in root.iter("testcase"):
        outcomes = {child.tag for child in case}
        if outcomes & {"failure", "error"}:
            failed += 1
        elif "skipped" in outcomes:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def _test_summaries(bep_path: pathlib.Path) -> dict[str, str]:
    statuses: dict[str, str] = {}
    for line in bep_path.read_text().splitlines():
        event = json.loads(line)
        summary_id = event.get("id", {}).get("testSummary")
        if summary_id:
            statuses[summary_id["label"]] = event.get("testSummary", {}).get("overallStatus", "NO_STATUS")
        aborted = event.get("aborted")
        target = event.get("id", {}).get("targetCompleted")
        if aborted and target and target["label"] not in statuses:
            statuses[target["label"]] = "FAILED_TO_BUILD"
    return statuses


def _xml_for(label: str, testlogs: pathlib.Path) -> pathlib.Path:
    package, _, name = label.lstrip("/").partition(":")
    return testlogs / package / name / "test.xml"


def main() -> int:
    bep_path, testlogs = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    statuses = _test_summaries(bep_path) if bep_path.exists() else {}
    passed = failed = skipped = 0
    failing_targets = []
    for label, status in sorted(statuses.items()):
        counts = _case_counts(_xml_for(label, testlogs))
        if status in _PASSING and counts is not None:
            passed += counts[0]
            failed += counts[1]
            skipped += counts[2]
            continue
        if status in _PASSING:
            passed += 1
            continue
        failing_targets.append(f"{label}: {status}")
        if counts is not None and counts[1] > 0:
            passed += counts[0]
            failed += counts[1]
            skipped += counts[2]
        else:
            failed += 1
    for line in failing_targets:
        print(f"failing: {line}")
    print(f"{len(statuses)} test targets")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
