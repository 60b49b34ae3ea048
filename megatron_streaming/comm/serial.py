"""Background threads that a blocked call must not hold up: the cross-worker exchange's and
the rendezvous store's (``lifecycle.Liveness``)."""

from __future__ import annotations

import concurrent.futures
import queue
import threading


class SerialThread:
    """Runs submitted calls one at a time, in order, on one daemon thread. A daemon because a
    collective with a peer that never answers may block it until its timeout: that must not
    keep a failed process from exiting (``ThreadPoolExecutor``'s threads are joined at
    interpreter exit)."""

    def __init__(self, name: str, initializer=None):
        self._queue: "queue.Queue" = queue.Queue()
        self._initializer = initializer  # run first on the thread (e.g. its CUDA device)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> None:
        self._queue.put((fn, args))

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            fn(*args)  # reports its own errors through its futures

    def shutdown(self, wait: bool = True) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            if wait:
                self._thread.join()


class BoundedCalls:
    """Calls run one at a time on a ``SerialThread``, each waited for (queueing included) at
    most ``timeout`` seconds. A call to the rendezvous store over a link that went down does
    not fail: it blocks until TCP gives up, about 15 minutes on Linux. Here the caller gets
    ``TimeoutError`` after ``timeout`` instead; a call whose caller gave up before it started
    is skipped, so calls do not pile up behind a blocked one (which completes, late, if the
    link comes back)."""

    def __init__(self, name: str):
        self._thread = SerialThread(name)

    def __call__(self, fn, timeout: float):
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            if not future.set_running_or_notify_cancel():
                return  # its caller has given up
            try:
                future.set_result(fn())
            except BaseException as e:  # delivered to the caller
                future.set_exception(e)

        self._thread.submit(run)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # skipped if it has not started
            raise TimeoutError(f"no answer within {timeout:g} s") from None
