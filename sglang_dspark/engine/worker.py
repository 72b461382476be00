"""`DSparkLiveWorker`: DSpark speculative decoding inside SGLang's scheduler (V2 result schema).

One decode step, for the whole batch:
1. draft: the drafter reads each request's cached target context (its slot is SGLang's
   `req_pool_index`) and walks a block of gamma drafts from the bonus token;
2. plan: how many drafts of each request to verify (`engine.planning`);
3. verify: ONE target forward over every request's `[bonus, admitted drafts]` (ragged), run as
   `TARGET_VERIFY` so the logits processor keeps every row, and capturing the tapped layers;
4. accept: first the logit changes SGLang's sampler would make (min_new_tokens bans, frequency /
   presence / repetition penalties, grammar masks, logit_bias, custom logit processors),
   then greedy rows by argmax match, sampled rows by rejection sampling on the forward's packed
   rows (`decoding.verify_greedy`, `decoding.verify_packed`); logprobs, when asked, from the same
   rows;
5. commit: the accepted tokens' taps are stored beside their KV slots (the tap store); KV of
   rejected drafts stays in the request's reserved slots and is overwritten by the next window.
   The drafter context catches up from the tap store only when a step drafts (`_catch_up`), so
   a step that skips the drafter costs what plain decoding costs, and a prefix that SGLang's
   radix cache serves seeds the context the same way;
6. `on_publish(new_seq_lens)` exactly once, then the V2 result with `next_draft_input`.

The scheduler owns request state, KV allocation and finishing (EOS, stop strings,
max_new_tokens): the worker never mutates a request (but to abort one whose custom logit
processor fails, in a verify row or in the prefill's sampler, as SGLang aborts a running
request); the result processor truncates an accepted run where a request finishes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch, ForwardMode,
                                                          get_required_capture_hidden_mode,
                                                          get_server_return_hidden_states_mode)
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

from sglang_dspark.decoding import DraftBlock, SamplingParams, sample_block, verify_greedy, verify_packed
from sglang_dspark.decoding.tree import DraftTree, accept_sampled, tree_slot_order
from sglang_dspark.decoding.verification import NO_TOKEN, TargetSampler, VerifyResult
from sglang_dspark.engine import verify_attention
from sglang_dspark.engine.grammar import (GrammarSteering, SlotLogits, apply_grammar_masks, guide_drafts,
                                          steer_walked_block)
from sglang_dspark.engine.lookup import SlotLookups
from sglang_dspark.engine.logit_processors import (apply_custom_logit_processors, isolated_prefill_processors,
                                                   reads_request)
from sglang_dspark.engine.penalties import OutputHistories, penalise_rows, penalties_of
from sglang_dspark.engine.planning import StepDecision, VerifyPlanner
from sglang_dspark.engine.records import RequestStep, StepRecord, StepRecorder
from sglang_dspark.engine.requests import StopBan, min_new_tokens_bans
from sglang_dspark.engine.settings import load_settings
from sglang_dspark.kernels_cpu.build import KernelUnavailable, vector_isa_supported
from sglang_dspark.kernels_cpu.cpu_attention import layer_fits
from sglang_dspark.kernels_cpu.draft_walk import KernelWalk, kernel_walk_fits
from sglang_dspark.kernels_cpu.drafter_ops import add_drafter_kernels
from sglang_dspark.kernels_cpu.layer_hooks import kernels_enabled as layer_kernels_enabled
from sglang_dspark.kernels_cpu.layer_ops import load_layer_ops, row_argmax
from sglang_dspark.kernels_cpu.gemm_layout import add_linear_panels, gemm_layout_mode, relayout_linears
from sglang_dspark.kernels_cpu.paged_attention import KeyLayout
from sglang_dspark.kernels_cpu.panel_gemm import PanelKernelUnavailable
from sglang_dspark.kernels_cpu.target_sampling import kernel_sampler, load_target_sampling
from sglang_dspark.model import DraftContextCache, TargetWeights, load_drafter
from sglang_dspark.model.cache import packed_rows
from sglang_dspark.runtime import cpu_has_native_bf16

logger = logging.getLogger(__name__)


TOP_K_OFF_THRESHOLD = 1 << 20
"""SGLang encodes "no top-k" as a huge k; anything at or above this means off."""

_ACTIVE_WORKER: "DSparkLiveWorker | None" = None


def active_worker() -> "DSparkLiveWorker | None":
    """The worker of this scheduler process (for the control plane), or None before it exists."""
    return _ACTIVE_WORKER


def sampling_params_of(batch: ScheduleBatch) -> SamplingParams:
    """Per-request temperature/top-p/top-k/min-p from SGLang's batch (its greedy is top_k == 1)."""
    info = batch.sampling_info
    top_k = info.top_ks.to(torch.long).reshape(-1).cpu()
    greedy = top_k <= 1
    temperature = info.temperatures.reshape(-1).float().cpu()
    return SamplingParams(
        temperature=torch.where(greedy, torch.zeros_like(temperature), temperature),
        top_p=info.top_ps.reshape(-1).float().cpu().clamp(min=1e-6, max=1.0),
        top_k=torch.where(greedy | (top_k >= TOP_K_OFF_THRESHOLD), torch.zeros_like(top_k), top_k),
        min_p=info.min_ps.reshape(-1).float().cpu().clamp(min=0.0, max=1.0),
    )


class DSparkLiveWorker(BaseSpecWorker):
    """The speculative worker SGLang's scheduler builds for `--speculative-algorithm DSPARK_LIVE`."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker) -> None:
        super().__init__()
        global _ACTIVE_WORKER
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.settings = load_settings(server_args.speculative_draft_model_path, server_args.dtype,
                                      getattr(server_args, "device", None))
        self.gamma = self.settings.gamma
        self.stride = self.settings.verify_window
        self.speculative_num_draft_tokens = self.stride
        self.enable_overlap = not server_args.disable_overlap_schedule
        self.drafter = self._load_drafter()
        self.model_runner.model.set_dflash_layers_to_capture(list(self.drafter.target_layer_ids))
        self.planner = VerifyPlanner(self.settings)
        self.recorder = StepRecorder(self.settings.max_records, self.settings.step_log)
        # drafting runs on the device, acceptance on host copies of the verify logits
        self.generator = torch.Generator(device=self.device).manual_seed(self.settings.seed)
        self.verify_generator = torch.Generator().manual_seed(self.settings.seed + 1)
        self.context: DraftContextCache | None = None
        self.tap_store: torch.Tensor | None = None
        self._slot_owner: dict[int, str] = {}
        self.lookups = SlotLookups() if self.settings.lookup != "off" else None
        self.output_histories = OutputHistories()
        self.vocab_size = self.model_runner.model_config.vocab_size
        self.row_argmax = _row_argmax_for(self.device)
        self.kernel_walk = _kernel_walk_for(self.drafter)
        self.target_sampler = _target_sampler_for(self.device)
        self._step = 0
        self._decode_ended: float | None = None  # when the last decode step returned (None: another forward since)
        self._scheduler_gap = 0.0  # the last seconds between two decode steps with no other forward between
        _ACTIVE_WORKER = self
        logger.info(
            "DSPARK_LIVE worker: drafter %s (%s), gamma %d, taps %s, planner %s (cost model %s, served offsets %s), "
            "overlap %s, verify attention %s, lookup drafts %s",
            self.settings.draft_path, self.drafter.dtype, self.gamma, list(self.drafter.target_layer_ids),
            self.settings.planner, self.settings.sps_path, "on" if self.planner.served_offsets else "off",
            self.enable_overlap, self.settings.verify_attention, self.settings.lookup,
        )

    # ------------------------------------------------------------------ set-up

    @property
    def draft_worker(self):
        return None

    def alloc_memory_pool(self, **kwargs) -> None:
        """Share the target's pools; size the drafter context cache to SGLang's request slots and
        the tap store to its KV slots."""
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()
        num_slots = int(self.req_to_token_pool.req_to_token.shape[0])
        self.context = self.drafter.new_cache(num_slots=num_slots, capacity=256)
        kv_rows = self._kv_rows = int(self.model_runner.token_to_kv_pool.get_key_buffer(0).shape[0])
        self.tap_store = torch.zeros((kv_rows, self.drafter.fc.in_features), dtype=self.model_runner.dtype,
                                     device=self.device)
        logger.info("DSPARK_LIVE: tap store of %d KV slots x %d (%.0f MB), radix cache %s", kv_rows,
                    self.tap_store.shape[1], self.tap_store.numel() * self.tap_store.element_size() / 2**20,
                    "off" if self.server_args.disable_radix_cache else "on")

    def _load_drafter(self):
        """Load the checkpoint sharing the target's embedding and lm_head tensors, in its dtype."""
        model = self.model_runner.model
        vocab = self.model_runner.model_config.vocab_size
        embed = model.model.embed_tokens.weight[:vocab]
        head = model.lm_head.weight[:vocab] if hasattr(model, "lm_head") else embed
        drafter = load_drafter(self.settings.draft_path, target=TargetWeights(embed_tokens=embed, lm_head=head))
        drafter = drafter.to(device=self.device, dtype=self._draft_dtype()).eval()
        if torch.device(self.device).type == "cpu" and gemm_layout_mode() == "auto":
            relayout_linears(drafter)
            try:
                logger.info("DSPARK_LIVE: %d drafter linears multiply small inputs through weight panels",
                            add_linear_panels(drafter))
            except PanelKernelUnavailable as error:
                logger.warning("DSPARK_LIVE: the drafter's linears use the BLAS (no weight panels): %s", error)
        if torch.device(self.device).type == "cpu" and layer_kernels_enabled():
            logger.info("DSPARK_LIVE: %d drafter norms and attentions run their small ops as kernel calls",
                        add_drafter_kernels(drafter))
        return drafter

    def _draft_dtype(self) -> torch.dtype:
        """`DSPARK_DRAFT_DTYPE`; `auto` is the target's dtype, except fp32 for a bf16/fp16 target on
        a CPU without native bf16 math where the weight panels cannot serve it: there torch's
        bf16 GEMM ran the small drafter ~2x slower than fp32. The panels widen bf16 weights in
        registers and the drafter is memory-bound, so with them bf16 halves the bytes it streams
        (AVX2 EPYC, session 24: draft 7.8 -> 5.8 ms a step at batch 1; block at batch 16 7.2 -> 4.5 ms)."""
        if self.settings.draft_dtype != "auto":
            return getattr(torch, self.settings.draft_dtype)
        target_dtype = self.model_runner.dtype
        if torch.device(self.device).type != "cpu" or target_dtype == torch.float32 or cpu_has_native_bf16():
            return target_dtype
        panels_serve_bf16 = vector_isa_supported() and gemm_layout_mode() == "auto"
        return target_dtype if target_dtype == torch.bfloat16 and panels_serve_bf16 else torch.float32

    # ----------------------------------------------------------------- dispatch

    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, grammar_barrier=None, *,
                                 pp_proxy_tensors=None) -> GenerationBatchResult:
        if batch.forward_mode.is_idle():
            return self._idle_result(on_publish)
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._forward_prefill(batch, on_publish)
        return self._forward_decode(batch, on_publish)

    def _idle_result(self, on_publish) -> GenerationBatchResult:
        self._decode_ended = None
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        if on_publish is not None:
            on_publish(empty)
        return GenerationBatchResult(
            logits_output=None, next_token_ids=empty, accept_lens=empty.to(torch.int32),
            next_draft_input=make_draft_input_v2(bonus_tokens=empty, new_seq_lens=empty),
            can_run_cuda_graph=False, speculative_num_draft_tokens=self.stride, new_seq_lens=empty,
        )

    # ------------------------------------------------------------------ prefill

    def _forward_prefill(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """Target extend capturing the taps of every new prompt position into the tap store."""
        self._decode_ended = None
        slots = batch.req_pool_indices.to(torch.long).cpu()
        prefix_lens = torch.tensor(batch.prefix_lens, dtype=torch.long)
        extend_lens = torch.tensor(batch.extend_lens, dtype=torch.long)
        self._align_context(slots, prefix_lens, [str(req.rid) for req in batch.reqs])
        with (_keeping_final_hidden(self.model_runner.model, batch.return_hidden_states),
              isolated_prefill_processors(batch.sampling_info, batch.reqs)):
            result = self._target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        taps = result.logits_output.hidden_states
        if taps is None or taps.shape[0] != int(extend_lens.sum()):
            raise RuntimeError(
                f"DSPARK_LIVE prefill: expected taps for {int(extend_lens.sum())} tokens from the target's aux "
                f"hidden capture, got {None if taps is None else tuple(taps.shape)}"
            )
        self._store_taps(batch.out_cache_loc, taps)
        if self.lookups is not None:
            for slot, req in zip(slots.tolist(), batch.reqs):
                self.lookups.reset(slot, list(req.get_fill_ids()))  # the tokens whose KV this extend completed
        result.logits_output.hidden_states = _prefill_hidden_states(batch, result.logits_output, extend_lens)
        result.logits_output.last_hidden_states = None
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(batch.seq_lens)
        result.next_draft_input = make_draft_input_v2(bonus_tokens=result.next_token_ids,
                                                      new_seq_lens=batch.seq_lens)
        self.recorder.note_prefill()
        return result

    def _align_context(self, slots: torch.Tensor, prefix_lens: torch.Tensor, rids: list[str]) -> None:
        """Before an extend, a slot's context must hold no more than the request's own prefix: a
        chunked prefill's next chunk keeps its context, a new request (or a retracted one back)
        in a slot cuts it to what is still its own. `_catch_up` fills in the rest (the radix
        cache's prefix too) from the tap store when the slot next drafts."""
        same_owner = torch.tensor([self._slot_owner.get(int(slot)) == rid for slot, rid in zip(slots.tolist(), rids)])
        for slot, rid in zip(slots.tolist(), rids):
            self._slot_owner[slot] = rid
        kept = torch.where(same_owner, torch.minimum(self.context.lengths[slots], prefix_lens), torch.zeros_like(prefix_lens))
        self.context.truncate(slots, kept)

    def _catch_up(self, slots: torch.Tensor, seq_lens: torch.Tensor) -> int:
        """Project each slot's committed taps the drafter context has not seen yet, read from the
        tap store at the request's KV slots (one batched projection for every skipped step);
        returns how many."""
        lengths = self.context.lengths[slots].cpu()
        missing = seq_lens - lengths
        rows = missing > 0
        if not bool(rows.any()):
            return 0
        slots, lengths, missing = slots[rows], lengths[rows], missing[rows]
        request, offset = packed_rows(missing)
        req_to_token = self.req_to_token_pool.req_to_token
        kv_slots = req_to_token[slots[request].to(req_to_token.device),
                                (lengths[request] + offset).to(req_to_token.device)].to(torch.long)
        self.drafter.append_context(self.context, slots, self.tap_store[kv_slots.to(self.device)], missing)
        return int(missing.sum())

    def _store_taps(self, kv_slots: torch.Tensor, taps: torch.Tensor) -> None:
        """Keep committed tokens' taps beside their KV, where `_catch_up` reads them."""
        self.tap_store[kv_slots.to(device=self.device, dtype=torch.long)] = taps.to(self.tap_store.dtype)

    # ------------------------------------------------------------------- decode

    def _forward_decode(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        started = time.perf_counter()
        between_steps = None if self._decode_ended is None else started - self._decode_ended
        batch_size = len(batch.reqs)
        slots = batch.req_pool_indices.to(torch.long).cpu()
        seq_lens = batch.seq_lens.to(torch.long).cpu()
        bonus = batch.spec_info.bonus_tokens.to(torch.long).reshape(-1).cpu()
        params = sampling_params_of(batch)
        if not bool((self.context.lengths[slots].cpu() <= seq_lens).all()):
            raise RuntimeError(
                f"DSPARK_LIVE: drafter context lengths {self.context.lengths[slots].tolist()} exceed the "
                f"committed lengths {seq_lens.tolist()} (slots {slots.tolist()})"
            )

        rids = [req.rid for req in batch.reqs]
        times, clock = DraftTimes(), time.perf_counter()
        decision = self.planner.decide(rids, seq_lens)
        times.decide, clock = _lap(clock)
        caught_up = 0
        proposals, lookup_lens, lookup_matches = [], None, None
        if decision.lookups and (decision.draft or self.planner.verifies_lookups_on_skipped_steps):
            # lookups cost no drafting, so they span the whole block whatever width the drafter runs at
            proposals, lookup_lens, lookup_matches = self._lookup_proposals(slots, bonus, seq_lens, params,
                                                                            self.settings.gamma)
            lookup_seconds, clock = _lap(clock)
            times.decide += lookup_seconds
        has_lookups = lookup_lens is not None and bool((lookup_lens > 0).any())
        if decision.draft or has_lookups:
            # requests with lookup drafts skip the drafter (their context catches up when they next draft)
            walked = torch.full((batch_size,), decision.draft, dtype=torch.bool)
            if has_lookups:
                walked &= lookup_lens == 0
            block = tree_base = None
            if bool(walked.any()):
                every_row = bool(walked.all())
                rows = walked.nonzero().squeeze(-1)
                own = (slots, bonus, seq_lens, params) if every_row else (
                    slots[rows], bonus[rows], seq_lens[rows], params.select(rows))
                caught_up = self._catch_up(own[0], own[2])
                times.catch_up, clock = _lap(clock)
                self.planner.draft_costs.add_catch_up(caught_up, times.catch_up)
                constrained = None if not (batch.has_grammar and self.settings.grammar_steering) else (
                    batch.reqs if every_row else [batch.reqs[int(row)] for row in rows])
                block, tree_base = self._draft_block(own[0], own[1], own[3], decision.draft_width, times,
                                                     constrained, self._grows_tree(batch, params))
                clock = time.perf_counter()
                self.planner.draft_costs.add(len(rows), decision.draft_width, times.block, times.walk)
            draft = block if not has_lookups else self._with_lookup_drafts(block, walked, proposals, params,
                                                                           self.settings.gamma)
            grammar_lens = guide_drafts(draft, batch.reqs, params.greedy, self.vocab_size, self._draft_columns) \
                if batch.has_grammar else None
            plan = self.planner.plan(rids, draft.confidence_logits, seq_lens, decision, greedy=params.greedy,
                                     lookup_lens=lookup_lens if has_lookups else None, grammar_lens=grammar_lens,
                                     lookup_matches=lookup_matches if has_lookups else None)
            tree, plan = self._tree_plan(tree_base, int(bonus[0]), plan, draft.tokens[0].tolist(),
                                         bool(params.greedy[0]))
            times.plan, _ = _lap(clock)
            drafts = draft.tokens
        else:  # drafts would cost more than they return: this step is a plain decode step
            tree = None
            draft = _empty_block(batch_size, sampled=not bool(params.greedy.all()))
            plan = self.planner.skipped(rids, seq_lens)
            drafts = draft.tokens[:, :0].to(self.device)
        drafted = time.perf_counter()

        logits, taps, window_kv_slots, final_hidden, forward_seconds = self._verify_forward(
            batch, slots, seq_lens, bonus, drafts, plan.verify_lens, tree)
        verified = time.perf_counter()
        penalties = [penalties_of(req.sampling_params) for req in batch.reqs]
        histories = self.output_histories.refresh(batch.reqs, bonus, seq_lens, [
            request_penalties.active or reads_request(req) for req, request_penalties in zip(batch.reqs, penalties)])
        logprob_rows = None
        tree_accepted: list[int] = []
        if tree is not None:  # a lone request with plain rows: they are the target's own logits
            window_lens = torch.tensor([tree.rows])
            chain = draft.tokens[0, : int(plan.verify_lens[0])].tolist()
            if bool(params.greedy[0]):
                tree_accepted, committed_tokens = tree.accept_greedy(self.row_argmax(logits).cpu().tolist())
            else:  # the chain's drafts are tested as a chain verify would (`_tree_plan`: the tree holds them)
                tree_accepted, committed_tokens = accept_sampled(tree, logits.cpu(), params, self.verify_generator,
                                                                 self.target_sampler, draft, len(chain))
            chain_accepted = _chain_accepted(chain, committed_tokens)
            outcome = _tree_outcome(committed_tokens, self.stride)
        else:
            window_lens = plan.verify_lens + 1
            _ban_stop_tokens(logits, min_new_tokens_bans(batch.reqs), seq_lens, window_lens)
            penalise_rows(logits, batch.reqs, penalties, histories, drafts, window_lens)
            if batch.has_grammar:
                apply_grammar_masks(logits, batch.reqs, bonus, drafts, window_lens, logits.shape[1])
            _add_logit_bias(logits, batch.sampling_info.logit_bias, window_lens)
            apply_custom_logit_processors(logits, batch.sampling_info, batch.reqs, histories, drafts, window_lens)
            # the rows acceptance reads, laid out for SGLang's spec logprobs when a request asks for them
            logprob_rows = _rows_at_stride(logits, window_lens, self.stride) if batch.return_logprob else None
            target_argmax = self.row_argmax(logits).cpu()
            if bool(params.greedy.all()):  # the logits are never copied or padded
                outcome = verify_greedy(draft.tokens, _pad_rows(target_argmax, window_lens), plan.verify_lens)
            else:  # only sampled requests' rows become distributions
                outcome = verify_packed(draft, logits.cpu(), plan.verify_lens, params, self.verify_generator,
                                        target_argmax=target_argmax, sampler=self.target_sampler)
            chain_accepted = outcome.num_accepted
        accept_lens = outcome.num_accepted + 1
        self.output_histories.commit(batch.reqs, outcome.tokens, accept_lens)
        new_seq_lens = seq_lens + accept_lens
        if tree is not None:  # the bonus row, then the accepted nodes' rows, whose slots take their positions
            kept = [0] + tree_accepted
            self._store_taps(window_kv_slots[kept], taps[kept])
            self._take_tree_slots(int(slots[0]), int(seq_lens[0]), window_kv_slots[1:].tolist(), tree_accepted)
        elif decision.draft or has_lookups:
            committed = _committed_rows(window_lens, accept_lens)
            self._store_taps(window_kv_slots[committed], taps[committed])
        else:
            self._store_taps(window_kv_slots, taps)  # a one-token step commits every row
        rows = torch.arange(batch_size)
        new_bonus = outcome.tokens[rows, outcome.num_accepted]
        if self.lookups is not None:  # committed: the bonus and the accepted drafts
            looked_up = [False] * batch_size if plan.lookup_lens is None else (
                (plan.lookup_lens > 0) & (plan.verify_lens > 0)).tolist()
            # host lists once: indexing the tensors per request cost ~0.1 ms a step at batch 16
            for slot, accepted, first, tokens, observed in zip(slots.tolist(), outcome.num_accepted.tolist(),
                                                               bonus.tolist(), outcome.tokens.tolist(), looked_up):
                if observed:
                    self.lookups.observe(slot, accepted)
                self.lookups.commit(slot, [first] + tokens[:accepted])
        if on_publish is not None:
            on_publish(new_seq_lens.to(self.device))

        next_tokens = torch.zeros((batch_size, self.stride), dtype=torch.int64)
        next_tokens[:, : outcome.tokens.shape[1]] = outcome.tokens.clamp(min=0)
        logits_output = None
        if logprob_rows is not None:
            logits_output = LogitsProcessorOutput(next_token_logits=logprob_rows)
            compute_spec_logprobs(batch, logits_output, next_tokens.reshape(-1).to(self.device),
                                  chain_stride=self.stride)
            logits_output.next_token_logits = None  # the scheduler reads only the logprobs
        if final_hidden is not None:  # request b's output token j came from its window row j
            logits_output = logits_output or LogitsProcessorOutput(next_token_logits=None)
            logits_output.hidden_states = _rows_at_stride(final_hidden, window_lens, self.stride)
        self._record(batch, rids, slots, seq_lens, params, plan, outcome.num_accepted, chain_accepted,
                     started, drafted, verified, decision, caught_up, times, forward_seconds, between_steps,
                     0 if tree is None else tree.rows - 1)
        result = GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=next_tokens.reshape(-1).to(self.device),
            accept_lens=accept_lens.to(device=self.device, dtype=torch.int32),
            cap_lens=window_lens.to(device=self.device, dtype=torch.int32),
            new_seq_lens=new_seq_lens.to(self.device),
            next_draft_input=make_draft_input_v2(bonus_tokens=new_bonus.to(self.device),
                                                 new_seq_lens=new_seq_lens.to(self.device)),
            can_run_cuda_graph=False,
            speculative_num_draft_tokens=self.stride,
        )
        self._decode_ended = time.perf_counter()  # the next step's between_steps_seconds counts from here
        return result

    def _draft_block(self, slots: torch.Tensor, bonus: torch.Tensor, params: SamplingParams, width: int,
                     times: DraftTimes, reqs: list | None = None, grows_tree: bool = False
                     ) -> tuple[DraftBlock, torch.Tensor | None]:
        """The drafter's block forward and Markov walk for these requests (timed into `times`), and
        where the lone request `grows_tree` (`_grows_tree`) its whole block's slot logits
        `[gamma, V_draft]`, which the tree grows from once the plan is made (None otherwise).
        `reqs` (given when the batch holds grammars to steer by): the walk kernel walks first and
        rows are drawn again, steered, from a draft their grammar refuses; without the kernel the
        whole walk is steered (`engine.grammar`)."""
        clock = time.perf_counter()
        width = self.gamma if grows_tree else width
        hidden = self.drafter.forward_block(self.context, slots, bonus, width)
        times.block, clock = _lap(clock)
        tree_base = None
        if self.kernel_walk is None:
            steering = None if reqs is None else GrammarSteering(reqs, self.vocab_size, self._draft_ids)
            try:
                draft = sample_block(self.drafter, hidden, bonus.to(self.device), params.to(self.device),
                                     self.generator, steering=steering if steering and steering.steers else None)
            finally:
                if steering is not None:
                    steering.close()
        else:
            base = self.kernel_walk.base_logits(hidden)  # the steering reads them too
            if bool(params.greedy.all()):
                draft = self.kernel_walk.greedy(hidden, bonus, base)
            else:
                draft = self.kernel_walk.sampled(hidden, bonus, params, self.generator, base)
            if reqs is not None:
                steer_walked_block(draft, reqs, params, bonus, self.vocab_size, self._draft_ids,
                                   self._slot_logits(hidden, base), self.generator)
            if grows_tree:
                tree_base = base[0]
        times.walk, _ = _lap(clock)
        return draft, tree_base

    def _grows_tree(self, batch: ScheduleBatch, params: SamplingParams) -> bool:
        """Whether this step verifies a tree instead of a chain (`DSPARK_TREE_NODES`; 0: never): only
        for a lone request, greedy or sampled, with the walk kernel, where the paged kernel verifies
        (`_trees_verifiable`). Requests whose verify rows SGLang's sampler would change (penalties,
        grammars, logit bias, custom processors, min_new_tokens) or that ask for logprobs or hidden
        states keep the chain: a tree is accepted on the target's own distributions."""
        return (self.settings.tree_nodes > 0 and self.kernel_walk is not None and len(batch.reqs) == 1
                and _plain_rows(batch) and self._trees_verifiable)

    @cached_property
    def _trees_verifiable(self) -> bool:
        """Whether every attention layer of the target verifies through the paged kernel, the one
        verify attention that takes a tree window (each row attends to its own ancestry)."""
        if torch.device(self.device).type != "cpu" or self.settings.verify_attention != "linear":
            return False
        from sglang.srt.layers.radix_attention import RadixAttention

        layers = [module for module in self.model_runner.model.modules() if isinstance(module, RadixAttention)]
        cache_dtype = self.model_runner.token_to_kv_pool.get_key_buffer(0).dtype
        return bool(layers) and all(layer_fits(layer, self.model_runner.dtype, cache_dtype) for layer in layers)

    def _tree_plan(self, base: torch.Tensor | None, bonus: int, plan, chain: list[int], greedy: bool
                   ) -> tuple[DraftTree | None, object]:
        """The tree grown from the block's slot logits `base` where the plan verifies k >= 1 drafts
        of the chain (None otherwise): 2k + 1 nodes, at most `DSPARK_TREE_NODES`. The planner's k
        is what the cost model lets a chain verify at this context, so the tree's rows shrink with
        it where rows grow dear (each row attends to the whole context: ~2.5 ms a row at 3,500
        tokens against ~0.3 at 300 on the Zen 4 CPU). And the plan, its chain's verify length the
        part of the chain the tree holds, so the calibration learns from exactly those drafts; the
        cost table learns the rows the step really verifies. Greedy, the chain is the drafter's
        argmax walk, which the best-first tree mostly holds: its verify length is cut to what the
        tree holds (`_chain_accepted`). Sampled, the chain's drafts were drawn from the drafter and
        may leave the tree; the tree holds its k drafts too, and as many of the best nodes as fit
        beside them: on the chain's rows its drafts are tested by rejection sampling first
        (`decoding.tree.accept_sampled`), so the walk accepts at least what the chain would, and
        the chain's own outcome is read off the walk (`_chain_accepted`)."""
        planned = int(plan.verify_lens[0])
        if base is None or planned < 1:
            return None, plan
        nodes = min(self.settings.tree_nodes, 2 * planned + 1)
        if greedy:
            tree = self.kernel_walk.tree(base, bonus, nodes)
            plan.verify_lens[0] = min(planned, tree.chain_depth(chain))
        else:
            best, held = self.kernel_walk.tree(base, bonus, nodes), chain[: min(planned, nodes)]
            kept = nodes
            while (tree := best.first(kept).with_path(held)).rows - 1 > nodes:  # ends by kept = nodes - len(held)
                kept -= tree.rows - 1 - nodes
            plan.verify_lens[0] = len(held)
        if plan.step_shape is not None:
            plan = dataclasses.replace(plan, step_shape=dataclasses.replace(plan.step_shape, batch_tokens=tree.rows))
        return tree, plan

    def _take_tree_slots(self, slot: int, committed: int, node_slots: list[int], accepted_rows: list[int]) -> None:
        """Give the request's positions past its bonus the KV slots where its accepted nodes' KV
        was computed (`decoding.tree_slot_order`: the window's own slots, reordered)."""
        req_to_token = self.req_to_token_pool.req_to_token
        order = tree_slot_order(node_slots, accepted_rows)
        req_to_token[slot, committed + 1: committed + 1 + len(order)] = torch.tensor(order, dtype=req_to_token.dtype,
                                                                                  device=req_to_token.device)

    def _slot_logits(self, hidden: torch.Tensor, base: torch.Tensor) -> SlotLogits:
        """The drafter's logits and confidences at one slot of this block, from its base logits
        (`engine.grammar.SlotLogits`)."""
        def slot_logits(rows: torch.Tensor, slot: int, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            rows = rows.to(hidden.device)
            slot_hidden = hidden[rows, slot]
            prev = prev.to(hidden.device)
            bias, _ = self.drafter.markov_bias(prev, slot_hidden, None)
            logits = base[rows, slot].float() + bias.float()
            confidences = self.drafter.confidence_logits(slot_hidden, prev) if self.drafter.has_confidence_head else None
            return logits, confidences
        return slot_logits

    def _lookup_proposals(self, slots: torch.Tensor, bonus: torch.Tensor, seq_lens: torch.Tensor,
                          params: SamplingParams, width: int
                          ) -> tuple[list[list[int]], torch.Tensor | None, torch.Tensor | None]:
        """Each eligible request's lookup drafts (`engine.lookup`; `[]`: none), their counts [B]
        and the lengths of the matches that proposed them [B] (None, None: lookups off, or no
        eligible request). A sampled request's lookup is a point mass on each draft, which the
        draft distribution can hold only inside the draft vocabulary: one that leaves it is not
        proposed."""
        sampled_too = self.settings.lookup == "on"
        if self.lookups is None or not (sampled_too or bool(params.greedy.any())):
            return [], None, None
        greedy = params.greedy.tolist()
        eligible = [True] * len(greedy) if sampled_too else greedy
        found = self.lookups.propose(slots.tolist(), bonus.tolist(), seq_lens.tolist(), eligible, width)
        found = [(tokens, match) if is_greedy or not tokens or bool((self._draft_columns(tokens) >= 0).all())
                 else ([], 0) for (tokens, match), is_greedy in zip(found, greedy)]
        return ([tokens for tokens, _ in found], torch.tensor([len(tokens) for tokens, _ in found], dtype=torch.long),
                torch.tensor([match for _, match in found], dtype=torch.long))

    @cached_property
    def _d2t_cpu(self) -> torch.Tensor | None:
        """The draft-to-target id map on the CPU, where lookups are proposed (copied once, not per row)."""
        return None if self.drafter.d2t is None else self.drafter.d2t.cpu()

    @cached_property
    def _draft_ids(self) -> torch.Tensor:
        """The target id of each column of the drafter's logits."""
        return self._d2t_cpu if self._d2t_cpu is not None else torch.arange(self.drafter.config.draft_vocab_size)

    def _draft_columns(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """Target token ids -> their columns in the draft distribution (-1: outside the draft vocabulary)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        d2t = self._d2t_cpu
        if d2t is None:
            return tokens
        columns = torch.searchsorted(d2t, tokens).clamp(max=d2t.numel() - 1)
        return torch.where(d2t[columns] == tokens, columns, -1)

    def _with_lookup_drafts(self, block: DraftBlock | None, walked: torch.Tensor, proposals: list[list[int]],
                            params: SamplingParams, width: int) -> DraftBlock:
        """The step's block: the drafter's rows where `walked`, lookup drafts elsewhere: a point mass
        on each draft for sampled rows (rejection sampling then accepts a draft with the target's
        probability of it, and on rejection samples the target's distribution without it), never
        read for greedy rows (zeros); lookup rows' confidences are replaced by the lookup survivals
        (zeros here)."""
        batch = len(walked)
        tokens = torch.tensor([tokens or [0] * width for tokens in proposals], dtype=torch.long)
        has_head = self.drafter.has_confidence_head
        confidences = torch.zeros((batch, width), dtype=torch.float32) if has_head else None
        sampled = not bool(params.greedy.all())
        probs = torch.zeros((batch, width, self.drafter.config.draft_vocab_size), dtype=torch.float32) if sampled else None
        if sampled:
            greedy, positions = params.greedy.tolist(), torch.arange(width)
            for row, lookup in enumerate(proposals):  # (a step that skipped the drafter walks no row)
                if lookup and not greedy[row]:
                    probs[row, positions, self._draft_columns(lookup)] = 1.0
        if block is not None:  # the drafter's rows: its width, zeros past it (never verified)
            drafted = block.tokens.shape[1]
            tokens = tokens.to(block.tokens.device)
            tokens[walked, :drafted] = block.tokens
            if confidences is not None:
                confidences[walked, :drafted] = block.confidence_logits.float().cpu()
            if probs is not None and block.probs is not None:  # (None: every walked row is greedy)
                probs = probs.to(block.probs.device)
                probs[walked, :drafted] = block.probs
        return DraftBlock(tokens=tokens, probs=probs, confidence_logits=confidences,
                          probs_vocab=self.drafter.d2t if sampled else None)

    def _attention_backends(self) -> list:
        runner = self.model_runner
        return list({id(b): b for b in (runner.attn_backend, getattr(runner, "decode_attn_backend", None)) if b}.values())

    def _install_verify_attention(self) -> None:
        """Wrap the target's attention backends (they exist only after SGLang's late init)."""
        if self.settings.verify_attention == "linear":
            for backend in self._attention_backends():
                verify_attention.install(backend)

    def _verify_forward(self, batch: ScheduleBatch, slots: torch.Tensor, seq_lens: torch.Tensor,
                        bonus: torch.Tensor, drafts: torch.Tensor, verify_lens: torch.Tensor,
                        tree: DraftTree | None = None):
        """One TARGET_VERIFY forward over each request's `[bonus, first verify_lens[b] drafts]`.

        Returns packed logits `[sum(w), V]` (on the device), taps `[sum(w), m*d]`, the window rows' KV slots,
        when a request of the batch asks for hidden states, the target's final hidden states `[sum(w), d]` (else
        None), and the seconds of the target forward alone. The window's KV slots were reserved by the
        scheduler (`eagle_prepare_for_decode`: 2 x window past the committed length).

        `tree` (batch 1): the window is `[bonus, tree nodes]` instead, each node at the position
        after its parent's, attending to the prefix and its own ancestry (`verify_attention.tree_window`).
        """
        self._install_verify_attention()
        req_to_token = self.req_to_token_pool.req_to_token
        tree_layout = None
        if tree is None:
            window_lens = verify_lens + 1
            request, offset = packed_rows(window_lens)
            windows = torch.cat((bonus[:, None], drafts.cpu()), dim=1)
            input_ids = windows[request, offset].to(self.device)
            positions = seq_lens[request] + offset
            out_cache_loc = req_to_token[slots[request].to(req_to_token.device),
                                         positions.to(req_to_token.device)].to(torch.int64).cpu()
        else:
            committed, slot = int(seq_lens[0]), int(slots[0])
            window_lens = torch.tensor([tree.rows])
            input_ids = torch.tensor([int(bonus[0])] + tree.tokens, device=self.device)
            positions = committed + torch.tensor([0] + tree.depths)
            window_slots = req_to_token[slot, committed: committed + tree.rows]
            out_cache_loc = window_slots.to(torch.int64).cpu()
            tree_layout = KeyLayout.for_tree(req_to_token[slot, :committed], window_slots,
                                             [tree.ancestry(row) for row in range(tree.rows)], self._kv_rows)
        spans = (seq_lens, window_lens)
        if bool((out_cache_loc <= 0).any()):
            raise RuntimeError("DSPARK_LIVE verify: a window slot was not reserved by the scheduler (KV id 0)")

        saved = (batch.forward_mode, batch.input_ids, batch.out_cache_loc, batch.spec_info)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = input_ids
        batch.out_cache_loc = out_cache_loc.to(self.device)
        batch.spec_info = DFlashVerifyInput(draft_token=input_ids, positions=positions.to(self.device),
                                            draft_token_num=self.stride, capture_hidden_mode=CaptureHiddenMode.FULL)
        calls_before = verify_attention.linear_calls(self._attention_backends())
        try:
            forward_batch = ForwardBatch.init_new(batch, self.model_runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                                  return_hidden_states_before_norm=False)
            _reshape_as_extend(forward_batch, *spans, self.device)
            trees = nullcontext() if tree_layout is None else verify_attention.tree_window(
                self._attention_backends(), tree_layout)
            with _keeping_final_hidden(self.model_runner.model, batch.return_hidden_states), trees:
                forward_started = time.perf_counter()
                result = self._target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch,
                                                                      is_verify=True)
                forward_seconds = time.perf_counter() - forward_started
        finally:
            batch.forward_mode, batch.input_ids, batch.out_cache_loc, batch.spec_info = saved
        if self.settings.verify_attention == "linear" and (
                verify_attention.linear_calls(self._attention_backends()) == calls_before):
            raise RuntimeError("DSPARK_LIVE verify: the linear verify attention was not used (SGLang's "
                               "forward path changed?); set DSPARK_VERIFY_ATTENTION=native to serve anyway")
        output = result.logits_output
        logits = output.next_token_logits[:, : self.vocab_size]
        if output.hidden_states is None or output.hidden_states.shape[0] != logits.shape[0]:
            raise RuntimeError("DSPARK_LIVE verify: the target returned no taps for the verify window")
        final_hidden = _final_hidden_states(output, logits.shape[0]) if batch.return_hidden_states else None
        return logits, output.hidden_states.cpu(), out_cache_loc, final_hidden, forward_seconds

    # ------------------------------------------------------------------ records

    def _record(self, batch, rids, slots, seq_lens, params, plan, num_accepted, chain_accepted, started, drafted,
                verified, decision: StepDecision, caught_up: int, times: DraftTimes, forward_seconds: float,
                between_steps: float | None, tree_drafts: int = 0):
        self._step += 1
        finished = time.perf_counter()
        committed = int(num_accepted.sum()) + len(rids)
        # a drafting step's seconds as if every step drafted: the catch-up it paid for skipped
        # steps is replaced by the steady cost of projecting this step's committed tokens
        steady_seconds = finished - started - times.catch_up + (
            self.planner.draft_costs.catch_up_seconds(committed) if decision.draft else 0.0)
        # the scheduler's seconds between two decode steps (~1.4 ms at batch 16) are paid once a
        # step whatever it commits, so the speculate-or-plain check counts them; where a prefill
        # ran in between (None) the last clean gap stands in
        if between_steps is not None:
            self._scheduler_gap = between_steps
        self.planner.observe(plan, rids, target_seconds=finished - drafted,
                             step_seconds=steady_seconds + self._scheduler_gap, committed_tokens=committed,
                             drafted=decision.draft)
        self.planner.observe_rounds(plan, chain_accepted, params.greedy)  # the chain's drafts are calibrated
        observe_seconds = time.perf_counter() - finished  # a refit stalls the scheduler here, unseen otherwise
        no_head = [[] for _ in rids]  # a drafter without a confidence head predicts no survivals
        confidences = no_head if plan.confidence_logits is None else plan.confidence_logits.tolist()
        survivals = no_head if plan.survivals is None else plan.survivals.tolist()
        verify_lens = plan.verify_lens.tolist()
        accepted = num_accepted.tolist()
        lookup_drafts = [0] * len(rids) if plan.lookup_lens is None else plan.lookup_lens.tolist()
        lookup_matches = [0] * len(rids) if plan.lookup_matches is None else plan.lookup_matches.tolist()
        tree_gain = accepted[0] - int(chain_accepted[0]) if tree_drafts else 0
        requests = [
            RequestStep(rid=str(rid), slot=int(slot), context_len=int(length), verify_len=verify_lens[b],
                        accepted=accepted[b], temperature=float(params.temperature[b]),
                        confidence_logits=confidences[b], survivals=survivals[b], lookup_drafts=lookup_drafts[b],
                        lookup_match=lookup_matches[b], tree_drafts=tree_drafts if b == 0 else 0,
                        tree_gain=tree_gain if b == 0 else 0)
            for b, (rid, slot, length) in enumerate(zip(rids, slots.tolist(), seq_lens.tolist()))
        ]
        self.recorder.add(StepRecord(
            step=self._step, wall_time=time.time(), batch_size=len(rids), capacity=plan.capacity,
            verify_tokens=1 + tree_drafts if tree_drafts else sum(verify_lens) + len(rids), accepted_tokens=sum(accepted),
            committed_tokens=sum(accepted) + len(rids), predicted_seconds=plan.predicted_seconds,
            measured_seconds=finished - started, draft_seconds=drafted - started,
            verify_seconds=verified - drafted, overlap=self.enable_overlap, drafted=decision.draft,
            vetoed=decision.vetoed, catch_up_rows=caught_up, catch_up_seconds=times.catch_up,
            decide_seconds=times.decide, block_seconds=times.block, walk_seconds=times.walk,
            plan_seconds=times.plan, forward_seconds=forward_seconds, between_steps_seconds=between_steps,
            observe_seconds=observe_seconds, requests=requests,
        ))


@contextmanager
def _keeping_final_hidden(model, wanted: bool) -> Iterator[None]:
    """Have the target's logits processor hand back its final (normed) hidden states, beside the
    taps it returns as `hidden_states`, for a forward whose batch has a request that asks for
    them (`return_hidden_states`): SGLang's processor keeps them, as `last_hidden_states`, when
    `keep_last_hidden_states` is set (its aux-capture feature sets it at launch)."""
    if not wanted:
        yield
        return
    processor = getattr(model, "logits_processor", None)
    if processor is None or not hasattr(processor, "keep_last_hidden_states"):
        raise RuntimeError(f"DSPARK_LIVE: the target {type(model).__name__} has no logits processor that can keep "
                           "its final hidden states, so return_hidden_states cannot be served")
    saved = processor.keep_last_hidden_states
    processor.keep_last_hidden_states = True
    try:
        yield
    finally:
        processor.keep_last_hidden_states = saved


def _final_hidden_states(output: LogitsProcessorOutput, rows: int) -> torch.Tensor:
    """The final hidden states of a forward run under `_keeping_final_hidden`, one per row."""
    final = output.last_hidden_states
    if final is None or final.shape[0] != rows:
        raise RuntimeError(f"DSPARK_LIVE: expected the target's final hidden states for {rows} rows, got "
                           f"{None if final is None else tuple(final.shape)}")
    return final


def _prefill_hidden_states(batch: ScheduleBatch, output: LogitsProcessorOutput,
                           extend_lens: torch.Tensor) -> torch.Tensor | None:
    """What plain serving's prefill returns as `hidden_states` for a batch that asks for them, in
    the layout SGLang's result processor reads (`_append_prefill_hidden_states`): every extend
    token's final hidden state when it reads the FULL mode, each request's last one when LAST."""
    if not batch.return_hidden_states:
        return None
    final = _final_hidden_states(output, int(extend_lens.sum()))
    mode = get_required_capture_hidden_mode(max(batch.return_hidden_states_mode, get_server_return_hidden_states_mode()),
                                            batch.spec_info)
    if mode.is_full():
        return final
    return final[(torch.cumsum(extend_lens, 0) - 1).to(final.device)]


def _reshape_as_extend(forward_batch: ForwardBatch, seq_lens: torch.Tensor, window_lens: torch.Tensor,
                       device) -> None:
    """Give the TARGET_VERIFY forward the extend-over-prefix fields attention backends read.

    The linear verify attention reads the spans from the `*_cpu` extend fields; SGLang's own
    torch_native extend (`DSPARK_VERIFY_ATTENTION=native`) reads the tensors and grown seq_lens.
    """
    total = seq_lens + window_lens
    forward_batch.extend_prefix_lens = seq_lens.to(device=device, dtype=torch.int32)
    forward_batch.extend_seq_lens = window_lens.to(device=device, dtype=torch.int32)
    forward_batch.extend_prefix_lens_cpu = seq_lens.tolist()
    forward_batch.extend_seq_lens_cpu = window_lens.tolist()
    forward_batch.extend_num_tokens = int(window_lens.sum())
    forward_batch.extend_start_loc = (torch.cumsum(window_lens, 0) - window_lens).to(device=device, dtype=torch.int32)
    forward_batch.seq_lens = total.to(device=device, dtype=forward_batch.seq_lens.dtype)
    forward_batch.seq_lens_cpu = total.clone()
    forward_batch.seq_lens_sum = int(total.sum())


def _empty_block(batch_size: int, sampled: bool) -> DraftBlock:
    """A stand-in block for a step that did not draft: one never-verified slot per request, so
    `verify_packed` samples every request's next token from the target alone (the draft
    distribution, never read, spans no columns)."""
    probs = torch.zeros((batch_size, 1, 0)) if sampled else None
    return DraftBlock(tokens=torch.zeros((batch_size, 1), dtype=torch.long), probs=probs, confidence_logits=None,
                      probs_vocab=torch.zeros(0, dtype=torch.long) if sampled else None)


def _rows_at_stride(packed: torch.Tensor, lengths: torch.Tensor, stride: int) -> torch.Tensor:
    """`[sum(lengths), V]` verify rows -> `[B * stride, V]`, request b's row j at `b * stride + j`
    (the rest zeros): the layout in which SGLang's `compute_spec_logprobs` pairs output token
    (b, j) with the logits row that chose it."""
    request, offset = packed_rows(lengths)
    out = packed.new_zeros((len(lengths) * stride, packed.shape[1]))
    out[(request * stride + offset).to(packed.device)] = packed
    return out


def _pad_rows(packed: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`[sum(lengths), ...]` -> `[B, max(lengths), ...]` (rows past a request's length are zeros):
    the verify rows' argmax ids, as `verify_greedy` takes them."""
    width = int(lengths.max())
    if int(lengths.min()) == width:  # equal windows (always at batch 1): a view, no copy
        return packed.view(len(lengths), width, *packed.shape[1:])
    request, offset = packed_rows(lengths)
    out = packed.new_zeros((len(lengths), width, *packed.shape[1:]))
    out[request, offset] = packed
    return out


@dataclass
class DraftTimes:
    """Where a step's seconds before the verify forward went (zeros for parts it skipped)."""

    decide: float = 0.0  # the planner's draft-or-skip decision and width, and the lookup proposals
    catch_up: float = 0.0  # committed taps projected into the drafter context
    block: float = 0.0  # the drafter's parallel block forward
    walk: float = 0.0  # the Markov walk sampling the drafts, with their confidences
    plan: float = 0.0  # the verify lengths from the survivals, and a lone request's tree grown to fit them


def _lap(since: float) -> tuple[float, float]:
    """Seconds since `since`, and now (the next lap's start)."""
    now = time.perf_counter()
    return now - since, now


def _row_argmax_for(device) -> Callable[[torch.Tensor], torch.Tensor]:
    """The C++ row argmax on a CPU (3-9x torch's on verify logits), torch's elsewhere or, with a
    warning, where the kernel cannot be built."""
    if torch.device(device).type != "cpu":
        return lambda logits: logits.argmax(-1)
    try:
        load_layer_ops()
    except KernelUnavailable as error:
        logger.warning("DSPARK_LIVE: acceptance uses torch's argmax (no C++ row argmax: %s)", error)
        return lambda logits: logits.argmax(-1)
    return row_argmax


def _kernel_walk_for(drafter) -> KernelWalk | None:
    """The one-call C++ walk on a CPU (greedy: 0.5 against 2.1 ms for a 7-slot block at batch 1
    here), or None: other devices, gated/RNN Markov heads, `DSPARK_CPU_LAYER_OPS=torch`, and (with
    a warning) a CPU where the kernel cannot be built walk with `decoding.sample_block`."""
    if not kernel_walk_fits(drafter) or not layer_kernels_enabled():
        return None
    try:
        return KernelWalk(drafter, head_panels=gemm_layout_mode() == "auto")
    except KernelUnavailable as error:
        logger.warning("DSPARK_LIVE: blocks walk in torch (no C++ walk: %s)", error)
        return None


def _target_sampler_for(device) -> TargetSampler | None:
    """The C++ target sampling for sampled requests on a CPU (a batch-16 step's sampled
    acceptance without 49,152-way softmaxes of every verify row), or None (torch's): other devices,
    `DSPARK_CPU_LAYER_OPS=torch`, or (with a warning) a CPU where the kernel cannot be built."""
    if torch.device(device).type != "cpu" or not layer_kernels_enabled():
        return None
    try:
        load_target_sampling()
    except KernelUnavailable as error:
        logger.warning("DSPARK_LIVE: sampled acceptance materialises the target's softmax (no kernel: %s)", error)
        return None
    return kernel_sampler


def _plain_rows(batch: ScheduleBatch) -> bool:
    """Whether the target's verify rows of this batch are its logits as they come (what a tree's
    rows are read as): no grammar, penalty, logit bias, custom processor or min_new_tokens
    ban changes them, and no request asks for logprobs or hidden states of them."""
    if batch.has_grammar or batch.return_logprob or batch.return_hidden_states:
        return False
    info = batch.sampling_info
    if info.logit_bias is not None or getattr(info, "has_custom_logit_processor", False):
        return False  # (any processor changes rows, whether or not it reads the request)
    return not min_new_tokens_bans(batch.reqs) and not any(penalties_of(req.sampling_params).active
                                                           for req in batch.reqs)


def _ban_stop_tokens(logits: torch.Tensor, bans: list[StopBan], seq_lens: torch.Tensor,
                     window_lens: torch.Tensor) -> None:
    """`min_new_tokens`, as SGLang's penalizer applies it: -inf on each ban's stop tokens in the
    packed verify rows at input positions below its `until_position` (request b's rows sit at
    positions `seq_lens[b] + i`), before acceptance reads the logits."""
    if not bans:
        return
    starts = torch.cumsum(window_lens, 0) - window_lens
    for ban in bans:
        b = ban.batch_index
        rows = min(int(window_lens[b]), ban.until_position - int(seq_lens[b]))
        token_ids = [t for t in ban.token_ids if 0 <= t < logits.shape[1]]
        if rows > 0 and token_ids:
            first = int(starts[b])
            logits[first:first + rows, torch.tensor(token_ids, device=logits.device)] = float("-inf")


def _add_logit_bias(logits: torch.Tensor, logit_bias: torch.Tensor | None, window_lens: torch.Tensor) -> None:
    """Each request's `logit_bias` row (SGLang keeps it per batch, `[B, V]`) added to its verify
    rows, after the bans, as SGLang's sampler adds it after its penalties."""
    if logit_bias is None:
        return
    request, _ = packed_rows(window_lens)
    logits.add_(logit_bias[request.to(logit_bias.device), : logits.shape[1]].to(logits.device, logits.dtype))


def _tree_outcome(committed_tokens: list[int], stride: int) -> VerifyResult:
    """A tree's outcome as a one-row `VerifyResult`: the accepted drafts, then the bonus."""
    tokens = torch.full((1, stride), NO_TOKEN, dtype=torch.long)
    tokens[0, : len(committed_tokens)] = torch.tensor(committed_tokens, dtype=torch.long)
    return VerifyResult(num_accepted=torch.tensor([len(committed_tokens) - 1]), tokens=tokens)


def _chain_accepted(chain: list[int], committed_tokens: list[int]) -> torch.Tensor:
    """Drafts of the walked chain a chain verify would have accepted, `[1]`: its leading tokens
    the target committed. Exact for a chain the tree holds as a path (`_tree_plan` makes it so):
    the tree's greedy walk then follows it as far as the target agrees, and one token beyond; a
    sampled walk tests its drafts as a chain verify would, and a rejected draft is never the
    token drawn in its place."""
    accepted = 0
    while accepted < len(chain) and accepted < len(committed_tokens) and chain[accepted] == committed_tokens[accepted]:
        accepted += 1
    return torch.tensor([accepted])


def _committed_rows(window_lens: torch.Tensor, accept_lens: torch.Tensor) -> torch.Tensor:
    """Mask of the packed window rows that are committed: the first `accept_lens[b]` of each window."""
    request, offset = packed_rows(window_lens)
    return offset < accept_lens[request]
