"""Multi-node tests: skipped with the reason where nodes cannot be made (not root, no
``ip netns``); a table of every run on nodes at the end of the session."""

from __future__ import annotations

import pytest
from netns_cluster import RECORDS, why_not


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = why_not()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no nodes on this machine: {reason} "
                                   "(launch/netns-nodes --why-not; docs/multinode.md)")
    for item in items:
        if "multinode" in item.path.parts:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RECORDS:
        return
    terminalreporter.section("runs on nodes (network namespaces)")
    terminalreporter.write_line("| nodes x ranks | case | outcome | time (s) |")
    terminalreporter.write_line("| --- | --- | --- | --- |")
    for r in RECORDS:
        terminalreporter.write_line(f"| {r.shape} | {r.case} | {r.outcome} | {r.seconds:.1f} |")
