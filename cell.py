"""What runs: one record, ``Cell``, from which every other shape of a configuration is derived.

A configuration used to be spelled once per consumer (the fuzz cell, the command line's flags,
the probe configuration of ``flow``, the fuzzer's per-run ``Config``, the verdict table's tuples,
the fuzz command's name for it), copied between them by matching names. Here it is spelled once:
each field of ``Cell`` carries, in its metadata, how the command line offers it (``Flag``) and how
a cell names a value other than its default (``Flag.shown``). What is derived from it:

- the spec's ``Config`` (``Cell.config``: the cell's fields that are ``Config`` fields, plus what
  a run draws or fixes beside them: geometry, budgets);
- the command line's options (``add_arguments``) and the cell a parsed command line asks for
  (``Cell.from_args``);
- a cell's name (``Cell.name``: ``kvspec fuzz``'s verdict line, the verdict table's rows,
  ``Cell.features``);
- the results of running one (``OfCell``: a result carries its cell and answers for its fields).

The trace header is derived from the spec's ``Config`` itself (``conformance/trace.py``), and the
reference engine's ``EngineConfig`` too (``conformance/adapter.py``'s ``engine_config``): a field
added to ``Config`` reaches both with no edit there. A field added here with its ``Flag`` reaches
``kvspec fuzz``'s options, the fuzzer's runs, the trace and the verdict row in one edit
(``tests/test_cell.py`` adds one and follows it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvspec.conformance.budget import MAX_DEPTH
from kvspec.spec import DISCIPLINES, POLICIES, PREEMPTIONS, STALE_OUTPUTS, Config

NAMED_APART = ("policy", "discipline", "preemption", "depth", "loads")
"""Fields that a cell's name and the verdict table say in places of their own."""

FUZZ, SIMULATE = "fuzz", "simulate"
"""The commands whose options are a cell's (``kvspec prove`` has its own sizes: ``cli.py``)."""


@dataclass(frozen=True)
class Flag:
    """How the command line offers one field of a cell."""

    option: str
    """The option's spelling, e.g. ``--spec-tokens``."""
    help: str
    commands: tuple[str, ...] = (FUZZ, SIMULATE)
    """The commands that offer it; the others run the field's default."""
    argparse: Mapping[str, Any] = field(default_factory=dict)
    """``add_argument``'s other keywords (type, choices, action, metavar)."""
    shown: Callable[[Any], str] | None = None
    """How the cell's name says a value other than the default (None: not said, or said by a
    column of its own, ``NAMED_APART``)."""
    kept: bool = True
    """An engine must run the value asked (a ``Config`` field): an adapter whose own config
    (``adapter.config``) says otherwise does not run the flag, and fuzzing it is refused by
    name (``flow.probe_target``), never run as if it did. False for the fields an adapter may
    settle itself."""


def _setting(default: Any, flag: Flag) -> Any:
    """A field of ``Cell``: its default and its ``Flag``."""
    return field(default=default, metadata={"flag": flag})


def number(kind: type, low: float = 0.0, high: float | None = None) -> Callable[[str], object]:
    """An argparse type: a finite ``kind`` > ``low`` (>= when ``high`` is given), <= ``high``."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> object:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if high is not None:
            if not low <= value <= high:
                raise argparse.ArgumentTypeError(f"must be {low:g}..{high:g}, got {text!r}")
        elif value <= low:
            raise argparse.ArgumentTypeError(f"must be > {low:g}: {text!r}")
        return value

    return parse


@dataclass(frozen=True)
class Cell:
    """What is run: a registration policy, a scheduling discipline and preemption, the steps in
    flight (None: drawn 1 to 3, or 2 to 3 when steps overlap), whether external KV loads happen
    (some failing), async scheduling (decodes on placeholder tokens; None: drawn per run), what
    becomes of a preempted request's output still in flight (``docs/async.md``; None: drawn),
    whether the pool caches prefixes at all (``Config.prefix_caching``), the draft tokens per
    decode (``spec_tokens``, speculative decoding) and a sliding window (``sliding_window``).
    A new field is one line here, with its ``Flag``; a field named as a ``Config`` field reaches
    the spec's configuration of every run."""

    policy: str = field(
        metadata={
            "flag": Flag(
                "--policy",
                "registration policy (README)",
                argparse={"required": True, "choices": tuple(POLICIES)},
                kept=False,
            )
        }
    )
    discipline: str = _setting(
        "vllm",
        Flag(
            "--discipline",
            "scheduling discipline",
            argparse={"choices": DISCIPLINES},
            kept=False,
        ),
    )
    preemption: str = _setting(
        "fcfs",
        Flag("--preemption", "preemption order", argparse={"choices": PREEMPTIONS}, kept=False),
    )
    depth: int | None = _setting(
        None,
        Flag(
            "--depth",
            f"steps in flight (1..{MAX_DEPTH}; default: drawn from 1..3 by fuzz, 1 for simulate)",
            argparse={"type": number(int, 1, MAX_DEPTH)},
            kept=False,
        ),
    )
    loads: bool = _setting(
        False,
        Flag(
            "--loads",
            "also external KV loads, some of which fail",
            commands=(FUZZ,),
            argparse={"action": "store_true"},
        ),
    )
    async_scheduling: bool | None = _setting(
        False,
        Flag(
            "--async",
            "async scheduling: schedule on placeholder tokens (vLLM's default; needs depth >= 2)",
            argparse={"action": "store_true"},
            shown=lambda value: "async" if value else "sync|async",
            kept=False,
        ),
    )
    stale_output: str | None = _setting(
        "drop",
        Flag(
            "--stale-output",
            "a preempted request's output in a submitted step: drop or deliver "
            "(vLLM's default; needs depth >= 2)",
            argparse={"choices": STALE_OUTPUTS},
            shown=lambda value: f"stale output {value}ed" if value else "stale output drawn",
            kept=False,
        ),
    )
    prefix_caching: bool = _setting(
        True,
        Flag(
            "--no-prefix-caching",
            "a pool without prefix caching (vLLM's enable_prefix_caching=False): nothing is "
            "published and nothing hits",
            argparse={"action": "store_false"},
            shown=lambda value: "no prefix caching",
            kept=False,
        ),
    )
    spec_tokens: int = _setting(
        0,
        Flag(
            "--spec-tokens",
            "speculative decoding: up to K draft tokens per decode, some rejected",
            commands=(FUZZ,),
            argparse={"metavar": "K", "type": number(int, 0, 64)},
            shown=lambda value: f"{value} draft tokens",
        ),
    )
    sliding_window: int | None = _setting(
        None,
        Flag(
            "--sliding-window",
            "one sliding-window group of W tokens (default: full attention)",
            commands=(FUZZ,),
            argparse={"metavar": "W", "type": number(int, 1, 1 << 20)},
            shown=lambda value: f"window {value}",
        ),
    )

    @property
    def overlaps(self) -> bool:
        """Whether steps in flight differ from synchronous ones (needs a depth of 2 or more)."""
        return bool(self.async_scheduling) or self.stale_output == "deliver"

    def run_depth(self) -> int:
        """The depth a single run takes: the cell's, else the smallest at which its overlap
        means something; ValueError for an explicit depth below it."""
        if self.depth is not None and self.depth < 2 and self.overlaps:
            raise ValueError("--async and --stale-output deliver need --depth >= 2")
        return self.depth or (2 if self.overlaps else 1)

    def config(self, **run: Any) -> Config:
        """The spec's ``Config`` of one run of the cell: every field of the cell that is a
        ``Config`` field (a drawn one, None, left to ``run``, else ``Config``'s default), the
        depth ``run_depth``, then ``run`` (geometry, budgets, what the run drew)."""
        settings = {
            name: getattr(self, name)
            for name in CONFIG_FIELDS
            if getattr(self, name) is not None or name in NULLABLE
        }
        if "depth" not in run:
            settings["depth"] = self.run_depth()
        return Config(**{**settings, **run})

    def probe_config(self) -> Config:
        """The small configuration an adapter is built on and checked with before fuzzing."""
        return self.config(num_blocks=8, block_size=4, stop_token=0)

    def features(self, skip: Collection[str] = NAMED_APART) -> list[str]:
        """The cell's values other than their defaults that its name says (``Flag.shown``), in
        field order, leaving out ``skip`` (fields said in columns of their own)."""
        return [
            flag.shown(getattr(self, f.name))
            for f, flag in _flags()
            if flag.shown is not None and f.name not in skip and getattr(self, f.name) != f.default
        ]

    def name(self) -> str:
        """``policy (discipline/preemption, the other values it sets)``: ``kvspec fuzz``'s name
        for the cell."""
        said = "".join(f", {word}" for word in self.features())
        return f"{self.policy} ({self.discipline}/{self.preemption}{said})"

    @classmethod
    def from_args(cls, args: argparse.Namespace, **fixed: Any) -> Cell:
        """The cell a parsed command line asks for (``add_arguments``'s options; a field the
        command does not offer keeps its default), then ``fixed``."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **fixed})


CONFIG_FIELDS = tuple(f.name for f in fields(Cell) if f.name in Config.__dataclass_fields__)
"""The cell's fields that are the spec's: they reach every run's ``Config``."""
NULLABLE = frozenset(
    name for name in CONFIG_FIELDS if Config.__dataclass_fields__[name].default is None
)
"""Config fields whose None is a value (no window), not "drawn"."""


def _flags() -> list[tuple[dataclasses.Field[Any], Flag]]:
    return [(f, f.metadata["flag"]) for f in fields(Cell) if "flag" in f.metadata]


def not_kept(asked: Config, claimed: Config) -> str | None:
    """The first ``Flag.kept`` field an engine's own ``claimed`` config does not run as
    ``asked``, said as a refusal of its option; None when it runs them all."""
    for f, flag in _flags():
        if flag.kept and f.name in CONFIG_FIELDS:
            mine, theirs = getattr(asked, f.name), getattr(claimed, f.name)
            if mine != theirs:
                return f"the engine does not run {flag.option} (its {f.name} is {theirs})"
    return None


def add_arguments(
    parser: argparse.ArgumentParser, command: str, policies: Collection[str] | None = None
) -> None:
    """The cell's options of ``command`` (each field whose ``Flag`` names it), with ``policies``
    the choices of ``--policy`` when given."""
    for f, flag in _flags():
        if command not in flag.commands:
            continue
        options = dict(flag.argparse)
        if f.name == "policy" and policies is not None:
            options["choices"] = tuple(policies)
        if options.get("action") not in ("store_true", "store_false") and "required" not in options:
            options["default"] = f.default
        parser.add_argument(flag.option, dest=f.name, help=flag.help, **options)


class OfCell:
    """A result of running a cell (``cell`` its field): it answers for the cell's fields too
    (``result.policy``), so that a field added to ``Cell`` reaches every result."""

    cell: Cell

    def __getattr__(self, name: str) -> Any:
        cell = self.__dict__.get("cell")
        if cell is None or name.startswith("__") or name not in Cell.__dataclass_fields__:
            raise AttributeError(name)
        return getattr(cell, name)
