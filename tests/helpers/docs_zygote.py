"""A fork server for the docs' shell blocks (tests/helpers/docs_runner.py): ``lowbit`` in a block is
a small client that hands its argv, folder and stdio to a process that has already imported lowbit,
torch and transformers; that process forks, and the child runs ``lowbit.cli.main`` (the console
script's entry point) as the real command would, exit code included. It saves the interpreter start
and the imports, several seconds per command on a small machine, and changes nothing else.

The server forks right after the imports, before any torch computation, so no thread pool exists
when it forks a command.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

CLIENT = """#!{python} -S
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect({sock!r})
req = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(s, [len(req).to_bytes(8, "big") + req], [0, 1, 2])
code = s.recv(8)
sys.exit(int.from_bytes(code, "big", signed=True) if len(code) == 8 else 70)
"""


def _recv_exact(conn: socket.socket, n: int, first: bytes) -> bytes:
    data = first
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("client went away")
        data += chunk
    return data


def _run_command(req: dict, fds: list[int]) -> None:
    """In the forked child: become the command, then exit with its code."""
    code = 0
    try:
        for i, fd in enumerate(fds[:3]):
            os.dup2(fd, i)
        sys.stdin, sys.stdout, sys.stderr = (open(0, closefd=False), open(1, "w", closefd=False),
                                             open(2, "w", closefd=False))
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["lowbit", *req["argv"]]
        from lowbit.cli import main

        main(req["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - an uncaught error, as the interpreter would report it
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve(sock_path: Path) -> None:
    """Accept commands on ``sock_path`` one at a time until killed (never returns)."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    server.listen(8)
    while True:
        conn, _ = server.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            size = int.from_bytes(msg[:8], "big")
            req = json.loads(_recv_exact(conn, size + 8, msg)[8:])
            pid = os.fork()
            if pid == 0:
                server.close()
                _run_command(req, fds)
            for fd in fds:
                os.close(fd)
            _, status = os.waitpid(pid, 0)
            conn.sendall(os.waitstatus_to_exitcode(status).to_bytes(8, "big", signed=True))


def start(bin_dir: Path) -> tuple[int, dict[str, str]]:
    """Fork the server (after importing what the commands import) and write the ``lowbit`` client
    into ``bin_dir``; returns (the server's pid, an environment with that ``lowbit`` first on PATH)."""
    import lowbit.checkpoint  # noqa: F401 - the heavy imports, done once
    import lowbit.cli  # noqa: F401
    import lowbit.model_quant  # noqa: F401
    import lowbit.report.compare  # noqa: F401

    bin_dir.mkdir(parents=True, exist_ok=True)
    sock = bin_dir / "lowbit.sock"
    pid = os.fork()
    if pid == 0:
        try:
            serve(sock)
        finally:
            os._exit(1)
    exe = bin_dir / "lowbit"
    exe.write_text(CLIENT.format(python=sys.executable, sock=str(sock)))
    exe.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    import time

    for _ in range(200):  # the socket exists once the server listens
        if sock.exists():
            break
        time.sleep(0.05)
    return pid, env
