"""Wrong ping-pong choices in SGLang's MAMBA ``extra_buffer`` (``extra.py``) that the judge must
name StateAtItsBoundary (``tests/test_sglang_mamba.py``), each planted on
``extra.FlippedScheduler`` (SGLang with the flip it misses after a prefill, which holds), so that
the finding is the plant's and not SGLang's own (``docs/adapters.md``, MAMBA ``extra_buffer``):

* ``DonateOtherSlot`` (the wrong ping-pong slot donated): ``get_mamba_ping_pong_keep_idx``
  answers the other ping-pong position than ``mamba_last_track_idx``, so an insert donates the
  slot the latest track did not write (never written, or written at an older boundary);
* ``ShortTrackKey`` (the wrong seqlen): a running insert keys the donated state one track
  interval short of ``mamba_last_track_seqlen``, the boundary the step wrote it at.

Why a module of its own: ``mutants.py`` plants on the plain, SWA and no_buffer trees over
``SglangAdapter``; these need the extra_buffer adapter and its scheduler."""

from __future__ import annotations

from typing import Any

from kvspec.reference.choices import Choices
from kvspec.spec import Config

from .build import ComponentType, Req
from .extra import TRACK_INTERVAL, ExtraAdapter, FlippedScheduler


class DonateOtherSlot(FlippedScheduler):
    def hook_tree(self) -> None:
        pool = self.pool

        def keep_idx_(req: Req) -> int:
            return int(pool.get_mamba_ping_pong_other_idx(req.kv.mamba_last_track_idx))

        pool.get_mamba_ping_pong_keep_idx = keep_idx_


class ShortTrackKey(FlippedScheduler):
    def hook_tree(self) -> None:
        component = self.tree.components[ComponentType.MAMBA]
        prepare = component.prepare_for_caching_req

        def prepare_(req: Req, insert_params: Any, token_ids_len: int, is_finished: bool) -> Any:
            length = prepare(req, insert_params, token_ids_len, is_finished)
            if not is_finished and length > TRACK_INTERVAL:
                return length - TRACK_INTERVAL
            return length

        component.prepare_for_caching_req = prepare_


def _build(scheduler_class: type[FlippedScheduler], config: Config, choices: Choices) -> Any:
    from . import mamba_extra_refusal

    why = mamba_extra_refusal(config)
    if why is not None:
        raise ValueError(why)
    adapter = type(
        f"{scheduler_class.__name__}Adapter", (ExtraAdapter,), {"scheduler_class": scheduler_class}
    )
    return adapter(config, choices)


def donate_other_slot_factory(config: Config, choices: Choices) -> Any:
    """``DonateOtherSlot`` on ``mamba_extra_factory``'s cell."""
    return _build(DonateOtherSlot, config, choices)


def short_track_key_factory(config: Config, choices: Choices) -> Any:
    """``ShortTrackKey`` on ``mamba_extra_factory``'s cell."""
    return _build(ShortTrackKey, config, choices)
