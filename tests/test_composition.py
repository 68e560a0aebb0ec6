"""What users stack on a pipeline × the strategies, at 2 gloo ranks: exact, or refused naming why.

Each case is ``(feature, strategy, expected)``: the feature (``composition_features.FEATURES``) on its tiny
pipeline runs under the strategy and must equal the same feature on one device (``"exact"``: every rank within
the feature's tolerance, every rank equal), or raise a :class:`~paradiff.errors.ParadiffError` on every rank
whose message contains the reason (``"refused: <reason>"``); never a crash, a hang or a silent difference.
docs/composition.md shows :func:`composition_table` of these cases; it takes several case lists, so other
modules' cases of the same shape join the table.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from composition_features import FEATURES, compose

COMPOSITION_DOC = Path(__file__).resolve().parents[1] / "docs" / "composition.md"

#: What a strategy that keeps only a rank's stage of the blocks says to a change of the model.
CANNOT_FOLLOW = "refused: cannot follow it (each rank holds only its stage of the blocks)"

CASES = [
    ("torchao int8 weight-only · SD", "patch", "exact"),
    ("torchao int8 weight-only · SD", "cfg", "exact"),
    ("torchao int8 weight-only · Flux", "patch", "exact"),
    ("torchao int8 weight-only · Flux", "ulysses", "exact"),
    ("torchao int8 weight-only · Flux", "pipefusion", "refused: cannot do with Int8Tensor weights"),
    ("quanto int8 weights · Flux", "patch", "exact"),
    ("quanto int8 weights · Flux", "ulysses", "exact"),
    ("quanto int8 weights · Flux", "pipefusion", "exact"),
    ("fp8 layerwise casting · SD", "patch", "exact"),
    ("fp8 layerwise casting · SD", "parastep", "exact"),
    ("fp8 layerwise casting · Flux", "patch", "exact"),
    ("fp8 layerwise casting · Flux", "ulysses", "exact"),
    ("bf16 · SD", "patch", "exact"),
    ("bf16 · Flux", "ulysses", "exact"),
    ("LoRA loaded after parallelize · SD", "patch", "exact"),
    ("LoRA loaded after parallelize · SD", "asyncdiff", "exact"),
    ("LoRA loaded after parallelize · SD", "cfg", "exact"),
    ("LoRA loaded after parallelize · Flux", "ulysses", "exact"),
    ("LoRA loaded after parallelize · Flux", "pipefusion", CANNOT_FOLLOW),
    ("LoRA unloaded after parallelize · SD", "patch", "exact"),
    ("LoRA hot-swapped after parallelize · SD", "patch", "exact"),
    ("LoRA hot-swapped after parallelize · SD", "parastep", "exact"),
    ("LoRA hot-swapped after parallelize · Flux", "ulysses", "exact"),
    ("LoRA hot-swapped after parallelize · Flux", "pipefusion", CANNOT_FOLLOW),
    ("LoRA scale set after parallelize · SD", "patch", "exact"),
    ("LoRA fused after parallelize · SD", "patch", "exact"),
    (
        "QKV fused after parallelize · SD",
        "patch",
        "refused: uses fused QKV projections, which the patch strategy cannot split",
    ),
    ("QKV fused after parallelize · SD", "cfg", "exact"),
    ("QKV fused after parallelize · Flux", "patch", "exact"),
    ("QKV fused after parallelize · Flux", "ulysses", "exact"),
    ("torchao int8 after parallelize · Flux", "patch", "exact"),
    ("another scheduler after parallelize · SD", "parastep", "exact"),
    ("ControlNet · Flux", "patch", "exact"),
    ("ControlNet · Flux", "ulysses", "exact"),
    ("ControlNet · Flux", "pipefusion", "refused: cannot pass controlnet_block_samples"),
    ("ControlNet · Flux", "cfg", "exact"),
    ("ControlNet · SD3", "patch", "exact"),
    ("ControlNet · SD3", "ulysses", "exact"),
    ("ControlNet · SD3", "pipefusion", "refused: cannot pass block_controlnet_hidden_states"),
    ("2 images per prompt · Flux", "patch", "exact"),
    ("2 images per prompt · Flux", "ulysses", "exact"),
    ("2 images per prompt · Flux", "pipefusion", "exact"),
    ("2 prompts · Flux", "pipefusion", "exact"),
    ("2 prompts · SD3", "cfg", "exact"),
    (
        "weights ×1.05 on one rank · SD",
        "patch",
        "refused: ranks disagree on the pipeline's model: unet weights differs",
    ),
    ("another scheduler on one rank · SD", "cfg", "refused: ranks disagree on the pipeline's model: scheduler differs"),
]


def composition_table(*case_lists: list[tuple[str, str, str]]) -> str:
    """The markdown table of features × strategies: ✓ exact, or ✗ with the reason, from one or more case lists."""
    cases = [case for cases in case_lists for case in cases]
    features = list(dict.fromkeys(feature for feature, _, _ in cases))
    strategies = list(dict.fromkeys(strategy for _, strategy, _ in sorted(cases, key=_strategy_order)))
    cells = {(feature, strategy): _cell(expected) for feature, strategy, expected in cases}
    lines = [
        "| feature | " + " | ".join(f"`{strategy}`" for strategy in strategies) + " |",
        "| --- |" + " --- |" * len(strategies),
    ]
    for feature in features:
        row = [cells.get((feature, strategy), "") for strategy in strategies]
        lines.append(f"| {feature} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _strategy_order(case: tuple[str, str, str]) -> int:
    from paradiff.strategies import strategy_names

    names = list(strategy_names())
    return names.index(case[1]) if case[1] in names else len(names)


def _cell(expected: str) -> str:
    if expected == "exact":
        return "✓"
    return "✗ " + expected.removeprefix("refused: ").replace("|", "\\|")


def _case_id(feature: str, strategy: str) -> str:
    """An ASCII test id (``-k`` selects by it): ``LoRA-loaded-after-parallelize-SD-patch``."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"{feature} {strategy}").strip("-")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("feature", "strategy", "expected"), CASES, ids=[_case_id(f, s) for f, s, _ in CASES])
def test_composition(pool2, feature, strategy, expected):
    if FEATURES[feature].needs:
        pytest.importorskip(FEATURES[feature].needs)
    results = pool2.run(compose, feature, strategy, timeout_s=240)
    if expected == "exact":
        for rank, result in enumerate(results):
            assert result["refusal"] is None, (rank, result["refusal"])
            assert result["error"] <= FEATURES[feature].tolerance, (rank, result["error"])
        np.testing.assert_array_equal(results[1]["output"], results[0]["output"])
    else:
        reason = expected.removeprefix("refused: ")
        for rank, result in enumerate(results):
            assert result["refusal"] is not None and reason in result["refusal"], (rank, result)


def test_the_docs_show_the_generated_table():
    text = COMPOSITION_DOC.read_text()
    shown = re.search(r"<!-- composition:begin -->\n(.*?)\n<!-- composition:end -->", text, re.S)
    assert shown is not None, "docs/composition.md has no composition block"
    assert shown.group(1) == composition_table(CASES), (
        "regenerate it: cd tests && python -c 'import test_composition as t; print(t.composition_table(t.CASES))'"
    )


def test_the_table_joins_case_lists():
    table = composition_table([("a", "patch", "exact")], [("a", "cfg", "refused: no CFG"), ("b", "patch", "exact")])
    assert table.splitlines() == [
        "| feature | `patch` | `cfg` |",
        "| --- | --- | --- |",
        "| a | ✓ | ✗ no CFG |",
        "| b | ✓ |  |",
    ]


def installations_across_calls() -> list[bool]:
    """Whether each call ran on the installation of the call before: only the one after the LoRA load re-installs."""
    from composition_features import _generate, load_lora

    import paradiff
    from paradiff.tiny import build_pipeline, prompt_inputs

    pipe = paradiff.parallelize(build_pipeline("sd"), strategy="patch", warmup_steps=2)
    inputs, kept, part = prompt_inputs(pipe, "sd"), [], None
    for change in (None, None, load_lora("sd"), None):
        if change:
            change(pipe)
        _generate(pipe, inputs, 2, {})
        kept.append(pipe._paradiff.strategy_part is part)
        part = pipe._paradiff.strategy_part
    paradiff.unparallelize(pipe)
    return kept


@pytest.mark.timeout(120)
def test_only_a_call_after_layers_were_replaced_installs_again(pool2):
    for kept in pool2.run(installations_across_calls, timeout_s=100):
        assert kept == [False, True, False, True]


def test_weight_sums_are_read_again_only_for_tensors_written_since():
    """The per-call checksum reads a tensor again when its version counter or storage changed, not otherwise (a
    write through ``.data`` bumps neither, as it escapes autograd)."""
    import torch
    from torch import nn

    from paradiff.runtime.weights import SumCache

    cache, weight, buffer = SumCache(), nn.Parameter(torch.ones(3)), torch.ones(2)
    assert cache.sums([weight, buffer]) == [3.0, 2.0]
    with torch.no_grad():
        weight.mul_(2)
    buffer.data = torch.zeros(2)
    assert cache.sums([weight, buffer]) == [6.0, 0.0]
    weight.data.mul_(10)
    assert cache.sums([weight, buffer]) == [6.0, 0.0]
