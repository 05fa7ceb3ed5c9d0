"""The Ray actor of the Ray backend (one per worker): it reports its node, the rank-0 actor hosts
the rendezvous store, and each runs ``python -m ringtrain.launch.worker`` as its child process.

Imported by Ray inside the actor process (by reference: ringtrain must be installed on every
node); it imports Ray and torch only inside methods.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from typing import IO, Any

from ringtrain.launch.reaper import remove_worker_temp_dir, wait_unreaped


class RayWorker:
    """One Ray actor per worker: reports its node, optionally hosts the rendezvous store, and
    runs ``python -m ringtrain.launch.worker`` as its child, forwarding its output and exit.

    Runs as a threaded actor (its methods may run concurrently); all state is guarded by one
    condition variable.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._lines: deque[tuple[str, str]] = deque()
        self._proc: subprocess.Popen[bytes] | None = None
        self._open_pipes = 0
        self._lines_read = 0  # lines read from the worker's pipes so far (poll takes them)
        self._returncode: int | None = None
        self._exited_at = 0.0
        self._store: Any = None
        self._store_error: str | None = None

    def node_info(self) -> dict[str, Any]:
        """``node_id``, ``ip``, ``pid`` and ``cuda_visible_devices`` (what Ray assigned)."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")
            or ",".join(str(i) for i in ray.get_gpu_ids()),
        }

    def host_store(self, world_size: int) -> int:
        """Host the rendezvous ``TCPStore`` on this node; returns its port at once.

        The listening socket is bound here, to this node's address (the one Ray reports, which
        the other workers reach it at; not the wildcard), port chosen by the OS so there is no
        race for a "free" port, and handed to the store by file descriptor while torch is
        imported in the background: workers start meanwhile, and their connections wait in the
        socket's backlog. The store lives as long as this actor."""
        import ray

        from ringtrain.wire.handshake import listen_backlog, listen_socket

        host = ray.util.get_node_ip_address()
        sock = listen_socket(host, max(1024, listen_backlog(world_size)))
        port = int(sock.getsockname()[1])
        fd = sock.detach()  # the store owns the descriptor from now on

        def serve() -> None:
            try:
                import torch.distributed as dist

                self._store = dist.TCPStore(
                    host,
                    port,
                    world_size,
                    is_master=True,
                    wait_for_workers=False,
                    master_listen_fd=fd,
                )
            except BaseException as exc:
                with self._cond:
                    self._store_error = f"rendezvous store failed: {type(exc).__name__}: {exc}"
                    self._cond.notify_all()

        threading.Thread(target=serve, name="ringtrain-store", daemon=True).start()
        return port

    def net_plan(
        self, master: tuple[str, int], driver_addr: str, env: dict[str, str], timeout_s: float
    ) -> dict[str, Any]:
        """How this worker will communicate, asked on its node before it starts: the interface
        gloo will use (``GLOO_SOCKET_IFNAME`` of ``env`` or of this node's environment, else the
        one that routes to ``master``), the variables to set for it (``env``), whether it is a
        loopback address (``loopback``, ``advertised``, ``why``), and what it cannot reach
        from there within ``timeout_s`` (``unreachable``: the rendezvous store ``master``, the
        driver's channel ``driver_addr``, ``"host:port"``)."""
        from ringtrain.cluster.netif import (
            choose_interface,
            interface_environment,
            probe,
            resolve,
        )

        environ = {**os.environ, **env}
        choice = choose_interface(master[0], environ)
        plan: dict[str, Any] = {
            "hostname": socket.gethostname(),
            "interface": choice.describe(),
            "source": choice.source,
            "env": interface_environment(choice, environ),
            "loopback": choice.loopback,
            "advertised": choice.address,
            "why": f"GLOO_SOCKET_IFNAME={choice.ifname}",
        }
        if choice.ifname is None:  # gloo falls back to the address the host name resolves to
            name = socket.gethostname()
            addresses = resolve(name)
            plan["advertised"] = addresses[0] if addresses else None
            plan["loopback"] = bool(addresses) and addresses[0].startswith(("127.", "::1"))
            plan["why"] = f"the host name {name!r} resolves to it"
        driver_host, _, driver_port = driver_addr.rpartition(":")
        unreachable = []
        for what, host, port in (
            ("the rendezvous store", master[0], int(master[1])),
            ("the driver", driver_host.strip("[]"), int(driver_port)),
        ):
            why = probe(choice.address, host, port, timeout_s)
            if why is not None:
                unreachable.append(f"{what} at {host}:{port} ({why})")
        plan["unreachable"] = unreachable
        return plan

    def path_exists(self, path: str) -> bool:
        return os.path.exists(path)

    def start(
        self, cmd: list[str], env: dict[str, str], pythonpath: list[str], cwd: str | None
    ) -> int:
        """Start the worker process with this actor's environment updated by ``env``; returns
        its pid."""
        full_env = dict(os.environ)
        full_env.update(env)
        paths = [*pythonpath, *filter(None, [os.environ.get("PYTHONPATH")])]
        full_env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        proc = subprocess.Popen(
            cmd,
            env=full_env,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._proc = proc
        self._open_pipes = 2
        assert proc.stdout is not None and proc.stderr is not None
        for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            threading.Thread(target=self._read, args=(pipe, name), daemon=True).start()
        threading.Thread(target=self._wait, args=(proc, full_env), daemon=True).start()
        return proc.pid

    def _read(self, pipe: IO[bytes], name: str) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                with self._cond:
                    self._lines.append((name, raw.decode("utf-8", errors="replace")))
                    self._lines_read += 1
                    self._cond.notify_all()
        finally:
            with contextlib.suppress(OSError):
                pipe.close()
            with self._cond:
                self._open_pipes -= 1
                self._cond.notify_all()

    def _wait(self, proc: subprocess.Popen[bytes], env: dict[str, str]) -> None:
        wait_unreaped(proc.pid)  # its pid stays the worker's until reaped
        remove_worker_temp_dir(proc.pid, env)  # a killed worker's exit handlers never ran
        code = proc.wait()
        with self._cond:
            self._returncode = code
            self._exited_at = time.monotonic()
            self._cond.notify_all()

    def _finished(self) -> bool:
        # The exit counts once the output is drained (or 2 s later: a grandchild, such as a
        # DataLoader worker, may hold the pipe a moment longer).
        return self._returncode is not None and (
            self._open_pipes == 0 or time.monotonic() - self._exited_at > 2.0
        )

    def poll(self, timeout_s: float) -> tuple[list[tuple[str, str]], int | None]:
        """Output lines ``(stream, line)`` since the last call, and the worker's return code
        once it has exited (negative: killed by that signal). Waits up to ``timeout_s`` seconds
        for either."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._store_error is not None:
                raise RuntimeError(self._store_error)
            while not self._lines and not self._finished():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            lines = list(self._lines)
            self._lines.clear()
            return lines, self._returncode if self._finished() else None

    def dump_stacks(self, quiet_s: float = 0.5, timeout_s: float = 5.0) -> bool:
        """Send :data:`~ringtrain.launch.base.STACK_DUMP_SIGNAL` to the worker process (not its
        process group: a DataLoader worker would die of it), which prints every thread's stack
        to its stderr, then wait until :meth:`poll` has taken all of its output and none came
        for ``quiet_s`` seconds (at most ``timeout_s`` seconds): the stacks are then on their
        way to the driver, before it stops the group. False when no worker process runs."""
        from ringtrain.launch.base import STACK_DUMP_SIGNAL

        proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, STACK_DUMP_SIGNAL)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            read, since = self._lines_read, time.monotonic()
            while (now := time.monotonic()) < deadline:
                if self._lines_read != read:
                    read, since = self._lines_read, now
                elif not self._lines and now - since >= quiet_s:
                    break
                self._cond.wait(min(0.1, deadline - now))
        return True

    def terminate(self, grace_s: float) -> None:
        """SIGTERM the worker's process group, SIGKILL it after ``grace_s`` seconds."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        _signal_group(proc.pid, signal.SIGKILL)  # its DataLoader workers too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def remote_worker_class(ray: Any) -> Any:
    """``ray.remote(RayWorker)``, a new actor class per call: Ray exports a class once per
    decoration, so its caller keeps it (one per :class:`~ringtrain.launch.ray.RayLauncher`,
    i.e. per run), and no module-level cache holds it."""
    return ray.remote(RayWorker)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
