"""``torch.compile`` of the denoiser after ``parallelize``: the strategies' hooks and transfers run around the
compiled graphs, and exact mode stays exact. The slower compiles (the U-Net's, and ``patch``, ``parastep``,
``asyncdiff``, and inductor's code for every strategy: 30-70 s each on 2 cores with an empty compile cache) run
in ``benchmarks/compile_check.py``."""

from __future__ import annotations

import functools

import pytest
import torch
from exactness import assert_exact, latents, relative_error

import paradiff
from paradiff.models import find_denoiser
from paradiff.tiny import build_pipeline, prompt_inputs

STEPS = 3
#: PixArt's DiT: its compile takes seconds where the U-Net's takes a minute.
FAMILY = "pixart"
#: What the strategies' hooks meet is dynamo's tracing, the same under every backend: ``aot_eager`` traces and runs the
#: graphs without generating inductor's code (a minute on 2 cores with an empty compile cache).
BACKEND = "aot_eager"


class CountingBackend:
    """A compiler backend (the one named, e.g. ``aot_eager``) counting the graphs it compiles and the calls of them.

    Equal images alone would also pass if nothing were compiled (dynamo disabled, or every frame skipped).
    """

    def __init__(self, name: str):
        self.name = name
        self.graphs = self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        compiled = lookup_backend(self.name)(graph, example_inputs)

        @functools.wraps(compiled)  # keeps its calling convention (``_boxed_call``)
        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


def compiled_against_uncompiled(strategy: str, warmup_steps: int, options: dict) -> dict:
    """The largest difference of the compiled call from the same call uncompiled (one device when exact)."""
    pipe = build_pipeline(FAMILY)

    def draw():
        generator = torch.Generator().manual_seed(0)
        inputs = prompt_inputs(pipe, FAMILY)
        return latents(
            pipe(**inputs, height=64, width=64, num_inference_steps=STEPS, generator=generator, output_type="latent")
        )

    exact = warmup_steps >= STEPS
    reference = draw() if exact else None
    pipe = paradiff.parallelize(pipe, strategy=strategy, warmup_steps=warmup_steps, **options)
    if not exact:
        reference = draw()
    backend = CountingBackend(BACKEND)
    find_denoiser(pipe).compile(backend=backend)
    try:
        output = draw()
    finally:
        paradiff.unparallelize(pipe)
        torch._dynamo.reset()
    return {
        "error": relative_error(output, reference),
        "output": output,
        "graphs": backend.graphs,
        "runs": backend.runs,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "warmup_steps", "options"),
    [
        ("cfg", STEPS, {}),
        ("ulysses", STEPS, {}),
        ("pipefusion", 1, {}),
        ("pipefusion", STEPS, {"pipefusion_sync": "sequence"}),
    ],
    ids=["cfg", "ulysses", "pipefusion-displaced", "pipefusion-rows-exact"],
)
def test_a_compiled_denoiser_computes_what_the_uncompiled_one_does(pool2, strategy, warmup_steps, options):
    """Exact settings against one device; displaced pipefusion (patches through the stages) against itself."""
    results = pool2.run(compiled_against_uncompiled, strategy, warmup_steps, options)
    for result in results:
        compiled = (result["graphs"], result["runs"])
        assert compiled[0] >= 1 and compiled[1] >= STEPS, compiled  # graphs compiled, and run at least once a step
    assert_exact(results, strategy)
