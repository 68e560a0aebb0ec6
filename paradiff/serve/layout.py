"""The ranks' layout per request: which ``parallelize`` setting the pipeline runs under, switched only when needed.

A request names a strategy, or ``auto``: the fastest exact setting for its shape (size, frames, steps, the
pictures per call, guidance on or off), or the fastest of all with ``fidelity="displaced"``. The first request
of a shape runs ``strategy="auto"``, which plans from that very call (a few seconds of timing on every rank);
what it picked (``paradiff.plan_of``) is kept for the shape, so later requests of it run that setting at once.

Switching is ``unparallelize`` then ``parallelize``: an exact undo and redo (hooks, processors and class
restored, the old process groups shut down), tens of milliseconds on the built-in models; a request whose
setting is the current one switches nothing. Rank 0 decides the setting (:meth:`Layout.setting_for`) and
hands it out with the batch; every rank applies it alike (:meth:`Layout.apply`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .jobs import Request

#: The keywords of a ``parallelize`` call, as sorted ``(name, value)`` pairs; empty: the pipeline as loaded.
Options = tuple


@dataclass(frozen=True)
class Setting:
    """What a batch runs under: ``parallelize``'s keywords, a label and why (filled in after an ``auto`` plan)."""

    options: Options
    label: str
    why: str

    @property
    def plans(self) -> bool:
        """Whether the call plans itself (``auto``, the first request of its shape)."""
        return dict(self.options).get("strategy") == "auto"


def label_of(options: dict) -> str:
    """``patch, warm-up 4``, ``cfg``, ``one device``: a setting as a reply names it."""
    from ..plan.costs import always_exact

    if not options:
        return "one device"
    name = options["strategy"]
    shown = {key: value for key, value in options.items() if key not in ("strategy", "warmup_steps")}
    extra = "".join(  # no cfg_parallel=False; a floor of 30.0 dB reads 30
        f" {key}={value:g}" if isinstance(value, float) else f" {key}={value}"
        for key, value in shown.items()
        if value is not False
    )
    warmup = "" if name == "auto" or always_exact(name) else f", warm-up {options['warmup_steps']}"
    return f"{name}{extra}{warmup}"


def _items(options: dict) -> Options:
    return tuple(sorted(options.items()))


class Layout:
    def __init__(self, pipe, nproc: int, timeout_s: float, default_strategy: str):
        self.pipe, self.nproc, self.timeout_s, self.default_strategy = pipe, nproc, timeout_s, default_strategy
        self.current: Options = ()
        #: What ``auto`` picked per request shape: the setting and why (rank 0's decisions).
        self.plans: dict[tuple, tuple[Options, str]] = {}

    @staticmethod
    def _plan_key(request: Request) -> tuple:
        return (*request.shape, request.fidelity, request.warmup, request.floor)

    @staticmethod
    def _floor(request: Request) -> dict:
        """The staleness guard's keyword for ``request``: its floor, held by whatever setting runs it."""
        return {} if request.floor is None else {"fidelity_floor_db": request.floor}

    def setting_for(self, request: Request, asked: bool) -> Setting:
        """The setting ``request`` runs under (rank 0); ``asked``: the request named its strategy."""
        if self.nproc == 1:
            return Setting((), "one device", "one rank: the pipeline runs as loaded")
        if request.strategy == "auto":
            known = self.plans.get(self._plan_key(request))
            if known is not None:
                options, why = known
                return Setting(options, label_of(dict(options)), f"{why} (planned at an earlier request of this shape)")
            options = {
                "strategy": "auto",
                "fidelity": request.fidelity,
                "warmup_steps": request.warmup,
                **self._floor(request),
            }
            return Setting(_items(options), "auto", "")
        options = {"strategy": request.strategy, "warmup_steps": request.warmup, **self._floor(request)}
        why = "the request asked for it" if asked else f"the server's default (--strategy {self.default_strategy})"
        return Setting(_items(options), label_of(options), why)

    def apply(self, setting: Setting) -> None:
        """Lay the pipeline out for ``setting`` (every rank alike); nothing when it is the current one."""
        import paradiff

        if setting.options == self.current:
            return
        paradiff.unparallelize(self.pipe)
        self.current = ()
        if setting.options:
            paradiff.parallelize(self.pipe, **dict(setting.options), timeout_s=self.timeout_s)
        self.current = setting.options

    def learn(self, request: Request, setting: Setting) -> Setting:
        """After a call that planned itself: keep what ``auto`` picked for the request's shape; the setting it ran."""
        import paradiff

        choice = paradiff.plan_of(self.pipe)
        picked = {**choice.prediction.parallelize_options(), **self._floor(request)}  # auto ran its pick guarded
        self.current = _items(picked)
        self.plans[self._plan_key(request)] = (self.current, choice.reason)
        return Setting(self.current, label_of(picked), choice.reason)
