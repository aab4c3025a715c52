"""Which module is running right now, forward or backward, without wrapping any module.

Forward: a global forward-pre hook pushes a :class:`ModuleCall` and a forward hook
that each seen module gets once (registered last, ``always_call=True``) pops it.
The pop hook is per module rather than global on purpose: global forward hooks
run before a module's own hooks, and parallel styles put their output
redistribution (collectives) in the module's own hooks; those belong to the
module.  For the same reason the push happens in a global pre hook, which runs
before the module's own input-preparation hooks.

Backward: a module's backward starts when the first gradient of one of its
outputs is ready and ends when the gradients of all its inputs are.  Multi-grad
hooks on those tensors move a per-graph-task "current call" pointer; the rules in
:meth:`ModuleTracker._backward_started` and :meth:`ModuleTracker._backward_finished`
make the result independent of the order in which hooks on a shared tensor run
(a ``Sequential``'s last child returns the very tensor the container returns).

Forward calls that happen while autograd runs a backward (activation
checkpointing recomputation) are reported as recomputation inside the backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["GLOBAL_MODULE_NAME", "ModuleCall", "ModuleInfo", "Attribution", "ModuleTracker"]

GLOBAL_MODULE_NAME = "Global"

# Backward bookkeeping is kept per autograd graph task (a nested backward, e.g. from
# reentrant checkpointing, must not clobber its parent's); old tasks are dropped.
_MAX_GRAPH_TASKS_KEPT = 64


@dataclass(eq=False)
class ModuleCall:
    """One invocation of a module's forward."""

    fqn: str
    module_id: int
    parent: ModuleCall | None
    chain: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.chain = (self.parent.chain if self.parent is not None else ()) + (self.fqn,)

    def is_self_or_descendant_of(self, other: ModuleCall) -> bool:
        call: ModuleCall | None = self
        while call is not None:
            if call is other:
                return True
            call = call.parent
        return False


@dataclass(frozen=True)
class ModuleInfo:
    """A module seen during the session: its name, class and the module that first called it."""

    fqn: str
    module_type: str
    parent_fqn: str


class Attribution(NamedTuple):
    """Where an op runs: the chain of module names (outermost first) and the pass."""

    chain: tuple[str, ...]
    is_backward: bool
    is_recompute: bool


@dataclass
class _GraphTaskState:
    forward_depth_at_start: int
    backward_call: ModuleCall | None = None


def _tensors_requiring_grad(values: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    pending: list[object] = [values]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.append(value)
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return found


def _on_gradients(tensors: list[torch.Tensor], hook: Callable[[object], None], *, mode: str) -> None:
    """Call ``hook`` once per backward when the first (mode "any") or last (mode "all") gradient
    of ``tensors`` is ready."""
    if len(tensors) == 1:
        # Same semantics for one tensor, at a fraction of the cost of a multi-grad hook.
        tensors[0].register_hook(hook)
    else:
        register_multi_grad_hook(tensors, hook, mode="any" if mode == "any" else "all")


def _qualified_type_name(module: nn.Module) -> str:
    module_class = type(module)
    return f"{module_class.__module__}.{module_class.__qualname__}"


class ModuleTracker:
    """Tracks the running module chain while :meth:`start` .. :meth:`stop` are in effect.

    Modules are named by fully-qualified name from the outermost module they were
    first seen under, which is named by its class (``"MLP"``, ``"MLP.net1"``); a
    second, different outermost module of the same class gets a numbered name
    (``"MLP#1"``).  ``on_module_call(module, fqn)`` is called at every forward call.
    """

    def __init__(self, on_module_call: Callable[[nn.Module, str], None] | None = None) -> None:
        self._on_module_call = on_module_call
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._root_names: set[str] = set()
        self._modules: dict[str, ModuleInfo] = {}
        self._forward_stack: list[ModuleCall] = []
        self._graph_tasks: dict[int, _GraphTaskState] = {}
        self._global_handle: RemovableHandle | None = None
        self._pop_hook_handles: dict[nn.Module, RemovableHandle] = {}

    @property
    def modules(self) -> dict[str, ModuleInfo]:
        """Every module called since :meth:`start`, in first-call order."""
        return self._modules

    def start(self) -> None:
        if self._global_handle is not None:
            raise RuntimeError("this ModuleTracker is already started; stop() it before starting it again")
        self._names = weakref.WeakKeyDictionary()
        self._root_names = set()
        self._modules = {}
        self._forward_stack = []
        self._graph_tasks = {}
        self._global_handle = register_module_forward_pre_hook(self._before_forward)

    def stop(self) -> None:
        if self._global_handle is not None:
            self._global_handle.remove()
            self._global_handle = None
        for handle in self._pop_hook_handles.values():
            handle.remove()
        self._pop_hook_handles = {}
        self._forward_stack = []
        self._graph_tasks = {}

    def current(self) -> Attribution:
        """The module chain and pass of whatever runs now."""
        state = self._graph_task_state()
        if state is None:
            chain = self._forward_stack[-1].chain if self._forward_stack else ()
            return Attribution(chain, is_backward=False, is_recompute=False)
        if len(self._forward_stack) > state.forward_depth_at_start:
            return Attribution(self._forward_stack[-1].chain, is_backward=True, is_recompute=True)
        call = state.backward_call
        return Attribution(call.chain if call is not None else (), is_backward=True, is_recompute=False)

    def _graph_task_state(self) -> _GraphTaskState | None:
        task_id = torch._C._current_graph_task_id()
        if task_id == -1:
            return None
        state = self._graph_tasks.get(task_id)
        if state is None:
            if len(self._graph_tasks) >= _MAX_GRAPH_TASKS_KEPT:
                del self._graph_tasks[next(iter(self._graph_tasks))]
            state = _GraphTaskState(forward_depth_at_start=len(self._forward_stack))
            self._graph_tasks[task_id] = state
        return state

    def _fqn_of(self, module: nn.Module) -> str:
        name = self._names.get(module)
        if name is not None:
            return name
        base = type(module).__name__
        root = base
        suffix = 1
        while root in self._root_names:
            root = f"{base}#{suffix}"
            suffix += 1
        self._root_names.add(root)
        self._names[module] = root
        for child_name, child in module.named_modules():
            if child_name and child not in self._names:
                self._names[child] = f"{root}.{child_name}"
        return root

    def _before_forward(self, module: nn.Module, args: Sequence[object]) -> None:
        fqn = self._fqn_of(module)
        call = ModuleCall(fqn, id(module), self._parent_for_new_call())
        if fqn not in self._modules:
            self._modules[fqn] = ModuleInfo(fqn, _qualified_type_name(module), self._parent_fqn(call))
        self._forward_stack.append(call)
        if module not in self._pop_hook_handles:
            self._pop_hook_handles[module] = module.register_forward_hook(self._after_forward, always_call=True)
        if self._on_module_call is not None:
            self._on_module_call(module, fqn)
        if torch.is_grad_enabled():
            inputs = _tensors_requiring_grad(args)
            if inputs:
                _on_gradients(inputs, partial(self._backward_finished, call), mode="all")

    @staticmethod
    def _parent_fqn(call: ModuleCall) -> str:
        # A recomputed call may hang under its own earlier call; a module is never its own parent.
        ancestor = call.parent
        while ancestor is not None and ancestor.fqn == call.fqn:
            ancestor = ancestor.parent
        return ancestor.fqn if ancestor is not None else GLOBAL_MODULE_NAME

    def _parent_for_new_call(self) -> ModuleCall | None:
        state = self._graph_task_state()
        if state is not None and len(self._forward_stack) <= state.forward_depth_at_start:
            # A forward run by the backward itself (checkpoint recomputation) belongs to
            # the module whose backward needs it.
            if state.backward_call is not None:
                return state.backward_call
        return self._forward_stack[-1] if self._forward_stack else None

    def _after_forward(self, module: nn.Module, args: Sequence[object], output: object) -> None:
        module_id = id(module)
        for depth in range(len(self._forward_stack) - 1, -1, -1):
            if self._forward_stack[depth].module_id == module_id:
                call = self._forward_stack[depth]
                # Calls above it never saw their own exit (raised past us); drop them too.
                del self._forward_stack[depth:]
                break
        else:
            return  # entered before tracking started
        if torch.is_grad_enabled():
            outputs = _tensors_requiring_grad(output)
            if outputs:
                _on_gradients(outputs, partial(self._backward_started, call), mode="any")

    def _backward_started(self, call: ModuleCall, grads: object) -> None:
        state = self._graph_task_state()
        if state is None:
            return
        current = state.backward_call
        # A descendant already started means this hook merely ran late on a shared tensor.
        if current is not None and current.is_self_or_descendant_of(call):
            return
        state.backward_call = call

    def _backward_finished(self, call: ModuleCall, grads: Sequence[object]) -> None:
        state = self._graph_task_state()
        if state is None:
            return
        current = state.backward_call
        if current is not None and current.is_self_or_descendant_of(call):
            state.backward_call = call.parent
