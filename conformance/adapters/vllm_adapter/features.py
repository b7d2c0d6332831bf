"""What the spec does not model, read from vLLM's own state: each check names a feature.

The attachments (``attach.py``, ``pool_attach.py``) *refuse* to judge where one of these shows,
instead of judging it wrongly (a feature the spec does not know becomes a false alarm, or a
silent pass). ``scheduler_features`` reads a ``Scheduler`` (at attach time and again at every
entry point, since tests change settings after construction), ``request_features`` a request as it
arrives, ``pending_features`` what a waiting or running request carries into ``schedule()``.
Every function returns ``(feature, detail)`` pairs; the feature is a short stable name (the
summary counts by it), the detail says what was seen.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from . import versions
from .chunked import chunked_features, is_chunked
from .groups import encoder_decoder, hybrid_features
from .versions import read

try:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
except ImportError:  # pragma: no cover - an older vLLM
    AsyncScheduler = None  # type: ignore[assignment,misc]

Feature = tuple[str, str]

MODELLED_CONNECTORS = ("MockKVConnector", "ExampleConnector")
"""KV connectors whose scheduler side only answers the scheduler's calls (how many tokens an
external store holds, the load plan, the step's metadata) and never drives the KV-cache manager
itself: all they do then shows in what the attachment reads (``allocate_slots``' external
tokens, the runner output's ``kv_connector_output``, a free ``request_finished`` delays). Their
loads are judged, synchronous and asynchronous (``spec.actions.schedule``, ``docs/model.md``);
a failed asynchronous load under vLLM's ``fail`` policy is judged where it is the spec's
failed load and an abort (``Attachment._failed_loads``); other load failures, finished sends
and delayed frees are refused where they show (``attach.py``).
Any other connector (or a test's stand-in object) is refused by its class name."""

BLOCKED = (
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    RequestStatus.WAITING_FOR_REMOTE_KVS,
    RequestStatus.WAITING_FOR_STREAMING_REQ,
)


def scheduler_features(sched: Any) -> list[Feature]:
    """Settings of the scheduler, its KV-cache manager and its pool that the spec does not model.

    The scheduler's other connectors are judged whatever their class (a test's ``Mock`` included),
    since in 0.33.0 they reach what the spec models only through answers the attachment checks at
    run time, and refuses where they change something (``attach.py``):

    * the EC connector (``ec_connector``, an encoder cache): ``request_finished`` may delay a
      request's free (seen as its request still in ``requests`` after ``_free_request``: "delayed
      block free"), ``take_unavailable_requests`` finishes requests with an error (vLLM's
      ``finish_requests`` inside ``update_from_output``: "request errors"), and its other hooks
      (``ensure_cache_available``, ``has_cache_item``, ``update_state_after_alloc``) run only for
      multimodal requests, refused at arrival (and encoder inputs scheduled, at ``submit``). Holding
      no reference to the scheduler, it touches no block itself;
    * the aux output connector (``aux_output_connector``, e.g. ``AuxOutputSchedulerConnector``, set
      after construction by vLLM's tests): ``max_cache_hit`` bounds the local prefix-cache lookup.
      vLLM's own counts the leading blocks that are cached in the pool or retained by it, so with
      one full-attention group and hash blocks of the block size its bound is never below the
      lookup's own (the longest cached prefix, the last token's block excluded) and the hit is the
      spec's; a bound that cuts the hit short or lets it cover the last token's block (a test's
      stub) is refused at the admission's ``allocate_slots``. ``cap_external_hit`` may drop a KV
      connector's external hit (vLLM's keeps it whole or drops it): the load left is still the
      engine's choice in a ``schedule`` decision, read from ``allocate_slots``' external tokens
      and checked there like any load (whole blocks, short of the last token's). Its other calls
      (``build_connector_meta``, ``request_finished``, ``take_output``, ``reset``) read the pool or
      its own state only. A stand-in is held to the same checks (vLLM raises on a ``Mock``'s
      bound; a ``MagicMock``'s acts as 1, a capped hit)."""
    found: list[Feature] = []
    kv = sched.kv_cache_manager
    groups = sched.kv_cache_config.kv_cache_groups

    def need(cond: object, feature: str, detail: str) -> None:
        if cond:
            found.append((feature, detail))

    connector = sched.connector
    if connector is not None:
        name = type(connector).__name__
        need(name not in MODELLED_CONNECTORS, "KV connector", name)
        need(
            read(connector, "supports_divergent_local_hybrid_hits"),
            "KV connector",
            f"{name} takes hits the local prefix cache did not",
        )
    # ec_connector and aux_output_connector are judged (the docstring says why)
    need(
        read(sched.scheduler_config, "async_scheduling")
        and not (AsyncScheduler is not None and isinstance(sched, AsyncScheduler)),
        "async scheduling without AsyncScheduler",
        "scheduler_config.async_scheduling on a synchronous Scheduler",
    )
    found += speculation_features(sched)
    need(not groups, "hybrid KV-cache groups", "no KV-cache group")
    found += hybrid_features(sched)  # several groups: groups.py names what is not followed
    for group in groups if len(groups) == 1 else ():
        spec = group.kv_cache_spec
        if getattr(spec, "sliding_window", None):
            found += window_features(sched, spec)
        elif is_chunked(spec):
            found += chunked_features(sched, spec)
        elif type(spec) is not FullAttentionSpec:
            found.append((f"KV-cache spec {type(spec).__name__}", "not plain full attention"))
    # defer_block_free and defer_async_loads are modelled (Config.defer_free, defer_loads, read
    # by config_of); CoW retentions released against a fence are not (attach.py). HiSparse,
    # whose reads of released pages are why vLLM defers loads, is refused below.
    need(
        read(sched, "defer_async_loads") and not read(sched, "defer_block_free"),
        "deferred async loads",
        "defer_async_loads without defer_block_free",
    )
    need(
        read(sched, "num_hash_lookahead_tokens"),
        "lookahead hashing",
        f"{read(sched, 'num_hash_lookahead_tokens')} tokens after each block in its hash",
    )
    need(
        read(sched, "hash_block_size") != sched.block_size,
        "hash block size",
        f"hashes of {read(sched, 'hash_block_size')} tokens, blocks of {sched.block_size}",
    )
    need(
        read(kv.coordinator, "enable_partial_hash_hits"),
        "partial prefix-cache hits",
        "hits inside a block",
    )
    need(  # a decoder full-attention group beside a cross-attention one is judged (groups.py)
        read(sched, "is_encoder_decoder") and not encoder_decoder(sched),
        "encoder-decoder model",
        "cross-attention",
    )
    need(read(sched, "is_mm_encoder_only"), "multimodal encoder-only", "no sampling")
    need(read(sched, "num_sampled_tokens_per_step") != 1, "pooling or diffusion model", "")
    need(read(sched, "prefix_replay_tokens"), "prefix replay", "recomputed hit tails")
    need(  # the chunk vLLM shortens for it is a chunk size like any (attach.py)
        read(kv.coordinator, "num_reprefillable_tokens"),
        "prefill lookahead (MTP)",
        f"the last {read(kv.coordinator, 'num_reprefillable_tokens')} computed tokens "
        "registered late",
    )
    need(
        read(sched, "dcp_world_size") > 1 or read(sched, "pcp_world_size") > 1,
        "context parallelism",
        "",
    )
    mamba = read(sched.kv_cache_config, "has_mamba_layers")
    need(mamba and len(groups) < 2, "Mamba layers", "")  # beside other groups: groups.py
    need(
        read(sched.kv_cache_config, "hisparse_host_num_blocks") is not None,
        "HiSparse",
        "",
    )
    # 0.34.0's admission changes (versions.py reads them as off on 0.33.0)
    # cache-aware admission is modelled (Config.admission_window, spec/admission.py) where the
    # spec's queue is vLLM's: not beside a KV connector (loads wait outside the rule's slots)
    # nor several groups (the probe is the coordinator's)
    window = versions.admission_window(sched)
    need(
        window and (connector is not None or len(groups) > 1),
        "cache-aware admission",
        f"the first {window} waiting requests reordered by cached prefix "
        "beside a KV connector or several KV-cache groups",
    )
    loads = versions.inflight_kv_loads(sched)
    need(
        loads is not None,
        "in-flight KV load limit",
        f"max_num_inflight_kv_loads={loads}: loads start from async_kv_waiting",
    )
    need(
        type(sched) is not Scheduler and not (AsyncScheduler and type(sched) is AsyncScheduler),
        f"Scheduler subclass {type(sched).__name__}",
        "its overrides are not vLLM's scheduler",
    )
    return found


def sliding_window_of(sched: Any) -> int | None:
    """The window of a scheduler's one KV-cache group when it is plain sliding-window attention
    (vLLM's ``SlidingWindowSpec`` under a ``SlidingWindowManager``, no extra retained tokens):
    the spec's ``Config.sliding_window``. None otherwise (full attention, or refused)."""
    groups = sched.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return None
    spec = groups[0].kv_cache_spec
    if type(spec) is not SlidingWindowSpec or read(spec, "extra_retained_tokens"):
        return None
    managers = read(sched.kv_cache_manager.coordinator, "single_type_managers")
    if len(managers) != 1 or type(managers[0]) is not SlidingWindowManager:
        return None
    return int(spec.sliding_window)


def trims_at_finish(sched: Any) -> bool:
    """The spec's ``Config.trim_at_finish`` (``WindowFinish``): a sliding window the spec models
    (``sliding_window_of``) beside a KV connector, whose ``_connector_finished`` frees the
    blocks before the window (``remove_skipped_blocks`` on the processed tokens) before the
    table is handed to the connector and freed."""
    return sliding_window_of(sched) is not None and read(sched, "connector") is not None


def window_features(sched: Any, spec: Any) -> list[Feature]:
    """A sliding-window group: modelled (``Config.sliding_window``, read by ``config_of``) when
    ``sliding_window_of`` reads it, alone, without drafts (the spec does not model them beside a
    window); refused as "sliding window" otherwise. Beside a KV connector it is judged up to what
    the spec does not model there, refused where it happens (``attach_blocks.py``,
    ``attach_outputs.py``): an asynchronous load (a synchronous one is the spec's ``WindowLoad``;
    a finish, whose ``_connector_finished`` frees the blocks before the window before the table,
    is its ``WindowFinish``, ``trims_at_finish``)."""
    detail = f"{type(spec).__name__}({spec.sliding_window})"
    if sliding_window_of(sched) is None:
        return [("sliding window", detail)]
    if read(sched, "num_spec_tokens") or read(sched, "use_eagle"):
        return [("sliding window", f"{detail} with speculative decoding")]
    return []


def speculation_features(sched: Any) -> list[Feature]:
    """What of speculative decoding the spec does not model. It models draft tokens scheduled
    past a request's known tokens, at most ``num_spec_tokens`` of them, the rejected ones rolled
    back from the computed tokens (``Config.spec_tokens``), in a ``Scheduler`` and in an
    ``AsyncScheduler`` (whose placeholders then cover the drafts, the next decode scheduled as if
    all were accepted; ``docs/model.md``, "Drafts under async scheduling"); not drafters that
    reserve lookahead slots beyond the scheduled tokens (EAGLE, MTP, a draft model), a draft
    count chosen per batch size. Drafts beside a KV connector are judged: the connector's part
    in a draft decode is a budget (``draft_slots``) and, for an asynchronous load, blocks
    reserved for the first decode (``_spec_decode_step_blocks``), both of which only decide
    whether vLLM schedules, and the single token of a request admitted over a load, or resumed
    after one, is padded with drafts like any admission's (``tests/vllm_cases/case_loads.py``).
    Lookahead hashing and prefill lookahead are refused on their own."""
    spec = sched.vllm_config.speculative_config
    k = read(sched, "num_spec_tokens")
    if spec is None and not k and not read(sched, "num_lookahead_tokens"):
        return []
    found: list[Feature] = []
    if read(sched, "num_lookahead_tokens"):
        found.append(("draft lookahead slots", f"{sched.num_lookahead_tokens} (EAGLE, MTP, ...)"))
    if read(sched, "dynamic_sd_lookup") is not None:
        found.append(("dynamic speculative decoding", "draft tokens per batch size"))
    if spec is None or not k:
        found.append(("speculative decoding", f"{k} draft tokens without a speculative config"))
    return found


def request_features(sched: Any, request: Any) -> list[Feature]:
    """What a request arriving at ``add_request`` carries that the spec does not model."""
    found: list[Feature] = []

    def need(cond: object, feature: str, detail: str) -> None:
        if cond:
            found.append((feature, detail))

    params = request.sampling_params
    need(request.request_id in sched.requests, "streaming input", "a request id added twice")
    need(read(request, "resumable"), "streaming input", "a resumable request")
    # Multimodal inputs need nothing here: their part in the hashes is checked as LoRA's is
    # (``lora_skips``), the encoder's scheduling only sizes chunks or passes a request over
    # (``passed_over``).
    need(read(request, "cache_salt"), "cache salt", "a salt in the first block's hash")
    need(request.prompt_token_ids is None, "prompt embeddings", "no prompt token ids")
    need(request.pooling_params is not None or params is None, "pooling", "no sampling")
    # A request that skips or bounds the prefix-cache read (prompt logprobs, prompt scoring) is
    # judged: its admissions' decisions carry the bound (``attach_blocks._hit_bound``).
    caching = bool(read(sched.kv_cache_manager, "enable_caching"))
    need(read(request, "kv_transfer_params"), "KV connector", "kv_transfer_params")
    fresh = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    need(  # structured output arrives waiting for its grammar (pending_features)
        request.status not in fresh or request.num_computed_tokens,
        "a request added mid-flight",
        f"{request.status} with {request.num_computed_tokens} computed tokens",
    )
    if request.prompt_token_ids is not None:
        bsz = sched.block_size
        lookahead = hasher_lookahead(request) or 0
        full = max(0, request.num_tokens - lookahead) // bsz
        need(  # without prefix caching no hash is ever read
            caching and len(request.block_hashes) != full,
            "no block hasher",
            f"{len(request.block_hashes)} block hashes for {full} full blocks"
            + (f" with {lookahead} tokens after each" if lookahead else ""),
        )
        need(
            request.num_prompt_tokens >= sched.max_model_len,
            "prompt at max_model_len",
            f"{request.num_prompt_tokens} tokens, max_model_len {sched.max_model_len}",
        )
    return found


def hasher_lookahead(request: Any) -> int | None:
    """L, the tokens after each block that the request's block hasher puts in its hash (the
    ``num_hash_lookahead_tokens`` of vLLM's ``get_request_block_hasher``, read from the hasher's
    closure: vLLM's tests give a request a lookahead hasher while the scheduler's own lookahead
    is 0), the spec's ``Config.hash_lookahead``. None where there is no hasher or it is not
    vLLM's (no such closure variable): its hashes then are checked as plain chained ones."""
    hasher = getattr(request, "_block_hasher", None)
    code = getattr(hasher, "__code__", None)
    cells = getattr(hasher, "__closure__", None)
    if code is None or not cells or "num_hash_lookahead_tokens" not in code.co_freevars:
        return None
    value = cells[code.co_freevars.index("num_hash_lookahead_tokens")].cell_contents
    return value if type(value) is int and value >= 0 else None


def lora_skips(sched: Any, request: Any) -> list[Feature]:
    """LoRA at the admission of ``request``: vLLM passes over a waiting request whose adapter
    would exceed ``max_loras`` and admits one behind it, which the spec's admission order does
    not allow. Once the adapters of the running requests (those admitted earlier in this
    ``schedule()`` included) fill ``max_loras`` no other adapter joins in that call, so such a
    skip happened, or may, exactly where another waiting request (skipped ones are off the
    queue meanwhile: read from ``requests``) carries an adapter outside that full set. The
    adapter's part in the block hashes needs nothing of its own: hashes that are not a
    function of the tokens are refused where they are checked (``attach._check_hashes``)."""
    config = read(sched, "lora_config")
    if config is None:
        return []

    def adapter(r: Any) -> int:
        lora = read(r, "lora_request")
        return lora.lora_int_id if lora is not None and lora.lora_int_id > 0 else 0

    held = {adapter(r) for r in sched.running} - {0}
    if len(held) < config.max_loras:
        return []
    for other in sched.requests.values():
        waiting = other.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        if other is not request and waiting and adapter(other) not in held | {0}:
            return [("LoRA", f"{other.request_id} passed over: max_loras {config.max_loras}")]
    return []


def passed_over(sched: Any, request: Any, modelled: Collection[str]) -> list[Feature]:
    """At the admission of ``request``: another waiting request vLLM passed over (its
    ``skip_request`` puts each in ``deferred_waiting`` until admitted) for a reason the spec
    does not model (encoder budget or cache, a chunk aligned or shortened to nothing, ...): the
    spec admits in queue order. Not refused: output of a step in flight still to be delivered
    (the spec's ``admissible``) and the asynchronous loads the attachment follows
    (``modelled``). ``deferred_waiting`` also keeps requests passed over in an earlier step
    and not admitted since; one of those still queued now was not passed over in this pass:
    vLLM takes its queues from the head (the KV-holding one first) and pops each request it
    passes over, so a request still in them is behind this one, in the order it had (a pass
    puts the requests it passed over back at the head, in their order)."""
    queued = {id(r) for r in sched.waiting}
    queued |= {id(r) for r in read(sched, "kv_holding_waiting")}
    for other in read(sched, "deferred_waiting"):
        if other is request or other.request_id in modelled or id(other) in queued:
            continue
        if other.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            continue  # blocked ones are refused on their own (pending_features)
        if other.num_stale_output_tokens and not other.drop_stale_output:
            continue
        return [("a waiting request passed over", f"{other.request_id}, then {request.request_id}")]
    return []


def grammar_ready(request: Any) -> bool:
    """Whether the request waits for a grammar that is compiled (not an error): vLLM
    makes it waiting when its turn comes and admits it like any, so it is not blocked. A
    grammar still compiling, or failed, is: vLLM passes the request over (a failed one then
    finishes in error, a finish the spec does not have)."""
    if request.status != RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        return False
    structured = read(request, "structured_output_request")
    grammar = structured.grammar if structured is not None else None
    return grammar is not None and not isinstance(grammar, Exception)


def pending_features(
    sched: Any,
    scheduling: bool,
    loaders: Collection[str] = (),
    held: Collection[str] = (),
    dropped: Collection[str] = (),
) -> list[Feature]:
    """What vLLM's requests show at an entry point that the spec does not model: blocked
    waiting states, drafts on a request beyond the scheduler's ``num_spec_tokens`` (any, without
    speculative decoding; the kinds of speculation the spec does not model are
    ``scheduler_features``', checked beside this at every entry point), requests that hold blocks
    while waiting, and stale
    output whose mode (drop or deliver) is not the scheduler's (``reset_prefix_cache`` with
    running requests and resumable requests drop it; the spec has one mode per configuration).
    ``scheduling``: the entry point is ``schedule()``. ``loaders``: requests the attachment
    follows through an asynchronous KV load (``WAITING_FOR_REMOTE_KVS``, then waiting with
    their loaded blocks until scheduled), which the spec models. ``held``: requests waiting
    for their grammar that the attachment keeps from the spec until it is compiled (vLLM
    passes them over as if they were not there). ``dropped``: requests whose output in flight a
    reset beside steps in flight dropped, which the spec's rule drops too."""
    found: list[Feature] = []
    for request in sched.requests.values():
        blocked = request.status in BLOCKED and not grammar_ready(request)
        if blocked and request.request_id not in loaders and request.request_id not in held:
            found.append(("blocked waiting request", f"{request.request_id}: {request.status}"))
        drafts = len(request.spec_token_ids or ()) if not request.is_finished() else 0
        if drafts > read(sched, "num_spec_tokens"):  # the rest: scheduler_features
            found.append(("speculative decoding", f"{drafts} draft tokens on {request.request_id}"))
        if (
            request.num_stale_output_tokens
            and not request.is_finished()
            and bool(request.drop_stale_output) != bool(sched.requires_kv_delivery)
            and not (request.drop_stale_output and request.request_id in dropped)
        ):
            mode = "drop" if request.drop_stale_output else "deliver"
            found.append(("stale output mode per request", f"{request.request_id}: {mode}"))
    if versions.admission_window(sched):  # the rule's probe and slots are the spec's only so
        for request in sched.waiting:
            if request.status in BLOCKED:
                found.append(
                    ("cache-aware admission", f"{request.request_id} blocked in the queue")
                )
            elif versions.prefix_read_limit(request) == 0:
                found.append(
                    ("cache-aware admission", f"{request.request_id} skips the prefix-cache read")
                )
    if versions.async_kv_waiting(sched):
        found.append(("in-flight KV load limit", "async_kv_waiting is not empty"))
    holding = read(sched, "kv_holding_waiting")
    if any(request.request_id not in loaders for request in holding):
        found.append(("blocks held while waiting", "kv_holding_waiting is not empty"))
    if read(sched, "num_waiting_for_streaming_input"):
        found.append(("streaming input", "a session waits for input"))
    return found
