"""Which parameters travel together: the communication units zerofx chooses from the model's structure.

A transformer repeats one block; FSDP2's users wrap each block with ``fully_shard`` because a block's parameters are
used together, and its size does not grow with depth. zerofx finds those blocks itself: the children of a
``ModuleList`` or ``Sequential`` whose children are all of one class (at least two of them), or the classes a
Hugging Face model lists in ``_no_split_modules``. ``units=`` replaces that rule with module classes or a predicate
``(path, module) -> bool``, the way FSDP2 is applied. Parameters outside every unit (embeddings, the final norm)
are grouped with their neighbours by ``passes.bucketing``.
"""

from __future__ import annotations

from typing import Callable, Union

import torch.nn as nn

UnitRule = Union[str, type, tuple, Callable[[str, nn.Module], bool]]
UNIT_CAP_BYTES = 64 * 2**20  # no unit is larger by default (C_B)


def unit_of_params(modules: list[nn.Module], prefixes: list[str], param_aliases: dict[str, str],
                   rule: UnitRule = "blocks") -> dict[str, str]:
    """fqn -> the path of the outermost module the rule picks that holds the parameter; parameters in none are left
    out. ``prefixes`` are the names the step gives each module argument's parameters ("" for a single module)."""
    unit_of: dict[str, str] = {}
    for path, sub in picked_modules(modules, prefixes, rule):
        for name, _ in sub.named_parameters(remove_duplicate=False):
            unit_of.setdefault(param_aliases[f"{path}.{name}"], path)  # pre-order: the outermost unit wins
    return unit_of


def picked_modules(modules: list[nn.Module], prefixes: list[str], rule: UnitRule) -> list[tuple[str, nn.Module]]:
    """(path, module) for every submodule the rule picks, in pre-order (an outer module before the ones inside)."""
    picked = []
    for module, prefix in zip(modules, prefixes):
        picks = _rule(rule, module)
        picked += [(prefix + path, sub) for path, sub in module.named_modules(remove_duplicate=False)
                   if path and picks(path, sub)]
    return picked


def check_rule(rule: UnitRule, argument: str = "units") -> None:
    if not (rule == "blocks" or _is_classes(rule) or callable(rule)):
        raise ValueError(f"{argument} must be 'blocks', a module class, a tuple of classes or a predicate "
                         f"(path, module) -> bool, got {rule!r}")


def _is_classes(rule) -> bool:
    return isinstance(rule, type) or (isinstance(rule, tuple) and all(isinstance(t, type) for t in rule))


def _rule(rule: UnitRule, root: nn.Module) -> Callable[[str, nn.Module], bool]:
    check_rule(rule)
    if rule == "blocks":
        return _repeated_blocks(root)
    if _is_classes(rule):
        return lambda path, module: isinstance(module, rule)
    return rule


def _repeated_blocks(root: nn.Module) -> Callable[[str, nn.Module], bool]:
    no_split = set(getattr(root, "_no_split_modules", None) or ())
    repeated = set()
    for module in root.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.children())
            if len(children) >= 2 and len({type(c) for c in children}) == 1:
                repeated.update(id(c) for c in children)
    return lambda path, module: id(module) in repeated or type(module).__name__ in no_split
