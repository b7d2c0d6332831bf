"""Speculative decoding in the spec (``Config.spec_tokens``): a decode scheduled with draft slots
past the known tokens, the commit's count of accepted drafts, the rejected ones rolled back from
the computed tokens, only verified tokens hashed; a block over a rejected draft is never
published or read before it is rewritten (NoUnwrittenPublish, NoUnwrittenRead), shown by planting
an engine that publishes it; the trace header carries K; the fast model and the Z3 model refuse
it by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_reference import lockstep_run

from kvspec.conformance.trace import read_trace, write_events, write_trace
from kvspec.judge import Judge
from kvspec.reference import EngineConfig
from kvspec.spec import POLICIES, Config, Illegal, apply, check, initial_state, policies
from kvspec.spec.state import Draft, State

PROMPT = (1, 2, 3, 4, 5, 6)
"""Six tokens in blocks of 4; with the first sampled token the decode computes position 6, its
drafts sit at 7, 8 and 9, and with none accepted the bonus token lands at 7, block 1's last
slot."""
Event = tuple[object, ...]


def decoded(config: Config, accepted: int, drafts: int = 3) -> tuple[State, list[Event]]:
    """Request 0 prefills ``PROMPT`` and samples 8, then decodes with ``drafts`` draft slots, of
    which the commit accepts ``accepted`` (its tokens 20, 21, ...); the decisions and effects.
    Every invariant holds after every decision (else ``Found``)."""
    s, trace = initial_state(config), []
    sampled = tuple((0, 20 + j) for j in range(accepted + 1))
    for decision in [
        ("arrive", 0, PROMPT, 10, 0),
        ("begin", 0),
        ("schedule", 0, len(PROMPT), 0),
        ("submit", 0),
        ("execute", 0, ()),
        ("commit", 0, ((0, 8),)),
        ("begin", 1),
        ("schedule", 0, 1 + drafts, 0),
        ("submit", 1),
        ("execute", 1, ()),
        ("commit", 1, sampled),
    ]:
        trace += [decision, *apply(s, decision)]
        violation = check(s)
        if violation is not None:
            raise Found(violation)
    return s, trace


class Found(Exception):
    """An invariant failed in ``decoded``; ``args[0]`` is the ``Violation``."""


def test_the_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="spec_tokens must be an integer >= 0"):
        Config(8, 4, spec_tokens=-1)
    assert Config(8, 4, depth=2, async_scheduling=True, spec_tokens=2).spec_tokens == 2


def test_drafts_are_scheduled_only_past_the_known_tokens_and_up_to_k() -> None:
    for spec_tokens, ok in ((0, False), (2, False), (3, True)):
        s = initial_state(Config(8, 4, spec_tokens=spec_tokens))
        for decision in [
            ("arrive", 0, PROMPT, 10, 0),
            ("begin", 0),
            ("schedule", 0, 6, 0),
            ("submit", 0),
            ("execute", 0, ()),
            ("commit", 0, ((0, 8),)),
            ("begin", 1),
        ]:
            apply(s, decision)
        if ok:
            apply(s, ("schedule", 0, 4, 0))
            assert s.steps[-1].entries[0].drafts == 3
        else:
            with pytest.raises(Illegal, match="nor one of its draft slots"):
                apply(s, ("schedule", 0, 4, 0))


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_rejected_drafts_leave_the_computed_tokens(accepted: int) -> None:
    s, _ = decoded(Config(8, 4, policy="eager-unsafe", spec_tokens=3), accepted)
    req = s.requests[0]
    assert req.tokens == [*PROMPT, 8, *range(20, 21 + accepted)]
    assert req.computed == len(req.tokens) - 1 == 7 + accepted
    assert len(req.table) == 3  # the slots of the rejected drafts stay in the table
    # accepted drafts resolved to the tokens sampled there, rejected ones stay drafts
    tail = s.blocks[req.table[2]].written
    assert tail is not None and tail[: 7 + accepted] == tuple(req.tokens[: 7 + accepted])
    assert len(tail) == 10 and all(isinstance(x, Draft) for x in tail[7 + accepted :])


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_only_verified_tokens_are_hashed(accepted: int) -> None:
    """vLLM's post-output registration reaches the computed tokens after the rollback: the
    blocks full of accepted tokens, never one holding a rejected draft or the bonus token."""
    s, trace = decoded(Config(8, 4, policy="eager-unsafe", spec_tokens=3), accepted)
    published = [e for e in trace if e[0] == "publish"]
    full = (7 + accepted) // 4  # blocks within the computed tokens
    assert [e[2] for e in published] == list(range(full))
    assert all(tuple(s.requests[0].tokens[: len(key)]) == key for key in s.index)


def test_more_tokens_than_drafts_plus_one_are_illegal() -> None:
    with pytest.raises(Illegal, match="up to one more than its draft tokens"):
        decoded(Config(8, 4, spec_tokens=3), 4, drafts=3)
    with pytest.raises(Illegal, match="up to one more than its draft tokens"):
        decoded(Config(8, 4, spec_tokens=3), 1, drafts=0)


def test_a_stop_inside_the_accepted_drafts_drops_the_rest() -> None:
    config = Config(8, 4, policy="eager-unsafe", spec_tokens=3, stop_token=21)
    s, trace = decoded(config, 3)
    req = s.requests[0]
    assert req.status == "finished" and req.tokens[-1] == 21 and len(req.tokens) == 9
    assert ("finish", 0, "stop") in trace


def _publishing_the_bonus_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted engine: its post-output registration counts every known token, the bonus
    token too, instead of the computed ones (vLLM's ``num_tokens`` for ``num_computed_tokens``):
    a block whose last slot holds a rejected draft's K/V is published under the real tokens."""
    register = policies.register

    def on_output(s: State, req: object, entry: object, rejected: int = 0) -> list[Event]:
        return register(s, req, len(req.tokens) // s.config.block_size)[0]  # type: ignore[attr-defined]

    monkeypatch.setattr(policies, "on_output", on_output)


def test_publishing_a_block_over_a_rejected_draft_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No draft accepted: the bonus token lands at position 7, the last slot of block 1, whose
    K/V the step computed from draft 0. The correct engine leaves block 1 unpublished; the
    planted one publishes it and NoUnwrittenPublish names it."""
    config = Config(8, 4, policy="eager-unsafe", spec_tokens=3)
    s, _ = decoded(config, 0)
    assert len(s.index) == 1  # block 0 only
    _publishing_the_bonus_token(monkeypatch)
    with pytest.raises(Found) as caught:
        decoded(config, 0)
    violation = caught.value.args[0]
    assert violation.invariant == "NoUnwrittenPublish" and violation.blocks == (2,)


def test_an_engine_publishing_over_a_rejected_draft_is_caught_by_the_judge() -> None:
    """Observed judging (``engine-registers``): an engine's own ``publish`` of that block, on
    the same trace, is a NoUnwrittenPublish finding; so is another request's read of it."""
    config = Config(8, 4, policy="engine-registers", spec_tokens=3)
    _, trace = decoded(config, 0)
    judge = Judge.stream(config, observed=True)
    judge.feed_all([*trace, ("publish", 0, 1, 2)])
    finding = judge.finish()
    assert finding is not None and finding.invariant == "NoUnwrittenPublish", finding
    assert finding.blocks == (2,)
    judge = Judge.stream(config, observed=True)  # the correct engine's trace holds
    judge.feed_all(trace)
    assert judge.finish() is None


def test_the_trace_header_carries_k(tmp_path: Path) -> None:
    config = Config(8, 4, policy="eager-unsafe", spec_tokens=3)
    _, trace = decoded(config, 1)
    path = tmp_path / "t.jsonl"
    write_trace(path, config, trace, engine=("test", "0"))
    header = json.loads(path.read_text().splitlines()[0])
    assert header["model"]["spec_tokens"] == 3
    read = read_trace(path)
    assert read[0] == config and list(read[1]) == trace
    lines = path.read_text().splitlines()
    header["model"]["spec_tokens"] = "3"
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(Exception, match="spec_tokens"):
        read_trace(path)
    arrive: list[Event] = [("arrive", 0, (1, 2, 3), 1, 0)]
    for config in (Config(8, 2), Config(8, 2, spec_tokens=2)):  # default: not written
        v1, v0 = tmp_path / "v1.jsonl", tmp_path / "v0.jsonl"
        write_trace(v1, config, arrive, engine=("test", "0"))
        write_events(v0, config, arrive)
        model = json.loads(v1.read_text().splitlines()[0])["model"]
        v0_config = json.loads(v0.read_text().splitlines()[0])["config"]
        for fields in (model, v0_config):
            assert ("spec_tokens" in fields) == bool(config.spec_tokens), fields
        assert read_trace(v1)[0] == config and read_trace(v0)[0] == config


def test_kvspec_check_judges_drafts_by_the_spec(tmp_path: Path) -> None:
    from kvspec.conformance.check import check_file

    config = Config(8, 4, policy="eager-unsafe", spec_tokens=3)
    _, trace = decoded(config, 2)
    path = tmp_path / "t.jsonl"
    write_trace(path, config, trace, engine=("test", "0"))
    assert check_file(path).exit_code == 0
    bad = trace[: trace.index(("commit", 1, ((0, 20), (0, 21), (0, 22))))]
    bad.append(("commit", 1, ((0, 1),) * 5))  # five tokens for three drafts
    write_trace(path, config, bad, engine=("test", "0"))
    assert check_file(path).exit_code == 1


def test_the_fast_and_z3_models_refuse_drafts() -> None:
    """Declared out of their scope (kvspec/twins.py): refused by name, never judged as if the
    drafts were known tokens."""
    from kvspec.conformance.monitor import Monitor
    from kvspec.judge.fastmodel import FastModel
    from kvspec.proofs.symbolic import Fragment

    with pytest.raises(ValueError, match="speculative decoding"):
        FastModel(Config(8, 4, spec_tokens=2))
    with pytest.raises(ValueError, match="spec_tokens"):
        Fragment(Config(4, 1, spec_tokens=1))
    assert Monitor.fast(Config(8, 4, spec_tokens=2)).run is None  # the spec judges


@pytest.mark.parametrize("discipline", ["vllm", "general"])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_reference_engine_with_drafts_conforms(policy: str, discipline: str) -> None:
    """Lockstep: random workloads (shared prefixes, preemption, external loads that fail,
    aborts, resets) on the reference engine with up to K draft tokens per decode, the drafter
    and the model's rejections drawn; replayed through the spec event by event with the pool
    compared before every decision; depths 1 and 2 (synchronous), caching on and off."""
    drafted = rejected = several = 0
    for depth in (1, 2):
        for seed in range(6):
            rng = random.Random(f"drafts-{policy}-{discipline}-{depth}-{seed}")
            cfg = EngineConfig(
                num_blocks=rng.randint(6, 10),
                block_size=rng.randint(1, 3),
                depth=depth,
                policy=policy,
                discipline=discipline,
                preemption=rng.choice(["fcfs", "priority"]),
                token_budget=rng.randint(3, 10),
                max_running=rng.randint(1, 4),
                stop_token=rng.choice([None, 0]),
                vocab=3,
                prefix_caching=rng.random() < 0.8,
                spec_tokens=rng.randint(1, 3),
            )
            eng, rec, _ = lockstep_run(cfg, seed, rng, 8, compare=False)
            drafted += eng.stats["draft_tokens"]
            rejected += eng.stats["rejected_drafts"]
            several += sum(
                1 for e in rec if e[0] == "commit" and len({r for r, _ in e[2]}) < len(e[2])
            )
    assert drafted > 40 and rejected >= 5 and several >= 3, (drafted, rejected, several)
