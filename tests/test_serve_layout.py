"""The server's layout per request: switching the ranks from one exact setting to another and back is exact and
leaves nothing behind (the pipeline's own class, signature and result)."""

from __future__ import annotations

import numpy as np
import pytest
from exactness import TOLERANCE, latents, relative_error

CFG = {"strategy": "cfg", "warmup_steps": 3}
PATCH = {"strategy": "patch", "warmup_steps": 3}  # warm-up covering every step: exact
STEPS = 3


def switch_settings() -> dict:
    """On every rank: one device, then cfg, patch, cfg again and back to one device, through the server's layout."""
    import inspect

    import torch

    from paradiff.serve.layout import Layout, Setting
    from paradiff.tiny import build_pipeline, prompt_inputs

    torch.set_num_threads(1)
    pipe = build_pipeline("sd")
    original = type(pipe)
    inputs = prompt_inputs(pipe, "sd")

    def call() -> np.ndarray:
        size = {"height": 64, "width": 64, "num_inference_steps": STEPS}
        return latents(pipe(**inputs, **size, output_type="latent", generator=torch.Generator().manual_seed(0)))

    reference = call()
    layout = Layout(pipe, 2, timeout_s=60, default_strategy="auto")
    outputs, classes, signatures = [], [], []
    for options in (CFG, PATCH, CFG, {}):
        layout.apply(Setting(tuple(sorted(options.items())), "", ""))
        outputs.append(call())
        classes.append(type(pipe) is original)
        signatures.append("num_inference_steps" in inspect.signature(type(pipe).__call__).parameters)
    return {
        "errors": [relative_error(output, reference) for output in outputs],
        "outputs": outputs,
        "original_class": classes,
        "signature": signatures,
    }


@pytest.mark.timeout(300)
def test_switching_settings_between_requests_is_exact(pool2):
    results = pool2.run(switch_settings, timeout_s=240)
    for rank, result in enumerate(results):
        assert max(result["errors"]) <= TOLERANCE, (rank, result["errors"])
        assert result["original_class"] == [False, False, False, True], "only 'one device' is the loaded pipeline"
        assert all(result["signature"]), "a parallelized pipeline keeps its call's signature"
        np.testing.assert_array_equal(result["outputs"][0], result["outputs"][2])  # cfg again: the same bits
    for first, second in zip(results[0]["outputs"], results[1]["outputs"], strict=True):
        np.testing.assert_array_equal(first, second)
