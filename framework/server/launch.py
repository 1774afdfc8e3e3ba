"""`batchyard serve`: start the processes, serve HTTP, supervise, and shut down cleanly.

    main process   uvicorn + FastAPI + TokenizerManager (asyncio)
    scheduler      framework.server.scheduler_process (spawned), one per tensor-parallel rank
                   on this node: "scheduler" (rank 0), "scheduler-tp1", ...
    dp_controller  framework.server.dp_controller (spawned), with several replicas only
    detokenizer    framework.server.detokenizer (spawned)

With parallel.dp_size > 1 there are dp_size replicas (scheduler-dp0, scheduler-dp0-tp1, ...,
scheduler-dp1, ...), each a tensor-parallel group of tp_size ranks, behind a data-parallel
controller, which owns the scheduler socket the TokenizerManager sends to and forwards to each
replica's rank 0. With DP attention each of the tp_size ranks is a replica behind the controller.
With the DP_RANK environment variable set, the server is that one replica of dp_size (an outside
router runs and balances the others).

On a node with node_rank >= 1 the main process runs only that node's scheduler ranks and waits
on them: no HTTP, tokenizer or detokenizer (reference A1).

Start-up: every scheduler reports `SchedulerReady` over a pipe once the model and the pools are
ready; only then does the HTTP server bind. While serving, a supervisor task checks the children
a few times a second: if one dies, every request answers 503 and the server exits with status 1
within about a second. SIGINT, SIGTERM or SIGHUP stop the server with status 0; the children are
always terminated and the IPC directory removed, whatever the way out.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import secrets
import signal
import socket
import time
from multiprocessing.connection import Connection, wait

import uvicorn

from framework.config import Settings
from framework.distributed import ParallelConfigError, check_layout, check_lora_layout, check_model_fits, node_ranks
from framework.images import ImageProcessor
from framework.messages import SchedulerFailed, SchedulerReady
from framework.metrics import ServerMetrics
from framework.plugins import PluginManager
from framework.server.detokenizer import run_detokenizer_process
from framework.server.dp_controller import run_dp_controller_process
from framework.server.http_server import ServerInfo, build_app
from framework.server.ipc import IpcNames, configure_logging, freeze_startup_objects
from framework.server.limits import RequestLimits, max_token_bytes
from framework.server.scheduler_process import dp_rank_from_env, run_scheduler_process
from framework.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("batchyard.server")

SUPERVISE_INTERVAL_S = 0.25
# After a child dies: time for in-flight requests to get their 503 before the server stops.
DEATH_GRACE_S = 0.5
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dp_attention_settings(settings: Settings) -> Settings:
    """The reference's DP-attention side effects (L1) on a copy of the settings: dp_size = tp_size,
    half the prefill chunk, 0.3 x the schedule conservativeness. (The reference's chunk halving
    raises a TypeError when chunked prefill is off; here it is simply skipped.)"""
    settings = settings.model_copy(deep=True)
    settings.parallel.dp_size = settings.parallel.tp_size
    if settings.scheduler.chunked_prefill_size is not None:
        settings.scheduler.chunked_prefill_size = max(1, settings.scheduler.chunked_prefill_size // 2)
    settings.scheduler.schedule_conservativeness *= 0.3
    return settings


def rank_process_name(replica: str, tp_rank: int) -> str:
    """"scheduler", "scheduler-tp1", "scheduler-dp0", "scheduler-dp0-tp1", ..."""
    return replica if tp_rank == 0 else f"{replica}-tp{tp_rank}"


class Shutdown(Exception):
    """A signal arrived during start-up."""


def serve(settings: Settings) -> int:
    """Run the server until a signal (returns 0) or a failure (returns 1)."""
    configure_logging(settings.server.log_level)
    return Launcher(settings).run()


def served_model_name(settings: Settings) -> str:
    if settings.model.served_model_name:
        return settings.model.served_model_name
    if settings.model.path is None:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(settings.model.path)) or settings.model.path


def check_bind(host: str, port: int) -> None:
    """OSError naming the address when the HTTP server could not bind it (a port in use, a host
    that does not resolve or is not this machine's), found before the model is loaded rather than
    after (uvicorn binds only then). The socket is closed again at once, with SO_REUSEADDR as
    uvicorn's, so the address stays free for it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"server.host {host!r} does not resolve: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise OSError(f"cannot listen on {host}:{port} (server.host, server.port): {exc.strerror}") from None


class Launcher:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self.ipc_dir: str | None = None
        self.raise_on_signal = True
        self.stopped_by: int | None = None
        self.exit_code = 0

    def _on_signal(self, signum, frame) -> None:
        self.stopped_by = signum
        if self.raise_on_signal:
            raise Shutdown(signal.Signals(signum).name)

    @staticmethod
    def _hangup_as_sigterm(signum, frame) -> None:
        """SIGHUP (a closed terminal or ssh session) stops the server as SIGTERM does, through
        whichever handler has SIGTERM then (this launcher's during start-up, uvicorn's while it
        serves); by default it killed the main process at once, leaving the IPC directory."""
        os.kill(os.getpid(), signal.SIGTERM)

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._hangup_as_sigterm)
        try:
            code = self._run()
            self.raise_on_signal = False
            # A child that did not stop cleanly fails the run, even after a clean HTTP shutdown.
            return code if self._stop_children() else 1
        except Shutdown as exc:
            logger.info("Received %s during start-up; stopping", exc)
            return 0
        except (OSError, ValueError) as exc:  # e.g. a model path that does not exist
            logger.error("Cannot start the server: %s", exc)
            return 1
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind
            logger.error("The HTTP server could not start (exit status %s)", exc.code)
            return 1
        finally:
            self.raise_on_signal = False
            if not self._stop_children() and self.exit_code == 0:
                self.exit_code = 1
            if self.ipc_dir is not None:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        from framework.model.loader import load_tokenizer, resolve_model

        if self.settings.parallel.nnodes > 1 and not self.settings.parallel.dist_secret:
            # Rank 0 sends the other nodes pickled messages: unauthenticated, anyone reaching the
            # rendezvous port could run code in the ranks.
            logger.error("Cannot start the server: parallel.dist_secret (the same on every node) is required "
                         "when nnodes > 1")
            return 1
        if self.settings.parallel.tp_size > 1 and not self.settings.parallel.dist_secret:
            # One node: a random secret per start authenticates the ranks' broadcasts.
            self.settings = self.settings.model_copy(deep=True)
            self.settings.parallel.dist_secret = secrets.token_hex(32)
        settings = self.settings
        par = settings.parallel
        env_rank = dp_rank_from_env()
        if env_rank is not None and env_rank >= par.dp_size:
            raise ValueError(f"DP_RANK={env_rank} names no replica: parallel.dp_size is {par.dp_size}")
        # The plugin selection and [plugin.*] sections, as `batchyard config` checks them: one line
        # now, rather than a scheduler process's traceback after it has started (on a copy: the
        # check turns the sections into their models).
        PluginManager(settings.model_copy(deep=True))
        if par.node_rank == 0:
            check_bind(settings.server.host, settings.server.port)  # before the model loads
        # Resolved here first so a first-time GGUF conversion happens once, not in every process.
        model_folder = resolve_model(settings.model.path)
        if not self._check_parallel(model_folder, one_replica=env_rank is not None):
            return 1
        tokenizer_folder = settings.model.tokenizer_path or model_folder
        ipc, self.ipc_dir = IpcNames.in_new_temp_dir()
        ctx = multiprocessing.get_context("spawn")
        readers = self._start_schedulers(ctx, ipc, serve_all_replicas=env_rank is None)
        if par.node_rank > 0:
            return self._run_worker_node(readers)
        self._start(ctx, "detokenizer", run_detokenizer_process, (tokenizer_folder, ipc, settings.server.log_level))
        tokenizer = load_tokenizer(tokenizer_folder)
        if tokenizer is None:
            logger.error("No tokenizer in %s; the server needs one (set model.tokenizer_path)", tokenizer_folder)
            return 1
        readies = self._wait_ready(readers)
        if readies is None:
            return 1
        for name, ready in readies.items():
            logger.info(
                "%s ready: max_total_num_tokens=%d, context_len=%d, max_req_input_len=%d", name.capitalize(),
                ready.max_total_num_tokens, ready.context_len, ready.max_req_input_len,
            )
        # As in the reference, the first replica's limits stand for all (they are built alike).
        ready = next(iter(readies.values()))
        info = ServerInfo(
            model_path=settings.model.path or model_folder, tokenizer_path=tokenizer_folder,
            model_folder=model_folder,
            model_name=served_model_name(settings),
            process_ids={"main": os.getpid(), **{n: p.pid for n, p in self.processes.items()}},
        )
        self.raise_on_signal = False  # uvicorn handles signals while it serves
        asyncio.run(self._serve(ipc, ready, tokenizer, info))
        if self.stopped_by is not None and self.exit_code == 0:
            logger.info("Stopped by %s", signal.Signals(self.stopped_by).name)
        return self.exit_code

    def _start(self, ctx, name: str, target, args) -> None:
        proc = ctx.Process(target=target, args=args, name=name)
        proc.start()
        self.processes[name] = proc

    def _check_parallel(self, model_folder: str, one_replica: bool) -> bool:
        """Clear start-up errors for layouts that cannot work, before anything is spawned."""
        from framework.model.llava import language_model_config
        from framework.model.loader import load_hf_config

        par = self.settings.parallel
        try:
            check_layout(par, one_replica)
            check_lora_layout(par, self.settings.model.lora_paths)
            check_model_fits(language_model_config(load_hf_config(model_folder)), par.tp_size,
                             par.enable_dp_attention)
        except ParallelConfigError as exc:
            logger.error("Cannot start the server: %s", exc)
            return False
        return True

    def _start_schedulers(self, ctx, ipc: IpcNames, serve_all_replicas: bool) -> dict[str, Connection]:
        """The scheduler processes of this node, and the data-parallel controller in front of
        several replicas (dp_size > 1, or DP attention's ranks); returns each scheduler's ready
        pipe, by process name. With `serve_all_replicas` False (DP_RANK is set: an outside router
        runs the others) this server is one replica."""
        settings = self.settings
        if settings.parallel.enable_dp_attention:
            return self._start_dp_attention_ranks(ctx, ipc, dp_attention_settings(settings))
        if settings.parallel.dp_size == 1 or not serve_all_replicas:
            return self._start_replica(ctx, settings, "scheduler", ipc, None)
        replicas = self._start_controller(ctx, ipc, settings, settings.parallel.dp_size)
        readers: dict[str, Connection] = {}
        for d, replica_ipc in enumerate(replicas):
            readers.update(self._start_replica(ctx, settings, f"scheduler-dp{d}", replica_ipc, d))
        return readers

    def _start_replica(self, ctx, settings: Settings, name: str, ipc: IpcNames,
                       dp_rank: int | None) -> dict[str, Connection]:
        """One replica: its tensor-parallel ranks on this node, a group of their own. One node: the
        rendezvous is a free local port; several: node 0's address, given by the user."""
        init_addr = settings.parallel.dist_init_addr or f"127.0.0.1:{free_port()}"
        names = {t: rank_process_name(name, t) for t in node_ranks(settings.parallel)}
        return {n: self._start_scheduler(ctx, n, settings, ipc, (dp_rank, t, init_addr)) for t, n in names.items()}

    def _start_dp_attention_ranks(self, ctx, ipc: IpcNames, settings: Settings) -> dict[str, Connection]:
        """DP attention: the tp_size ranks are one group, and each rank is a replica of its own
        behind the controller (reference L1, A5); one rank is a plain scheduler."""
        if settings.parallel.tp_size == 1:
            return self._start_replica(ctx, settings, "scheduler", ipc, None)
        ranks = self._start_controller(ctx, ipc, settings, settings.parallel.tp_size)
        init_addr = f"127.0.0.1:{free_port()}"
        names = {r: rank_process_name("scheduler", r) for r in range(len(ranks))}
        return {n: self._start_scheduler(ctx, n, settings, ranks[r], (r, r, init_addr)) for r, n in names.items()}

    def _start_controller(self, ctx, ipc: IpcNames, settings: Settings, num_replicas: int) -> list[IpcNames]:
        """The data-parallel controller in front of `num_replicas` replicas; their endpoints."""
        replicas = [ipc.for_replica(d) for d in range(num_replicas)]
        self._start(ctx, "dp_controller", run_dp_controller_process, (settings, ipc, [r.scheduler for r in replicas]))
        return replicas

    def _start_scheduler(self, ctx, name: str, settings: Settings, ipc: IpcNames, rank: tuple) -> Connection:
        """One scheduler process; `rank` is (dp_rank, tp_rank, dist_init_addr)."""
        reader, writer = ctx.Pipe(duplex=False)
        self._start(ctx, name, run_scheduler_process, (settings, ipc, writer, *rank))
        writer.close()  # so a scheduler that dies early gives EOF, not a hang
        return reader

    def _run_worker_node(self, readers: dict[str, Connection]) -> int:
        """node_rank >= 1: serve the local ranks until a signal or until one of them exits."""
        if self._wait_ready(readers) is None:
            return 1
        pids = {name: proc.pid for name, proc in self.processes.items()}
        logger.info("Node %d: ranks %s ready, processes %s", self.settings.parallel.node_rank,
                    node_ranks(self.settings.parallel), pids)
        while True:
            time.sleep(SUPERVISE_INTERVAL_S)
            for name, proc in self.processes.items():
                if not proc.is_alive():
                    logger.error("The %s process exited (exit code %s); this node stops", name, proc.exitcode)
                    return 1

    def _wait_ready(self, readers: dict[str, Connection]) -> dict[str, SchedulerReady] | None:
        """Every scheduler's SchedulerReady, by process name; None (logged) if one fails."""
        names = {conn: name for name, conn in readers.items()}
        readies: dict[str, SchedulerReady] = {}
        while len(readies) < len(readers):
            for conn in wait([c for c, n in names.items() if n not in readies], timeout=0.5):
                name = names[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    msg = SchedulerFailed(f"the {name} process exited (exit code {self.processes[name].exitcode})")
                if not isinstance(msg, SchedulerReady):
                    logger.error("Scheduler start-up failed: %s", msg.message)
                    return None
                readies[name] = msg
            for name, proc in self.processes.items():
                if not proc.is_alive():
                    logger.error("The %s process exited during start-up (exit code %s)", name, proc.exitcode)
                    return None
        return {name: readies[name] for name in readers}

    async def _serve(self, ipc: IpcNames, ready: SchedulerReady, tokenizer, info: ServerInfo) -> None:
        settings = self.settings
        limits = RequestLimits.from_settings(settings.server, ready.vocab_size, ready.max_req_input_len,
                                             max_token_bytes(tokenizer))
        tm = TokenizerManager(ipc, ready, tokenizer, ServerMetrics(info.model_name),
                              log_requests=settings.server.log_requests,
                              request_timeout=settings.server.request_timeout,
                              image_processor=ImageProcessor.from_model_folder(info.model_folder), limits=limits,
                              max_client_labels=settings.metrics.max_client_labels)
        tm.start()
        freeze_startup_objects()  # a full collection here would hold up every request's tokens
        config = uvicorn.Config(
            build_app(tm, settings, info), host=settings.server.host, port=settings.server.port,
            log_config=None, log_level=settings.server.log_level.lower(),
            access_log=settings.server.log_requests, lifespan="off", timeout_graceful_shutdown=3,
            timeout_keep_alive=settings.server.keep_alive_timeout,
        )
        server = GracefulServer(config, tm)
        supervisor = asyncio.get_running_loop().create_task(self._supervise(server, tm, info))
        try:
            await server.serve()
        finally:
            supervisor.cancel()
            tm.close()

    async def _supervise(self, server: uvicorn.Server, tm: TokenizerManager, info: ServerInfo) -> None:
        announced = False
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            if server.started and not announced:
                announced = True
                host, port = self.settings.server.host, self.settings.server.port
                logger.info("batchyard is serving %s at http://%s:%d", info.model_name, host, port)
            for name, proc in self.processes.items():
                # Once a signal stops the server, a child may exit first (systemd and `kill -- -PGID`
                # signal the whole group): that is the stop, and _stop_children judges its status.
                if proc.is_alive() or server.should_exit:
                    continue
                reason = f"the {name} process exited unexpectedly (exit code {proc.exitcode})"
                logger.error("%s; the server answers 503 and stops", reason.capitalize())
                tm.mark_dead(f"Server unavailable: {reason}")
                self.exit_code = 1
                await asyncio.sleep(DEATH_GRACE_S)
                server.should_exit = True
                return

    def _stop_children(self) -> bool:
        """SIGTERM every child and wait; False (logged) if one did not exit with status 0. Each
        child is checked once: a second call (the `finally` after a clean stop) finds none left."""
        stopping = dict(self.processes)
        self.processes.clear()
        for proc in stopping.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 5.0
        clean = True
        for name, proc in stopping.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("The %s process did not stop; killing it", name)
                proc.kill()
                proc.join(1.0)
                clean = False
            elif proc.exitcode != 0:
                logger.error("The %s process exited with status %s", name, proc.exitcode)
                clean = False
        return clean


class GracefulServer(uvicorn.Server):
    """uvicorn's server that, when it stops, first ends the requests in flight: a stream gets a
    last error event and ends, a waiting request a 503, so no connection is cut mid-answer."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager):
        super().__init__(config)
        self.tm = tm

    async def shutdown(self, sockets=None) -> None:
        self.tm.begin_shutdown()
        await super().shutdown(sockets=sockets)
