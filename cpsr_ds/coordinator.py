"""The coordinator (paper Section III-B, Fig. 5): predictor work hidden in the 1F1B pipeline bubbles.

DeepSpeed's :class:`TrainSchedule` yields 2(M+S-1) steps per batch; each stage has
2(S-1) of them with no forward or backward pass. A stage does not wait in those steps
but in the next blocking receive: stage s waits about s*tF in its first
``RecvActivation``, (S-1-s)*tB in its first ``RecvGrad``, tF in each ``RecvGrad`` that
follows a step with no pass (cool-down), and s*tB at the end of the batch, in the
collectives of ``OptimizerStep`` (the gradient norm of clipping is reduced across the
stages). Work fills a bubble only if it runs *before* the receive that will wait, and
only as long as the wait: :class:`BubbleSchedule` puts a :class:`PredictorWork`
instruction in those places (:func:`bubble_slots`), and :class:`Coordinator` runs the
queued predictor work there, each slot within its budget.

A slot's budget is measured online: the span from the slot's start to the end of the
receive after it (its work plus what is left of the wait; DeepSpeed's ``PIPE_RECV``
timers lump the transfer in and crash every stage but the last), a low percentile of
the spans of recent iterations, times a safety factor (``coordinator`` in the config).
Work that overruns a bubble shows as a shorter span and shrinks the budget. The end
slot's span holds the optimizer step's own time too, so its budget is an upper bound.

On CPU (gloo) a receive blocks the process and the work runs inline. On CUDA the
work is issued on a side stream that waits on the compute stream at the slot
(:func:`_side_stream`), and the compute stream waits for it before the training loop's
thread touches the predictor again (:meth:`Coordinator.join`); its spans are CPU time,
not GPU time. Only a predictor on the GPU (``predictor.device: cuda``) issues work there;
``tests/jobs/test_coordinator_cuda.py`` checks that path where a GPU is (``benchmarks/gpu``), not
in ``make test``.

Predictor work is queued as jobs (:class:`TrainJob`: the learning predictor's steps
after a checkpoint, a micro-batch at a time; :class:`PiecesJob`: work that stops after each small
piece, such as the copy of a checkpoint's share into the predictor's history;
:class:`CallJob`: a piece that cannot be sliced, such as the held-out check). A job
whose smallest piece has no measured cost yet runs that piece at once, inline, to
measure it (or, queued behind other work, at the next checkpoint); what is still queued
at a checkpoint runs inline there, before the predictor sees the new checkpoint, and
what is queued when the job ends is dropped, each job closed where it is (:meth:`Coordinator.drop`), so that
no piece of it runs later, during the interpreter's teardown. With ``coordinator.fill``, a
:class:`FillJob` queued last keeps the learning predictor training in every slot left
until the next checkpoint, which drops it, or until more steps stop lowering its error
on a split of chunks held out for that (the predictor's ``filling``): it only ever uses
bubble time.

Without a pipeline (one stage: plain data parallelism or ZeRO) there are no bubbles;
:class:`Background` runs the queued jobs to their ends on a thread of its own at the
lowest priority (nice 19), so that the training loop's thread keeps the core it
needs. The contract is the bubbles': what has not started by the next checkpoint
runs inline there (after the job running on the thread has ended), before the
predictor sees the new checkpoint. On CUDA that thread issues its work on the side
stream, started where the compute stream is when the job begins. The plugin gives it
a learning predictor's work only: a simple predictor's few milliseconds per checkpoint
cost the training loop more on that thread, which shares the interpreter's lock and
the cores with it, than at the checkpoint.

Record: ``coordinator/rankNNNNN.jsonl`` in the run directory, one JSON line per
``coordinator.log_every`` iterations per rank: ``rank``, ``stage``, ``iteration`` (the
last one covered), ``iterations`` (how many), ``bubble_s`` (the slots' measured spans,
summed), ``predictor_s`` (predictor work placed in slots), ``background_s`` (predictor
work run on :class:`Background`'s thread), ``inline_s`` (predictor work run inline, or
waited for, on the training loop's path), ``predictor_cpu_s`` (the CPU time of all of
that work, each thread's own: with more processes than cores the wall seconds hold the
wait for a core too; on CUDA it is the time to issue the work) and ``slices``,
``[slot, budget_s, spent_s]`` for every slot that ran work. Per iteration:
``bubble_s / iterations`` and ``predictor_s / iterations``; the bubble filled:
``predictor_s / bubble_s``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from collections import defaultdict, deque
from typing import Callable, Iterator, Optional, Protocol

import numpy as np
import torch
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.schedule import PipeInstruction, TrainSchedule

from cpsr_ds.config import CoordinatorConfig

log = logging.getLogger(__name__)

RECORD_DIR = "coordinator"
PIECES = 5  # recent costs of a job's smallest piece that its estimate is the largest of
MIN_PIECE_S = 0.002  # no piece is expected to take less: timing noise on a shared CPU is of that order
LOWEST_PRIORITY = 19  # the nice value of the background thread
DROP_WAIT_S = 30.0  # how long the end of the job waits for the background thread's running job
DONE = object()  # what a PiecesJob's exhausted pieces give


class PredictorWork(PipeInstruction):
    """Run queued predictor work within the budget of bubble ``slot``."""

    def __init__(self, slot: str):
        super().__init__(slot=slot)


def _computes(cmds: list) -> bool:
    return any(isinstance(c, (schedule.ForwardPass, schedule.BackwardPass)) for c in cmds)


def bubble_slots(steps: list[list]) -> list[tuple[int, int, str]]:
    """Where a stage's schedule ``steps`` waits: (step, position in the step, slot name).

    Before the first ``RecvActivation``, the first ``RecvGrad`` and each ``RecvGrad``
    after a step with no pass, at the start of their step; in a last step with no pass,
    right before its batch-end collectives (after a ``SendGrad`` that another stage
    waits for).
    """
    found, seen = [], set()
    for i, cmds in enumerate(steps):
        kinds = {type(c) for c in cmds}
        idle_before = i > 0 and not _computes(steps[i - 1])
        for kind in (schedule.RecvActivation, schedule.RecvGrad):
            if kind in kinds and (kind not in seen or (kind is schedule.RecvGrad and idle_before)):
                found.append((i, 0, f"{kind.__name__}@{i}"))
            if kind in kinds:
                seen.add(kind)
        if i == len(steps) - 1 and not _computes(cmds) and schedule.ReduceTiedGrads in kinds:
            at = next(k for k, c in enumerate(cmds) if isinstance(c, schedule.ReduceTiedGrads))
            found.append((i, at, f"OptimizerStep@{i}"))
    return found


class BubbleSchedule(TrainSchedule):
    """DeepSpeed's 1F1B training schedule with a :class:`PredictorWork` in each of the stage's bubbles."""

    def steps(self):
        steps = [list(cmds) for cmds in super().steps()]
        for step, position, slot in bubble_slots(steps):
            steps[step].insert(position, PredictorWork(slot))
        yield from steps


class Job(Protocol):
    optional: bool  # True: only for the bubbles; a flush drops it (close), nothing runs it inline

    def cost(self) -> Optional[float]:
        """Seconds of the job's smallest piece; None: not measured yet."""

    def run(self, budget_s: Optional[float]) -> bool:
        """Work for at most ``budget_s`` seconds (None: to the end); True once the job is done."""

    def close(self) -> None:
        """Stop the job where it is: a flush drops an optional job, the end of the job every one."""


class PieceCost:
    """The cost of a job kind's smallest piece: the largest of the last few measured.

    A piece that a job's generator names before it (it yields the name at the pause before that piece) has a
    record of its own, ``named(name)``: vitp's held-out check, one piece after the 24 micro-batches of its steps,
    was estimated from the micro-batches it followed and ran 73-79 ms in a 51-53 ms slot."""

    def __init__(self):
        self.recent: deque[float] = deque(maxlen=PIECES)
        self.names: dict[str, PieceCost] = {}

    def named(self, name: Optional[str]) -> "PieceCost":
        """The record of the pieces called ``name`` (None: this one)."""
        return self if name is None else self.names.setdefault(name, PieceCost())

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)

    def estimate(self) -> Optional[float]:
        return max(MIN_PIECE_S, *self.recent) if self.recent else None


class Piecewise:
    """What the jobs share: the cost record of their kind's smallest piece, and whether the job is optional."""

    optional = False

    def __init__(self, piece: PieceCost):
        self.piece = piece

    def cost(self) -> Optional[float]:
        return self.piece.estimate()

    def close(self) -> None:
        """Nothing runs until the job's next slice."""


class CallJob(Piecewise):
    """One call that cannot be sliced; its cost is the largest of its kind's recent calls."""

    def __init__(self, call: Callable[[], None], piece: PieceCost):
        super().__init__(piece)
        self.call = call

    def run(self, budget_s: Optional[float]) -> bool:
        t0 = time.perf_counter()
        self.call()
        self.piece.add(time.perf_counter() - t0)
        return True


class PiecesJob(Piecewise):
    """Work done a piece at a time: ``pieces`` yields after each (e.g. Predictor.observing's copy of a share), None
    or the name of the piece that follows where that one is of another size (:meth:`PieceCost.named`); a slice
    runs pieces while the next one's estimated cost fits the budget. A named piece not yet measured has no
    estimate: it waits for the next flush, which measures it."""

    def __init__(self, pieces: Iterator[Optional[str]], piece: PieceCost):
        super().__init__(piece)
        self.pieces = pieces
        self.upcoming: Optional[str] = None  # the name of the next piece

    def cost(self) -> Optional[float]:
        return self.piece.named(self.upcoming).estimate()

    def run(self, budget_s: Optional[float]) -> bool:
        start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            upcoming = next(self.pieces, DONE)
            self.piece.named(self.upcoming).add(time.perf_counter() - t0)
            if upcoming is DONE:
                return True
            self.upcoming = upcoming
            cost = self.cost()
            if budget_s is not None and (cost is None or time.perf_counter() - start + cost > budget_s):
                return False

    def close(self) -> None:
        """Stop the work where it is (its generator's ``finally`` runs now, not whenever it is collected)."""
        self.pieces.close()


class TrainJob(PiecesJob):
    """A learning predictor's training after a checkpoint: ``steps`` steps or ``seconds`` seconds of its own
    running, then its held-out check, a piece at a time (``predictor.training``: a micro-batch of a step, or the
    check), so that it stops and goes on between pieces as the slots allow and ends as it would in one go."""

    def __init__(self, predictor, steps: Optional[int], seconds: Optional[float], piece: PieceCost):
        super().__init__(predictor.training(budget_s=seconds, n_steps=steps), piece)


class FillJob(PiecesJob):
    """The learning predictor's training in what is left of the bubbles until the next checkpoint
    (``coordinator.fill``): ``predictor.filling``, which stops where more steps no longer help; no held-out check
    (the checkpoint's record makes one), never inline, and closed when dropped (filling then keeps its best
    weights)."""

    optional = True

    def __init__(self, predictor, piece: PieceCost):
        super().__init__(predictor.filling(), piece)


def budget(spans, percentile: float, safety: float) -> float:
    """A slot's budget: the ``percentile`` of its recent ``spans`` times ``safety``; 0 before any."""
    return float(np.percentile(list(spans), percentile)) * safety if spans else 0.0


def _side_stream(side):
    """On CUDA, ``side`` made to start at this point of the compute stream; on CPU (``side`` None), nothing."""
    if side is None:
        return contextlib.nullcontext()
    side.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(side)


class Coordinator:
    """One rank's queue of predictor work, its slots' spans and budgets, and its record."""

    def __init__(self, cfg: CoordinatorConfig, directory: str, rank: int, stage: int):
        self.cfg = cfg
        self.path = os.path.join(directory, RECORD_DIR, f"rank{rank:05d}.jsonl")
        self.rank, self.stage = rank, stage
        self.queue: deque[Job] = deque()
        self.spans: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=cfg.window))
        self.pieces: dict[str, PieceCost] = defaultdict(PieceCost)
        self.open = None  # (slot, start, budget, spent) until the receive after the slot ends
        self.side = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.lock = threading.Condition()  # the record's sums, and Background's queue
        self._reset()

    def _reset(self) -> None:
        self.iterations, self.bubble_s, self.predictor_s, self.inline_s, self.slices = 0, 0.0, 0.0, 0.0, []
        self.background_s, self.predictor_cpu_s = 0.0, 0.0

    @contextlib.contextmanager
    def _spent(self, wall: Optional[str]):
        """Add the block's wall seconds to the record's field ``wall`` (None: to none) and this thread's CPU
        seconds in it to ``predictor_cpu_s``."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            with self.lock:
                if wall is not None:
                    setattr(self, wall, getattr(self, wall) + time.perf_counter() - t0)
                self.predictor_cpu_s += time.thread_time() - c0

    def piece(self, kind: str) -> PieceCost:
        """The cost record of the jobs of ``kind``, kept across checkpoints."""
        return self.pieces[kind]

    def budget(self, slot: str) -> float:
        return budget(self.spans[slot], self.cfg.percentile, self.cfg.safety)

    def join(self) -> None:
        """On CUDA: the compute stream waits for the work issued on the side stream so far, so that what the
        training loop's thread does next with the predictor (inline work, its weights copied into a checkpoint,
        a prediction) sees that work done. The CPU does not wait."""
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)

    def submit(self, job: Job) -> None:
        """Queue ``job``. A job with no measured piece runs one piece now, inline, to measure it; behind other
        work (which it must follow) it waits for the next :meth:`flush`, which measures it."""
        if job.cost() is None and not self.queue and not job.optional:
            self.join()
            with self._spent("inline_s"):
                done = job.run(0.0)
            if done:
                return
        self.queue.append(job)

    def flush(self) -> None:
        """Run everything queued to its end, inline, but optional jobs, which are dropped; a job not measured yet
        runs one piece first, to measure it (run to its end at once, its pieces are not timed one at a time, and
        it would never fit a slot)."""
        self.join()
        with self._spent("inline_s"):
            while self.queue:
                job = self.queue.popleft()
                if job.optional:
                    job.close()
                    continue
                if job.cost() is None and job.run(0.0):  # done with its first piece
                    continue
                job.run(None)

    def drop(self) -> None:
        """Give up what is queued (the job ends), saying so: each job closed here, on the calling thread."""
        _cancel(self.rank, list(self.queue))
        self.queue.clear()

    def slot(self, slot: str) -> None:
        """At bubble ``slot``: run queued work within its budget."""
        start = time.perf_counter()
        limit, ran = self.budget(slot), False
        # The slot's wall time is its span's, counted once the receive after it ends (waited).
        with self._spent(None), _side_stream(self.side):
            while self.queue:
                left = limit - (time.perf_counter() - start)
                cost = self.queue[0].cost()
                if cost is None or cost > left:
                    break
                ran = True
                if self.queue[0].run(left):
                    self.queue.popleft()
        self.open = (slot, start, limit, time.perf_counter() - start if ran else 0.0)

    def waited(self) -> None:
        """The receive after the open slot has ended: its span is measured."""
        if self.open is None:
            return
        slot, start, limit, spent = self.open
        self.open = None
        span = time.perf_counter() - start
        self.spans[slot].append(span)
        self.bubble_s += span
        if spent > 0:
            self.predictor_s += spent
            self.slices.append([slot, round(limit, 6), round(spent, 6)])

    def end_iteration(self, iteration: int) -> None:
        """Count the iteration; every ``log_every`` iterations append the record's line."""
        self.iterations += 1
        if self.iterations < self.cfg.log_every:
            return
        with self.lock:
            row = {"rank": self.rank, "stage": self.stage, "iteration": iteration, "iterations": self.iterations,
                   "bubble_s": round(self.bubble_s, 6), "predictor_s": round(self.predictor_s, 6),
                   "background_s": round(self.background_s, 6), "inline_s": round(self.inline_s, 6),
                   "predictor_cpu_s": round(self.predictor_cpu_s, 6), "slices": self.slices}
            self._reset()
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as err:  # a record never stops training
            log.warning("cpsr: could not append to %s: %s", self.path, err)


class Background(Coordinator):
    """Without a pipeline: the queued jobs run to their ends on a low-priority thread of this rank."""

    def __init__(self, cfg: CoordinatorConfig, directory: str, rank: int, stage: int):
        super().__init__(cfg, directory, rank, stage)
        self.running = False
        self.stopped = False
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._work, name=f"cpsr-predictor-rank{rank}", daemon=True)
        self.thread.start()
        # A script that ends without engine.destroy() must not leave the thread inside torch while the
        # interpreter finalises: that aborts the process ("terminate called without an active exception").
        atexit.register(self.drop)

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the thread; an optional job is for bubbles, and there are none: dropped."""
        if job.optional:
            return
        with self.lock:
            self.queue.append(job)
            self.lock.notify_all()

    def _work(self) -> None:
        # A thread's own nice value (Linux): the training loop's thread keeps the CPU it needs.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self.queue or self.stopped)
                if self.stopped:
                    return
                job, self.running = self.queue.popleft(), True
            error = None
            try:
                with self._spent("background_s"), _side_stream(self.side):
                    self._run_to_end(job)
            except BaseException as err:  # raised on the training loop's thread at the next flush
                error = err
            with self.lock:
                self.running, self.error = False, self.error or error
                self.lock.notify_all()

    def _run_to_end(self, job: Job) -> None:
        """``job`` a piece at a time until it is done, or closed where it is once the job ends (:meth:`drop`): the
        thread is then outside torch before the interpreter's teardown, which aborts a thread inside it."""
        while not job.run(0.0):
            if self.stopped:
                job.close()
                return

    def flush(self) -> None:
        """Wait for the job running on the thread, then run what has not started, inline."""
        with self._spent("inline_s"):  # waiting costs no CPU time
            with self.lock:
                pending = list(self.queue)
                self.queue.clear()
                self.lock.wait_for(lambda: not self.running)
                error, self.error = self.error, None
            if error is not None:
                raise RuntimeError(f"cpsr: rank {self.rank}: the predictor's work on the background thread "
                                   f"failed: {error}") from error
            self.join()
            for job in pending:
                job.run(None)

    def drop(self) -> None:
        """Give up what has not started and end the thread, its running job closed after its current piece
        (waited for at most DROP_WAIT_S)."""
        with self.lock:
            left = list(self.queue)
            self.queue.clear()
            self.stopped = True
            self.lock.notify_all()
        _cancel(self.rank, left)
        self.thread.join(timeout=DROP_WAIT_S)
        if self.thread.is_alive():
            log.warning("cpsr: rank %d: the predictor's background thread still runs a piece %g s after the end of "
                        "the job", self.rank, DROP_WAIT_S)


def _cancel(rank: int, jobs: list) -> None:
    """Close ``jobs``, queued when the job ends, saying how many were not optional."""
    left = sum(not job.optional for job in jobs)
    if left:
        log.info("cpsr: rank %d: %d job(s) of predictor work cancelled at the end of the job", rank, left)
    for job in jobs:
        job.close()


def read_records(directory: str) -> list[dict]:
    """Every rank's coordinator lines in ``directory``, in file order."""
    folder = os.path.join(directory, RECORD_DIR)
    rows = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows
