"""Stage 3 module hooks: unshard a module's unit before its forward and again
before its backward, reshard after, and prefetch the next unit in the order
recorded on the previous forward.

    forward:   pre(m_i): finish_unshard(u_i), start_unshard(u_{i+1})  ...  post(m_i): reshard(u_i)
    backward:  grad hook on m_i's outputs: finish_unshard(u_i), start_unshard(u_{i-1})
               last gradient of u_i (param_group): reduce-scatter, reshard(u_i)
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .comm import Comm
from .unit import Unit


class UnitGatherer:
    """Owns the module -> unit map and the forward order used for prefetch."""

    def __init__(self, module_units: dict[nn.Module, Unit], comm: Comm) -> None:
        self.module_units = module_units
        self.comm = comm
        self.order: list[Unit] = []  # forward order of the last forward
        self.current: list[Unit] = []
        self.handles: list = []

    def register(self) -> None:
        for module in self.module_units:
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward))

    def start_forward(self) -> None:
        if self.current:
            self.order = self.current
        self.current = []

    def _neighbour(self, unit: Unit, offset: int) -> Unit | None:
        try:
            i = self.order.index(unit) + offset
        except ValueError:
            return None
        return self.order[i] if 0 <= i < len(self.order) else None

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        unit = self.module_units[module]
        if unit not in self.current:
            self.current.append(unit)
        unit.finish_unshard(self.comm)
        nxt = self._neighbour(unit, +1)
        if nxt is not None:
            nxt.start_unshard(self.comm)

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        unit = self.module_units[module]
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook(unit))
        unit.reshard()

    def _pre_backward_hook(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            unit.finish_unshard(self.comm)
            prev = self._neighbour(unit, -1)
            if prev is not None:
                prev.start_unshard(self.comm)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
