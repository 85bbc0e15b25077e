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

    def __init__(self, module_units: dict[nn.Module, Unit], comm: Comm, *, prefetch_numel: int,
                 max_live_numel: int) -> None:
        self.module_units = module_units
        self.comm = comm
        self.prefetch_numel = prefetch_numel  # stage3_prefetch_bucket_size
        self.max_live_numel = max_live_numel  # stage3_max_live_parameters
        self.order: list[Unit] = []  # forward order of the last forward
        self.current: list[Unit] = []
        self.handles: list = []
        self.peak_live_nbytes = 0  # gathered units at once, the communication buffers of stage 3

    def register(self) -> None:
        for module in self.module_units:
            self.handles.append(module.register_forward_pre_hook(self._pre_forward))
            self.handles.append(module.register_forward_hook(self._post_forward))

    def start_forward(self) -> None:
        if self.current:
            self.order = self.current
        self.current = []

    def _prefetch(self, unit: Unit, direction: int) -> None:
        """Starts gathering the units after `unit` in `direction` (+1 forward,
        -1 backward) of the recorded order: at least one, then more while they
        fit in prefetch_numel and the gathered total stays under max_live_numel."""
        if unit not in self.order:
            self._note_live()
            return
        live = sum(u.bucket.numel for u in self.order if u.full is not None)
        fetched, i = 0, self.order.index(unit) + direction
        while 0 <= i < len(self.order):
            nxt = self.order[i]
            numel = nxt.bucket.numel
            if fetched and (fetched + numel > self.prefetch_numel or live + numel > self.max_live_numel):
                break
            if nxt.full is None:
                nxt.start_unshard(self.comm)
                live += numel
            fetched += numel
            i += direction
        self._note_live()

    def _note_live(self) -> None:
        live = sum(u.full.nbytes for u in self.module_units.values() if u.full is not None)
        self.peak_live_nbytes = max(self.peak_live_nbytes, live)

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        unit = self.module_units[module]
        if unit not in self.current:
            self.current.append(unit)
        unit.finish_unshard(self.comm)
        self._prefetch(unit, +1)

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
            self._prefetch(unit, -1)
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
