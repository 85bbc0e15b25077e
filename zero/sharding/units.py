"""Stage 3's gather units: the modules around whose forward parameters are
gathered, each with the parameters it gathers. See [Note: gather units].

[Note: gather units]
A unit is gathered before its forward and its backward and resharded after,
with one pre-forward hook, one post-forward hook and one collective per
direction. Gathering per leaf module (DeepSpeed's default) costs a hook and a
collective per Linear and LayerNorm: ~30 per micro step for a 4-layer GPT-2,
most of a small model's stage-3 overhead. FSDP2 users wrap each repeated block
instead; zero finds those blocks itself. A unit is, outermost first:
- a module marked as a leaf, DeepSpeed's `deepspeed.utils.set_z3_leaf_modules`
  (`module._z3_leaf = True`), or of a class in WHOLE_MODULES (it uses its
  children's parameters without calling them);
- a repeated block: a module whose class a Hugging Face model names in
  `_no_split_modules` (its "do not split" units: GPT2Block, LlamaDecoderLayer),
  or a child of a ModuleList/Sequential whose children (two or more) all have
  one class;
- any other module with parameters of its own (recurse=False), as before.
A unit takes every parameter of its subtree; modules inside a unit get no hooks.
`ZeroOptions.gather_unit = "module"` (zero_optimization.stage3_gather_unit)
keeps DeepSpeed's per-module units, with only the leaves and WHOLE_MODULES above.
"""
from __future__ import annotations

from torch import nn

WHOLE_MODULES = (nn.MultiheadAttention,)  # use their children's parameters without calling the children
UNIT_KINDS = ("block", "module")


def parse(section: dict) -> str:
    """zero_optimization.stage3_gather_unit: "block" (the default) or "module"."""
    kind = section.get("stage3_gather_unit", "block")
    if kind not in UNIT_KINDS:
        raise ValueError(f"zero config: zero_optimization.stage3_gather_unit must be one of {UNIT_KINDS}, got {kind!r}")
    return kind


def repeated_blocks(model: nn.Module) -> set[int]:
    """ids of the modules that are repeated blocks (see the note)."""
    no_split = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    blocks = {id(m) for m in model.modules() if type(m).__name__ in no_split}
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                blocks.update(id(c) for c in children)
    return blocks


def gather_units(model: nn.Module, params: list[nn.Parameter], kind: str = "block"
                 ) -> tuple[list[nn.Module], list[list[int]]]:
    """The units in module order and, for each, the indices into `params` of the
    parameters it gathers; units without such parameters are left out."""
    blocks = repeated_blocks(model) if kind == "block" else set()
    index_of = {id(p): i for i, p in enumerate(params)}
    modules, groups, inside = [], [], set()
    for module in model.modules():
        if id(module) in inside:
            continue
        whole = getattr(module, "_z3_leaf", False) or isinstance(module, WHOLE_MODULES) or id(module) in blocks
        if whole:
            inside.update(id(m) for m in module.modules())
        indices = [index_of[id(p)] for p in module.parameters(recurse=whole) if id(p) in index_of]
        if indices:
            modules.append(module)
            groups.append(indices)
    return modules, groups
