"""Which strategy runs which denoiser family, asked of each strategy (``Strategy.supports``), never written by hand.

Refusals name what does work from here, and docs/strategies.md's support matrix is :func:`support_matrix`'s output
(a test holds the two equal).
"""

from __future__ import annotations

from ..models import FAMILIES, AnyDenoiserFamily, DenoiserFamily, PlannedDiTFamily, families
from . import BUILTIN_NAMES, listed, strategy_class, strategy_names

#: The row of the matrix for a denoiser class no family describes.
ANY_OTHER = "any other denoiser"
#: The row for a class no family module describes but diffusers ships a context-parallel plan for.
ANY_PLANNED = "any other transformer with diffusers' `_cp_plan`"


def supported_classes(strategy: type) -> str:
    """The denoiser classes ``strategy`` runs, as a message names them."""
    if strategy.supports(AnyDenoiserFamily()):
        return ANY_OTHER
    names = [name for family in families() if strategy.supports(family) for name in family.class_names]
    return ", ".join(names + ([ANY_PLANNED] if strategy.supports(PlannedDiTFamily()) else []))


def strategies_for(family: DenoiserFamily, cfg_split: bool = True) -> str:
    """The strategies that run ``family``'s denoisers, as a message names them: ``strategy='patch', ... or 'cfg'``.

    ``cfg_split=False`` leaves out the strategies that are the CFG split alone.
    """
    names = [
        f"'{name}'"
        for name in strategy_names()
        if strategy_class(name).supports(family) and (cfg_split or not strategy_class(name).cfg_split_alone)
    ]
    return f"strategy={listed(names)}"


def support_matrix(names: tuple[str, ...] = BUILTIN_NAMES) -> str:
    """A Markdown table: one row per family (and one for any other denoiser), one column per strategy."""
    rows = [(", ".join(f"`{n}`" for n in family.class_names), family) for family in FAMILIES]
    rows += [(ANY_PLANNED, PlannedDiTFamily()), (ANY_OTHER, AnyDenoiserFamily())]
    lines = [f"| denoiser | {' | '.join(f'`{name}`' for name in names)} |", "|---" * (len(names) + 1) + "|"]
    for label, family in rows:
        marks = " | ".join("✓" if strategy_class(name).supports(family) else "—" for name in names)
        lines.append(f"| {label} | {marks} |")
    return "\n".join(lines)
