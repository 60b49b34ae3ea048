"""One preloaded process for the whole test session, from which every launch is forked.

    python tests/zygote.py serve SOCKET          # the server (``harness`` starts it)
    python tests/zygote.py SOCKET NPROC SCRIPT [ARGS...]
    python tests/zygote.py SOCKET 1 -m MODULE [ARGS...]

The second form is the launch a test runs in place of ``python SCRIPT ARGS`` (NPROC 1) or
``tests/preloaded_launcher.py NPROC SCRIPT ARGS``: a small client that hands the server its
standard streams (SCM_RIGHTS), environment and directory; the server forks a process that
takes them and runs ``preloaded_launcher.launch``, so the launch's processes start with
torch, DeepSpeed and megatron-core already imported (about 6.5 s of every launch's start on
2 cores) instead of importing them per launch. For the test it is the same process:

* its output streams, exit status (a lone process killed by a signal: the client ends by the
  same signal) and SIGTERM / SIGINT (passed on);
* killed (``Popen.kill``), the client's socket closes and the launch's processes are killed;
* the expected warnings the imports print (``quiet``) are printed again at the start of a
  script's launch, as a launch that imported them itself would (not of a module's: the
  package's tools import less).

``harness.command`` sends a launch here only when its environment differs from the server's
in nothing an import reads (``IMPORT_TIME``); tests of the launchers themselves and of
network namespaces do not come here (``harness.PRELOADED``, ``wrap``).
"""

import json
import os
import signal
import socket
import struct
import sys
import time

# Environment variables read when torch, DeepSpeed, megatron-core or Python itself start: a
# launch that sets any of them differently from the server imports on its own.
IMPORT_TIME = ("PYTHON", "TORCH", "LD_", "CUDA", "CUBLAS", "NCCL", "DS_", "OMP_", "MKL_",
               "KMP_", "GOMP_", "NVTE_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TMPDIR",
               "HOME")
# ... but not these, set by the session's in-process tests that compile (the launches run with
# TORCHDYNAMO_DISABLE, so they never compile) or by launchers at run time.
RUN_TIME = ("TORCHINDUCTOR_", "TORCHELASTIC_")
STREAMS = (0, 1, 2)
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def differs_at_import(base: dict, environment: dict) -> list:
    """The variables an import reads that ``environment`` sets otherwise than ``base``."""
    return sorted(k for k in set(base) | set(environment)
                  if k.startswith(IMPORT_TIME) and not k.startswith(RUN_TIME)
                  and base.get(k) != environment.get(k))


def _send(sock: socket.socket, payload: dict, fds=()) -> None:
    data = json.dumps(payload).encode()
    header = struct.pack("!Q", len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError("the other end closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket, fd_count: int = 0):
    if fd_count:
        header, fds, _, _ = socket.recv_fds(sock, 8, fd_count)
        header += _read_exactly(sock, 8 - len(header)) if len(header) < 8 else b""
    else:
        header, fds = _read_exactly(sock, 8), []
    (size,) = struct.unpack("!Q", header)
    return json.loads(_read_exactly(sock, size)), fds


# ---- the server -----------------------------------------------------------------------------

def _preload_capturing() -> dict:
    """``preloaded_launcher._preload`` with what it prints kept: each launch prints it again."""
    import tempfile

    import preloaded_launcher

    saved, captured = {}, {}
    for fd in (1, 2):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        saved[fd], captured[fd] = os.dup(fd), tempfile.TemporaryFile()
        os.dup2(captured[fd].fileno(), fd)
    try:
        preloaded_launcher._preload()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
    printed = {}
    for fd, f in captured.items():
        f.seek(0)
        printed[fd] = f.read()
        f.close()
    return printed


def _take_launch(conn: socket.socket, printed: dict) -> None:
    """In the forked process: become the client's launch, tell it the exit status, exit."""
    import preloaded_launcher
    from megatron_streaming.run import quiet

    request, fds = _receive(conn, len(STREAMS))
    for fd, mine in zip(STREAMS, fds):
        os.dup2(mine, fd)
        os.close(mine)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # The imports' expected warnings, as a script's launch would print them (a module, the
    # package's tools, imports less than the server did: it prints none of them).
    if request["script"] != "-m" and (int(request["nproc"]) > 1 or quiet.launch_rank() == 0):
        for fd in (1, 2):
            if printed[fd]:
                os.write(fd, printed[fd])
    _send(conn, {"pid": os.getpid()})
    code = preloaded_launcher.launch(int(request["nproc"]), request["script"], request["args"],
                                     client=conn)
    try:
        _send(conn, {"code": code})
    except OSError:
        pass  # the client is gone
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve(path: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    printed = _preload_capturing()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    listener.settimeout(1.0)
    os.rename(path + ".new", path)  # clients connect once it is ready
    while os.getppid() == parent:  # the test session that started it is still there
        while True:  # finished launches
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _take_launch(conn, printed)
        conn.close()


# ---- the client -----------------------------------------------------------------------------

def _connect(path: str, seconds: float = 300.0) -> socket.socket:
    deadline = time.monotonic() + seconds
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if time.monotonic() > deadline:
                raise SystemExit(f"zygote.py: no server at {path} after {seconds:g} s")
            time.sleep(0.05)


def client(path: str, nproc: int, script: str, args: list) -> int:
    # A signal that comes before the launch's pid is known waits for it (blocked), then goes
    # on to the launch as every later one does.
    signal.pthread_sigmask(signal.SIG_BLOCK, set(FORWARDED))
    sock = _connect(path)
    _send(sock, {"nproc": nproc, "script": script, "args": args, "cwd": os.getcwd(),
                 "env": dict(os.environ)}, STREAMS)
    launch = _receive(sock)[0]["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda s, f: os.kill(launch, s))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(FORWARDED))
    try:
        code = _receive(sock)[0]["code"]
    except EOFError:
        print(f"zygote.py: the launch (pid {launch}) ended without an exit status",
              file=sys.stderr)
        return 1
    if code < 0:  # a lone process killed by a signal: so is this one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
