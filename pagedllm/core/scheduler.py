"""The continuous-batching scheduler (vLLM V1 style: no prefill or decode phases).

Each step has one token budget (`max_num_batched_tokens`) and a sequence limit (`max_num_seqs`). Every
request's `num_computed_tokens` catches up with its `num_tokens`: a running request in decode needs one
token, one mid-prompt needs the rest of its prompt, chunked to what the budget allows. Running requests
are served first (so a long new prompt never starves decodes), then waiting ones are admitted in policy
order. When the KV cache runs out, running requests are preempted by recompute: their blocks are freed
and they go back to the front of the waiting queue, to be resumed later (prefix-cache hits on their own
earlier blocks then make the recompute cheap).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_events import KVCacheEvent
from pagedllm.core.outputs import EngineCoreOutputs, SchedulerStats
from pagedllm.core.pipelining import BatchPipeline
from pagedllm.core.request import GrammarState, Request, RequestStatus
from pagedllm.core.request_queue import RequestQueue
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import CachedRequestData, GrammarOutput, NewRequestData, SchedulerOutput
from pagedllm.core.scheduler_update import SchedulerCounters, SchedulerUpdate, make_scheduler_stats
from pagedllm.errors import ErrorReport, RequestError

if TYPE_CHECKING:
    # Type hints only: importing pagedllm.config pulls in torch, which core/ must not need.
    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.core.kv_connector import SchedulerConnector


class GrammarBitmaskFiller(Protocol):
    """What the scheduler needs of the structured-output manager."""

    def grammar_bitmask(self, grammars: list[GrammarState]) -> Any: ...


logger = logging.getLogger("pagedllm.core")


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        log_stats: bool = True,
        structured_output_manager: GrammarBitmaskFiller | None = None,
        enable_kv_cache_events: bool = False,
        kv_connector: SchedulerConnector | None = None,
        max_loras: int | None = None,
        max_concurrent_batches: int = 1,
        num_lookahead_tokens: int = 0,
    ) -> None:
        if scheduler_config.max_num_seqs is None or scheduler_config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs a resolved max_num_seqs and max_num_batched_tokens")
        if scheduler_config.max_num_partial_prefills != 1 or scheduler_config.max_long_partial_prefills != 1:
            # As in vLLM V1, any number of prompts may be mid-prefill at once (the token budget is the
            # only limit), so these V0 knobs would silently do nothing.
            raise ValueError(
                f"max_num_partial_prefills={scheduler_config.max_num_partial_prefills} / "
                f"max_long_partial_prefills={scheduler_config.max_long_partial_prefills} are not supported "
                "(only the default 1); use long_prefill_token_threshold to cap prefill chunks"
            )
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_scheduled_tokens = scheduler_config.step_token_budget
        # Admit a request only when blocks for its whole prompt are free (no admission that the next
        # chunk would have to preempt for).
        self.reserve_full_prompt = scheduler_config.scheduler_reserve_full_isl
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.policy: str = scheduler_config.policy
        # Distinct LoRA adapters the running requests may use at once (None: LoRA is off).
        self.max_loras = max_loras
        # KV slots reserved past each request's scheduled tokens: a draft model writes the KV of its
        # own draft tokens there (through the target's block table) before the target verifies them.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.log_stats = log_stats
        if num_blocks * self.block_size < max_model_len:
            # Otherwise a lone request could outgrow the cache with nothing left to preempt.
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {self.block_size} tokens, fewer than one "
                f"max_model_len={max_model_len} sequence needs ({-(-max_model_len // self.block_size)})"
            )
        if not self.enable_chunked_prefill and self.max_num_scheduled_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_scheduled_tokens} < max_model_len={max_model_len} "
                "with chunked prefill disabled: a long prompt could never be scheduled"
            )
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            self.block_size,
            max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue(self.policy)
        # Admission order; fcfs preempts from the end.
        self.running: list[Request] = []
        # Set while a weight update waits for the running requests to finish: the waiting ones are
        # held, so they start on the new weights.
        self.hold_waiting = False
        # Finished since the last schedule(): the runner drops their state on the next step.
        self.finished_req_ids: set[str] = set()
        # Preemptions, connector lookups and transfers, drafts verified: counted until make_stats().
        self.counters = SchedulerCounters()
        # Structured outputs: requests whose grammar is still compiling (kept out of the waiting queue
        # so they hold no one up), the ids of every live constrained request, and the requests whose
        # grammar failed to compile since the last step (id -> message).
        self.structured_output_manager = structured_output_manager
        self.waiting_for_fsm: list[Request] = []
        self.constrained_req_ids: set[str] = set()
        self.grammar_errors: dict[str, ErrorReport] = {}
        # The KV connector's scheduler side (offloading tier, shared storage): it may supply the tokens
        # after a request's local prefix hit.
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.bind_scheduler(self.requests, self.kv_cache_manager)
        # Several batches in flight (pipeline parallelism): balanced batches, and the stages that do not
        # sample learn each step's input tokens from the scheduler output. None for one batch at a time.
        self.pipeline = BatchPipeline(max_concurrent_batches) if max_concurrent_batches > 1 else None
        self.output_stage = SchedulerUpdate(
            self.requests, max_model_len, self.pipeline, self.counters, self._free_request
        )

    # ---------------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        n = request.num_prompt_tokens
        # A pooling request generates nothing: its prompt may fill the whole context.
        if n + (request.pooling_params is None) > self.max_model_len:
            raise RequestError(
                "prompt",
                f"request {request.request_id!r}: the prompt has {n} tokens, but max_model_len="
                f"{self.max_model_len} leaves room for at most {self.max_model_len - 1} prompt tokens "
                "(at least one token must be generated)",
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        grammar = request.structured_output_request
        if grammar is not None:
            self.constrained_req_ids.add(request.request_id)
            if not grammar.is_ready():
                request.status = RequestStatus.WAITING_FOR_FSM
                self.waiting_for_fsm.append(request)
                return
            self._init_grammar(request)
            if request.is_finished():
                return
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def _init_grammar(self, request: Request) -> None:
        """Build the matcher of a request whose grammar is compiled; a grammar that failed to compile
        finishes the request (aborted) with the error reported once."""
        assert request.structured_output_request is not None
        try:
            request.structured_output_request.init_matcher()
        except Exception as e:  # the core must survive any bad grammar
            self.grammar_errors[request.request_id] = ErrorReport.of(e, param="structured_outputs")
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)

    def _admit_compiled_grammars(self) -> None:
        """Move the requests whose grammar finished compiling into the waiting queue."""
        still: list[Request] = []
        for request in self.waiting_for_fsm:
            assert request.structured_output_request is not None
            if not request.structured_output_request.is_ready():
                still.append(request)
                continue
            self._init_grammar(request)
            if not request.is_finished():
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
        self.waiting_for_fsm = still

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort); unknown or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running: set[Request] = set()
        waiting: set[Request] = set()
        compiling: set[Request] = set()
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM:
                compiling.add(request)
            else:
                (running if request.status == RequestStatus.RUNNING else waiting).add(request)
            request.status = finished_status
            self._free_request(request)
        # One pass over each queue, however many requests are aborted.
        if running:
            self.running = [r for r in self.running if r not in running]
        if waiting:
            self.waiting.remove_many(waiting)
        if compiling:
            self.waiting_for_fsm = [r for r in self.waiting_for_fsm if r not in compiling]

    def _free_request(self, request: Request) -> None:
        if self.kv_connector is not None:
            self.kv_connector.request_finished(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self.constrained_req_ids.discard(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def waiting_only_for_grammars(self) -> bool:
        """Whether every unfinished request waits for a grammar still compiling (nothing to schedule)."""
        if not self.waiting_for_fsm or len(self.waiting_for_fsm) != len(self.requests):
            return False
        return not any(r.structured_output_request.is_ready() for r in self.waiting_for_fsm)  # type: ignore[union-attr]

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        reset = self.kv_cache_manager.reset_prefix_cache()
        if reset and self.kv_connector is not None:
            self.kv_connector.reset_cache()
        return reset

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV cache events since the last call, for the engine core to publish."""
        return self.kv_cache_manager.take_events()

    # ---------------------------------------------------------------------------------- outputs
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs, any_stopped = self.output_stage.apply(scheduler_output, model_runner_output)
        if any_stopped:
            self.running = [r for r in self.running if not r.is_finished()]
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def make_stats(self) -> SchedulerStats | None:
        """Queue lengths and cache usage now; prefix-cache counts and preemptions since the last call."""
        if not self.log_stats:
            return None
        waiting = [*self.waiting, *self.waiting_for_fsm]
        return make_scheduler_stats(
            self.counters, self.kv_cache_manager, self.running, waiting, bool(self.max_loras)
        )

    # ---------------------------------------------------------------------------------- schedule
    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        # Drafts ride along after the last token; none may reach past max_model_len.
        n = min(request.num_tokens_with_spec, self.max_model_len) - num_computed
        # The threshold chunks long prompts, so it only applies where chunking is allowed.
        if self.enable_chunked_prefill and 0 < self.long_prefill_token_threshold < n:
            n = self.long_prefill_token_threshold
        return min(n, token_budget)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            # Worst (priority, arrival) first: the reverse of the admission order.
            return max(self.running, key=lambda r: (r.priority, r.arrival_time, r.request_id))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.prepend(request)

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_fsm:
            self._admit_compiled_grammars()
        kv = self.kv_cache_manager
        token_budget = self.max_num_scheduled_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_block_ids: dict[str, list[int]] = {}
        spec_decode_tokens: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        preempted: list[Request] = []
        pipeline = self.pipeline
        seats = (
            self.max_num_seqs if pipeline is None else pipeline.seats(len(self.running) + len(self.waiting))
        )

        # Running requests first, in admission order.
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, token_budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(
                    request, num_new, num_lookahead_tokens=self.num_lookahead_tokens
                )
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self.running.pop(victim_index)
                if victim.request_id in num_scheduled_tokens:
                    # Scheduled earlier in this step (possible under the priority policy): undo it.
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                    spec_decode_tokens.pop(victim.request_id, None)
                    scheduled_running.remove(victim)
                    kv.uncache_unscheduled_blocks(victim)
                if victim_index < i:
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                # An undone victim returned budget: a prefill chunk may now be longer.
                num_new = self._num_new_tokens(request, request.num_computed_tokens, token_budget)
            if new_blocks is None:
                continue  # `request` itself was preempted; running[i] is now the next one
            num_scheduled_tokens[request.request_id] = num_new
            new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            if request.spec_token_ids:
                # The drafts that fit the budget follow the request's last token; the rest are dropped.
                num_spec = num_new - (request.num_tokens - request.num_computed_tokens)
                if num_spec > 0:
                    spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
                request.spec_token_ids = []
            scheduled_running.append(request)
            token_budget -= num_new
            i += 1
            if len(scheduled_running) == seats:
                break

        # Then waiting requests, unless this step had to preempt (the cache is full: admitting now would
        # only preempt again).
        scheduled_new: list[Request] = []
        if not preempted:
            scheduled_new = self._schedule_waiting(
                token_budget, num_scheduled_tokens, seats - len(scheduled_running)
            )

        # Build the output from the state before this step, then advance num_computed_tokens (the
        # tokens are in flight; the next schedule() treats them as computed).
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                lora_request=r.lora_request,
                pooling_params=r.pooling_params,
            )
            for r in scheduled_new
        ]
        cached = CachedRequestData(
            req_ids=[r.request_id for r in scheduled_running],
            new_block_ids=[new_block_ids[r.request_id] for r in scheduled_running],
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
        )
        if pipeline is not None:
            cached.token_ids = [
                r.all_token_ids[
                    r.num_computed_tokens : r.num_computed_tokens + num_scheduled_tokens[r.request_id]
                ]
                for r in scheduled_running
            ]
            pipeline.started(num_scheduled_tokens)
        for r in scheduled_running:
            r.num_computed_tokens += num_scheduled_tokens[r.request_id]
        for r in scheduled_new:
            r.num_computed_tokens += num_scheduled_tokens[r.request_id]

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=spec_decode_tokens,
        )
        self.finished_req_ids = set()
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta(output)
        return output

    def _schedule_waiting(
        self, token_budget: int, num_scheduled_tokens: dict[str, int], seats: int
    ) -> list[Request]:
        """Admit waiting (and preempted) requests in policy order while budget, seats and blocks last.
        Stops at the first request that does not fit, so no request is overtaken by a later one: that
        also holds for a request whose LoRA adapter would be one more than `max_loras` running
        adapters, which waits until one of them drains instead of being starved by later requests of
        the running adapters."""
        kv = self.kv_cache_manager
        scheduled: list[Request] = []
        loras = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        while (
            self.waiting
            and not self.hold_waiting
            and token_budget > 0
            and len(self.running) < self.max_num_seqs
            and len(scheduled) < seats
        ):
            request = self.waiting.peek()
            if self.pipeline is not None and self.pipeline.awaits_output(request.request_id):
                break  # preempted while in flight: resumed once that batch's tokens are in
            if (
                self.max_loras
                and request.lora_int_id
                and request.lora_int_id not in loras
                and len(loras) >= self.max_loras
            ):
                break
            computed_blocks, num_local_hit = kv.get_computed_blocks(request)
            num_external = (
                self.kv_connector.get_num_new_matched_tokens(request, num_local_hit)
                if self.kv_connector is not None
                else 0
            )
            num_hit = num_local_hit + num_external
            num_new = request.num_tokens - num_hit
            if not self.enable_chunked_prefill and num_new > token_budget:
                break  # the whole prompt must run in one step: wait for a step with room
            num_new = self._num_new_tokens(request, num_hit, token_budget)
            if self.reserve_full_prompt and not kv.can_fit(request, computed_blocks):
                break
            new_blocks = kv.allocate_slots(
                request, num_new, num_hit, computed_blocks, self.num_lookahead_tokens
            )
            if new_blocks is None:
                break
            self.waiting.pop()
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(
                    request, kv.get_block_ids(request.request_id), num_external
                )
                self.counters.external_queries += request.num_tokens - num_local_hit
                self.counters.external_hits += num_external
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.num_external_computed_tokens = num_external
            if request.first_scheduled_time is None:
                # Wall clock: the front-end subtracts its own time.time() arrival from it.
                request.first_scheduled_time = time.time()
            kv.record_prefix_cache_lookup(request.num_tokens, num_local_hit)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            scheduled.append(request)
            if request.lora_int_id:
                loras.add(request.lora_int_id)
            num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
        return scheduled

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The allowed-token bitmask of the step's constrained requests that sample a token (a
        mid-prefill chunk samples nothing); None when there are none (at once when no live request is
        constrained, so the unconstrained path does no per-step work)."""
        if not self.constrained_req_ids:
            return None
        req_ids: list[str] = []
        grammars: list[GrammarState] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            if req_id not in self.constrained_req_ids:
                continue
            request = self.requests[req_id]
            # schedule() advanced num_computed_tokens: it reaches num_tokens when this step samples.
            if request.num_computed_tokens >= request.num_tokens:
                assert request.structured_output_request is not None
                req_ids.append(req_id)
                grammars.append(request.structured_output_request)
        if not req_ids:
            return None
        assert self.structured_output_manager is not None
        return GrammarOutput(req_ids, self.structured_output_manager.grammar_bitmask(grammars))

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Record the drafter's proposals: each running request verifies its drafts next step. A
        constrained request drafts nothing (its grammar state could not follow unverified tokens)."""
        for req_id, token_ids in draft_token_ids.items():
            request = self.requests.get(req_id)
            if (
                request is not None
                and request.status == RequestStatus.RUNNING
                and req_id not in self.constrained_req_ids
            ):
                request.spec_token_ids = list(token_ids)
