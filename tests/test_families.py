"""Every diffusers family paradiff runs, under every strategy that applies to it, equal to one device.

Tiny real pipelines (``paradiff.tiny``'s image DiTs and videos), fp32 on CPU, 2 gloo ranks: in exact mode
(warm-up over every step) each strategy's output is the one-device output within float round-off, the
same on every rank, and the pipeline comes back untouched. Which strategies apply is asked of the code
(``Strategy.supports`` and the pipeline's CFG), so a family or strategy that stops supporting the other
drops out of the matrix in docs/strategies.md and here alike, and ``test_the_families_run_what_the_matrix_says``
fails.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from displaced_reference import (
    asyncdiff_reference,
    patch_reference,
    pipefusion_flowing_reference,
    pipefusion_reference,
)
from exactness import TOLERANCE, latents

import paradiff
from paradiff.compat import ContextParallelInput, ulysses_gathers_key_masks
from paradiff.errors import ParadiffError
from paradiff.layers.token_plan import split_piece
from paradiff.models import family_of, find_denoiser
from paradiff.strategies import strategy_class
from paradiff.strategies.cfg import cfg_free_reason
from paradiff.tiny import build, names

STEPS = 3
#: Strategies tried on every family: all but ``ring``, which needs an attention backend CUDA alone has.
STRATEGIES = ("patch", "pipefusion", "parastep", "asyncdiff", "cfg", "ulysses")
#: One tiny pipeline per family beyond the classic five (which other test modules run strategy by strategy).
FAMILY_PIPELINES = names(group="image_dits") + names(group="videos")


def applicable(pipe, strategy: str) -> bool:
    denoiser = find_denoiser(pipe)
    cls = strategy_class(strategy)
    if cls.cfg_split_alone and cfg_free_reason(pipe, denoiser):
        return False
    return cls.supports(family_of(denoiser, any_model=True))


def strategies_vs_one_device(name: str, strategies=STRATEGIES, steps: int = STEPS, **extra) -> dict:
    """On this rank: the one-device latents, then each applicable strategy's (exact mode), then restored."""
    pipe, call = build(name)
    call = {**call, "num_inference_steps": steps}

    def run():
        return latents(pipe(**{**call, "generator": torch.Generator().manual_seed(0)}))

    reference = run()
    scale = float(np.abs(reference).max())
    results = {}
    for strategy in [s for s in strategies if applicable(pipe, s)]:
        options = {"warmup_steps": steps} if strategy_class(strategy).uses_warmup else {}
        pipe = paradiff.parallelize(pipe, strategy=strategy, **options, **extra)
        try:
            output = run()
        except ParadiffError as error:  # a refusal: _check_exact says which ones are expected
            results[strategy] = {"refused": str(error)}
            continue
        finally:
            paradiff.unparallelize(pipe)
        results[strategy] = {"error": float(np.abs(output - reference).max()) / scale, "output": output}
    results["restored"] = float(np.abs(run() - reference).max())
    return results


def _check_exact(results: list[dict]) -> None:
    assert results[0]["restored"] == 0.0
    for strategy, result in results[0].items():
        if strategy == "restored":
            continue
        if "refused" in result:  # only a diffusers whose Ulysses cannot mask the keys it gathers may refuse
            assert strategy == "ulysses" and not ulysses_gathers_key_masks(), result["refused"]
            assert "does not extend a mask over the keys it gathers" in result["refused"]
            continue
        assert result["error"] <= TOLERANCE, (strategy, result["error"])
        for other in results[1:]:
            np.testing.assert_array_equal(other[strategy]["output"], result["output"], err_msg=strategy)


@pytest.mark.parametrize("name", FAMILY_PIPELINES)
def test_every_applicable_strategy_is_exact(pool2, name):
    results = pool2.run(strategies_vs_one_device, name)
    print(name, {k: v.get("error", "refused") for k, v in results[0].items() if k != "restored"})
    _check_exact(results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["qwenimage", "wan", "ltx"])
def test_pipefusion_with_exact_calls_in_row_bands_is_exact(pool2, name):
    """``pipefusion_sync="sequence"`` where K/V are completed through diffusers' attention dispatch (Qwen-Image,
    Wan) and where a per-token table carries the batch (LTX's rotary table)."""
    _check_exact(pool2.run(strategies_vs_one_device, name, ("pipefusion",), pipefusion_sync="sequence"))


def test_a_class_no_family_module_describes_runs_from_diffusers_plan():
    """Flux.2 has no family module: its shipped ``_cp_plan`` is its description (patch and ulysses)."""
    pipe, _ = build("flux2")
    family = family_of(find_denoiser(pipe))
    assert type(family).__name__ == "PlannedDiTFamily" and family.class_names == ("Flux2Transformer2DModel",)
    assert applicable(pipe, "patch") and applicable(pipe, "ulysses") and not applicable(pipe, "cfg")


def test_the_families_run_what_the_matrix_says():
    """The matrix these tests walk: each strategy covers the families it was built for (a regression drops one)."""
    names = set(FAMILY_PIPELINES)
    runs = {s: {name for name in names if applicable(build(name)[0], s)} for s in STRATEGIES}
    assert runs["parastep"] == names
    assert runs["cfg"] == names - {"flux2"}  # guidance-distilled: nothing to split
    assert runs["patch"] == names - {"lumina2"}
    assert runs["asyncdiff"] == names - {"chroma", "flux2"}
    dits = {"qwenimage", "cogview4", "wan", "cogvideox", "hunyuanvideo", "ltx", "mochi", "allegro"}
    assert runs["pipefusion"] == dits
    # diffusers' plans (Qwen-Image, Wan, Flux.2) and family plans with the stock processors' attention dispatched
    assert runs["ulysses"] == {"qwenimage", "flux2", "wan", "cogvideox", "cogview4", "auraflow", "hunyuandit", "latte"}


@pytest.mark.parametrize("options", [{}, {"cfg_parallel": True}], ids=["patch", "patch-x-cfg"])
def test_a_video_dit_at_4_ranks(rank_pool, options):
    """Wan (two calls per step for CFG) over 4 ranks: 4 pieces of its 2 frames × 4 × 4 tokens, or 2 per CFG half."""
    results = rank_pool(4).run(strategies_vs_one_device, "wan", ("patch",), **options)
    assert set(results[0]) == {"patch", "restored"}
    _check_exact(results)


def test_a_pipeline_without_cfg_is_refused_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # no process group exists: it must fail before creating one
    pipe, _ = build("flux2")
    for options in ({"strategy": "cfg"}, {"strategy": "patch", "cfg_parallel": True}):
        with pytest.raises(ParadiffError, match=r"Flux2Pipeline runs no classifier-free guidance.*'patch'"):
            paradiff.parallelize(pipe, **options)
        assert not hasattr(pipe, "_paradiff")


def displaced_vs_reference(name: str, strategy: str, steps: int, warmup: int, reference, **options) -> dict:
    """This rank's latents under a displaced strategy, the single-process reference's, and one device's."""
    pipe, call = build(name)
    call = {**call, "num_inference_steps": steps}

    def run(pipe, hold=None):
        kwargs = {**call, "generator": torch.Generator().manual_seed(0)}
        return latents(hold(pipe, kwargs) if hold else pipe(**kwargs))

    one_device = run(pipe)
    expected = run(pipe, partial(reference, warmup_steps=warmup))
    pipe = paradiff.parallelize(pipe, strategy=strategy, warmup_steps=warmup, **options)
    try:
        output = run(pipe)
        flow = paradiff.comm_stats(pipe).get("flow")
    finally:
        paradiff.unparallelize(pipe)
    scale = float(np.abs(expected).max())
    return {
        "error": float(np.abs(output - expected).max()) / scale,
        "moved": float(np.abs(output - one_device).max()) / scale,
        "output": output,
        "flow": flow,
    }


@pytest.mark.parametrize(
    ("name", "strategy", "reference", "options"),
    [
        ("ltx", "patch", partial(patch_reference, ranks=2), {}),
        ("ltx", "asyncdiff", partial(asyncdiff_reference, cut=(1, 1)), {"asyncdiff_cut": (1, 1)}),
        ("ltx", "pipefusion", partial(pipefusion_reference, patches=4), {"pipefusion_patches": 4}),
        (
            "wan",
            "pipefusion",
            partial(pipefusion_flowing_reference, patches=4, stages=2, guidance=5.0, calls=2),
            {"pipefusion_patches": 4},
        ),
        ("sana", "patch", partial(patch_reference, ranks=2), {}),
        ("animatediff", "patch", partial(patch_reference, ranks=2), {}),
    ],
    ids=[
        "video-dit-patch",
        "video-dit-asyncdiff",
        "video-dit-pipefusion",
        "video-dit-pipefusion-two-calls",
        "image-dit-patch",
        "video-unet-patch",
    ],
)
def test_displaced_steps_equal_their_reference(pool2, name, strategy, reference, options):
    """A video DiT (LTX; Wan, whose CFG is two calls per step in ``cache_context("cond"/"uncond")``), an image DiT
    with a convolution among its tokens (Sana) and a video U-Net (AnimateDiff). ``pipefusion`` flows from every
    displaced call into the next but the last (5 steps, warm-up 1: 3 displaced steps)."""
    results = pool2.run(displaced_vs_reference, name, strategy, 5, 1, reference, **options)
    for result in results:
        assert result["error"] <= TOLERANCE, result["error"]
        assert result["moved"] >= 1e-3, result["moved"]  # displaced: not the one-device output
        np.testing.assert_array_equal(result["output"], results[0]["output"])
        if strategy == "pipefusion":
            calls = 2 if name == "wan" else 1
            assert result["flow"]["calls_flowing"] == 3 * calls - 1 and result["flow"]["stopped"] is None


def decoded_with_parallel_vae(name: str) -> dict:
    """This rank's decoded video (``output_type="np"``) under parastep with ``parallel_vae`` on, and one device's."""
    pipe, call = build(name)

    def run():
        return latents(pipe(**{**call, "output_type": "np", "generator": torch.Generator().manual_seed(0)}))

    reference = run()
    pipe = paradiff.parallelize(pipe, strategy="parastep", warmup_steps=STEPS)
    try:
        output = run()
        stats = paradiff.comm_stats(pipe)
    finally:
        paradiff.unparallelize(pipe)
    return {"difference": float(np.abs(output - reference).max()), "output": output, "stats": stats}


@pytest.mark.parametrize("name", ["wan", "cogvideox", "hunyuanvideo", "ltx", "mochi", "svd"])
def test_a_video_vae_decodes_on_one_rank_for_all(pool2, name):
    """Video VAEs carry a cache across chunks of frames: rank 0 decodes, the other ranks receive its frames."""
    results = pool2.run(decoded_with_parallel_vae, name)
    for result in results:
        assert result["difference"] == 0.0
        np.testing.assert_array_equal(result["output"], results[0]["output"])
    sent = [result["stats"]["vae_decode_bytes"] for result in results]
    assert sent[0] >= results[0]["output"].size * 4 and sent[1] == 0  # rank 0 sent the frames (fp32), rank 1 nothing


def test_tokens_that_do_not_divide_name_the_fix():
    comm = SimpleNamespace(size=3, rank=0)
    spec = ContextParallelInput(split_dim=1, expected_dims=3)
    with pytest.raises(ParadiffError, match=r"the 32 tokens of 'blocks.0' input .* 3 equal pieces; .*'parastep'"):
        split_piece(torch.zeros(1, 32, 8), spec, comm, "'blocks.0' input 'hidden_states'")
    second_half = split_piece(torch.arange(4.0).view(1, 4, 1), spec, SimpleNamespace(size=2, rank=1), "")
    assert second_half.flatten().tolist() == [2.0, 3.0]


def test_pcpp_on_tokens_cut_by_a_plan_is_refused_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # no process group exists: it must fail before creating one
    pipe, _ = build("wan")
    with pytest.raises(ParadiffError, match=r"partial_context needs the image's row bands, and the wan model's"):
        paradiff.parallelize(pipe, strategy="patch", partial_context=0.5)
    assert not torch.distributed.is_initialized() and not hasattr(pipe, "_paradiff")
