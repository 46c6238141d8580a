"""Continuous batching of tree rollouts: the engine stays full, retrieval runs beside it.

Every walk (a trajectory in the making) is in one state:

    DECODING ──step ends──▶ WAITING (search sent) ──result──▶ READY ──append──▶ DECODING
        │                        (feedback: READY at once)
        └──answer / forced step / full context──▶ DONE

and the loop repeats, with no barrier between prompts, trees or rounds:

  1. admit queued prompts while the pool has room for their whole trees (a prompt's
     slots are held until all its leaves are done, so later rounds can fork from any node);
  2. append every READY observation in one `Engine.append`;
  3. one decode *quantum* over every DECODING walk: at most `quantum` steps, returning
     early once `exit_fraction` of the rows' steps ended; a step may span many quanta
     (the engine keeps each slot's stop-string window, the walk keeps its tokens);
  4. `end_step` for each walk whose step ended; all searches of that moment go to the
     retrieval thread as one batched call; a tree whose round is done picks its next
     round's nodes and forks them at once (all such trees in one `Engine.fork`);
  5. collect finished searches without blocking — or, when nothing is left to decode,
     wait for the first (`PhaseTimes.retrieval_wait`).

With a paged engine memory is pages, not slots: a prompt is admitted when the free pages
cover its prefill and one quantum of every walk; a quantum, an append or a fork that finds
too few pages runs for the oldest prompts' walks that fit and leaves the rest waiting for
pages to be freed. If nothing can move, the youngest prompt is *preempted*: its pages are
freed and it goes back to the head of the queue. Its trees come out the same when it is
rerun (sampling and picks depend only on keys), and its loop counters are kept per prompt
and dropped with it, so a preemption costs time and changes no result. A prompt alone in the
pool that still does not fit has its walks truncated (leaves marked TRUNCATED).

Trees equal the lock-step driver's for the same key (tests/rollout/test_scheduler.py):
sampling depends only on a row's key and write position, picks on (key, prompt, tree,
round), and `renumber_round` gives the nodes the lock-step order's ids.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from treegrpo_jax.data.rows import QARow
from treegrpo_jax.env.retrieval import SearchResult
from treegrpo_jax.rollout.agent import (
    LoopCounters,
    StepEnd,
    StepOutput,
    Trajectory,
    end_step,
    finish_leaf,
    observation_text,
    place_observation,
    step_budget,
)
from treegrpo_jax.rollout.page_pool import OutOfPagesError
from treegrpo_jax.rollout.sampling import SamplingParams
from treegrpo_jax.rollout.search_state import (
    RolloutCancelled,
    RolloutContext,
    TreeState,
    fork_branches,
    prompt_tokens,
    record_holder,
    renumber_round,
    start_trees,
)
from treegrpo_jax.rollout.tree import Node, Tree
from treegrpo_jax.validation import as_enum, check_int


class Driver(enum.StrEnum):
    CONTINUOUS = "continuous"  # this module (the default)
    LOCKSTEP = "lockstep"  # rollout/lockstep.py: the reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How rollouts are driven (values chosen by `benchmarks/rollout.py --parts=scheduler,leaf_cost`).

    Attributes:
      driver: continuous (this module) or lockstep (the reference).
      quantum: decode steps per engine call at most (a power of two: one compile).
      exit_fraction: a call returns once this fraction of its rows' steps ended, so they
        leave the batch instead of being computed idle. 1.0 (a call runs its quantum unless
        every row ends): on this CPU a decode step costs about its rows, so splitting a
        round into more, smaller calls (0.5) cost 5–16 % of leaves/s (BENCHMARKS.md §9).
      admit_prompts: queued prompts are admitted only this many at a time (one prefill for
        all), unless nothing else is left to decode.
      retrieval_workers: searches in flight at once (each one batched call): a slow
        retriever's latency overlaps instead of queueing.
      retrieval_sync: before a decode call, searches in flight are waited for up to this
        fraction of the last decode call's seconds, when searches have been landing within it,
        so a search joins this call instead of missing it by a millisecond and waiting a whole
        quantum (an in-process BM25 answers in ~1 ms where a call takes ~50: without the wait a
        tree's walks drifted apart, 16 calls of 38 rows per step against 12 of 45). 0: never
        wait; a retriever slower than the budget is overlapped as before.
    """

    driver: Driver | str = Driver.CONTINUOUS  # a name is parsed in __post_init__
    quantum: int = 32
    exit_fraction: float = 1.0
    admit_prompts: int = 1
    retrieval_workers: int = 4
    retrieval_sync: float = 0.25

    def __post_init__(self):
        object.__setattr__(self, "driver", as_enum(Driver, self.driver, "SchedulerConfig.driver"))
        q = self.quantum
        if isinstance(q, bool) or not isinstance(q, int) or q < 1 or q & (q - 1):
            raise ValueError(f"SchedulerConfig.quantum must be a power of two ≥ 1, got {q!r}")
        if isinstance(self.exit_fraction, bool) or not 0 < self.exit_fraction <= 1:
            raise ValueError(f"SchedulerConfig.exit_fraction must be in (0, 1], got {self.exit_fraction!r}")
        for name in ("admit_prompts", "retrieval_workers"):
            check_int(f"SchedulerConfig.{name}", getattr(self, name), 1)
        r = self.retrieval_sync
        if isinstance(r, bool) or not isinstance(r, int | float) or not 0 <= r <= 1:
            raise ValueError(f"SchedulerConfig.retrieval_sync must be a number in [0, 1], got {r!r}")


class WalkState(enum.StrEnum):
    DECODING = "decoding"
    WAITING = "waiting"  # its search is with the retriever
    READY = "ready"  # its observation waits for the next append
    DONE = "done"


@dataclasses.dataclass(kw_only=True, eq=False)
class _Prompt:
    row: int  # index into the call's rows
    order: int  # admission order: the oldest prompts get pages first
    slots: list[int]  # taken so far
    reserved: int  # slots its later rounds will still take
    open_trees: int
    counters: LoopCounters = dataclasses.field(default_factory=LoopCounters)  # merged when done
    preempted: bool = False


@dataclasses.dataclass(kw_only=True, eq=False)
class _Tree:
    state: TreeState
    prompt: _Prompt
    round: int = -1  # -1: the first chain; r ≥ 0: expansion round r
    first_new: int = 1  # node count when the round started
    order: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # node → lock-step key
    walks: list[_Walk] = dataclasses.field(default_factory=list)  # this round's, in branch order
    open_walks: int = 0


@dataclasses.dataclass(kw_only=True, eq=False)
class _Walk:
    traj: Trajectory
    tree: _Tree
    branch: int  # index among its round's walks of its tree
    state: WalkState = WalkState.DECODING
    steps: int = 0  # nodes made in this round
    tokens: list[int] = dataclasses.field(default_factory=list)  # the current step so far
    logprobs: list[float] = dataclasses.field(default_factory=list)
    entropies: list[float] = dataclasses.field(default_factory=list)
    node: Node | None = None  # the node whose observation is awaited
    obs: list[int] | None = None  # READY: the observation to append


class Scheduler:
    """Runs one rollout call; `run` returns the trees prompt-major, then tree id."""

    def __init__(
        self,
        ctx: RolloutContext,
        rows: Sequence[QARow],
        uids: Sequence[int],
        cfg: SchedulerConfig,
        *,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.ctx, self.rows, self.uids, self.cfg = ctx, rows, uids, cfg
        self.should_stop = should_stop or (lambda: False)
        self.queue = collections.deque(range(len(rows)))
        self.trees: dict[int, list[Tree]] = {}  # row index → its M trees
        self.decoding: list[_Walk] = []
        self.ready: list[_Walk] = []
        self.inflight: collections.deque = collections.deque()  # (future, walks) in submit order
        self.prompts: list[_Prompt] = []
        self.fork_backlog: list[_Tree] = []  # next rounds waiting for pages
        self.reserved = 0  # slots admitted prompts will still take
        self.admitted = 0
        self.preempted = 0  # prompts sent back to the queue for want of pages
        self.admit_after_done = False  # after a preemption: admit again once a prompt completes
        self.page_truncated = 0  # walks ended because their prompt alone did not fit the pool
        self._progress = False
        self._prompt_len: dict[int, int] = {}
        self._footprints: list[int] = []  # pages each completed prompt held at its end
        g = ctx.search.leaves_per_prompt
        self.later = g - ctx.search.num_trees  # a prompt's slots after its first chains
        self.sampling = {}  # rows → SamplingParams (the same knobs for every row)
        self._call_s = 0.0  # the last decode call's seconds (what `retrieval_sync` is a fraction of)
        self._search_s = 0.0  # a running mean of one batched search's seconds

    # ------------------------------------------------------------------ loop
    def run(self) -> list[Tree]:
        self.retrieval_threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.cfg.retrieval_workers, thread_name_prefix="retrieval"
        )
        try:
            while self.queue or self.decoding or self.ready or self.inflight or self.fork_backlog:
                if self.should_stop():
                    raise RolloutCancelled("rollout stopped on request (SIGTERM)")
                self.ctx.report(t for trees in self.trees.values() for t in trees)
                self._progress = False
                self._admit()
                self._sync_retrieval()
                self._collect(block=False)
                if self.fork_backlog:
                    self._fork(self._take_fork_backlog())
                self._append_ready()
                if self.decoding:
                    self._quantum()
                if not self._progress:  # waiting on retrieval, or on pages
                    if self.inflight:
                        self._collect(block=True)
                    else:
                        self._relieve()
            self.ctx.report(t for trees in self.trees.values() for t in trees)
        finally:
            # Queued searches are dropped; running ones finish (each is bounded by the retriever's
            # own timeout), so no retrieval thread outlives the rollout that started it.
            self.retrieval_threads.shutdown(wait=True, cancel_futures=True)
            for prompt in self.prompts:  # after an error: hand back what is still held
                if prompt.open_trees:
                    self.ctx.engine.free(prompt.slots)
                    self.ctx.counters.add(prompt.counters)
        return [t for i in range(len(self.rows)) for t in self.trees[i]]

    def _quantum_pages(self) -> int:
        p = self.ctx.engine.pool
        return -(-self.cfg.quantum // p.page_size) if p else 0

    def _pages_fit(self, fits: int) -> int:
        """How many of the first `fits` queued prompts the free pages admit: each needs its
        prefill, a partial page per extra tree, and one quantum per first walk, on top of one
        quantum for every walk already running. With nothing running, the first prompt needs
        only its prefill (its walks then wait for pages, or are truncated if it is alone)."""
        engine, m = self.ctx.engine, self.ctx.search.num_trees
        q = self._quantum_pages()
        free = engine.free_pages - q * (len(self.decoding) + len(self.ready))
        open_prompts = [p for p in self.prompts if p.open_trees and not p.preempted]
        alone = not open_prompts
        # Once prompts have completed, their mean footprint is what a prompt will hold at its end:
        # the running prompts' remaining growth is reserved, and a new one must fit whole (an
        # optimistic rule alone admits prompts that are later preempted: wasted work).
        expected = int(np.mean(self._footprints)) if self._footprints else 0
        if expected:
            free -= sum(max(0, expected - self._prompt_pages(p)) for p in open_prompts)
        n = 0
        for i in list(self.queue)[:fits]:
            if i not in self._prompt_len:
                self._prompt_len[i] = len(prompt_tokens(self.ctx.env, self.rows[i].question))
            prefill = engine.pool.pages_for(self._prompt_len[i]) + (m - 1)
            need = max(prefill + m * q, expected)
            if need > free and not (alone and n == 0 and prefill <= free):
                if alone and n == 0:
                    raise OutOfPagesError(
                        f"question {self.rows[i].id!r}: its prompt needs {prefill} pages for {m} trees "
                        f"but the pool has {engine.pool.num_pages}; raise rollout.kv_pages"
                    )
                break
            free -= need
            n += 1
        return n

    def _prompt_pages(self, prompt: _Prompt) -> int:
        """Distinct pages the prompt's sequences hold (its trees share the prompt's pages)."""
        return self.ctx.engine.pages_held(prompt.slots)

    def _admit(self) -> None:
        engine, g = self.ctx.engine, self.ctx.search.leaves_per_prompt
        fits = min(len(self.queue), (engine.num_free - self.reserved) // g)
        if self.admit_after_done and (self.decoding or self.ready or self.inflight or self.fork_backlog):
            # A preempted prompt must not take back the pages its preemption freed for the
            # others (a livelock): it waits until a prompt completes, or nothing else runs.
            return
        if engine.paged and fits > 0:
            fits = self._pages_fit(fits)
        # Batched admission: one prefill for several prompts, unless the engine would idle.
        idle = not (self.decoding or self.ready)
        if fits <= 0 or (fits < self.cfg.admit_prompts and fits < len(self.queue) and not idle):
            return
        t0 = time.perf_counter()
        idx = [self.queue.popleft() for _ in range(fits)]
        states, trajs, slots = start_trees(
            self.ctx, [self.rows[i] for i in idx], idx, [self.uids[i] for i in idx]
        )
        m = self.ctx.search.num_trees
        for p, row in enumerate(idx):
            prompt = _Prompt(
                row=row,
                order=self.admitted,
                slots=[trajs[p * m + t].slot for t in range(m)],
                reserved=self.later,
                open_trees=m,
            )
            self.admitted += 1
            self.prompts.append(prompt)
            self.reserved += self.later
            self.trees[row] = [s.tree for s in states[p * m : (p + 1) * m]]
            for t in range(m):
                tree = _Tree(state=states[p * m + t], prompt=prompt)
                self._start_walks(tree, [trajs[p * m + t]])
        del slots
        self._progress = True
        self.ctx.times.append += time.perf_counter() - t0

    def _start_walks(self, tree: _Tree, trajs: list[Trajectory]) -> None:
        tree.first_new = len(tree.state.tree.nodes)
        tree.walks = [_Walk(traj=t, tree=tree, branch=b) for b, t in enumerate(trajs)]
        tree.open_walks = len(trajs)
        tree.order = {}
        self.decoding += tree.walks

    # ---------------------------------------------------------------- decode
    def _quantum(self) -> None:
        ctx, engine, cfg = self.ctx, self.ctx.engine, self.ctx.agent
        t0 = time.perf_counter()
        budget = lambda w: step_budget(cfg, len(w.tokens), engine.room(w.traj.slot))  # noqa: E731
        walks, waiting = self._with_pages(
            self.decoding, lambda w: engine.decode_pages_needed([w.traj.slot], self.cfg.quantum, budget(w))
        )
        if not walks:
            return
        self._progress = True
        slots = [w.traj.slot for w in walks]
        for w in walks:
            if not w.tokens:  # a step starts: what a resubmitting engine would prefill
                w.tree.prompt.counters.reprefill_tokens += int(engine.lengths[w.traj.slot] + 1)
        budgets = [budget(w) for w in walks]
        res = engine.decode(
            slots,
            max_new_tokens=budgets,
            sampling=self._sampling(len(walks)),
            keys=np.stack([w.traj.key for w in walks]),  # raw words: one host array, no eager ops
            num_steps=self.cfg.quantum,
            exit_after=math.ceil(self.cfg.exit_fraction * len(walks)),
        )
        t1 = time.perf_counter()
        ctx.times.decode += t1 - t0
        self._call_s = t1 - t0
        still, searches, forks = [], [], []
        for i, w in enumerate(walks):
            tokens, logprobs, entropies = res.row(i)
            w.tokens += tokens
            w.logprobs += logprobs
            w.entropies += entropies
            ended = res.hit_eos[i] or res.hit_stop[i] or res.hit_context[i] or len(tokens) >= budgets[i]
            if not ended:
                still.append(w)
                continue
            node, end = self._end_step(w, engine.room(w.traj.slot), **res.ending(i))
            if end is StepEnd.LEAF:
                self._walk_done(w, forks)
            elif end is StepEnd.SEARCH:
                w.state, w.node = WalkState.WAITING, node
                searches.append(w)
            else:
                self._observe(w, node, None, forks)
        self.decoding = still + waiting
        if searches:
            self._submit(searches)
        t2 = time.perf_counter()
        if forks:
            self._fork(forks)  # timed as `fork` (not host as well)
        ctx.times.host += t2 - t1

    def _end_step(self, w: _Walk, room: int, **ending: bool) -> tuple[Node, StepEnd]:
        """Ends walk w's step (the tokens of all its quanta) as a node of its tree."""
        step = StepOutput(w.tokens, w.logprobs, w.entropies, **ending)
        node, end = end_step(
            w.traj, step, room=room, env=self.ctx.env, cfg=self.ctx.agent, counters=w.tree.prompt.counters
        )
        w.tree.order[node.node_id] = (w.steps, w.branch)
        w.steps += 1
        w.tokens, w.logprobs, w.entropies = [], [], []
        return node, end

    def _with_pages(
        self, walks: list[_Walk], need: Callable[[_Walk], int]
    ) -> tuple[list[_Walk], list[_Walk]]:
        """(walks that get pages now, walks that wait): the oldest prompts first."""
        engine = self.ctx.engine
        if not engine.paged:
            return walks, []
        needs = [need(w) for w in walks]
        if sum(needs) <= engine.free_pages:
            return walks, []
        go, wait, free = [], [], engine.free_pages
        for i in sorted(range(len(walks)), key=lambda i: (walks[i].tree.prompt.order, i)):
            if needs[i] <= free:
                free -= needs[i]
                go.append(i)
            else:
                wait.append(i)
        go.sort()  # the call's rows in their usual order
        return [walks[i] for i in go], [walks[i] for i in wait]

    def _relieve(self) -> None:
        """Nothing could move for want of pages: preempt the youngest prompt, or — if one prompt
        alone fills the pool — end its waiting walks as truncated leaves."""
        open_prompts = [p for p in self.prompts if p.open_trees and not p.preempted]
        if len(open_prompts) > 1:
            self._preempt(max(open_prompts, key=lambda p: p.order))
            return
        if self.fork_backlog:
            raise OutOfPagesError(
                f"one prompt's tree needs more than the whole pool of {self.ctx.engine.pool.num_pages} pages "
                "to start its next round; raise rollout.kv_pages or shrink the tree"
            )
        forks: list[_Tree] = []
        for w in self.decoding + self.ready:  # one prompt, and its walks cannot get a page
            node = w.node if w.state is WalkState.READY else None
            if node is None:
                node, _ = self._end_step(w, 0, hit_context=True)
            else:
                node.obs_tokens = []
                w.tree.prompt.counters.truncated_leaves += 1
                finish_leaf(w.traj.tree, node, w.traj.golds, self.ctx.env.reward)
            self.page_truncated += 1
            self._walk_done(w, forks)
        self.decoding, self.ready = [], []
        self._progress = True
        if forks:
            self._fork(forks)

    def _preempt(self, prompt: _Prompt) -> None:
        """Frees every page of `prompt` and queues it again (it reruns to the same trees)."""
        prompt.preempted = True
        mine = lambda w: w.tree.prompt is prompt  # noqa: E731
        self.decoding = [w for w in self.decoding if not mine(w)]
        self.ready = [w for w in self.ready if not mine(w)]
        self.fork_backlog = [t for t in self.fork_backlog if t.prompt is not prompt]
        self.ctx.engine.free(prompt.slots)
        prompt.open_trees = 0
        self.reserved -= prompt.reserved
        del self.trees[prompt.row]
        self.queue.appendleft(prompt.row)
        self.preempted += 1
        self.admit_after_done = True
        self._progress = True

    def _sampling(self, n: int) -> SamplingParams:
        if n not in self.sampling:
            a = self.ctx.agent
            self.sampling[n] = SamplingParams.make(
                n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k_sampling, greedy=self.ctx.greedy
            )
        return self.sampling[n]

    # ------------------------------------------------------------ retrieval
    def _submit(self, walks: list[_Walk]) -> None:
        retriever, k = self.ctx.env.retriever, self.ctx.agent.top_k
        queries = [w.node.query for w in walks]

        def search() -> tuple[list[SearchResult], float]:
            t0 = time.perf_counter()
            results = retriever.search(queries, k)
            return results, time.perf_counter() - t0

        self.inflight.append((self.retrieval_threads.submit(search), walks))

    def _sync_retrieval(self) -> None:
        """Waits (bounded by `retrieval_sync` × the last call) for the searches in flight, while
        walks are decoding: a fast retriever's answers then join the next call."""
        budget = self.cfg.retrieval_sync * self._call_s
        # A retriever slower than the budget (an HTTP server under load) is never waited for: its
        # searches would not land in time, and the decode call overlaps them instead.
        if not (self.inflight and self.decoding and 0 < self._search_s <= budget):
            return
        t0 = time.perf_counter()
        futures = [f for f, _ in self.inflight]
        concurrent.futures.wait(futures, timeout=budget, return_when=concurrent.futures.ALL_COMPLETED)
        self.ctx.times.retrieval_wait += time.perf_counter() - t0

    def _collect(self, *, block: bool) -> None:
        """Turns finished searches into READY observations."""
        if block and self.inflight:
            t0 = time.perf_counter()
            futures = [f for f, _ in self.inflight]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
            self.ctx.times.retrieval_wait += time.perf_counter() - t0
        forks = []
        for future, walks in [(f, w) for f, w in self.inflight if f.done()]:
            self.inflight.remove((future, walks))
            results, seconds = future.result()  # re-raises RetrieverUnavailableError here
            self.ctx.times.retrieval += seconds
            self._search_s = seconds if not self._search_s else 0.5 * (self._search_s + seconds)
            self._progress = True
            for w, result in zip(walks, results, strict=True):
                if not w.tree.prompt.preempted:
                    self._observe(w, w.node, result, forks)
        if forks:
            self._fork(forks)

    def _observe(self, w: _Walk, node: Node, result: SearchResult | None, forks: list[_Tree]) -> None:
        """The observation after `node` becomes READY, or the walk ends if it does not fit."""
        ctx = self.ctx
        counters = w.tree.prompt.counters
        obs = ctx.env.encode_obs(observation_text(ctx.env, ctx.agent, node, result, counters))
        if place_observation(w.traj, node, obs, ctx.engine.room(w.traj.slot), ctx.env, ctx.agent, counters):
            w.state, w.obs, w.node = WalkState.READY, obs, None
            self.ready.append(w)
        else:
            self._walk_done(w, forks)

    def _append_ready(self) -> None:
        if not self.ready:
            return
        t0 = time.perf_counter()
        engine = self.ctx.engine
        reach = lambda w: {w.traj.slot: int(engine.lengths[w.traj.slot]) + len(w.obs)}  # noqa: E731
        go, self.ready = self._with_pages(self.ready, lambda w: engine.pages_needed(reach(w)))
        if not go:
            return
        engine.append({w.traj.slot: w.obs for w in go})
        for w in go:
            w.state, w.obs = WalkState.DECODING, None
        self.decoding += go
        self._progress = True
        self.ctx.times.append += time.perf_counter() - t0

    # ----------------------------------------------------------- tree rounds
    def _walk_done(self, w: _Walk, forks: list[_Tree]) -> None:
        """Ends a walk; a tree whose round is over joins `forks` (its next round) or is done."""
        w.state = WalkState.DONE
        tree = w.tree
        tree.open_walks -= 1
        if tree.open_walks:
            return
        # The round is over for this tree: lock-step ids, then which slot holds each node.
        remap = renumber_round(tree.state.tree, tree.first_new, tree.order)
        for walk in tree.walks:
            walk.traj.node_id = remap.get(walk.traj.node_id, walk.traj.node_id)
            record_holder(tree.state, walk.traj)
        tree.round += 1
        if tree.round < self.ctx.search.expansion_rounds:
            forks.append(tree)
            return
        prompt = tree.prompt
        prompt.open_trees -= 1
        if not prompt.open_trees:
            if self.ctx.engine.paged:
                self._footprints.append(self._prompt_pages(prompt))
            self.ctx.engine.free(prompt.slots)
            self.ctx.counters.add(prompt.counters)
            self.admit_after_done = False

    def _take_fork_backlog(self) -> list[_Tree]:
        trees, self.fork_backlog = self.fork_backlog, []
        return trees

    def _fork(self, trees: list[_Tree]) -> None:
        """Starts the next round of every tree in `trees` with one cache copy call; trees whose
        copies find no free page wait in `fork_backlog` (the oldest prompts go first)."""
        t0 = time.perf_counter()
        engine = self.ctx.engine
        picks = [(tree.state, self.ctx.pick(tree.state, tree.round)) for tree in trees]
        if engine.paged:
            need = lambda tp: engine.fork_pages_needed(  # noqa: E731
                len(tp[0].tree.path_tokens(node.node_id)[0]) for node, _ in tp[1]
            )
            order = sorted(range(len(trees)), key=lambda i: trees[i].prompt.order)
            free, keep = engine.free_pages, set()
            for i in order:
                if need(picks[i]) <= free:
                    free -= need(picks[i])
                    keep.add(i)
            self.fork_backlog += [t for i, t in enumerate(trees) if i not in keep]
            trees = [t for i, t in enumerate(trees) if i in keep]
            picks = [p for i, p in enumerate(picks) if i in keep]
            if not trees:
                return
        n = sum(len(p) for _, p in picks)
        slots = engine.allocate(n)
        trajs = fork_branches(self.ctx, picks, slots)
        self._progress = True
        offset = 0
        for tree, (_, tree_picks) in zip(trees, picks, strict=True):
            k = len(tree_picks)
            tree.prompt.slots += slots[offset : offset + k]
            tree.prompt.reserved -= k
            self.reserved -= k
            self._start_walks(tree, trajs[offset : offset + k])
            offset += k
        self.ctx.times.fork += time.perf_counter() - t0
