"""Counts from a Bazel build event file (--build_event_json_file) for the loopback check.

    bep_counts.py BEP.json                      -> remote: A of N actions executed remotely; P of T tests passed
    bep_counts.py --label NAME BEP.json         -> the same, plus remote cache hits, prefixed with NAME
    bep_counts.py --require-all-cached BEP.json -> exit 1 unless every action was a remote cache hit

Actions: Bazel reports how its processes ran in the build's closing summary ("N processes: X internal,
Y remote, Z remote cache hit."), which the event file carries in its progress events; internal ones
(symlink trees, manifests) are Bazel's own bookkeeping, not executed actions, and are left out of N.
Tests: one testSummary per test target (PASSED or FLAKY counts as passed); each testResult's
execution info says where the test ran (strategy "remote") and whether the remote cache answered.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field

_PROCESSES = re.compile(r"(\d+) processes?(?:: ([^\n]*?))?\.?\s*$", re.MULTILINE)
_PART = re.compile(r"(\d+) ([a-z][a-z -]*[a-z])")


@dataclass
class Counts:
    processes_by_runner: dict[str, int] = field(default_factory=dict)
    test_status: dict[str, str] = field(default_factory=dict)
    test_strategies: dict[str, set[str]] = field(default_factory=dict)
    tests_cached_remotely: set[str] = field(default_factory=set)
    actions_executed: int | None = None

    @property
    def executed(self) -> int:
        return sum(count for runner, count in self.processes_by_runner.items() if runner != "internal")

    @property
    def remote(self) -> int:
        return self.processes_by_runner.get("remote", 0)

    @property
    def remote_cache_hits(self) -> int:
        return self.processes_by_runner.get("remote cache hit", 0)


def read(path: str) -> Counts:
    counts = Counts()
    stderr_text = []
    with open(path) as events:
        for line in events:
            event = json.loads(line)
            event_id = event.get("id", {})
            if "progress" in event_id:
                stderr_text.append(event.get("progress", {}).get("stderr", ""))
            elif "testSummary" in event_id:
                counts.test_status[event_id["testSummary"]["label"]] = event.get("testSummary", {}).get(
                    "overallStatus", "NO_STATUS"
                )
            elif "testResult" in event_id:
                label = event_id["testResult"]["label"]
                info = event.get("testResult", {}).get("executionInfo", {})
                counts.test_strategies.setdefault(label, set()).add(info.get("strategy", ""))
                if info.get("cachedRemotely"):
                    counts.tests_cached_remotely.add(label)
            elif "buildMetrics" in event_id:
                executed = event.get("buildMetrics", {}).get("actionSummary", {}).get("actionsExecuted")
                counts.actions_executed = int(executed) if executed is not None else None
    # The last process summary printed is the build's (strip colour codes first).
    text = re.sub(r"\x1b\[[0-9;]*m", "", "".join(stderr_text))
    summaries = _PROCESSES.findall(text)
    if summaries:
        _total, parts = summaries[-1]
        for number, runner in _PART.findall(parts or ""):
            counts.processes_by_runner[runner.strip()] = counts.processes_by_runner.get(runner.strip(), 0) + int(number)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("bep")
    parser.add_argument("--label", default="")
    parser.add_argument("--require-all-cached", action="store_true")
    args = parser.parse_args()
    counts = read(args.bep)
    passed = sum(1 for status in counts.test_status.values() if status in ("PASSED", "FLAKY"))
    line = (
        f"remote: {counts.remote} of {counts.executed} actions executed remotely; "
        f"{passed} of {len(counts.test_status)} tests passed"
    )
    if args.label:
        others = {runner: n for runner, n in counts.processes_by_runner.items() if runner not in ("remote",)}
        line = (
            f"{args.label}: {line}; {counts.remote_cache_hits} remote cache hits; "
            f"tests answered by the remote cache: {len(counts.tests_cached_remotely)} of {len(counts.test_status)}; "
            f"processes by runner: {others}"
        )
    print(line)
    if args.require_all_cached:
        all_cached = counts.executed > 0 and counts.remote_cache_hits == counts.executed
        return 0 if all_cached and passed == len(counts.test_status) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
