"""Turns what CommDebugMode recorded into a module tree: an indented text table or JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ._comm_keys import CommCounts
from ._module_tracker import GLOBAL_MODULE_NAME, ModuleInfo
from ._trace import TraceEvent, check_noise_level, is_visible

__all__ = ["ModuleNode", "build_module_tree", "render_table", "render_json"]

_PHASES = ("forward", "backward")


@dataclass
class ModuleNode:
    fqn: str
    module_type: str
    counts: Mapping[str, CommCounts]
    parameters: list[tuple[str, str]]
    events: dict[str, list[TraceEvent]] = field(
        default_factory=lambda: {"forward": [], "backward": [], "recompute": []}
    )
    children: list[ModuleNode] = field(default_factory=list)


def build_module_tree(
    modules: Mapping[str, ModuleInfo],
    module_counts: Mapping[str, Mapping[str, CommCounts]],
    parameter_placements: Mapping[str, Mapping[str, object]],
    events: Sequence[TraceEvent],
) -> ModuleNode:
    empty = {phase: CommCounts() for phase in _PHASES}
    root = ModuleNode(GLOBAL_MODULE_NAME, "", module_counts.get(GLOBAL_MODULE_NAME, empty), [])
    nodes = {GLOBAL_MODULE_NAME: root}
    for fqn, info in modules.items():
        params = [(name, str(placements)) for name, placements in parameter_placements.get(fqn, {}).items()]
        nodes[fqn] = ModuleNode(fqn, info.module_type, module_counts.get(fqn, empty), params)
    for fqn, info in modules.items():
        nodes.get(info.parent_fqn, root).children.append(nodes[fqn])
    for event in events:
        node = nodes.get(event.module_fqn, root)
        bucket = "recompute" if event.is_recompute else ("backward" if event.is_backward else "forward")
        node.events[bucket].append(event)
    return root


def _pass_lines(node: ModuleNode, phase: str, header: str, indent: str, noise_level: int) -> list[str]:
    counts = node.counts[phase] if phase in node.counts else CommCounts()
    events = [event for event in node.events[phase] if is_visible(event, noise_level)]
    if noise_level == 0 and not counts:
        return []
    lines = [f"{indent}  {header}"]
    lines.extend(f"{indent}    *{op}: {count}" for op, count in counts.items())
    lines.extend(_event_lines(events, indent))
    return lines


def _event_lines(events: Sequence[TraceEvent], indent: str) -> list[str]:
    lines: list[str] = []
    for event in events:
        lines.append(f"{indent}    **{event.name}")
        lines.extend(f"{indent}      {detail}" for detail in event.detail_lines())
    return lines


def _node_lines(node: ModuleNode, depth: int, noise_level: int) -> list[str]:
    indent = "    " * depth
    lines = [f"{indent}{node.fqn}"]
    if noise_level >= 1 and node.fqn != GLOBAL_MODULE_NAME:
        lines.append(f"{indent}*module type: {node.module_type}")
        if node.parameters:
            lines.append(f"{indent}*Parameter List")
            lines.extend(f"{indent} *{name}: {placements}" for name, placements in node.parameters)
    lines.extend(_pass_lines(node, "forward", "FORWARD PASS", indent, noise_level))
    lines.extend(_pass_lines(node, "backward", "BACKWARD PASS", indent, noise_level))
    recomputed = [event for event in node.events["recompute"] if is_visible(event, noise_level)]
    if recomputed:
        lines.append(f"{indent}  ACTIVATION CHECKPOINTING (forward recomputed during backward)")
        lines.extend(_event_lines(recomputed, indent))
    for child in node.children:
        lines.extend(_node_lines(child, depth + 1, noise_level))
    return lines


def render_table(root: ModuleNode, noise_level: int) -> str:
    """Indented per-module report; each module's counts include its submodules'."""
    check_noise_level(noise_level)
    return "\n".join(_node_lines(root, 0, noise_level)) + "\n"


def render_json(node: ModuleNode, noise_level: int) -> dict[str, object]:
    """The same tree as nested dicts (JSON-serialisable), filtered by ``noise_level``."""
    check_noise_level(noise_level)

    def visible(bucket: str) -> list[dict[str, object]]:
        return [event.to_json() for event in node.events[bucket] if is_visible(event, noise_level)]

    def counts(phase: str) -> list[list[object]]:
        return [[str(op), count] for op, count in node.counts[phase].items()] if phase in node.counts else []

    return {
        "fqn": node.fqn,
        "module_type": node.module_type if noise_level >= 1 else "",
        "parameters": [list(param) for param in node.parameters] if noise_level >= 1 else [],
        "children": [render_json(child, noise_level) for child in node.children],
        "collectives_forward": counts("forward"),
        "collectives_backward": counts("backward"),
        "operations_forward": visible("forward"),
        "operations_backward": visible("backward"),
        "operations_checkpointing": visible("recompute"),
    }
