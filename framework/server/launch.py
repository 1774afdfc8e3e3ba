"""`batchyard serve`: start the processes, serve HTTP, supervise, and shut down cleanly.

    main process   uvicorn + FastAPI + TokenizerManager (asyncio)
    scheduler      framework.server.scheduler_process (spawned)
    detokenizer    framework.server.detokenizer (spawned)

With parallel.dp_size > 1 there is one scheduler process per replica (scheduler-dp0, ...) behind
a data-parallel controller (framework.server.dp_controller, spawned), which owns the scheduler
socket the TokenizerManager sends to. With the DP_RANK environment variable set, the server is that
one replica of dp_size (an outside router runs and balances the others).

Start-up: the scheduler reports `SchedulerReady` over a pipe once the model and the pools are
ready; only then does the HTTP server bind. While serving, a supervisor task checks the children
a few times a second: if one dies, every request answers 503 and the server exits with status 1
within about a second. SIGINT or SIGTERM stop the server with status 0; the children are always
terminated and the IPC directory removed, whatever the way out.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import time
from multiprocessing.connection import Connection, wait

import uvicorn

from framework.config import Settings
from framework.images import ImageProcessor
from framework.messages import SchedulerFailed, SchedulerReady
from framework.metrics import ServerMetrics
from framework.server.detokenizer import run_detokenizer_process
from framework.server.dp_controller import run_dp_controller_process
from framework.server.http_server import ServerInfo, build_app
from framework.server.ipc import IpcNames, configure_logging
from framework.server.scheduler_process import dp_rank_from_env, run_scheduler_process
from framework.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("batchyard.server")

SUPERVISE_INTERVAL_S = 0.25
# After a child dies: time for in-flight requests to get their 503 before the server stops.
DEATH_GRACE_S = 0.5
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


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

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
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
            self._stop_children()
            if self.ipc_dir is not None:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        from framework.model.loader import load_tokenizer, resolve_model

        settings = self.settings
        par = settings.parallel
        if (par.tp_size, par.nnodes) != (1, 1) or par.enable_dp_attention:
            # Tensor parallelism and DP attention are not wired into serve yet.
            logger.error("The server runs whole-model replicas: parallel.tp_size and nnodes must be 1")
            return 1
        env_rank = dp_rank_from_env()
        if env_rank is not None and env_rank >= par.dp_size:
            raise ValueError(f"DP_RANK={env_rank} names no replica: parallel.dp_size is {par.dp_size}")
        # Resolved here first so a first-time GGUF conversion happens once, not in two processes.
        model_folder = resolve_model(settings.model.path)
        tokenizer_folder = settings.model.tokenizer_path or model_folder
        ipc, self.ipc_dir = IpcNames.in_new_temp_dir()
        ctx = multiprocessing.get_context("spawn")
        readers = self._start_schedulers(ctx, ipc, serve_all_replicas=env_rank is None)
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

    def _start_schedulers(self, ctx, ipc: IpcNames, serve_all_replicas: bool) -> dict[str, Connection]:
        """The scheduler processes, and the data-parallel controller in front of dp_size > 1
        replicas; returns each scheduler's ready pipe. With `serve_all_replicas` False (DP_RANK is
        set: an outside router runs the others) this server is one replica."""
        dp_size = self.settings.parallel.dp_size
        if dp_size == 1 or not serve_all_replicas:
            return {"scheduler": self._start_scheduler(ctx, "scheduler", ipc, None)}
        replicas = [ipc.for_replica(d) for d in range(dp_size)]
        self._start(ctx, "dp_controller", run_dp_controller_process,
                    (self.settings, ipc, [r.scheduler for r in replicas]))
        return {f"scheduler-dp{d}": self._start_scheduler(ctx, f"scheduler-dp{d}", r, d) for d, r in enumerate(replicas)}

    def _start_scheduler(self, ctx, name: str, ipc: IpcNames, dp_rank: int | None) -> Connection:
        reader, writer = ctx.Pipe(duplex=False)
        self._start(ctx, name, run_scheduler_process, (self.settings, ipc, writer, dp_rank))
        writer.close()  # so a scheduler that dies early gives EOF, not a hang
        return reader

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
        tm = TokenizerManager(ipc, ready, tokenizer, ServerMetrics(info.model_name),
                              log_requests=settings.server.log_requests,
                              image_processor=ImageProcessor.from_model_folder(info.model_folder))
        tm.start()
        config = uvicorn.Config(
            build_app(tm, settings, info), host=settings.server.host, port=settings.server.port,
            log_config=None, log_level=settings.server.log_level.lower(),
            access_log=settings.server.log_requests, lifespan="off", timeout_graceful_shutdown=3,
        )
        server = uvicorn.Server(config)
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
                if proc.is_alive():
                    continue
                reason = f"the {name} process exited unexpectedly (exit code {proc.exitcode})"
                logger.error("%s; the server answers 503 and stops", reason.capitalize())
                tm.mark_dead(f"Server unavailable: {reason}")
                self.exit_code = 1
                await asyncio.sleep(DEATH_GRACE_S)
                server.should_exit = True
                return

    def _stop_children(self) -> None:
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 5.0
        for name, proc in self.processes.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("The %s process did not stop; killing it", name)
                proc.kill()
                proc.join(1.0)
