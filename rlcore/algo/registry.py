"""Policy losses and advantage estimators by name, as engines are (:mod:`rlcore.engine.registry`).

``algo.loss`` selects a :class:`LossSpec` and ``algo.name`` an :class:`EstimatorSpec`: a
built-in name below, a name added with :func:`register_loss` / :func:`register_estimator`, or an
import path ``package.module:attr`` naming a function (or a spec) outside the package. A path is
imported in every process that uses it (the driver computes the advantages and the loss
normaliser, every trainer rank the loss), so it must be importable on the whole cluster; a name
registered at run time exists only in the process that registered it.

Built-in functions are named by import path, so this module, and config validation with it,
stays free of torch; they are imported only where a loss or an estimator runs. The contract of
a loss function is in :mod:`rlcore.algo.surrogates`, that of an estimator in
:mod:`rlcore.algo.advantages`.

A new built-in loss is its surrogate in ``rlcore/algo/surrogates.py`` and one line in
``_BUILT_IN_LOSSES``; one with options of its own adds their dataclass and the ``AlgoConfig``
field ``algo.<name>`` in the config schema, and checks them in its ``problems``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass, fields
from typing import Any, Callable

from rlcore.algo.checks import Problem, at_least, clip_eps
from rlcore.config import AlgoConfig, CispoOptions, DapoOptions, DrGrpoOptions, GspoOptions

Normalizer = Callable[[AlgoConfig, int, int, int], float]
"""``(cfg, num_tokens, num_samples, max_new_tokens) -> normalizer`` over the global batch."""


class SpecError(ValueError):
    """A name or path that selects no loss / estimator; ``str()`` is ``KEY: message``."""

    def __init__(self, key: str, message: str):
        self.problem: Problem = (key, message)
        super().__init__(f"{key}: {message}")


def token_count(cfg: AlgoConfig, num_tokens: int, num_samples: int, max_new_tokens: int) -> float:
    """Token mean: the number of loss tokens in the global batch."""
    return num_tokens


def sample_count(cfg: AlgoConfig, num_tokens: int, num_samples: int, max_new_tokens: int) -> float:
    """Sequence mean: the number of samples in the global batch."""
    return num_samples


def dr_grpo_constant(cfg: AlgoConfig, num_tokens: int, num_samples: int, max_new_tokens: int) -> float:
    """``num_samples * L``, ``L = algo.dr_grpo.max_tokens`` or, when that is 0, ``max_new_tokens``:
    a constant that does not depend on the samples' lengths."""
    per_sample = cfg.dr_grpo.max_tokens or max_new_tokens
    if per_sample <= 0:
        raise ValueError("algo.loss=dr_grpo needs algo.dr_grpo.max_tokens or max_new_tokens > 0")
    return num_samples * per_sample


@dataclass(frozen=True)
class LossSpec:
    """One policy loss: what ``algo.loss`` selects."""

    name: str
    """The ``algo.loss`` value (for a spec reached by import path: informative only)."""
    surrogate: str | Callable[..., Any]
    """Its per-token surrogate (contract: :mod:`rlcore.algo.surrogates`), or ``module:function``
    naming it (imported only where the loss runs)."""
    normalizer: Normalizer = token_count
    """Divisor of the summed loss over the global batch, the same on every micro-batch and rank."""
    per_sequence: bool = False
    """Aggregation weight ``1/|y_i|``: a sample's tokens add up to one sequence term (needs
    ``LossInputs.sample_index``); False sums over tokens."""
    options: type | None = None
    """Dataclass of its own section ``algo.<name>`` (an ``AlgoConfig`` field); None: it reads only
    the shared ``algo.*`` keys."""
    problems: Callable[[AlgoConfig], list[Problem]] | None = None
    """Its config checks as ``(key, message)``; run on every config, whichever loss is selected
    (a check that matters only when it is selected tests ``cfg.loss`` itself)."""


@dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator: what ``algo.name`` selects."""

    name: str
    """The ``algo.name`` value."""
    estimate: str | Callable[..., Any]
    """``(rewards [G, n], cfg) -> advantages [G, n]`` (contract: :mod:`rlcore.algo.advantages`),
    or ``module:function`` naming it."""
    problems: Callable[[AlgoConfig], list[Problem]] | None = None
    """Its config checks as ``(key, message)``, run on every config."""


def imported(path: str, key: str) -> Any:
    """The object ``module:attr`` names; :class:`SpecError` naming ``key`` when there is none."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise SpecError(key, f"{path!r} is not an import path; give module:function")
    try:
        found = importlib.import_module(module)
    except Exception as exc:  # a user's module: whatever its import raises is the answer
        raise SpecError(key, f"cannot import {module!r} ({type(exc).__name__}: {exc})") from None
    if not hasattr(found, attr):
        raise SpecError(key, f"module {module!r} has no {attr!r}")
    return getattr(found, attr)


def function(ref: str | Callable[..., Any], key: str) -> Callable[..., Any]:
    """``ref`` itself, or the function its import path names."""
    return imported(ref, key) if isinstance(ref, str) else ref


_LOSSES: dict[str, LossSpec] = {}
_ESTIMATORS: dict[str, EstimatorSpec] = {}


def register_loss(spec: LossSpec) -> LossSpec:
    """Add (or replace) a loss by name; returns ``spec``. A spec with ``options`` needs the
    ``AlgoConfig`` field ``algo.<name>`` of that dataclass (sections are static in the schema)."""
    if ":" in spec.name:
        raise ValueError(f"loss {spec.name!r}: a registered name has no ':' (that is an import path)")
    if spec.options is not None:
        section = {f.name: f.default_factory for f in fields(AlgoConfig)}.get(spec.name)
        if section is not spec.options:
            raise ValueError(
                f"loss {spec.name!r}: options {spec.options.__name__} need the AlgoConfig field "
                f"algo.{spec.name}: {spec.options.__name__} in the config schema"
            )
    _LOSSES[spec.name] = spec
    return spec


def register_estimator(spec: EstimatorSpec) -> EstimatorSpec:
    """Add (or replace) an advantage estimator by name; returns ``spec``."""
    if ":" in spec.name:
        raise ValueError(f"estimator {spec.name!r}: a registered name has no ':' (that is an import path)")
    _ESTIMATORS[spec.name] = spec
    return spec


def unregister_loss(name: str) -> None:
    """Remove a registered loss (a test's or a plug-in's own clean-up)."""
    _LOSSES.pop(name, None)


def unregister_estimator(name: str) -> None:
    """Remove a registered estimator (a test's or a plug-in's own clean-up)."""
    _ESTIMATORS.pop(name, None)


def _spec(
    name: str, key: str, table: dict[str, Any], kind: str, spec_type: type, wrap: Callable[[str, Any], Any], what: str
) -> Any:
    """The spec ``key=name`` selects from ``table`` (a registered name), or the one an import
    path ``module:attr`` names: a ``spec_type`` itself, or a function ``wrap`` turns into one."""
    if ":" not in name:
        if name not in table:
            raise SpecError(
                key, f"unknown {kind} {name!r}; choose one of {', '.join(table)} or give an importable module:function"
            )
        return table[name]
    found = imported(name, key)
    if isinstance(found, spec_type):
        return found
    if not callable(found):
        raise SpecError(key, f"{name!r} is a {type(found).__name__}, not {what} or {spec_type.__name__}")
    return wrap(name, found)


def loss_spec(name: str) -> LossSpec:
    """The spec ``algo.loss=name`` selects: a registered name, or ``module:attr`` naming a
    :class:`LossSpec` or a surrogate (then a token-mean spec named by the path)."""
    return _spec(name, "algo.loss", _LOSSES, "loss", LossSpec, LossSpec, "a loss function")


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec ``algo.name=name`` selects: a registered name, or ``module:attr`` naming an
    :class:`EstimatorSpec` or an estimator function."""
    return _spec(
        name, "algo.name", _ESTIMATORS, "advantage estimator", EstimatorSpec, EstimatorSpec, "an estimator function"
    )


def is_per_sequence(loss: str) -> bool:
    """Whether ``algo.loss=loss`` weighs each sample as one sequence term (False when it selects
    no loss: that is reported as ``algo.loss``'s own problem)."""
    try:
        return loss_spec(loss).per_sequence
    except SpecError:
        return False


def _takes(key: str, fn: Callable[..., Any], params: str, count: int, options: dict[str, Any]) -> list[Problem]:
    """A problem when ``fn`` cannot be called with ``count`` positional arguments and the
    keyword arguments ``options``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: its arguments are not known
        return []
    try:
        signature.bind(*range(count))
    except TypeError:
        return [(key, f"{getattr(fn, '__qualname__', fn)!r} must take {params}, its signature is {signature}")]
    try:
        signature.bind(*range(count), **options)
    except TypeError as exc:
        return [
            (
                "algo.loss_options",
                f"{getattr(fn, '__qualname__', fn)!r}{signature} does not take {sorted(options)} ({exc})",
            )
        ]
    return []


def _selected(
    key: str,
    resolve: Callable[[str], Any],
    name: str,
    attr: str,
    params: str,
    count: int,
    options: dict[str, Any] | None = None,
) -> list[Problem]:
    """Whether ``name`` resolves to a spec, and whether its function, when already imported (a
    path names it), takes ``params``. A function named by a string is only looked for (its
    module found, not run), so a built-in name keeps validation free of torch."""
    try:
        ref = getattr(resolve(name), attr)
    except SpecError as exc:
        return [exc.problem]
    if not isinstance(ref, str):
        return _takes(key, ref, params, count, options or {})
    module = ref.partition(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package that is missing or broken
        found = None
    return [] if found is not None else [(key, f"{name!r} names {ref!r}, but there is no module {module!r}")]


def loss_problems(cfg: AlgoConfig) -> list[Problem]:
    """``algo.loss`` selects a loss whose surrogate takes ``(log_ratio, adv, cfg, ctx,
    **algo.loss_options)``; then the checks of every registered loss, and of a spec given by path."""
    selected = _selected(
        "algo.loss", loss_spec, cfg.loss, "surrogate", "(log_ratio, adv, cfg, ctx)", 4, dict(cfg.loss_options or {})
    )
    return selected + _loss_options_problems(cfg) + _checks(cfg, cfg.loss, loss_spec, _LOSSES)


def _loss_options_problems(cfg: AlgoConfig) -> list[Problem]:
    """Options are for a loss given by import path; a built-in loss has its own section."""
    if not cfg.loss_options or ":" in cfg.loss:
        return []
    return [
        (
            "algo.loss_options",
            f"options are passed to a loss given by import path (algo.loss=pkg.mod:fn); "
            f"algo.loss={cfg.loss} is built in: set its own section (algo.{cfg.loss}.*) "
            "or the shared algo.* keys",
        )
    ]


def estimator_problems(cfg: AlgoConfig) -> list[Problem]:
    """``algo.name`` selects an estimator that takes ``(rewards, cfg)``; then the checks of every
    registered estimator, and of a spec given by path."""
    return _selected("algo.name", estimator_spec, cfg.name, "estimate", "(rewards, cfg)", 2) + _checks(
        cfg, cfg.name, estimator_spec, _ESTIMATORS
    )


def _checks(cfg: AlgoConfig, name: str, resolve: Callable[[str], Any], registered: dict[str, Any]) -> list[Problem]:
    specs = list(registered.values())
    try:
        chosen = resolve(name)
    except SpecError:
        chosen = None
    if chosen is not None and registered.get(chosen.name) is not chosen:
        specs.append(chosen)
    return [problem for spec in specs if spec.problems is not None for problem in spec.problems(cfg)]


# ---- the built-in losses and estimators ----------------------------------------------------------


def _dr_grpo_problems(cfg: AlgoConfig) -> list[Problem]:
    out = at_least("algo.dr_grpo.max_tokens", cfg.dr_grpo.max_tokens, 0)
    if cfg.loss == "dr_grpo" and cfg.name == "grpo" and cfg.std_normalize:
        out.append(
            (
                "algo.std_normalize",
                "Dr.GRPO removes the std normalisation: set algo.std_normalize=false with algo.loss=dr_grpo",
            )
        )
    return out


def _dapo_problems(cfg: AlgoConfig) -> list[Problem]:
    return at_least("algo.dapo.clip_eps_high", cfg.dapo.clip_eps_high, 0.0)


def _gspo_problems(cfg: AlgoConfig) -> list[Problem]:
    return clip_eps("algo.gspo.clip_eps", cfg.gspo.clip_eps_low, cfg.gspo.clip_eps_high)


def _cispo_problems(cfg: AlgoConfig) -> list[Problem]:
    return clip_eps("algo.cispo.eps", cfg.cispo.eps_low, cfg.cispo.eps_high)


_S = "rlcore.algo.surrogates:"
_BUILT_IN_LOSSES = (
    LossSpec("ppo_clip", _S + "ppo_clip_surrogate"),
    LossSpec(
        "dr_grpo",
        _S + "dr_grpo_surrogate",
        normalizer=dr_grpo_constant,
        options=DrGrpoOptions,
        problems=_dr_grpo_problems,
    ),
    LossSpec("dapo", _S + "dapo_surrogate", options=DapoOptions, problems=_dapo_problems),
    LossSpec(
        "gspo",
        _S + "gspo_surrogate",
        normalizer=sample_count,
        per_sequence=True,
        options=GspoOptions,
        problems=_gspo_problems,
    ),
    LossSpec("cispo", _S + "cispo_surrogate", options=CispoOptions, problems=_cispo_problems),
)


_BUILT_IN_ESTIMATORS = (
    EstimatorSpec("grpo", "rlcore.algo.advantages:grpo_estimator"),
    EstimatorSpec("rloo", "rlcore.algo.advantages:rloo_estimator"),
    EstimatorSpec("reinforce_pp_baseline", "rlcore.algo.advantages:reinforce_pp_baseline_estimator"),
)

for _loss in _BUILT_IN_LOSSES:
    register_loss(_loss)
for _estimator in _BUILT_IN_ESTIMATORS:
    register_estimator(_estimator)

LOSSES = tuple(_LOSSES)
"""The built-in values of ``algo.loss``."""
ESTIMATORS = tuple(_ESTIMATORS)
"""The built-in values of ``algo.name``."""
