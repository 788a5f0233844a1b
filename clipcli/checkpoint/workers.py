"""The workers a run is shared by: threads, or forked processes that send back their results through pipes."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import select
import signal
import threading
import warnings
from collections.abc import Callable, MutableSequence
from typing import Any

from clipcli._stops import StopsHeld, ignore_in_worker


class Deal:
    """Which task each of a pass's workers takes next. The tasks are cut into contiguous runs, one a worker, each
    taken in order: a tensor's chunks then mostly stay with one worker, which finishes its figures there (only
    those come back, not its partial sums), and each worker reads on in a part of the files. A worker whose run
    is done takes the second half of the longest run left, so that none idles while another has two tasks to do.
    With one run (`runs` 1: a store that reads ahead in the order of the tasks), every worker takes the next.

    `bounds` (start, end of each run) and `lock` are shared by the workers: a list and a thread's lock, or shared
    memory and a process's lock.
    """

    def __init__(self, tasks: int, runs: int, bounds: MutableSequence[int], lock: Any):
        each, longer = divmod(tasks, runs)  # (the longer runs first: one left empty is a last worker's)
        for j in range(runs):
            bounds[2 * j] = j * each + min(j, longer)
            bounds[2 * j + 1] = bounds[2 * j] + each + (j < longer)
        self.runs, self.bounds, self.lock = runs, bounds, lock

    def take(self, k: int) -> int:
        """Worker `k`'s next task.

        Raises:
            StopIteration: when every task is taken.
        """
        b, own = self.bounds, k % self.runs
        with self.lock:
            if b[2 * own] >= b[2 * own + 1]:  # its run is done: the second half of the longest left
                j = max(range(self.runs), key=lambda j: b[2 * j + 1] - b[2 * j])
                start, end = b[2 * j], b[2 * j + 1]
                if start >= end:
                    raise StopIteration
                middle = start + (end - start) // 2  # (the one task of a run of one)
                b[2 * j + 1] = middle
                b[2 * own], b[2 * own + 1] = middle, end
            i = b[2 * own]
            b[2 * own] = i + 1
        return i


def runs_for(work: Any, jobs: int) -> int:
    """The runs `Deal` cuts a pass's tasks into: one a worker, or one for all where a store reads ahead in the
    order of the tasks (a remote one: `engine.read_ahead`)."""
    ahead = any(getattr(getattr(r, "store", None), "reads_ahead", False) for r in work.readers)
    return 1 if ahead else jobs


def in_threads(work: Any, jobs: int, progress: Callable[[int], None]) -> list[Any]:
    lock = threading.Lock()
    runs = runs_for(work, jobs)
    deal = Deal(len(work.tasks), runs, [0] * (2 * runs), lock)
    stop = threading.Event()
    results: list[Any] = [None] * jobs
    errors: list[BaseException] = []

    def report(n: int) -> None:
        with lock:
            progress(n)

    def worker(k: int) -> None:
        try:
            results[k] = work.loop(functools.partial(deal.take, k), report, stop)
        except BaseException as e:
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=worker, args=(k,), name=f"clipcli-{k}") for k in range(jobs)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    return results


def in_processes(work: Any, jobs: int, progress: Callable[[int], None]) -> list[Any]:
    """Forked workers: each takes the task numbers dealt it (`Deal`, in shared memory), counts its bytes there too,
    and sends back its kernel's result (or its error) through a pipe of its own."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    runs = runs_for(work, jobs)
    deal = Deal(len(work.tasks), runs, ctx.Array("q", 2 * runs, lock=False), ctx.Lock())
    done = ctx.Array("q", jobs, lock=False)
    children: dict[int, tuple[int, int]] = {}  # read end -> (pid, worker)
    try:
        for k in range(jobs):
            r, w = os.pipe()
            gc.freeze()  # objects made so far stay out of the workers' collections: their pages stay shared
            with warnings.catch_warnings(), StopsHeld():
                # Python 3.12+ warns that a process with threads (NumPy's BLAS pool) forks: the workers
                # use neither BLAS nor any lock those threads could hold.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
                if pid == 0:  # pragma: no cover (a worker: it never returns)
                    ignore_in_worker()  # Ctrl-C and SIGTERM are the parent's to handle
            if pid == 0:  # pragma: no cover
                os.close(r)
                _child(work, k, deal, done, w)
            os.close(w)
            children[r] = (pid, k)
        return _gather(children, jobs, done, progress, work.readers)
    finally:
        gc.unfreeze()
        for r, (pid, _) in children.items():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.close(r)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _child(work: Any, k: int, deal: Deal, done: Any, w: int) -> None:  # pragma: no cover
    """A worker process: runs its share, writes its pickled outcome to `w`, and exits without cleanup."""
    status = 0
    try:
        gc.disable()  # a worker makes little garbage, and a collection would write to every shared page
        _die_with_parent()
        for reader in work.readers:
            reader.forget_handles()

        def report(n: int) -> None:
            done[k] += n

        try:
            result = work.loop(functools.partial(deal.take, k), report)
            outcome: tuple[str, Any] = ("ok", (result, [r.take_read_log() for r in work.readers]))
        except BaseException as e:
            outcome = ("error", e)
        try:
            data = pickle.dumps(outcome)
        except Exception as e:
            data = pickle.dumps(("error", RuntimeError(f"{type(outcome[1]).__name__}: {outcome[1]} ({e})")))
        view = memoryview(data)
        while view:
            view = view[os.write(w, view) :]
    except BaseException:
        status = 1
    finally:
        os._exit(status)


def _die_with_parent() -> None:  # pragma: no cover (in a worker)
    """Linux: a worker is killed when its parent dies (kill -9), instead of running on alone."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _gather(
    children: dict[int, tuple[int, int]], jobs: int, done: Any, progress: Callable[[int], None], readers: list
) -> list:
    results: list[Any] = [None] * jobs
    buffers: dict[int, list[bytes]] = {r: [] for r in children}
    open_ends = set(children)
    reported = 0
    while open_ends:
        ready, _, _ = select.select(list(open_ends), [], [], 0.1)
        for r in ready:
            data = os.read(r, 1 << 20)
            if data:
                buffers[r].append(data)
                continue
            open_ends.discard(r)
            pid, k = children.pop(r)
            _, status = os.waitpid(pid, 0)
            os.close(r)
            raw = b"".join(buffers[r])
            if not raw:
                raise RuntimeError(f"worker {k} died ({_describe(status)})")
            state, value = pickle.loads(raw)
            if state == "error":
                raise value
            results[k], logs = value
            for reader, log in zip(readers, logs, strict=True):
                reader.add_read_log(log)
        now = int(sum(done))
        if now > reported:
            progress(now - reported)
            reported = now
    return results


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit status {os.WEXITSTATUS(status)}"
