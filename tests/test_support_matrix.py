"""docs/strategies.md's support matrix is what the strategies themselves say they run, and refusals name what does."""

from __future__ import annotations

import re
from pathlib import Path

from paradiff.models import FAMILIES, AnyDenoiserFamily
from paradiff.strategies import strategy_class
from paradiff.strategies.support import strategies_for, support_matrix, supported_classes

STRATEGIES_DOC = Path(__file__).resolve().parents[1] / "docs" / "strategies.md"


def test_the_docs_show_the_generated_matrix():
    text = STRATEGIES_DOC.read_text()
    shown = re.search(r"<!-- support-matrix:begin -->\n(.*?)\n<!-- support-matrix:end -->", text, re.S)
    assert shown is not None, "docs/strategies.md has no support-matrix block"
    assert shown.group(1) == support_matrix(), "regenerate it: python -c 'from paradiff.strategies.support ..."


def test_refusals_name_the_strategies_that_run_a_family():
    unet = next(family for family in FAMILIES if "UNet2DConditionModel" in family.class_names)
    # strategies registered by other test modules may follow the built-in ones
    assert strategies_for(unet).startswith("strategy='patch', 'parastep', 'asyncdiff'")
    assert "'cfg'" in strategies_for(unet) and "'pipefusion'" not in strategies_for(unet)
    assert strategies_for(AnyDenoiserFamily()) == "strategy='parastep' or 'cfg'"
    assert "UNet2DConditionModel" not in supported_classes(strategy_class("pipefusion"))
    assert supported_classes(strategy_class("cfg")) == "any other denoiser"
