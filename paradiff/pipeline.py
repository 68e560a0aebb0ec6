"""``parallelize`` / ``unparallelize``: change one pipeline instance, and only that one.

The pipeline keeps its own ``__call__`` loop (CFG combine, scheduler, callbacks, VAE). paradiff
(1) installs the strategy's hooks on the pipeline's denoiser and (2) moves this one instance to a
subclass of its own class whose ``__call__`` resets the step state, makes the starting noise agree
across ranks and then calls the stock ``__call__``. No class is modified; ``isinstance`` checks and
attribute access behave as before, and ``unparallelize`` restores the original class. Step
parallelism (``parastep``) also steers the loop: for the duration of each call it wraps the ``step``
of the pipeline's scheduler instance.

With a CFG split the ranks form a 2 × D mesh (``runtime/mesh.py``): the strategy runs over the D
ranks of each batch half, the split's hook wraps it. The VAE decode is banded over all 2·D ranks:
every rank holds the same final latent, so the whole world can share the decode, and the cfg split
alone (which has no row bands) gets a parallel decode too.

Every strategy follows one contract (``paradiff.strategies.base.Strategy``) and is found by name in one
registry (``paradiff.strategies``); this module knows no strategy but the CFG split and the banded
VAE decode, which it composes with whichever strategy runs within the batch halves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
from torch import nn

from .caches.applied import adapt_caches, check_auto, describe_caches
from .checks import check_parallelize, vae_scale_factor
from .config import SHARED_OPTIONS, ParallelConfig, default_warmup
from .errors import ParadiffError, PeerFailure
from .fidelity_floor import cache_key, calibrate, kept_calibration, remember
from .layers.decode_broadcast import DecodeOnOneRankHook
from .layers.refresh import RefreshHook
from .models import decoder_family_of, family_of, find_denoiser
from .plan.auto import check_fidelity, choose, untouched_generators
from .plan.memory_fit import call_refusal, call_steps, memory_setting_bytes, shape_key, smallest_over_ranks
from .runtime.agree import agree_on_noise
from .runtime.comm import CommStats, Communicator
from .runtime.consensus import agree, describe_call, describe_setup
from .runtime.distributed import RankGroup, can_join_world, ensure_process_group, env_world_size, local_device
from .runtime.failures import meet_every_rank
from .runtime.liveness import start_heartbeat
from .runtime.mesh import MeshGroups, build_mesh
from .runtime.model_watch import Snapshot, changes, snapshot
from .runtime.staleness import StalenessGuard
from .runtime.step_state import StepState
from .runtime.weights import SumCache
from .stages.load_stage import loaded_stage
from .strategies import strategy_class
from .strategies.base import Strategy
from .strategies.cfg import CfgStrategy
from .strategies.installation import Installation
from .strategies.patch import PatchStrategy

#: What a calibration run of the staleness guard leaves out of the caller's arguments: it runs no callbacks.
CALIBRATION_LEFT_OUT = ("callback_on_step_end", "callback", "callback_steps")
#: How to make ranks that disagree at ``parallelize`` agree.
SAME_SETUP = "load the same model and pass the same options to parallelize() on every rank"
#: How to make ranks that disagree on the model at a call agree.
SAME_MODEL = "change the model (its weights, adapters, layers) and the scheduler the same way on every rank, or on none"


@dataclass
class ParallelPart:
    """One module run in parallel (the denoiser, the VAE decoder) with its step state and counters."""

    comm: Communicator
    installed: Installation

    def begin_run(self) -> None:
        self.comm.state.begin_run()
        self.comm.stats.reset()


@dataclass
class ParallelState:
    """Everything ``parallelize`` attached to one pipeline instance."""

    config: ParallelConfig
    original_class: type
    #: Every rank, for agreeing on the starting noise.
    world: Communicator
    #: The process groups parallelize made (shut down by unparallelize).
    groups: MeshGroups
    denoiser: nn.Module | None = None
    #: The strategy within each batch half and its part; None for the cfg split alone.
    strategy: Strategy | None = None
    strategy_part: ParallelPart | None = None
    cfg_part: ParallelPart | None = None
    decoder_part: ParallelPart | None = None
    #: The model as the last call (or ``install``) left it, on this rank (``runtime.model_watch``).
    model: Snapshot | None = None
    #: False once removed for a model that changed, until installed on it again.
    installed: bool = False
    #: The weights' checksums, recomputed only for tensors written since the last call.
    sums: SumCache = field(default_factory=SumCache)
    #: The failure of a call that lost a peer rank: its process groups are broken, so later calls fail at once.
    lost: PeerFailure | None = None
    #: With ``strategy="auto"``: what it picked and why (:func:`plan_of`).
    choice: object | None = None
    #: The step caches on the denoiser, adapted to the ranks (``paradiff.caches``); None: no cache.
    caches: Installation | None = None
    #: One rank's device memory, the smallest over the ranks (None: not known, calls are not checked against it).
    memory_bytes: float | None = None
    #: The call shapes (``plan.memory_fit.shape_key``) already found to fit.
    fitting_shapes: set = field(default_factory=set)
    #: With ``fidelity_floor_db``: the staleness guard and the hook that consults it; None without one.
    guard: StalenessGuard | None = None
    guard_hook: Installation | None = None
    #: The guard's calibrated thresholds, by call shape and steps (``paradiff.fidelity_floor``).
    thresholds: dict = field(default_factory=dict)

    def install(self, pipe) -> None:
        """Install the strategy, the CFG split and the banded decode on the pipeline's model as it is now."""
        config, groups = self.config, self.groups
        self.denoiser = denoiser = find_denoiser(pipe)
        strategy_cls = strategy_class(config.strategy)
        family = family_of(denoiser, any_model=strategy_cls.model_agnostic)
        scale = vae_scale_factor(pipe)
        self.strategy = self.strategy_part = self.cfg_part = self.decoder_part = None
        if groups.strategy is not None:
            self.strategy = strategy_cls(config.options, groups)
            comm = Communicator(groups.strategy, StepState(config.warmup_steps))
            if config.fidelity_floor_db is not None and strategy_cls.uses_warmup:
                self.guard = comm.state.guard = StalenessGuard(comm)
            self.strategy_part = ParallelPart(comm, self.strategy.install(denoiser, family, comm, scale))
        if groups.cfg is not None:  # installed last, so its hook wraps the strategy's
            exact = _exact_communicator(groups.cfg)
            self.cfg_part = ParallelPart(exact, CfgStrategy(groups=groups).install(denoiser, family, exact, scale))
        if self.guard is not None and strategy_cls.refreshes == "per call":  # outside the split's hook
            self.guard_hook = Installation(denoiser, "guard")
            self.guard_hook.hook(denoiser, RefreshHook(family, self.guard))
            self.guard_hook.done()
        decoder = getattr(getattr(pipe, "vae", None), "decoder", None)
        if config.parallel_vae and isinstance(decoder, nn.Module):
            self.decoder_part = _parallel_decoder(decoder, _exact_communicator(groups.world), scale)
        tokens = self.strategy_part.comm if self.strategy_part and strategy_cls.call_split == "tokens" else None
        self.caches = adapt_caches(denoiser, tokens, self.cfg_part.comm if self.cfg_part else None)
        self.model = snapshot(pipe, self.per_rank, self.sums)
        self.installed = True

    def remove(self) -> None:
        """Undo :meth:`install` (hooks, processors, freed parameters)."""
        if self.caches is not None:
            self.caches.remove()
            self.caches = None
        if self.guard_hook is not None:
            self.guard_hook.remove()
        self.guard = self.guard_hook = None
        for part in reversed(self.parts):
            part.comm.state.begin_run()
            part.installed.remove()
        self.strategy_part = self.cfg_part = self.decoder_part = None
        self.installed = False

    def cannot_follow(self) -> str:
        """Why a change of the model is refused under a strategy that cannot follow one, and what to do."""
        return (
            f"strategy='{self.config.strategy}' cannot follow it (each rank holds only its stage of the blocks); "
            "call paradiff.unparallelize(pipe) before changing the model, then parallelize it again"
        )

    def per_rank(self) -> set[int]:
        """``id`` of the tensors whose content differs between ranks by design (each rank's stage of blocks)."""
        return {tensor for part in self.parts for tensor in part.installed.per_rank()}

    def follow(self, pipe) -> None:
        """Agree with the other ranks on the model as it is now; re-install on it if layers were replaced since the
        last call, or refuse where the strategy cannot follow or no longer runs the model."""
        now = snapshot(pipe, self.per_rank, self.sums)
        changed = changes(self.model, now)
        described = {**now.description, "changed since the last call": "; ".join(changed.kinds) or "nothing"}
        agree(described, self.world, "the pipeline's model", SAME_MODEL)
        if changed.replaced or not self.installed:
            what = "; ".join(changed.said)
            if not strategy_class(self.config.strategy).follows_model_changes:
                raise ParadiffError(f"the model changed after parallelize() ({what}), and {self.cannot_follow()}")
            self.remove()
            self.groups.reopen_tags()
            with _original_class(pipe, self.original_class):  # the checks read the pipeline's own class
                try:
                    check_parallelize(pipe, world_size=self.world.size, config=self.config)
                    self.install(pipe)
                except ParadiffError as error:
                    raise ParadiffError(f"the model changed after parallelize() ({what}), and {error}") from None
        else:
            self.model = now

    @property
    def parts(self) -> list[ParallelPart]:
        """Installed parts, in installation order."""
        parts = (self.strategy_part, self.cfg_part, self.decoder_part)
        return [part for part in parts if part is not None]

    def call(self, pipe, stock_call, args: tuple, kwargs: dict):
        if self.lost is not None:
            raise PeerFailure(f"an earlier call lost a rank, so this pipeline cannot run any more: {self.lost}")
        try:
            return self._call(pipe, stock_call, args, kwargs)
        except PeerFailure as failure:
            self.lost = failure
            raise

    def _call(self, pipe, stock_call, args: tuple, kwargs: dict):
        call = describe_call(inspect.signature(stock_call), pipe, args, kwargs)
        agree(call, self.world, "the call's arguments", "pass the same arguments to pipe(...) on every rank")
        self.follow(pipe)
        if self.strategy is not None and kwargs.get("height") and not _may_resize(stock_call, kwargs):
            degree = self.strategy_part.comm.size
            self.strategy.check_height(self.denoiser, degree, kwargs["height"], vae_scale_factor(pipe))
        self.check_memory(pipe, stock_call, args, kwargs)
        if self.guard is not None:
            self.guard.threshold_db = self.threshold(pipe, stock_call, args, kwargs)
        return self._run(pipe, stock_call, args, kwargs)

    def _run(self, pipe, stock_call, args: tuple, kwargs: dict):
        """One run of the stock call on the ranks, the call's arguments checked and agreed."""
        kwargs = agree_on_noise(kwargs, self.world)
        for part in self.parts:
            part.begin_run()
        steering = self.strategy_part.installed.steer(pipe) if self.strategy_part else contextlib.nullcontext()
        inside = self.parts[0].comm.failures_named("a transfer of diffusers' own code")  # its context parallelism
        lost_a_rank = False
        try:
            with steering, inside:
                return stock_call(pipe, *args, **kwargs)
        except PeerFailure:
            lost_a_rank = True  # transfers to a lost rank never end: nothing to drain
            raise
        finally:
            if not lost_a_rank:
                self.drain()

    def check_memory(self, pipe, stock_call, args: tuple, kwargs: dict) -> None:
        """Refuse a call of a new shape whose setting would not fit in a rank's device memory (every rank alike:
        the arguments and the memory figure are agreed)."""
        key = shape_key(kwargs)
        if self.memory_bytes is None or key in self.fitting_shapes:
            return
        with _original_class(pipe, self.original_class), untouched_generators(pipe, kwargs):
            refusal = call_refusal(pipe, stock_call, args, kwargs, self.config, self.world.size, self.memory_bytes)
        if refusal is not None:
            raise ParadiffError(refusal)
        self.fitting_shapes.add(key)

    def threshold(self, pipe, stock_call, args: tuple, kwargs: dict) -> float:
        """The guard's threshold for this call's shape and steps: known, kept from an earlier process (rank 0's
        cache, agreed), or calibrated now on the call itself (``paradiff.fidelity_floor``)."""
        steps = call_steps(stock_call, kwargs)
        shape = (shape_key(kwargs), steps)
        if shape in self.thresholds:
            return self.thresholds[shape]
        config = self.config
        key = cache_key(
            self.model.description, shape, steps, config.as_options(), self.world.size, config.fidelity_floor_db
        )
        kept = self.world.all_gather_object(kept_calibration(key) if self.world.rank == 0 else None)[0]
        installed = self.strategy_part.installed  # a guard comes with a strategy part
        if kept is not None and installed.adopt(kept.layout):
            threshold = kept.threshold_db
        else:

            def run(threshold: float | None):
                return self._calibration_run(pipe, stock_call, args, kwargs, threshold)

            start = time.perf_counter()
            calibration = calibrate(
                run, config.fidelity_floor_db, lambda psnr_db: self.world.all_gather_object(psnr_db)[0]
            )
            self.guard.calibrated = (calibration.runs, time.perf_counter() - start)
            if self.world.rank == 0:
                remember(key, calibration, installed.layout())
            threshold = calibration.threshold_db
        self.thresholds[shape] = threshold
        return threshold

    def _calibration_run(self, pipe, stock_call, args: tuple, kwargs: dict, threshold: float | None):
        """The call's images (in [0, 1]) and the guard's counters, the guard at ``threshold``; no callbacks run, and
        the caller's generators are left as they were."""
        self.guard.threshold_db = threshold
        kwargs = {key: value for key, value in kwargs.items() if key not in CALIBRATION_LEFT_OUT}
        with untouched_generators(pipe, kwargs):
            output = self._run(pipe, stock_call, args, {**kwargs, "output_type": "np", "return_dict": False})
        return np.asarray(output[0], dtype=np.float64), dataclasses.asdict(self.guard.counters)

    def drain(self) -> None:
        for part in self.parts:
            part.comm.state.drain()


@dataclass
class AutoState:
    """``strategy="auto"`` until its first call, which plans itself and installs the strategy it picks."""

    fidelity: str
    options: dict
    original_class: type

    def call(self, pipe, stock_call, args: tuple, kwargs: dict):
        warmup = self.options.get("warmup_steps", default_warmup(self.options))
        auto_class, pipe.__class__ = pipe.__class__, self.original_class  # the checks read the pipeline's own class
        try:
            choice = choose(pipe, stock_call, args, kwargs, self.fidelity, warmup)
        except BaseException:
            pipe.__class__ = auto_class
            raise
        del pipe._paradiff
        options = {**choice.prediction.parallelize_options(), "warmup_steps": warmup, **self.options}
        parallelize(pipe, **options)  # the warm-up asked (or the default the plan was made with) wins
        pipe._paradiff.choice = choice
        return pipe._paradiff.call(pipe, stock_call, args, kwargs)


#: What ``strategy="auto"`` takes: the shared options but the CFG split, which it decides, and ``fidelity``.
AUTO_OPTIONS = ("fidelity", *(name for name in SHARED_OPTIONS if name != "cfg_parallel"))


def _parallelize_auto(pipe, options: dict):
    unknown = sorted(set(options) - set(AUTO_OPTIONS))
    if unknown:
        raise ParadiffError(f"strategy='auto' takes {', '.join(AUTO_OPTIONS)}; got {', '.join(unknown)}")
    fidelity = options.pop("fidelity", "exact")
    check_fidelity(fidelity)
    ParallelConfig("parastep", **options)  # the shared options' own checks
    if isinstance(getattr(pipe, "_paradiff", None), (ParallelState, AutoState)):
        raise ParadiffError("this pipeline is already parallelized; call paradiff.unparallelize(pipe) first")
    if env_world_size() == 1:
        return pipe
    check_auto(find_denoiser(pipe))
    ensure_process_group(timedelta(seconds=options.get("timeout_s", SHARED_OPTIONS["timeout_s"])))
    pipe._paradiff = AutoState(fidelity, options, type(pipe))
    pipe.__class__ = _parallel_class(type(pipe))
    return pipe


def plan_of(pipe):
    """What ``strategy="auto"`` picked for ``pipe`` and why: a :class:`paradiff.plan.auto.Choice` (``.reason``,
    ``.prediction``, ``.plan``), known once the first call has run."""
    state = getattr(pipe, "_paradiff", None)
    if isinstance(state, AutoState):
        raise ParadiffError("strategy='auto' picks its strategy at the first call; call pipe(...) first")
    if not isinstance(state, ParallelState) or state.choice is None:
        raise ParadiffError("paradiff.plan_of(pipe) needs a pipeline parallelized with strategy='auto'")
    return state.choice


def _parallel_call(cls: type):
    """The ``__call__`` of ``cls``'s per-instance subclass: routes ``pipe(...)`` through the pipeline's state, and
    keeps ``cls.__call__``'s name, docstring and signature (``inspect.signature`` still lists its arguments)."""

    @functools.wraps(cls.__call__)
    def __call__(self, *args, **kwargs):
        return self._paradiff.call(self, self._paradiff.original_class.__call__, args, kwargs)

    return __call__


#: The pipeline's own methods that replace or rewrite the model's layers: under a strategy that cannot follow such
#: a change they are refused before they run (on a stage's freed weights diffusers and peft fail half-way).
MODEL_CHANGES = (
    "load_lora_weights",
    "unload_lora_weights",
    "fuse_lora",
    "unfuse_lora",
    "delete_adapters",
    "fuse_qkv_projections",
    "unfuse_qkv_projections",
)


def _model_change(cls: type, name: str):
    @functools.wraps(getattr(cls, name))
    def change(self, *args, **kwargs):
        state = self._paradiff
        if isinstance(state, ParallelState) and not strategy_class(state.config.strategy).follows_model_changes:
            raise ParadiffError(f"pipe.{name}() changes the model, and {state.cannot_follow()}")
        return getattr(state.original_class, name)(self, *args, **kwargs)

    return change


_SUBCLASSES: dict[type, type] = {}


@contextlib.contextmanager
def _original_class(pipe, original: type):
    """Inside, ``pipe`` is of its own class again (whose ``__call__`` the checks read)."""
    parallel, pipe.__class__ = pipe.__class__, original
    try:
        yield pipe
    finally:
        pipe.__class__ = parallel


def _parallel_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        guarded = {name: _model_change(cls, name) for name in MODEL_CHANGES if hasattr(cls, name)}
        namespace = {"__module__": cls.__module__, "__call__": _parallel_call(cls), **guarded}
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return _SUBCLASSES[cls]


def _may_resize(stock_call, kwargs: dict) -> bool:
    """Whether the pipeline may change the requested size itself (PixArt's resolution binning).

    Then only the denoiser's own check, on the size it really gets, can tell whether the bands align.
    """
    binning = inspect.signature(stock_call).parameters.get("use_resolution_binning")
    return binning is not None and kwargs.get("use_resolution_binning", binning.default) is True


def parallelize(pipe, strategy: str = "patch", config: ParallelConfig | None = None, **options):
    """Make ``pipe(...)`` run on every rank of the current torch.distributed world.

    Call it on every rank (e.g. under ``torchrun``), then call ``pipe(...)`` as on one device: every
    rank returns the full, identical result. Creates the process group from the torchrun environment
    if none exists (gloo on CPU, NCCL on CUDA with the device chosen by ``LOCAL_RANK``). With one rank
    it returns the pipeline unchanged. Options are the fields of :class:`ParallelConfig`.

    ``strategy="auto"`` (options ``fidelity`` — ``"exact"``, the default, or ``"displaced"`` — ``warmup_steps``,
    ``timeout_s``, ``parallel_vae``): the first call plans itself with its own arguments (a few seconds of
    timing on every rank, :mod:`paradiff.plan.auto`) and runs under the fastest predicted strategy, with the CFG
    split where it pays; :func:`plan_of` says which and why.
    """
    if strategy == "auto" and config is None:
        return _parallelize_auto(pipe, options)
    config = config or ParallelConfig.from_options(strategy, options)
    if isinstance(getattr(pipe, "_paradiff", None), (ParallelState, AutoState)):
        raise ParadiffError("this pipeline is already parallelized; call paradiff.unparallelize(pipe) first")
    world_size = env_world_size()
    try:
        check_parallelize(pipe, world_size=world_size, config=config)
        refusal = None
    except ParadiffError as error:
        if world_size == 1 or not can_join_world():
            raise
        refusal = error  # raised once the ranks agree on what they run: a rank that differs is named instead
    if world_size == 1:
        return pipe
    memory = memory_setting_bytes(config.device_memory, local_device())
    timeout = timedelta(seconds=config.timeout_s)
    ensure_process_group(timeout)
    start_heartbeat()
    meet_every_rank("parallelize()", timeout)
    everyone = RankGroup.world(timeout)
    setup = describe_setup(pipe, config.as_options(), loaded_stage)
    setup["step caches"] = describe_caches(find_denoiser(pipe))
    agree(setup, _exact_communicator(everyone), "what parallelize() runs", SAME_SETUP)
    if refusal is not None:
        raise refusal
    groups = build_mesh(*config.degrees(world_size), everyone)
    device = local_device()
    if device.type == "cuda" and find_denoiser(pipe).device != device:
        pipe.to(device)
    state = ParallelState(config, type(pipe), _exact_communicator(groups.world), groups)
    state.memory_bytes = smallest_over_ranks(memory, groups.world.group)
    state.install(pipe)
    pipe._paradiff = state
    pipe.__class__ = _parallel_class(type(pipe))
    return pipe


def _parallel_decoder(decoder: nn.Module, comm: Communicator, vae_scale_factor: int) -> ParallelPart:
    """The VAE decoder in row bands over every rank (exact) where a family describes it and its attention has no
    fused QKV projections to cut; else on rank 0 alone, its output broadcast (``paradiff.layers.decode_broadcast``)."""
    family = decoder_family_of(decoder)
    fused = any(getattr(module, "fused_projections", False) for module in decoder.modules())
    if family is not None and not fused:  # fused QKV projections cannot be cut into bands: decoded whole
        return ParallelPart(comm, PatchStrategy().install(decoder, family, comm, vae_scale_factor))
    installed = Installation(decoder, "decode")
    installed.hook(decoder, DecodeOnOneRankHook(comm))
    return ParallelPart(comm, installed.done())


def _exact_communicator(ranks) -> Communicator:
    """A communicator whose every step exchanges fresh data (the CFG split, the VAE decode, the noise agreement)."""
    return Communicator(ranks, StepState(warmup_steps=sys.maxsize))


def unparallelize(pipe):
    """Undo :func:`parallelize` on this instance: hooks, processors and class are restored, and the process
    groups it made are shut down (the default group stays).

    Call it on every rank, as ``parallelize``: with ``strategy="pipefusion"`` it is a collective (each
    stage's blocks come back from the rank that kept them).
    """
    state = getattr(pipe, "_paradiff", None)
    if isinstance(state, AutoState):
        pipe.__class__ = state.original_class
        del pipe._paradiff
        return pipe
    if not isinstance(state, ParallelState):
        return pipe
    state.remove()
    if state.lost is None:  # a lost peer's groups are broken: shutting them down could wait on it
        state.groups.destroy()
    pipe.__class__ = state.original_class
    del pipe._paradiff
    return pipe


def comm_stats(pipe) -> dict:
    """Communication counters of the last ``pipe(...)`` call: bytes per step, waits, exchange counts.

    The denoiser's counters include the cfg split's output gathers (``cfg_gathers``, their bytes and waits).
    With ``strategy="pipefusion"`` they also hold ``idle_share``: the share of the denoiser calls' time
    this rank waited for another stage (the pipeline's bubble), overall and per step. With ``fidelity_floor_db``,
    ``guard`` holds what the staleness guard decided (``runtime.staleness.GuardCounters``). ``layout`` holds the
    choices the strategy made at run time that change the picture, as the options that make them again
    (``asyncdiff``'s measured cut), where it made any.
    """
    state = getattr(pipe, "_paradiff", None)
    if isinstance(state, AutoState):
        raise ParadiffError("strategy='auto' picks its strategy at the first call; call pipe(...) first")
    if not isinstance(state, ParallelState):
        raise ParadiffError("this pipeline is not parallelized")
    denoiser_parts = [part for part in (state.strategy_part, state.cfg_part) if part is not None]
    summary = CommStats.combined(*(part.comm.stats for part in denoiser_parts)).summary()
    if state.decoder_part is not None:
        summary["vae_decode_bytes"] = state.decoder_part.comm.stats.total().bytes_sent
    layout = state.strategy_part.installed.layout() if state.strategy_part is not None else {}
    if layout:
        summary["layout"] = layout
    return summary
