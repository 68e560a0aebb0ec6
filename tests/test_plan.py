"""``paradiff plan``: the workload traced on the meta device, the cost model, the bytes it predicts against what
the strategies send, and the command."""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest
import torch
from cli_ranks import cli_on_ranks
from exactness import assert_exact, latents, relative_error
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from paradiff.cli import build_parser, main
from paradiff.models import find_denoiser
from paradiff.plan.architectures import architecture, architecture_names
from paradiff.plan.costs import predict
from paradiff.plan.hardware import Hardware, hardware_profile
from paradiff.plan.job import PLAN_PROMPT
from paradiff.plan.workload import Workload, meta_model, pipeline_workload
from paradiff.strategies.costing import balanced_sums
from paradiff.tiny import build, build_pipeline, pipeline, prompt_inputs
from paradiff.tiny.forcing import df_call, latent_frames_to_frames

SIZE = 64


def traced(family: str, layers: int | None = None):
    """The tiny pipeline (a DiT of ``layers`` blocks if given) and its workload at ``SIZE`` px."""
    pipe = build_pipeline(family)
    if layers is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pipe.transformer = type(pipe.transformer).from_config({**pipe.transformer.config, "num_layers": layers})
    inputs = prompt_inputs(pipe, family)

    def call():
        return pipe(**inputs, height=SIZE, width=SIZE, num_inference_steps=2, output_type="latent")

    return pipe, pipeline_workload(pipe, call)


@pytest.mark.parametrize(("family", "batch"), [("sd", 2), ("pixart", 2), ("flux", 1)])
def test_the_meta_trace_counts_the_flops_of_the_real_call_and_computes_nothing(family, batch):
    pipe, (workload, captured) = traced(family)
    denoiser = find_denoiser(pipe)
    ran = []
    handle = denoiser.register_forward_hook(lambda *_: ran.append(1))
    # on the CPU, SDPA's fused kernel has no FLOP formula; the math path (as on the meta device) has
    with FlopCounterMode(display=False) as real, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        denoiser(*captured.args, **captured.kwargs)
    handle.remove()
    assert ran == [1], "the capture left no hook behind"
    assert workload.flops == real.get_total_flops() > 0
    assert (workload.batch, workload.calls_per_step) == (batch, 1)
    assert workload.kernels > 0 and workload.kv_bytes > 0 and workload.attention_layers > 0
    assert workload.attention_heads == {"sd": 4, "pixart": 2, "flux": 2}[family]
    if family == "pixart":  # 2 self-attention layers: scores and weighted values of 2 × 16 tokens of width 32
        assert workload.attention_flops == 2 * 2 * (2 * 2 * 16 * 16 * 32)


def test_two_call_cfg_counts_two_calls_per_step():
    pipe, kwargs = build("wan")
    workload, _ = pipeline_workload(pipe, lambda: pipe(**{**kwargs, "num_inference_steps": 2}))
    assert workload.calls_per_step == 2 and workload.step_flops == 2 * workload.flops


#: Published parameter counts of the named denoisers (billions): the shipped configs are theirs.
PUBLISHED_PARAMS = {
    "sdxl": 2.6,
    "sd3.5-large": 8.1,
    "flux-dev": 12.0,
    "pixart-sigma": 0.6,
    "wan2.1-14b": 14.0,
    "hunyuanvideo": 13.0,
}


@pytest.mark.parametrize("name", architecture_names())
def test_architectures_are_the_published_models(name):
    arch = architecture(name)
    model = meta_model(arch.model_class(), arch.spec["config"], arch.dtype)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.05)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_the_sdxl_decode_is_costed_as_its_vae_computes_it():
    """The VAE's published config (83.7M parameters), traced on the meta device, against the real decoder's FLOPs at
    64 px; the plan costs the decode, banded over the ranks as paradiff runs it."""
    from diffusers import AutoencoderKL

    arch = architecture("sdxl")
    flops, kernels, dtype = arch.decode_cost(arch.dims(64, None))
    vae = AutoencoderKL.from_config(arch.spec["vae"]["config"]).eval()
    assert sum(p.numel() for p in vae.parameters()) / 1e6 == pytest.approx(83.7, rel=0.01)
    with FlopCounterMode(display=False) as real, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        vae.decode(torch.randn(1, 4, 8, 8))
    assert flops == real.get_total_flops() > 0 and kernels > 0 and dtype == "float32"
    from paradiff.plan.job import PlanJob, plan_architecture

    plan = plan_architecture(PlanJob("sdxl", nproc=2, steps=4, hardware="a100-nvlink", strategies=("cfg",)))
    costed = arch.decode_cost(arch.dims(1024, None))[0] / hardware_profile("a100-nvlink").rate("float32")
    assert plan.fixed.decode_banded and plan.fixed.decode_s == pytest.approx(costed, rel=0.05)


def _workload(**fields) -> Workload:
    base = dict(
        model="M",
        flops=1e12,
        kernels=0,
        itemsize=2,
        params=1000,
        stack_params=800,
        latent_bytes=1e6,
        kv_bytes=0.0,
        attention_layers=0,
        halo_row_bytes=0.0,
        convolutions=0,
        group_norms=0,
        unit_flops=(0.5e12, 0.5e12),
        unit_output_bytes=(1e6, 1e6),
        unit_last_reader=(1, 2),
        token_rows=64,
        batch=2,
    )
    return Workload(**{**base, **fields})


HARDWARE = Hardware("h", {"float16": 1e12}, 0.0, 1e9, 0.0, 1.0, 1.0, "test")


def test_the_cost_model_splits_compute_and_adds_transfers():
    free = _workload()
    patch = predict(free, HARDWARE, "float16", "patch", 4, 10, 2)
    gather_s = 0.75e6 / 1e9  # 3/4 of the prediction, at 1 GB/s: waited for in the 3 synchronous steps only
    assert patch.predicted_step_s == pytest.approx(0.25 + 3 * gather_s / 10)
    assert patch.predicted_speedup == pytest.approx(1.0 / patch.predicted_step_s)
    assert not patch.exact and predict(free, HARDWARE, "float16", "patch", 4, 3, 2).exact
    costly = _workload(kv_bytes=1e9, attention_layers=1)
    sent_s = 0.75 + 0.75e-3  # 3/4 of the keys and values and of the prediction, at 1 GB/s
    synced = predict(costly, HARDWARE, "float16", "patch", 4, 1, 0)
    assert synced.predicted_step_s == pytest.approx(0.25 + sent_s)
    displaced = predict(costly, HARDWARE, "float16", "patch", 4, 1001, 0)
    assert displaced.predicted_step_s == pytest.approx((0.25 + 1001 * sent_s) / 1001)  # hidden up to the transfer
    ulysses = predict(costly, HARDWARE, "float16", "ulysses", 4, 10, 0)
    assert ulysses.exact and ulysses.bytes_per_step == pytest.approx(2 * 1e9 * 3 / 16 + 1e6 * 3 / 4)
    cfg = predict(free, HARDWARE, "float16", "cfg", 2, 10, 0)
    assert cfg.exact and cfg.predicted_step_s == pytest.approx(0.5 + 0.5e6 / 1e9)
    pipefusion = predict(free, HARDWARE, "float16", "pipefusion", 2, 10, 0)
    assert pipefusion.memory_mb == pytest.approx((200 + 400) * 2 / 2**20)


def test_ulysses_over_a_head_count_its_ranks_do_not_divide_costs_the_padded_heads():
    """3 heads on 2 ranks: each rank attends with 2, so the attention's compute and bytes grow by 4/3."""
    fields = dict(kv_bytes=1e9, attention_layers=1, attention_flops=6e11)
    even, uneven = (
        predict(_workload(**fields, attention_heads=h), HARDWARE, "float16", "ulysses", 2, 10, 0) for h in (4, 3)
    )
    padding = 1 / 3
    assert uneven.predicted_step_s == pytest.approx(
        even.predicted_step_s + 6e11 / 2 * padding / 1e12 + 2 * 1e9 / 4 * padding / 1e9
    )
    assert uneven.bytes_per_step == pytest.approx(even.bytes_per_step + 2 * 1e9 / 4 * padding)
    divided = (
        predict(_workload(**fields, attention_heads=h), HARDWARE, "float16", "ulysses", 2, 10, 0) for h in (4, 2)
    )
    assert len({p.predicted_step_s for p in divided}) == 1  # heads the ranks divide cost nothing more


def test_a_two_call_step_costs_two_calls_and_the_cfg_split_gives_each_group_one():
    slow_link = Hardware("h", {"float16": 1e12}, 0.01, 1e9, 1e-3, 1.0, 1.0, "test")
    one = _workload(batch=1, kv_bytes=1e8, attention_layers=3)
    two = _workload(batch=1, kv_bytes=1e8, attention_layers=3, calls_per_step=2)
    for strategy in ("patch", "ulysses", "ring", "pipefusion", "asyncdiff"):
        options = {"pipefusion_flow": False} if strategy == "pipefusion" else {}  # flowing fills once, not per call
        single, double = (predict(w, slow_link, "float16", strategy, 2, 10, 1, **options) for w in (one, two))
        assert double.predicted_step_s == pytest.approx(2 * single.predicted_step_s), strategy
        assert double.predicted_speedup == pytest.approx(single.predicted_speedup), strategy
        assert double.bytes_per_step == pytest.approx(2 * single.bytes_per_step), strategy
    single, double = (predict(w, slow_link, "float16", "parastep", 2, 10, 1) for w in (one, two))
    assert double.bytes_per_step == single.bytes_per_step > 0  # a round sends each step's latent, not each call's
    assert double.predicted_step_s == pytest.approx(2 * single.predicted_step_s, rel=0.01)
    cfg = predict(two, slow_link, "float16", "cfg", 2, 10, 0)
    one_call_s = 1.0 + 0.01  # a group makes one of the two calls; its prediction goes to the other
    assert cfg.predicted_step_s == pytest.approx(one_call_s + 1e6 / 1e9 + 1e-3)
    assert cfg.predicted_speedup == pytest.approx(2 * (1.0 + 0.01) / cfg.predicted_step_s)
    batched = predict(_workload(flops=2e12), slow_link, "float16", "cfg", 2, 10, 0)
    assert batched.predicted_step_s == pytest.approx(one_call_s + 0.5e6 / 1e9 + 1e-3)  # half of one call's batch


def test_pipefusion_flowing_draining_and_the_patches_the_plan_chooses():
    """Two equal blocks on 2 stages, 21 steps (the first synchronous: the call's 2 samples pass the stages one after
    the other, 3 slots of half a stage): draining runs M + 1 patch slots a call, flowing M plus the slot of filling
    the pipeline once; flowing keeps (N−1)/M of its stage's keys and values to undo; without
    ``pipefusion_patches`` each picks the M whose loop is fastest."""
    w = _workload(kv_bytes=4e8, attention_layers=2)
    stage_s, sync_s, weights = 0.5, 3 * 0.25 + 1e-3, (200 + 400) * 2  # half the model; 3 half-stage slots + 1 ms
    drain = predict(w, HARDWARE, "float16", "pipefusion", 2, 21, 0, pipefusion_flow=False, pipefusion_patches=4)
    flow = predict(w, HARDWARE, "float16", "pipefusion", 2, 21, 0, pipefusion_patches=4)
    assert drain.predicted_step_s == pytest.approx((sync_s + 20 * 5 * stage_s / 4) / 21)
    assert flow.predicted_step_s == pytest.approx((sync_s + 20 * stage_s + stage_s / 4) / 21)
    assert drain.memory_mb == pytest.approx((weights + 2e8) / 2**20)
    assert flow.memory_mb == pytest.approx((weights + 2e8 * (1 + 1 / 4)) / 2**20)
    assert flow.label == "pipefusion pipefusion_patches=4"
    assert drain.label == "pipefusion pipefusion_flow=False pipefusion_patches=4"
    # 10 ms of Python per denoiser call: more patches cost more, fewer leave more of each drained call idle
    overhead = Hardware("h", {"float16": 1e12}, 0.01, 1e9, 0.0, 1.0, 1.0, "test")
    chosen = {
        flows: predict(w, overhead, "float16", "pipefusion", 2, 21, 0, pipefusion_flow=flows).options
        for flows in (True, False)
    }
    assert chosen == {True: {"pipefusion_patches": 4}, False: {"pipefusion_flow": False, "pipefusion_patches": 8}}
    # the CFG halves on different ranks: each call drains
    split, drained = (
        predict(w, HARDWARE, "float16", "pipefusion", 4, 21, 0, cfg_parallel=True, pipefusion_patches=4, **flow)
        for flow in ({}, {"pipefusion_flow": False})
    )
    assert split.predicted_step_s == pytest.approx(drained.predicted_step_s)
    assert split.memory_mb == pytest.approx(drained.memory_mb)
    # one sample per call: the synchronous step passes the stages one after the other, one device's time
    single = _workload(kv_bytes=4e8, attention_layers=2, batch=1)
    one = predict(single, HARDWARE, "float16", "pipefusion", 2, 21, 0, pipefusion_patches=4)
    assert one.predicted_step_s == pytest.approx((1.0 + 1e-3 + 20 * stage_s + stage_s / 4) / 21)
    # exact steps in row bands: half the tokens through every block on each rank, waiting for the other band's
    # keys and values (half of them) and the blocks' output band; every rank keeps the whole model
    rows = predict(w, HARDWARE, "float16", "pipefusion", 2, 21, 0, pipefusion_patches=4, pipefusion_sync="sequence")
    gathered = (4e8 + 1e6) / 2
    assert rows.predicted_step_s == pytest.approx((0.5 + gathered / 1e9 + 20 * stage_s + stage_s / 4) / 21)
    assert rows.memory_mb == pytest.approx((1000 * 2 + 2e8 * (1 + 1 / 4)) / 2**20)
    assert rows.bytes_per_step == pytest.approx((gathered + 21 * flow.bytes_per_step - 1e6) / 21)  # flow's: 1 MB
    assert rows.label == "pipefusion pipefusion_patches=4 pipefusion_sync=sequence"


def test_a_printed_command_leaves_out_only_the_models_own_steps():
    """The video model draws 8 steps unasked and the pictures 20, so a plan's command says ``--steps`` otherwise."""
    from paradiff.loading import default_size
    from paradiff.plan.costs import Fixed
    from paradiff.plan.job import Plan
    from paradiff.plan.printout import generate_command

    w = _workload()
    row = predict(w, HARDWARE, "float16", "cfg", 2, 8, 1)
    for model, steps, shown in (
        ("paradiff-tiny-video", 8, False),
        ("paradiff-tiny-video", 20, True),
        ("paradiff-tiny-dit", 20, False),
        ("paradiff-tiny-dit", 8, True),
    ):
        plan = Plan(model, default_size(model), None, steps, 2, "float16", HARDWARE, w, Fixed(), (row,))
        assert ("--steps" in shlex.split(generate_command(plan, row))) == shown, (model, steps)


def test_a_setting_whose_memory_per_rank_exceeds_a_device_is_marked_and_never_picked():
    """A device of 300 MB: ``patch``'s buffer of the whole image's K/V (381 MB) does not fit, ``pipefusion``'s of
    its stage's layers does; the plan names both, and neither its pick nor ``auto``'s (``Plan.best``) is ``patch``."""
    from paradiff.plan.costs import Fixed
    from paradiff.plan.job import Plan
    from paradiff.plan.printout import plan_lines

    w = _workload(kv_bytes=4e8, attention_layers=2)
    small = dataclasses.replace(HARDWARE, memory_bytes=300 * 2**20)
    rows = tuple(predict(w, small, "float16", strategy, 2, 10, 1) for strategy in ("patch", "pipefusion", "ulysses"))
    assert [row.fits for row in rows] == [False, True, True]
    assert rows[0].predicted_speedup > rows[1].predicted_speedup > rows[2].predicted_speedup  # patch would win
    assert predict(w, HARDWARE, "float16", "patch", 2, 10, 1).fits  # no memory figure: nothing refused
    plan = Plan("M", SIZE, None, 10, 2, "float16", small, w, Fixed(), rows)
    assert plan.best(exact=False).strategy == "pipefusion" and plan.best(exact=True).strategy == "ulysses"
    assert plan.unfit() == (
        "patch (381 MB) need more than a device's 300 MB per rank; fits: pipefusion pipefusion_patches=64, ulysses"
    )
    lines = plan_lines(plan)
    assert f"does not fit: {plan.unfit()}" in lines
    assert any(line.startswith("patch ") and line.endswith("no, does not fit") for line in lines)
    alone = Plan("M", SIZE, None, 10, 2, "float16", small, w, Fixed(), rows[:1])
    assert alone.best(exact=False) is None
    assert "fastest: none — no strategy fits in a device's memory on 2 ranks" in plan_lines(alone)
    assert hardware_profile("l40-pcie").memory_bytes == 45 * 2**30


def test_a_cpu_rank_has_no_device_memory_to_check():
    from paradiff.plan.calibrate import device_memory

    assert device_memory(torch.device("cpu")) is None


def test_a_balanced_cut_keeps_the_largest_component_small():
    assert balanced_sums((1, 1, 1, 1), 2) == [2, 2]
    assert balanced_sums((1,) * 40, 4) == [10, 10, 10, 10]
    assert balanced_sums((1,) * 10, 3) == [3, 4, 3]
    assert balanced_sums((3, 1, 1, 1), 2) == [3, 3]
    assert balanced_sums((1, 1), 4) == [1, 1, 0.0, 0.0]


#: (family, strategy, relative tolerance). asyncdiff cuts the U-Net where the measured times balance, the model
#: where the FLOPs do; a cut one block apart moves other skip features.
BYTES_CASES = [
    ("sd", "patch", 0.05),
    ("sd", "cfg", 0.05),
    ("sd", "asyncdiff", 0.4),
    ("pixart", "patch", 0.05),
    ("pixart", "ulysses", 0.05),
    ("pixart", "pipefusion", 0.05),
    ("pixart", "asyncdiff", 0.05),
]


def bytes_sent(family: str, strategy: str, layers: int | None = None, **options) -> tuple[float, float]:
    """(predicted, measured on this rank) bytes per step, 6 steps at warm-up 1."""
    import torch.distributed as dist

    import paradiff

    pipe, (workload, _) = traced(family, layers)
    prediction = predict(workload, HARDWARE, "float16", strategy, dist.get_world_size(), 6, 1, **options)
    pipe = paradiff.parallelize(pipe, strategy=strategy, warmup_steps=1, **options)
    pipe(**prompt_inputs(pipe, family), height=SIZE, width=SIZE, num_inference_steps=6, output_type="latent")
    measured = paradiff.comm_stats(pipe)["bytes_per_step"]
    paradiff.unparallelize(pipe)
    return prediction.bytes_per_step, measured


@pytest.mark.timeout(240)
def test_predicted_bytes_are_what_the_strategies_send(pool2):
    """The byte model against each strategy's own counters: what the cost of a transfer rests on."""
    for family, strategy, tolerance in BYTES_CASES:
        predicted, measured = pool2.run(bytes_sent, family, strategy)[0]
        assert predicted == pytest.approx(measured, rel=tolerance), (family, strategy, predicted, measured)


@pytest.mark.timeout(240)
def test_predicted_bytes_of_asyncdiff_at_stride_2_are_what_its_busiest_rank_sends(pool4):
    """Three components on four ranks, two steps per round: the extra rank and the last component each broadcast a
    prediction per round."""
    results = pool4.run(bytes_sent, "pixart", "asyncdiff", layers=3, asyncdiff_stride=2)
    assert results[0][0] == pytest.approx(max(measured for _, measured in results), rel=0.05)


def test_asyncdiff_at_stride_2_completes_two_steps_per_round_of_one_fewer_component():
    w = _workload(unit_flops=(0.25e12,) * 4, unit_output_bytes=(0.0,) * 4, unit_last_reader=(1, 2, 3, 4))
    for stride, components in ((1, 4), (2, 3)):
        row = predict(w, HARDWARE, "float16", "asyncdiff", 4, 1001, 0, asyncdiff_stride=stride)
        largest = 0.5 if components == 3 else 0.25  # four equal units: 2+1+1 or 1+1+1+1
        link_s = stride * 1e6 * 3 / 4 / 1e9  # each round's broadcasts, the mean over the ranks
        round_s = max(largest, link_s)  # a free link: the transfer hides behind the compute
        assert row.predicted_step_s == pytest.approx((1.0 + 1000 * round_s / stride) / 1001)
        assert row.options == ({"asyncdiff_stride": 2} if stride == 2 else {})
        assert row.label == ("asyncdiff asyncdiff_stride=2" if stride == 2 else "asyncdiff")


def test_plan_of_an_architecture_prints_json(capsys):
    assert main(["plan", "--model", "sdxl", "--hardware", "a100-nvlink", "--nproc", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["model"], plan["size"], plan["width"], plan["steps"], plan["nproc"]) == ("sdxl", 1024, 1024, 20, 2)
    assert plan["dtype"] == "float16" and plan["hardware"]["name"] == "a100-nvlink"
    assert plan["hardware"]["link_gb_s"] == pytest.approx(300 * 0.7)
    assert 0 < plan["hardware"]["ms_per_band"] < plan["hardware"]["ms_per_call"]
    rows = plan["predictions"]
    assert {(row["strategy"], row["cfg_parallel"]) for row in rows} >= {("patch", False), ("cfg", False)}
    for row in rows:
        assert {"strategy", "warmup_steps", "predicted_speedup", "predicted_step_s", "bytes_per_step", "exact"} <= set(
            row
        )
        assert 1 < row["predicted_speedup"] <= 2
        assert row["exact"] == (row["strategy"] == "cfg")
        assert (row["bench"] is None) == row["exact"]
    assert plan["fastest_exact"]["strategy"] == "cfg"
    assert plan["parallelize"] == 'paradiff.parallelize(pipe, strategy="cfg")'
    assert plan["launch"] == "torchrun --nproc-per-node 2 your_script.py"
    hub = "stabilityai/stable-diffusion-xl-base-1.0"
    prompt = "'a large red circle on the left on a white background'"
    assert plan["generate"] == f"paradiff generate --model {hub} --strategy cfg --nproc 2 --size 1024 {prompt}"
    assert "asyncdiff" in plan["not_run"] or "pipefusion" in plan["not_run"]


def test_plan_json_names_the_fastest_and_the_fastest_exact_setting(capsys):
    """Flux on two H100s, warm-ups 1 and 4: Ulysses and ring are the exact rows, at different predicted speeds."""
    argv = ["plan", "--model", "flux-dev", "--hardware", "h100-nvlink", "--nproc", "2", "--warmup", "1,4", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = plan["predictions"]
    exact = [row for row in rows if row["exact"]]
    speedups = sorted(row["predicted_speedup"] for row in exact)
    assert len(exact) == 2 and speedups[0] < speedups[1], exact
    fastest, fastest_exact = plan["fastest"], plan["fastest_exact"]
    assert fastest["predicted_speedup"] == max(row["predicted_speedup"] for row in rows)
    assert fastest["predicted_speedup"] > min(row["predicted_speedup"] for row in rows)
    assert fastest_exact["exact"] and fastest_exact["predicted_speedup"] == speedups[1]
    assert not fastest["exact"] and fastest["predicted_speedup"] > fastest_exact["predicted_speedup"]
    # the pick is the fastest exact setting, as a call, a launch line and the same run from the command line
    assert plan["parallelize"] == f'paradiff.parallelize(pipe, strategy="{fastest_exact["strategy"]}")'
    model = "black-forest-labs/FLUX.1-dev"
    assert plan["generate"] == (
        f"paradiff generate --model {model} --strategy {fastest_exact['strategy']} --nproc 2 --size 1024 "
        f"'{PLAN_PROMPT}'"
    )
    warmup = fastest["warmup_steps"]
    assert fastest["bench"] == (
        f"paradiff bench --model {model} --strategies {fastest['strategy']} --warmup {warmup} --nproc 2 --prompts 1 "
        "--size 1024"
    )


def test_a_plan_without_an_exact_setting_says_so_and_how_to_measure_the_fastest(capsys):
    """SDXL on 8 ranks: the CFG split runs on 2 only, so nothing exact runs; the pick is the fastest displaced one."""
    assert main(["plan", "--model", "sdxl", "--hardware", "a100-nvlink", "--nproc", "8", "--strategies", "patch"]) == 0
    out = capsys.readouterr().out
    assert "fastest exact: none — no exact strategy runs sdxl on 8 ranks" in out
    assert "GFLOP" not in out and "machine: a100-nvlink (published figures): one denoiser call " in out
    assert "to run patch + cfg_parallel (the fastest; not exact):" in out, out
    assert 'pipe = paradiff.parallelize(pipe, strategy="patch", warmup_steps=4, cfg_parallel=True)' in out
    assert "torchrun --nproc-per-node 8 your_script.py" in out
    assert "no paradiff generate command: generate and bench take no strategy options (cfg_parallel=True)" in out
    hub = "stabilityai/stable-diffusion-xl-base-1.0"
    bench = f"paradiff bench --model {hub} --strategies patch --warmup 4 --nproc 8 --prompts 1 --size 1024"
    assert bench in out


@pytest.mark.timeout(180)
def test_plan_runs_the_default_model(capsys):
    """The built-in DiT (PixArtAlphaPipeline, DPM-Solver++) timed on 2 ranks: the decode's timing once called it with
    1 step, whose own path fails (IndexError, exit 1)."""
    assert main(["plan", "--size", "128", "--steps", "6", "--nproc", "2", "--strategies", "cfg,patch", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["model"], plan["size"], plan["steps"]) == ("paradiff-tiny-dit", 128, 6)
    assert plan["hardware"]["name"] == "measured here" and plan["hardware"]["ms_per_call"] > 0
    assert plan["hardware"]["link_gb_s"] > 0
    assert {row["strategy"] for row in plan["predictions"]} == {"cfg", "patch"}
    assert plan["fastest_exact"]["strategy"] == "cfg"
    command = (
        f"paradiff generate --model paradiff-tiny-dit --strategy cfg --nproc 2 --steps 6 --size 128 '{PLAN_PROMPT}'"
    )
    assert plan["generate"] == command
    args = build_parser().parse_args(shlex.split(command)[1:])  # the command runs as printed
    assert (args.func.__name__, args.prompt, args.strategy, args.size) == ("generate", [PLAN_PROMPT], "cfg", 128)


def test_a_plan_on_one_rank_is_refused_before_any_worker_starts(capsys, monkeypatch):
    import paradiff.cli

    monkeypatch.setattr(paradiff.cli, "_make_plan", lambda *_: pytest.fail("a plan on one rank started"))
    assert main(["plan", "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "paradiff: error: a plan compares N ranks with one device; use --nproc 2 or more"
    ]


def test_pipefusion_in_row_bands_is_predicted_with_and_without_the_cfg_split(capsys):
    """PixArt-Sigma at 4096 px on 8 PCIe GPUs: exact steps in row bands beat the stage pipeline's (CFG's two
    samples through 8 stages) for the whole model's weights per rank, with the CFG split too; flowing in rows is
    within 15% of ``patch``."""
    argv = ["plan", "--model", "pixart-sigma", "--hardware", "l40-pcie", "--nproc", "8", "--size", "4096"]
    assert main([*argv, "--warmup", "1", "--strategies", "patch,pipefusion", "--json"]) == 0
    rows = {
        (p["strategy"], p["options"].get("pipefusion_sync"), p["cfg_parallel"]): p
        for p in json.loads(capsys.readouterr().out)["predictions"]
        if "pipefusion_flow" not in p["options"]
    }
    for split in (False, True):
        bands, stages = rows[("pipefusion", "sequence", split)], rows[("pipefusion", None, split)]
        assert bands["predicted_speedup"] > stages["predicted_speedup"]
        assert bands["memory_mb"] > stages["memory_mb"]  # every block on every rank
    assert (
        rows[("pipefusion", "sequence", False)]["predicted_speedup"]
        >= 0.85 * rows[("patch", None, False)]["predicted_speedup"]
    )


def test_an_architecture_plan_runs_only_what_parallelize_would_run(capsys):
    """On 8 ranks: the CFG split alone runs on 2 only, and SDXL's 7 U-Net units make at most 7 components (8 ranks at
    stride 2, or 4 per CFG half)."""
    assert main(["plan", "--model", "sdxl", "--hardware", "a100-nvlink", "--nproc", "8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip() for line in out.splitlines()[4:] if line[:1].isalpha() and "  " in line}
    assert {"patch", "patch + cfg_parallel", "asyncdiff asyncdiff_stride=2", "asyncdiff + cfg_parallel"} <= rows
    assert "cfg" not in rows and "asyncdiff" not in rows
    assert "not run: cfg: strategy='cfg' runs the two CFG halves on 2 ranks, got a world of 8" in out
    assert "not run: asyncdiff: strategy='asyncdiff' gives each of its 8 components at least one block" in out
    # ring refuses this machine's CPU, not the profile's GPUs: the machine's own checks are not the plan's
    assert main(["plan", "--model", "flux-dev", "--hardware", "h100-nvlink", "--nproc", "2", "--json"]) == 0
    assert "ring" in {row["strategy"] for row in json.loads(capsys.readouterr().out)["predictions"]}


def test_a_plan_for_another_machine_takes_its_ranks_as_asked_under_torchrun_too(capsys, monkeypatch):
    """Under torchrun the world is the run's rank count, but ``--hardware`` plans for another machine's GPUs."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["plan", "--model", "sdxl", "--hardware", "a100-nvlink", "--steps", "4", "--strategies", "cfg", "--json"]
    assert main([*argv, "--nproc", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["nproc"] == 8
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["nproc"] == 2, "without --nproc: the world's"


def test_a_plan_takes_a_width_apart_from_the_height(capsys):
    assert architecture("wan2.1-14b").dims(480, 33, 832) == {"H": 60, "W": 104, "F": 9}
    argv = ["plan", "--model", "sdxl", "--hardware", "a100-nvlink", "--steps", "4", "--strategies", "cfg"]
    assert main([*argv, "--size", "1024", "--width", "768"]) == 0
    wide = capsys.readouterr().out
    assert main([*argv, "--size", "1024"]) == 0
    square = capsys.readouterr().out

    def tflop(out: str) -> float:
        return float(out.splitlines()[0].split(": ")[-1].split()[0])

    assert "sdxl (UNet2DConditionModel) at 1024×768 px, 4 steps" in wide
    assert 0.6 < tflop(wide) / tflop(square) < 0.75  # 3/4 of the tokens, and attention grows with their square


def test_an_architecture_needs_a_hardware_profile(capsys):
    assert main(["plan", "--model", "flux-dev"]) == 2
    err = capsys.readouterr().err
    assert "flux-dev is an architecture without weights" in err and "pass --hardware" in err


@pytest.mark.timeout(180)
@pytest.mark.timeout(300)
def test_plan_times_this_machine_for_a_model_it_can_load(pool2):
    """On a shared pool, as under torchrun (``test_plan_runs_the_default_model`` starts its own workers)."""
    code, out, err = cli_on_ranks(pool2, "plan", "--model", "paradiff-tiny", "--size", "64", "--steps", "8")
    assert code == 0, err[-3000:]
    assert "machine: measured here (on 2 ranks on cpu): one denoiser call " in out and "fastest exact: " in out, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["cfg"], ["patch"])}
    assert rows["cfg"][-1] == "yes" and rows["patch"][-1] == "no", out
    assert "not run: pipefusion: strategy='pipefusion' does not support UNet2DConditionModel" in out


def overlap_with_ranks_apart() -> float:
    """The overlap timing when the ranks measured very different call times (so would want different counts)."""
    import time

    import torch.distributed as dist

    from paradiff.plan.calibrate import _overlap

    alone_s = 0.002 if dist.get_rank() == 0 else 0.02
    cpu = torch.device("cpu")
    return _overlap(lambda: time.sleep(alone_s), cpu, cpu, dist.get_world_size(), alone_s, link_s=0.001)


@pytest.mark.timeout(120)
def test_the_overlap_timing_issues_the_same_transfers_on_every_rank(pool2):
    """Each rank wanted its own number of all-gathers (1 and 10 here): the ranks' collectives then mismatched, and
    ``paradiff plan`` on the built-in video model died in gloo. They agree on the count first."""
    for overlap in pool2.run(overlap_with_ranks_apart, timeout_s=90):
        assert 0.0 <= overlap <= 1.0


def auto_against_one_device(fidelity: str, model: str | None = None) -> dict:
    """``strategy="auto"`` against one device: on the tiny SD pipeline, or the built-in ``model`` (as loaded)."""

    import paradiff
    from paradiff.loading import load_pipeline, prompt_kwargs

    if model is None:
        pipe = build_pipeline("sd")
    else:
        pipe = load_pipeline(model, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)

    def draw():
        inputs = prompt_inputs(pipe, "sd") if model is None else prompt_kwargs(pipe, model, "a red circle")
        generator = torch.Generator().manual_seed(0)
        return latents(
            pipe(**inputs, height=SIZE, width=SIZE, num_inference_steps=6, generator=generator, output_type="latent")
        )

    reference = draw()
    pipe = paradiff.parallelize(pipe, strategy="auto", fidelity=fidelity)
    with pytest.raises(paradiff.ParadiffError, match="picks its strategy at the first call"):
        paradiff.plan_of(pipe)
    output = draw()
    choice = paradiff.plan_of(pipe)
    paradiff.unparallelize(pipe)
    return {
        "error": relative_error(output, reference),
        "strategy": choice.prediction.strategy,
        "exact": choice.prediction.exact,
        "reason": choice.reason,
        "output": output,
    }


@pytest.mark.timeout(240)
def test_auto_plans_its_first_call_and_stays_exact(pool2):
    results = pool2.run(auto_against_one_device, "exact")
    assert_exact(results, "auto")
    for result in results:
        assert result["exact"], result["reason"]
        assert result["strategy"] == results[0]["strategy"] and "predicted over one device" in result["reason"]


@pytest.mark.timeout(240)
def test_auto_plans_the_first_call_of_pixart_under_dpm_solver(pool2):
    """The planner calls the pipeline itself (the decode's timing among them) with 2 steps, not 1: the built-in
    PixArtAlphaPipeline's one-step path indexes a scheduler result DPM-Solver++ does not return (IndexError)."""
    results = pool2.run(auto_against_one_device, "exact", "paradiff-tiny-dit")
    assert_exact(results, "auto on the built-in DiT")
    for result in results:
        assert result["exact"], result["reason"]
        assert result["strategy"] == results[0]["strategy"]


#: Hand-made predictions for 2 ranks, ``(strategy, warm-up, exact, speedup)``: the fastest of all is displaced
#: (``patch``), the fastest exact one is the CFG split, and neither comes first or last, so a pick by order or of
#: the slowest (``asyncdiff``, ``ring``) shows.
HAND_MADE = (
    ("parastep", 1, False, 1.1),
    ("cfg", 0, True, 1.6),
    ("patch", 1, False, 1.9),
    ("ring", 0, True, 1.3),
    ("asyncdiff", 1, False, 0.8),
)
#: The step count and warm-up the hand-made plan's call runs with (patch at warm-up 1 is displaced from step 3).
HAND_MADE_STEPS, HAND_MADE_WARMUP = 4, 1


def hand_made_plan():
    """A plan of the tiny SD pipeline at ``SIZE`` px on 2 ranks whose predictions are :data:`HAND_MADE`."""
    from paradiff.plan.costs import Fixed, Prediction
    from paradiff.plan.job import Plan

    rows = tuple(
        Prediction(
            strategy=strategy,
            warmup_steps=warmup,
            nproc=2,
            cfg_parallel=False,
            predicted_step_s=0.1 / speedup,
            predicted_total_s=1.0 / speedup,
            predicted_speedup=speedup,
            bytes_per_step=0.0,
            memory_mb=1.0,
            exact=exact,
        )
        for strategy, warmup, exact, speedup in HAND_MADE
    )
    return Plan(
        model="StableDiffusionPipeline",
        size=SIZE,
        frames=None,
        steps=HAND_MADE_STEPS,
        nproc=2,
        dtype="float32",
        hardware=hardware_profile("h200-nvlink"),  # unread by the pick: a plan carries one
        workload=None,  # unread by the pick, and no planner traced this plan
        fixed=Fixed(),
        predictions=rows,
    )


def test_the_plan_picks_the_fastest_exact_setting_or_the_fastest_of_all():
    import dataclasses

    plan = hand_made_plan()
    best_exact, best = plan.best(exact=True), plan.best(exact=False)
    assert (best_exact.strategy, best_exact.exact, best_exact.predicted_speedup) == ("cfg", True, 1.6)
    assert (best.strategy, best.exact, best.predicted_speedup) == ("patch", False, 1.9)
    displaced_only = dataclasses.replace(plan, predictions=tuple(p for p in plan.predictions if not p.exact))
    assert displaced_only.best(exact=True) is None and displaced_only.best(exact=False).strategy == "patch"


def auto_on_the_hand_made_plan(fidelity: str, floor: float | None = None, cache: str | None = None) -> dict:
    """``strategy="auto"`` on the tiny SD pipeline with the planner replaced by :func:`hand_made_plan` (rank 0
    plans, as the real one does): what the first call picked, installed and returned, beside one device's latents.
    With ``floor``: under that fidelity floor (its calibration kept in ``cache``) instead of a warm-up.

    The real planner's choice depends on this machine's timings; this one's is known, and the call costs no
    planning."""
    import os
    import unittest.mock

    import torch.distributed as dist

    import paradiff
    from paradiff.plan import auto, on_ranks

    pipe = build_pipeline("sd")

    def draw():
        generator = torch.Generator().manual_seed(0)
        return pipe(
            **prompt_inputs(pipe, "sd"),
            height=SIZE,
            width=SIZE,
            num_inference_steps=HAND_MADE_STEPS,
            generator=generator,
            output_type="latent",
        ).images

    planned = []

    def plan_pipeline(pipe, call, size, job, device):
        planned.append((size, job.nproc, job.steps, job.warmups))
        return hand_made_plan() if dist.get_rank() == 0 else None

    reference = draw()
    options = {"warmup_steps": HAND_MADE_WARMUP} if floor is None else {"fidelity_floor_db": floor}
    # auto imports plan_pipeline by name; on_ranks too, should choose import it from there when it runs
    with (
        unittest.mock.patch.object(auto, "plan_pipeline", plan_pipeline),
        unittest.mock.patch.object(on_ranks, "plan_pipeline", plan_pipeline),
        unittest.mock.patch.dict(os.environ, {"PARADIFF_CACHE_DIR": cache} if cache else {}),
    ):
        pipe = paradiff.parallelize(pipe, strategy="auto", fidelity=fidelity, **options)
        latents = draw()
    config = pipe._paradiff.config
    choice = paradiff.plan_of(pipe)
    guarded = "guard" in paradiff.comm_stats(pipe)
    paradiff.unparallelize(pipe)
    return {
        "planned": planned,
        "picked": (choice.prediction.strategy, choice.prediction.exact, choice.fidelity),
        "installed": (config.strategy, config.warmup_steps),
        "guarded": guarded,
        "relative_error": float((latents - reference).abs().max() / reference.abs().max()),
        "latents": latents.numpy(),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fidelity", "picked", "exact"), [("displaced", "patch", False), ("exact", "cfg", True)])
def test_auto_runs_the_fastest_prediction_its_fidelity_allows(pool2, fidelity, picked, exact):
    """``fidelity="displaced"`` picks the fastest of all (a displaced strategy), ``"exact"`` the fastest exact one,
    from the same plan; the first call plans itself at its own size and steps, installs the pick on both ranks and
    returns the same latents on both."""
    results = pool2.run(auto_on_the_hand_made_plan, fidelity, timeout_s=100)
    for result in results:
        assert result["planned"] == [(SIZE, 2, HAND_MADE_STEPS, (HAND_MADE_WARMUP,))]
        assert result["picked"] == (picked, exact, fidelity)
        assert result["installed"] == (picked, HAND_MADE_WARMUP)
        assert (result["latents"] == results[0]["latents"]).all()
        # the exact pick equals one device; the displaced one really ran displaced (stale activations after warm-up)
        assert (result["relative_error"] <= 1e-5) == exact, result["relative_error"]


@pytest.mark.timeout(120)
def test_auto_under_a_floor_plans_and_runs_from_warm_up_0_with_the_guard(pool2, tmp_path):
    """A fidelity floor without a warm-up: the plan is made at warm-up 0, as the guard runs, and the pick (a
    displaced strategy) is installed with it and guarded."""
    results = pool2.run(auto_on_the_hand_made_plan, "displaced", 30.0, str(tmp_path), timeout_s=100)
    for result in results:
        assert result["planned"] == [(SIZE, 2, HAND_MADE_STEPS, (0,))]
        assert result["installed"] == ("patch", 0) and result["guarded"]


def test_auto_refuses_options_it_decides_itself():
    import paradiff

    pipe = build_pipeline("sd")
    with pytest.raises(paradiff.ParadiffError, match="strategy='auto' takes fidelity, warmup_steps"):
        paradiff.parallelize(pipe, strategy="auto", cfg_parallel=True)
    with pytest.raises(paradiff.ParadiffError, match="fidelity must be 'exact' or 'displaced'"):
        paradiff.parallelize(pipe, strategy="auto", fidelity="close")


def test_the_block_schedule_counts_the_blocks_in_flight_and_those_just_finished():
    """Four blocks of 2 frames, 4 steps, each block one level behind the one before (``ar_step=1``)."""
    from paradiff.plan.forcing_loop import schedule_counts

    moving = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]]
    mask = torch.tensor(moving).repeat_interleave(2, dim=1)
    assert schedule_counts(mask, 2) == ((2, 3, 4, 4, 3, 2, 1), (0, 0, 0, 0, 1, 1, 1))
    history = torch.tensor([[0, 1], [0, 1]]).repeat_interleave(2, dim=1)  # a window that starts with a block done
    assert schedule_counts(history, 2) == ((1, 1), (1, 0))  # fresh, the first iteration runs that block once


def test_a_window_costs_its_frames_and_their_square():
    from paradiff.plan.forcing_loop import window_cost

    def cost(frames):  # per-frame layers and a self-attention over every frame
        return 3.0 * frames + 0.5 * frames**2

    assert window_cost(7, ((4, cost(4)), (10, cost(10)))) == pytest.approx(cost(7))
    assert window_cost(7, ((4, 8.0), (4, 8.0))) == pytest.approx(14.0)


def test_dualparal_costs_each_iteration_as_its_passes_through_the_stages():
    from paradiff.plan.forcing_loop import BlockLoop

    window = _workload(flops=8e12, unit_flops=(4e12, 4e12), unit_output_bytes=(0.0, 0.0), latent_bytes=0.0)
    block = _workload(flops=2e12, unit_flops=(1e12, 1e12), unit_output_bytes=(0.0, 0.0), latent_bytes=0.0)
    loop = BlockLoop(block, 0.5, (1, 2, 2, 1), finished=(0, 0, 1, 1), position=(0, 1, 2, 3), scale=(1.0,) * 4, blocks=3)
    stage_s, outside_s = 0.5, 0.0  # half of a half-block pass's stack (1e12 FLOPs at 1e12/s); no embeddings
    fresh = predict(window, HARDWARE, "float16", "dualparal", 2, 2, 100, blocks=loop)
    passes = (1, 2, 3, 2)  # fresh: the block that just finished runs once more
    assert fresh.predicted_step_s == pytest.approx(sum((p + 1) * stage_s + p * outside_s for p in passes) / 4)
    assert fresh.predicted_speedup == pytest.approx(8.0 / fresh.predicted_step_s)  # one device: the window, 8 s
    assert not fresh.exact  # three blocks: the second no longer sees the first, as the model's mask has it
    displaced = predict(window, HARDWARE, "float16", "dualparal", 2, 2, 0, blocks=loop)
    first, rest = 2 * stage_s, sum((p + 1) * stage_s for p in (2, 2, 1))  # iteration 0 fresh, then in flight only
    assert displaced.predicted_step_s == pytest.approx((first + rest) / 4)
    cfg = predict(window, HARDWARE, "float16", "cfg", 2, 2, 0, blocks=loop)
    assert cfg.predicted_total_s == pytest.approx(4 * 4.0)  # half the window, the loop's 4 iterations (not 2 steps)
    with pytest.raises(ValueError, match="without its block loop"):
        predict(window, HARDWARE, "float16", "dualparal", 2, 2, 0)


def dualparal_bytes(warmup: int, windows: int) -> tuple[float, float]:
    """(predicted, measured on this rank) bytes per iteration of ``dualparal`` on the tiny diffusion-forcing video of
    8 latent frames: one window, or two (6 frames, then 4 with the first 2 again as history)."""
    import paradiff
    from paradiff.plan.forcing_loop import block_loop

    pipe = pipeline("skyreels-df")
    extra = {} if windows == 1 else {"base_num_frames": latent_frames_to_frames(6), "overlap_history": 5}

    def call():
        return pipe(**df_call(latent_frames=8, steps=4, **extra))

    workload, captured = pipeline_workload(pipe, call)
    loop = block_loop(pipe, call, torch.float32, (workload, captured))
    if windows == 1:
        assert (loop.iterations, loop.blocks, loop.fraction) == (4 + 4 - 1, 4, 0.5)
        assert loop.position == tuple(range(7)) and loop.scale == (1.0,) * 7
    else:  # 3 blocks at 1 level apart, then 1 new block: 4 + 2 and 4 iterations; the second window is 2/3 as long
        assert loop.position == (0, 1, 2, 3, 4, 5, 0, 1, 2, 3)
        assert loop.scale[:6] == (1.0,) * 6 and 0.6 < loop.scale[6] == loop.scale[-1] < 2 / 3 + 0.05
    prediction = predict(workload, HARDWARE, "float16", "dualparal", 2, 4, warmup, blocks=loop)  # bytes: any rate
    pipe = paradiff.parallelize(pipe, strategy="dualparal", warmup_steps=warmup)
    call()
    measured = paradiff.comm_stats(pipe)["bytes_per_step"]
    paradiff.unparallelize(pipe)
    return prediction.bytes_per_step, measured


@pytest.mark.timeout(120)
@pytest.mark.parametrize("windows", [1, 2])
@pytest.mark.parametrize("warmup", [1, 100], ids=["displaced", "fresh"])
def test_predicted_dualparal_bytes_are_what_its_busiest_rank_sends(pool2, warmup, windows):
    """The schedules read from the pipeline, the block's shapes and the stages' transfers, against the counters."""
    results = pool2.run(dualparal_bytes, warmup, windows)
    assert results[0][0] == pytest.approx(max(measured for _, measured in results), rel=1e-6)


def test_a_diffusion_forcing_plan_predicts_dualparal_and_refuses_parastep():
    from paradiff.plan.job import PlanJob
    from paradiff.plan.on_ranks import plan_pipeline
    from paradiff.plan.printout import plan_lines
    from paradiff.strategies.parastep import COPIED_SCHEDULER

    pipe = pipeline("skyreels-df")
    job = PlanJob("skyreels-df", nproc=2, steps=3, hardware="h100-nvlink")
    for blocks, expected in ((2, {"cfg", "dualparal"}), (1, {"cfg"})):

        def call(height, steps, output_type, blocks=blocks):
            return pipe(**df_call(size=height, steps=steps, causal_block_size=blocks, ar_step=blocks - 1))

        plan = plan_pipeline(pipe, call, 32, job, torch.device("cpu"))
        assert {row.strategy for row in plan.predictions} == expected
        assert ("3 steps (6 iterations of frame blocks)" in plan_lines(plan)[0]) == (blocks == 2)
        assert plan.refused["parastep"] == COPIED_SCHEDULER
    assert "--call causal_block_size=N" in plan.refused["dualparal"]


def test_a_plan_for_more_frames_than_the_video_model_draws_is_refused_naming_the_most(capsys):
    """The hardware path loads the model on one process; the built-in video model's motion modules draw 16 frames at
    most, so a plan of 17 is refused there, not timed into a failing call."""
    assert main(["plan", "--model", "paradiff-tiny-video", "--hardware", "h100-nvlink", "--frames", "17"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "paradiff-tiny-video draws at most 16 frames" in err, err
