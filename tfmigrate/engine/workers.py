"""Running `check`'s or `fix`'s work over the files: in worker processes when there are
enough of them, with a progress bar on a terminal only.

Two things a run over a big tree must survive (see RELIABILITY.md):

- **A worker that crashes** (a parser overflowing the C stack, the out-of-memory killer) breaks
  a ``ProcessPoolExecutor`` for every file in flight. Each worker marks in shared memory
  (``status``, one slot per file) the file it starts and the files it finishes, so when the
  pool breaks the files in flight are known: each is run again alone, in a process of its own
  (one that crashes there gets its own error), and the files not reached go to a new pool.
- **Ctrl-C**: workers stop at once (a file being written is finished first, see
  :func:`tfmigrate.engine.source.interrupts_held`), what they finished comes back, and
  :class:`Interrupted` carries the results and how many files were written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Callable

# Below this many files a worker pool costs more to start than it saves.
PARALLEL_MIN_FILES = 40
# How long workers get, after Ctrl-C, to hand back what they finished before they are killed.
INTERRUPT_GRACE_SECONDS = 1.0
# A file's slot in ``status``: not started, done, done and written; a worker's pid while it runs.
PENDING, DONE, WRITTEN = 0, -1, -2


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run: ``results`` has None for the files not finished."""

    def __init__(self, results: list, written: int) -> None:
        super().__init__()
        self.results = results
        self.written = written


def default_jobs() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (containers, taskset)
    except AttributeError:
        return os.cpu_count() or 1


def _fork_context():
    """Workers forked from this process start at once, with the rules already imported;
    spawned ones would import everything again (about a second each). macOS and Windows get
    their platform default."""
    import multiprocessing

    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context()


# --- in a worker ------------------------------------------------------------------------------
_worker: dict = {"status": None, "stop": None, "queue": None, "busy": False}


def _on_sigint(signum, frame) -> None:
    """A worker's SIGINT: interrupt the file it works on; between files, nothing (the parent
    decides)."""
    if _worker["busy"]:
        raise KeyboardInterrupt


def _init_worker(status, stop, queue) -> None:
    _worker.update(status=status, stop=stop, queue=queue, busy=False)
    signal.signal(signal.SIGINT, _on_sigint)


def _run_chunk(work, items: list[tuple[int, str]], config) -> None:
    """Run ``work`` over a chunk in a worker, each result onto the queue; on Ctrl-C, stop."""
    status, stop, queue = _worker["status"], _worker["stop"], _worker["queue"]
    pid = os.getpid()
    index = None
    try:
        _worker["busy"] = True
        for index, path in items:
            if stop.value:
                break
            with _termination_held():
                status[index] = pid
                result = work(path, config)
                status[index] = WRITTEN if getattr(result, "written", False) else DONE
                _worker["busy"] = False  # a result is never cut in half on the queue
                queue.put((index, result))
                _worker["busy"] = True
    except KeyboardInterrupt as stop:
        _worker["busy"] = False
        # The file in progress was left as it was, or its write was finished and the interrupt
        # carries its result. Its slot must not keep this worker's pid: the parent SIGKILLs the
        # pids it finds there, and this worker, back to waiting for work, holds the pool's
        # task-queue lock, so the killing would leave the other workers (and the parent waiting
        # for them) hung for ever.
        finished = getattr(stop, "result", None)
        if index is not None and finished is not None:
            status[index] = WRITTEN if getattr(finished, "written", False) else DONE
            queue.put((index, finished))
        elif index is not None and status[index] == pid:
            status[index] = PENDING
    finally:
        _worker["busy"] = False


@contextlib.contextmanager
def _termination_held():
    """SIGTERM waits while a worker works on a file and reports it. When another worker crashes,
    the pool terminates the rest: one killed between writing its file and reporting it would
    leave a fixed file that no one counts (rerun, it has nothing left to fix)."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _run_alone(work, path: str, config, connection) -> None:
    connection.send(work(path, config))
    connection.close()


# --- in the parent ----------------------------------------------------------------------------
def _crash_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def run_alone(work, path: str, config, context) -> tuple[object | None, str]:
    """``work(path, config)`` in a process of its own: (its result, "") or (None, why it died)."""
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_run_alone, args=(work, path, config, sender), daemon=True)
    process.start()
    sender.close()
    try:
        result = receiver.recv()
    except EOFError:
        result = None
    except KeyboardInterrupt:
        process.kill()
        raise
    finally:
        process.join()
        receiver.close()
    return (result, "") if result is not None else (None, _crash_reason(process.exitcode))


def _signal_busy(status, signum: int) -> None:
    for pid in {slot for slot in status if slot > 0}:
        try:
            os.kill(pid, signum)
        except OSError:  # finished in the meantime
            pass


class _Pool:
    """One ``ProcessPoolExecutor`` round over some of the files (a crash ends the round).
    Workers put each file's result on ``queue`` as soon as it is done, so that a crash or
    Ctrl-C loses no finished file's result; a thread of the parent takes them off."""

    def __init__(self, work, files: list[str], config, jobs: int, status, stop, pause) -> None:
        self.work, self.files, self.config, self.status, self.stop = work, files, config, status, stop
        self.context = _fork_context()
        self.jobs, self.pause = jobs, pause
        self.queue = self.context.SimpleQueue()

    def run(self, indices: list[int], results: list, advance: Callable[[int], None]) -> bool:
        """Fill ``results`` for ``indices``; False when a worker crashed (the round stopped)."""
        import threading
        from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

        # Small chunks balance the load; not too small, each is a round trip to a worker.
        size = max(1, min(50, len(indices) // (self.jobs * 8)))
        chunks = [[(i, self.files[i]) for i in indices[k:k + size]] for k in range(0, len(indices), size)]
        with self.pause():  # the first submit forks the workers
            pool = ProcessPoolExecutor(
                max_workers=min(self.jobs, len(chunks)), mp_context=self.context,
                initializer=_init_worker, initargs=(self.status, self.stop, self.queue),
            )
            futures = [pool.submit(_run_chunk, self.work, chunk, self.config) for chunk in chunks]
        finished = threading.Event()
        drainer = threading.Thread(target=self._drain, args=(results, advance, finished), daemon=True)
        drainer.start()
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        except KeyboardInterrupt:
            self.interrupted(pool, futures, finished, drainer, results)
        pool.shutdown(wait=True, cancel_futures=True)
        finished.set()
        drainer.join()
        for future in futures:
            if not future.cancelled() and future.exception() is not None:
                from concurrent.futures.process import BrokenProcessPool

                if isinstance(future.exception(), BrokenProcessPool):
                    return False
                raise future.exception()
        return True

    def _drain(self, results: list, advance: Callable[[int], None], finished) -> None:
        """Take results off the queue until ``finished`` is set and the queue is empty."""
        while True:
            if not self.queue.empty():
                index, result = self.queue.get()
                results[index] = result
                advance(1)
            elif finished.is_set():
                return
            else:
                finished.wait(0.005)

    def interrupted(self, pool, futures: list, finished, drainer, results: list) -> None:
        """Ctrl-C: stop the workers, keep what they finished, kill those that do not answer."""
        from concurrent.futures import wait

        self.stop.value = 1
        _signal_busy(self.status, signal.SIGINT)  # Ctrl-C reached them too, unless it was `kill -INT`
        for future in futures:
            future.cancel()
        wait(futures, timeout=INTERRUPT_GRACE_SECONDS)
        _signal_busy(self.status, signal.SIGKILL)  # stuck in native code (a long parse)
        finished.set()
        drainer.join(INTERRUPT_GRACE_SECONDS)
        _shut_down_within(pool, INTERRUPT_GRACE_SECONDS)
        raise Interrupted(results, sum(1 for slot in self.status if slot == WRITTEN))


def _shut_down_within(pool, seconds: float) -> None:
    """Shut the pool down, waiting at most ``seconds`` for its manager thread to end.
    Not waiting at all races the interpreter's exit: Python 3.11's ``_python_exit`` wakes the
    manager thread through a pipe the thread may be closing that very moment, and prints an
    "OSError: Bad file descriptor" traceback (seen in CI after Ctrl-C)."""
    import threading

    closer = threading.Thread(target=pool.shutdown, kwargs={"wait": True, "cancel_futures": True}, daemon=True)
    closer.start()
    closer.join(seconds)


def run_pool(
    files: list[str], config, work, jobs: int, advance: Callable[[int], None], on_crash: Callable[[str, str], object],
    pause: Callable[[], contextlib.AbstractContextManager],
) -> list:
    """Results of ``work`` over the files, in worker processes, in the order of ``files``; a new
    round after a crash (see the module doc). ``on_crash(path, why)``: the result for a file
    whose process died. ``pause()``: a context in which no other thread of ours runs (the
    progress bar's), so that forking is safe."""
    from multiprocessing.sharedctypes import RawArray, RawValue

    status = RawArray("q", len(files))
    stop = RawValue("b", 0)
    results: list = [None] * len(files)
    pool = _Pool(work, files, config, jobs, status, stop, pause)

    def alone(index: int) -> None:
        with pause():
            result, why = run_alone(work, files[index], config, pool.context)
        results[index] = result if result is not None else on_crash(files[index], why)
        status[index] = WRITTEN if getattr(result, "written", False) else DONE
        advance(1)

    todo = list(range(len(files)))
    try:
        while todo and not pool.run(todo, results, advance):
            in_flight = [i for i in todo if results[i] is None and status[i] > 0]
            for index in in_flight:  # one of them crashed its worker: each alone
                alone(index)
            todo = [i for i in todo if results[i] is None]
            if not in_flight:  # a worker died between files (killed from outside?): the rest alone
                for index in todo:
                    alone(index)
                break
    except Interrupted:
        raise
    except KeyboardInterrupt:  # while a file ran alone
        raise Interrupted(results, sum(1 for slot in status if slot == WRITTEN)) from None
    return results
