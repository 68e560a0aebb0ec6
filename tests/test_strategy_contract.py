"""A strategy is one class and one registry line: this file adds a small exact one and runs it at 2 ranks.

``BatchShareStrategy`` splits every denoiser call's batch into one share per rank and gathers the
outputs (exact: samples of a batch never interact). It is written only against the strategy contract
(``Strategy``, ``StrategyOptions``, ``Installation``), the communicator and a family's description; it is
registered for the duration of each test (on the rank workers by the task itself), so that other test
modules see only the built-in strategies.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest
from diffusers.hooks import ModelHook
from exactness import assert_exact
from patch_cases import against_one_device

import paradiff
from paradiff.errors import ParadiffError
from paradiff.layers.split import output_sample, replace_output_sample
from paradiff.models.base import bind_inputs
from paradiff.runtime.comm import OUTPUT
from paradiff.strategies import register, strategy_names, supported_combinations, unregister
from paradiff.strategies.base import Strategy, StrategyOptions
from paradiff.strategies.costing import CostMachine, CostSetting, StepCost
from paradiff.strategies.installation import Installation
from paradiff.tiny import build_pipeline, prompt_inputs


@dataclass(frozen=True)
class BatchShareOptions(StrategyOptions):
    #: Refuse calls whose batch gives a rank fewer samples than this.
    batch_share_min: int = 1

    def __post_init__(self):
        if self.batch_share_min < 1:
            raise ParadiffError(f"batch_share_min must be >= 1, got {self.batch_share_min}")


class BatchShareHook(ModelHook):
    def __init__(self, family, comm, minimum: int):
        super().__init__()
        self.family, self.comm, self.minimum = family, comm, minimum

    def pre_forward(self, module, *args, **kwargs):
        bound = bind_inputs(module, args, kwargs)
        inputs, comm = bound.arguments, self.comm
        batch = inputs[self.family.latent_arg].shape[0]
        if batch % comm.size or batch // comm.size < self.minimum:
            raise ParadiffError(f"a batch of {batch} gives {comm.size} ranks no equal shares of {self.minimum}+")
        share = batch // comm.size
        for name, value in inputs.items():
            if hasattr(value, "shape") and value.ndim and value.shape[0] == batch:
                inputs[name] = value.narrow(0, comm.rank * share, share)
        return bound.args, bound.kwargs

    def post_forward(self, module, output):
        return replace_output_sample(output, self.comm.all_gather_output(output_sample(output), dim=0, kind=OUTPUT))


class BatchShareStrategy(Strategy):
    name = "test-batch-share"
    Options = BatchShareOptions
    uses_warmup = False

    @classmethod
    def step_cost(cls, m: CostMachine, n: int, setting: CostSetting) -> StepCost:
        """A rank computes 1/N of the batch; the outputs are gathered once per call."""
        w = m.w
        nbytes = w.latent_bytes / m.groups * (n - 1) / n
        step = m.compute(w.flops / m.groups / n) + m.transfer(nbytes, m.calls)
        return StepCost(step, step, nbytes, nbytes, m.weights)

    def install(self, denoiser, family, comm, vae_scale_factor) -> Installation:
        installed = Installation(denoiser, self.name)
        installed.hook(denoiser, BatchShareHook(family, comm, self.options.batch_share_min))
        return installed.done()


@contextmanager
def batch_share_registered():
    register(BatchShareStrategy)
    try:
        yield
    finally:
        unregister(BatchShareStrategy.name)


def _batch_share_vs_one_device(steps: int) -> dict:
    pipe = build_pipeline("sd")
    with batch_share_registered():
        return against_one_device(
            pipe, prompt_inputs(pipe, "sd"), 64, steps, strategy="test-batch-share", output_type="latent"
        )


@pytest.fixture
def registered():
    with batch_share_registered():
        yield


def test_a_strategy_registered_in_a_test_file_runs_exactly_at_2_ranks(pool2):
    results = pool2.run(_batch_share_vs_one_device, 3)
    assert_exact(results, "test-batch-share")
    for result in results:
        assert result["class_changed"] and result["class_restored"] and result["hooks_left"] == 0
        assert result["restored_error"] == 0.0
        assert result["stats"]["bytes_per_step"] > 0  # the shares really travelled


def test_registration_gives_the_name_its_options_and_messages(registered):
    assert "test-batch-share" in strategy_names()
    combinations = supported_combinations()
    assert "or 'test-batch-share' (world = its degree)" in combinations
    assert "or 'test-batch-share' with cfg_parallel=True" in combinations
    config = paradiff.ParallelConfig(strategy="test-batch-share", batch_share_min=2, warmup_steps=1)
    assert config.options == BatchShareOptions(batch_share_min=2) and config.batch_share_min == 2
    with pytest.raises(ParadiffError, match="batch_share_min must be >= 1, got 0"):
        paradiff.ParallelConfig(strategy="test-batch-share", batch_share_min=0)
    with pytest.raises(ParadiffError, match="batch_share_min is an option of the test-batch-share strategy, not of"):
        paradiff.ParallelConfig(strategy="patch", batch_share_min=2)
    with pytest.raises(ParadiffError, match="partial_context is an option of the patch strategy, not of"):
        paradiff.ParallelConfig(strategy="test-batch-share", partial_context=0.5)


def test_a_name_taken_by_a_built_in_strategy_is_refused():
    class Impostor(Strategy):
        name = "patch"

    with pytest.raises(ParadiffError, match="strategy name 'patch' is taken by a built-in strategy"):
        register(Impostor)


def test_unregistering_forgets_the_strategy_and_keeps_the_built_in_ones():
    with batch_share_registered():
        assert "test-batch-share" in strategy_names()
    assert "test-batch-share" not in strategy_names()
    with pytest.raises(ParadiffError, match="unknown strategy 'test-batch-share'"):
        paradiff.ParallelConfig(strategy="test-batch-share")
    with pytest.raises(ParadiffError, match="strategy 'patch' is built in and cannot be unregistered"):
        unregister("patch")


def test_a_registered_strategy_is_planned_and_one_without_a_cost_model_is_named(registered):
    """One plan with both registered: the costed strategy has its row, the uncosted one is left out; asked for by name,
    it is refused. Each plan traces the architecture on the meta device: PixArt-Σ is the quickest to trace."""
    from paradiff.plan.job import PlanJob, plan_architecture

    class Uncosted(Strategy):
        name = "test-uncosted"

    job = PlanJob("pixart-sigma", nproc=2, steps=10, hardware="h100-nvlink", size=1024)
    register(Uncosted)
    try:
        rows = {row.strategy: row for row in plan_architecture(job).predictions}
        assert "test-batch-share" in rows and rows["test-batch-share"].exact, sorted(rows)
        assert rows["test-batch-share"].warmup_steps == 0, "exact at every step: one row, no warm-up setting"
        assert rows["test-batch-share"].bytes_per_step > 0
        assert "test-uncosted" not in rows
        uncosted = r"strategy 'test-uncosted' declares no cost model \(Strategy.step_cost\)"
        with pytest.raises(ParadiffError, match=uncosted):
            plan_architecture(replace(job, strategies=("test-uncosted",)))
    finally:
        unregister("test-uncosted")
