"""The speculative engine: ONE draft -> verify -> keep -> commit -> stats cycle for one sequence and a batch alike.

Shape legend (docs/SHAPES.md): B batch rows (live sequences), T new tokens per row in one forward (the largest tree;
smaller trees are padded), N tree nodes of one row (root included), S cache slots, V vocab, E hidden size.

``generate`` (decoding/generate.py) is a batch of one; ``vanilla`` is the same cycle with no drafter (every tree is
a bare root, so a cycle is one plain decode step); serving, the bench, the sweep and training-time evaluation all
run this engine. Each row keeps its own accepted length and its own KV length: row b's tree sits at cache slots
[len_b, len_b + N_b) and positions len_b + depth, whatever the other rows hold. One cycle:

  limit = schedule.max_draft_nodes(B)        load-adaptive speculation: smaller trees, down to none, as B grows
  tree_b = prune(drafter_b.propose(root_b), limit)                                          (leader only)
  tokens_BT, positions_BT, mask_BTT = pack_trees(...)   padding: token 0 that attends only to itself
  logits_BTV, taps = target(tokens_BT, positions_BT, cache rows [0, B), mask_BTT)        one forward, all rows
  accepted_b = verify(tree_b, adjusted(logits_BTV[b, :N_b]))      (leader only; logit_bias, penalties per node)
  cache.keep(accepted nodes per row)          per-row rollback: rejected branches leave nothing behind
  row_b.behind += (root + accepted, taps on the path); emit accepted + bonus; finished rows leave

A row's drafter runs only in a cycle that drafts: committed tokens wait in the row (``behind``, with the forward's
taps) until ``_catch_up`` hands them over in ONE begin or commit before propose (a budget-0 cycle is vanilla's).

Requests join at cycle boundaries (each prefilled into the next free cache row, after the longest prefix of it the
prefix cache holds: eyas.decoding.prefixes) and leave when finished, cancelled or failed. Live rows always occupy
cache rows [0, B): a leaving row's slot is filled by moving the last row into it (``KVCache.move_row``), so a
cycle's forward runs on exactly B rows, never on idle capacity.

A failure that belongs to one request (its checks, its sampling, its drafter: anything but the batch's target
forward) ends that request alone, with ``finish_reason="error"`` and the error in its StepOutput; the other rows'
cycle goes on untouched. The leader decides it and shares it like any verdict (a None first token or commit).

Tensor parallelism (SPMD): every rank runs this same engine on its shard of the target, with the same commands in
the same order, so their collectives line up. Only the leader (rank 0) holds drafters and sampling generators: it
drafts, verifies and samples, and ``channel.share`` broadcasts its decisions (first tokens, tree shapes, accepted
paths) to the other ranks, which apply them as given (why rank 0 alone: eyas.decoding.tp).
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from eyas.decoding.logits import TokenLogprob, first_token, verify_tree
from eyas.decoding.prefixes import PrefixCache
from eyas.decoding.requests import Channel, LocalChannel, SequenceRequest, SpeculationSchedule, StepOutput
from eyas.decoding.rows import Row
from eyas.decoding.sampling import make_generator, truncate_at_stop
from eyas.decoding.tree import MAX_TREE_NODES, DraftTree, chain, check_tree_size, pack_trees, prune
from eyas.decoding.verify import Accepted
from eyas.models.decoder import Decoder

logger = logging.getLogger(__name__)


class SpecEngine:
    """Speculative generation on one target (one tensor-parallel rank of it), one row per live sequence.

    ``step(joins, leaves)`` is one scheduling round: drop the cancelled ``leaves`` (request ids), prefill the
    ``joins`` into free rows, run one draft -> verify -> commit cycle over every live row, and return a StepOutput
    per sequence that emitted tokens or finished. Finished sequences leave the batch at the end of the step.

    drafter_factory: builds one drafter (None: vanilla decoding); the leader builds ``capacity`` of them up front,
    one per row, since drafters hold per-sequence state. max_len: cache slots per row (the context limit).
    max_tree_nodes: the tree cap (root included) whose room every request reserves; at most MAX_TREE_NODES.
    prefix_cache_tokens: prompt tokens the prefix cache keeps (eyas.decoding.prefixes); 0: none.
    """

    def __init__(self, target: Decoder, capacity: int, max_len: int | None = None,
                 drafter_factory: Callable[[], Any] | None = None,
                 schedule: SpeculationSchedule = SpeculationSchedule(), eos_token_ids: Iterable[int] = (),
                 max_tree_nodes: int = MAX_TREE_NODES, channel: Channel | None = None,
                 prefix_cache_tokens: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: need at least one batch row")
        if not 1 <= max_tree_nodes <= MAX_TREE_NODES:
            raise ValueError(f"max_tree_nodes={max_tree_nodes}: must be in [1, {MAX_TREE_NODES}] (root included)")
        self.target = target
        self.capacity = capacity
        self.max_len = max_len or target.config.max_position_embeddings
        self.schedule = schedule
        self.eos = set(eos_token_ids)
        self.channel = channel or LocalChannel()
        self.leader = self.channel.is_leader
        self.speculative = drafter_factory is not None
        self.max_tree_nodes = max_tree_nodes if self.speculative else 1
        self.cache = target.new_cache(capacity, self.max_len)
        self.prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.rows: list[Row] = []
        self.free_drafters: list[Any] = []
        self.taps: tuple[int, ...] = ()
        if self.speculative and self.leader:
            self.free_drafters = [drafter_factory() for _ in range(capacity)]
            first = self.free_drafters[0]
            check_tree_size(first.max_draft_nodes, self.max_tree_nodes, getattr(first, "name", "given"))
            self.taps = tuple(sorted({l for d in self.free_drafters for l in d.target_taps}))

    # -- admission -------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.capacity - len(self.rows)

    def check_request(self, request: SequenceRequest) -> None:
        request.check(self.target.config.vocab_size, self.max_len, self.max_tree_nodes)

    # -- one round -------------------------------------------------------

    @torch.inference_mode()
    def step(self, joins: Sequence[SequenceRequest] = (), leaves: Iterable[str] = ()) -> list[StepOutput]:
        leaving = set(leaves)
        staying = [r.request.request_id for r in self.rows if r.request.request_id not in leaving]
        outputs: list[StepOutput] = []
        admitted = []
        for request in joins:  # a request that fails its checks is refused alone; the others join
            try:
                self.check_request(request)
                admitted.append(request)
            except ValueError as err:
                outputs.append(StepOutput(request.request_id, [], True, "error", error=str(err)))
        joins = admitted
        ids = staying + [r.request_id for r in joins]  # the scheduler's mistakes refuse the whole step, unchanged
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate request ids among {ids}")
        if len(ids) > self.capacity:
            raise ValueError(f"{len(joins)} requests cannot join: {self.capacity - len(staying)} of "
                             f"{self.capacity} rows free")
        for i in reversed(range(len(self.rows))):
            if self.rows[i].request.request_id in leaving:
                self._release(i)
        if joins:
            self._admit(joins)
            outputs += self._collect_finished()
        if self.rows:
            self._cycle()
        outputs += [self._output(row) for row in self.rows if row.new or row.finish_reason]
        for i in reversed(range(len(self.rows))):
            if self.rows[i].finish_reason:
                self._release(i)
        return outputs

    def _admit(self, joins: Sequence[SequenceRequest]) -> None:
        """Prefill each joining prompt into the next free row, after the longest prefix the prefix cache holds of
        it; the leader picks (and shares) each first token."""
        device = self.target.device
        firsts = []
        new_rows = []
        for request in joins:
            row = Row(request)
            b = len(self.rows)
            self.rows.append(row)
            new_rows.append(row)
            prompt = request.prompt_ids
            scored = request.prompt_logprobs is not None  # logits over the whole prompt, not only its last token
            cached_ok = self.prefixes is not None and self.target.prefill_is_exact(len(prompt), decode_bits=True)
            reused, key = self.prefixes.longest(prompt, self.taps) if cached_ok and not scored else (0, None)
            view = self.cache.rows(b, b + 1, [0])
            cached = self.prefixes.restore(key, reused, view, 0) if key is not None else {}
            prompt_1T = torch.tensor([prompt[reused:]], device=device)
            positions_1T = torch.arange(reused, len(prompt), device=device)[None]
            logits_1TV, hidden = self.target(prompt_1T, positions_1T, view, taps=self.taps,
                                             logits_slice=None if scored else slice(-1, None), decode_bits=cached_ok)
            if cached:
                hidden = {layer: torch.cat([cached[layer], hidden[layer]], dim=1) for layer in hidden}
            row.length = view.lengths[0]
            row.cached_tokens = reused
            row.decode_bits = cached_ok
            if cached_ok:
                self.prefixes.store(prompt, view, 0, hidden)
            if self.leader:
                token = None  # None: the leader failed this request, and every rank drops its row
                with self._isolated(row, "the first token"):
                    row.generator = make_generator(request.sampling, device)
                    token, row.new_logprobs, row.prompt_logprobs = first_token(
                        logits_1TV[0], request.prompt_ids, request.sampling, request.logprobs,
                        request.prompt_logprobs, row.generator)
                    if self.speculative:  # its begin waits for the first cycle that drafts (_catch_up)
                        row.drafter = self.free_drafters.pop()
                        row.behind.append((list(prompt), hidden, 0, list(range(len(prompt)))))
                firsts.append(token)
        firsts = self.channel.share(firsts if self.leader else None)
        for row, token in zip(new_rows, firsts):
            if token is None:
                self._fail(row)
            else:  # the first token's logprob (leader, when asked) is already in row.new_logprobs
                self._emit(row, [token])

    def _cycle(self) -> None:
        """One draft -> verify -> keep -> commit cycle over every live row.

        The leader times it with perf_counter (no device syncs but one, below): draft = the drafters' catch-up
        (begin / commit: a request's first drafting cycle carries its drafter's prefill) and propose calls, verify =
        the target forward, other = the cycle's wall time less both (packing, verification, cache rollback,
        bookkeeping: the engine's own overhead). Every row records the whole cycle's split, the time its own cycle
        took, so a row's draft_s + verify_s + other_s is the wall time of its cycles.
        """
        rows = self.rows
        trees: list[DraftTree] = []
        plan = None
        start = time.perf_counter()
        draft_s = 0.0
        if self.leader:
            limit = self.schedule.max_draft_nodes(len(rows)) if self.speculative else 0
            for row in rows:
                tree, seconds = None, 0.0
                with self._isolated(row, "drafting"):
                    tree, seconds = self._draft(row, limit)
                trees.append(tree if tree is not None else chain(row.out[-1], []))  # a failed drafter: nothing
                draft_s += seconds
            plan = [(tree.tokens_list, tree.parents_list) for tree in trees]
        plan = self.channel.share(plan)
        view = self.cache.rows(0, len(rows), [row.length for row in rows])
        tokens_BT, positions_BT, mask_BTT = pack_trees(plan, view.lengths, self.target.device)
        forward_start = time.perf_counter()
        logits_BTV, hidden = self.target(tokens_BT, positions_BT, view, mask=mask_BTT, taps=self.taps)
        if logits_BTV.is_cuda:  # verification's argmax would wait for the forward here anyway; its time is verify's
            torch.cuda.synchronize(logits_BTV.device)
        verify_s = time.perf_counter() - forward_start
        if self.prefixes is not None and not self.target.verify_is_exact(tokens_BT.numel()):
            for row in rows:  # this forward's bits depend on the batch: no answer of theirs is kept
                row.decode_bits = False
        verdicts = None
        logprobs: list[list[TokenLogprob] | None] = [None] * len(rows)  # the leader's, for rows that asked
        if self.leader:
            verdicts = []
            for b, (row, tree) in enumerate(zip(rows, trees)):
                verdict = ([0], None)  # a failed row keeps nothing in the cache and leaves
                if row.error is None:
                    with self._isolated(row, "verification"):
                        accepted, logprobs[b] = verify_tree(tree, logits_BTV[b, :tree.num_nodes], row.request.sampling,
                                                            row.request.logprobs, row.out, row.generator)
                        self._commit(row, b, tree, accepted, hidden)
                        verdict = (accepted.nodes, accepted.committed)
                verdicts.append(verdict)
        verdicts = self.channel.share(verdicts)
        view.keep([nodes for nodes, _ in verdicts])
        for row, (_, committed), length, row_logprobs in zip(rows, verdicts, view.lengths, logprobs):
            row.length = length
            if committed is None:
                self._fail(row)
            else:
                self._emit(row, committed, row_logprobs)
        if self.leader:
            other_s = time.perf_counter() - start - draft_s - verify_s
            for row in rows:
                row.stats.draft_s += draft_s
                row.stats.verify_s += verify_s
                row.stats.other_s += other_s

    def _draft(self, row: Row, limit: int | None) -> tuple[DraftTree, float]:
        """The row's tree and the seconds its drafter's catch-up and propose took. Under a budget of 0 the drafter
        is not called at all (a bare root, as vanilla's)."""
        root = row.out[-1]
        if row.drafter is None or limit == 0:
            return chain(root, []), 0.0
        start = time.perf_counter()
        self._catch_up(row)
        tree = row.drafter.propose(root, list(row.request.prompt_ids) + row.out, row.request.sampling.temperature,
                                   row.generator)
        seconds = time.perf_counter() - start
        assert tree.num_nodes <= self.max_tree_nodes, f"{tree.num_nodes} nodes: over the cap the drafter declared"
        return (tree if limit is None else prune(tree, limit)), seconds

    def _commit(self, row: Row, b: int, tree: DraftTree, accepted: Accepted, hidden: dict[int, torch.Tensor]
                ) -> None:
        """The leader queues the root and the accepted tokens (row b of this forward) for ``_catch_up`` and records
        the cycle. Cycles whose tree load-adaptation emptied still count (tau is tokens per target forward); a row
        without a drafter records no SpecStats cycle (tau stays None: vanilla does not speculate)."""
        if row.drafter is None:
            row.cycles.append((0, 0, 0))
            return
        row.behind.append(([tree.tokens_list[0]] + accepted.tokens, hidden, b, accepted.nodes))
        judged_depth = row.stats.record_verdict(tree, accepted.nodes)
        row.cycles.append((accepted.num_accepted, judged_depth, tree.num_nodes - 1))

    def _catch_up(self, row: Row) -> None:
        """Hand the row's drafter every token committed since it last ran, with their taps, in one begin (the first
        time) or commit call: the Drafter contract (base.py) makes that equal to one call per cycle."""
        if not row.behind:
            return
        tokens = [token for chunk, _, _, _ in row.behind for token in chunk]
        taps = {l: torch.cat([_rows_of(hidden[l][b], nodes) for _, hidden, b, nodes in row.behind])
                for l in self.taps}  # [len(tokens), E] each
        row.behind = []
        if row.begun:
            row.drafter.commit(tokens, taps)
        else:
            row.drafter.begin(tokens, taps)
            row.begun = True

    # -- bookkeeping -----------------------------------------------------

    @contextlib.contextmanager
    def _isolated(self, row: Row, what: str) -> Iterator[None]:
        """Leader-side work for one row: an exception (a drafter bug, sampling settings that slipped past the
        request checks) fails that request alone, reported in its StepOutput and logged, and the batch goes on."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 (not swallowed: the request gets the error, the log the traceback)
            row.error = f"{what} failed ({type(err).__name__}: {err})"
            logger.warning("eyas engine: request %s: %s", row.request.request_id, row.error, exc_info=True)

    def _fail(self, row: Row) -> None:
        row.finish_reason = "error"
        row.error = row.error or "failed on the leader rank"  # only the leader knows why; its output is reported

    def _emit(self, row: Row, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append a cycle's tokens (and their logprobs), cut at a stop or the budget. Only the new tokens are
        scanned: a row whose output held a stop would have finished."""
        budget = row.request.max_new_tokens
        kept, stopped = truncate_at_stop(tokens, self.eos, budget - len(row.out))
        row.new += kept
        row.out += kept
        if logprobs is not None:
            row.new_logprobs += logprobs[:len(kept)]
        if stopped:
            row.finish_reason = "stop"
        elif len(row.out) >= budget:
            row.finish_reason = "length"

    def _output(self, row: Row) -> StepOutput:
        new, row.new = row.new, []
        asked = self.leader and row.request.logprobs is not None
        logprobs, row.new_logprobs = (row.new_logprobs if asked else None), []
        prompt, row.prompt_logprobs = row.prompt_logprobs, None
        cycles, row.cycles = row.cycles, []
        cached, row.cached_tokens = row.cached_tokens, None
        stats = None
        if row.finish_reason and self.leader:
            stats = row.stats
            stats.new_tokens = len(row.out)
            stats.emitted(len(row.out) - 1)  # the first token came from the prefill; tau counts what was emitted
        return StepOutput(row.request.request_id, new, row.finish_reason is not None, row.finish_reason, stats,
                          cycles, row.error, logprobs, prompt, cached)

    def _collect_finished(self) -> list[StepOutput]:
        outputs = [self._output(row) for row in self.rows if row.finish_reason]
        for i in reversed(range(len(self.rows))):
            if self.rows[i].finish_reason:
                self._release(i)
        return outputs

    def _release(self, i: int) -> None:
        """Free row i: the last row moves into its cache slot, so live rows stay [0, B). A finished answer goes
        into the prefix cache first (``_keep_answer``)."""
        row = self.rows[i]
        self._keep_answer(row, i)
        last = len(self.rows) - 1
        if i != last:
            moved = self.rows[last]
            self.cache.move_row(last, i, moved.length)
            self.rows[i] = moved
        self.rows.pop()
        if row.drafter is not None:  # its next row begins it afresh
            self.free_drafters.append(row.drafter)

    def _keep_answer(self, row: Row, i: int) -> None:
        """A conversation's next turn repeats this prompt and its answer: keep their K/V (cache row i) in the prefix
        cache, for a finished answer whose every forward gave decode bits (the bits a prefill with ``decode_bits``
        would give the same tokens). Not where a drafter reads taps: only the prompt's are kept, not the answer's."""
        if (self.prefixes is None or self.taps or not row.decode_bits
                or row.finish_reason not in ("stop", "length")):
            return
        tokens = (list(row.request.prompt_ids) + row.out)[:row.length]  # the last token never reached the cache
        self.prefixes.store(tokens, self.cache.rows(i, i + 1, [row.length]), 0, {})

    def active_request_ids(self) -> list[str]:
        return [row.request.request_id for row in self.rows]

    def run(self, requests: Sequence[SequenceRequest]) -> dict[str, tuple[list[int], StepOutput]]:
        """Serve ``requests`` to completion, joining as rows free up: {request_id: (tokens, final output)}.
        A convenience for tests, the bench and offline use (single rank); a failed request raises."""
        pending = list(requests)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        done: dict[str, tuple[list[int], StepOutput]] = {}
        while pending or self.rows:
            joins, pending = pending[:self.num_free], pending[self.num_free:]
            for out in self.step(joins):
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id}: {out.error}")
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = (tokens[out.request_id], out)
        return done


def _rows_of(hidden_TE: torch.Tensor, nodes: list[int]) -> torch.Tensor:
    """hidden_TE[nodes]: a view when the nodes are 0..k-1 (a prefill, a chain's accepted prefix, a bare root)."""
    if nodes == list(range(len(nodes))):
        return hidden_TE[:len(nodes)]
    return hidden_TE[torch.as_tensor(nodes, device=hidden_TE.device)]
