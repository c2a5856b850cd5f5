"""mini-swe-agent, Codex and Claude Code against Qwen2.5-Coder-0.5B-Instruct, for real.

Each scaffold, unmodified (mini-swe-agent from this venv, the Codex and Claude Code CLIs of
`make setup-agents`), runs one short session in a folder holding `notes.txt`, through the
gateway on the model's own directory (its tokenizer, its `chat_template.jinja`), once with
vLLM's CPU build as the engine and once with the built-in engine:

    scaffold -> ScaffoldRecorder -> gateway -> EngineRecorder -> engine (the real model)

The checks, from records the gateway does not write (`real_sessions.assert_token_truth`
and the scaffold's own log): no call labelled `rewrite` (or any other branch); each
captured call holds the IDs the engine was sent and sent back; each later prompt is the
previous prompt + the engine's IDs + the new messages as transformers'
`apply_chat_template` renders them; and the scaffold's log (mini-swe-agent's trajectory,
Claude Code's stream-json, Codex's `--json` events) shows the command the model called
and its output, the file's secret word.

What the model writes (greedy, by hand on vLLM 0.32's CPU build; the built-in engine gave
the same replies): this checkpoint never writes Hermes' `<tool_call>` tags. Its tool calls
are the JSON object alone (`{"name": "bash", "arguments": {"command": "cat notes.txt"}}`)
or that object in a ```json fence, on each of the 19 prompts tried (the tags spelled out in the
system prompt and a tool call in the history among them). At the first sampled position
after the template's tool instructions, `<tool_call>` (ID 151657) has logprob -22.6 (rank
121,180 of 151,936) on Qwen's own weather example, and the same text in plain pieces
(`<`, `tool`, `_call`) -13.8 at `_call`; the ID's output-embedding row has the norm of
the vocabulary's unused padding rows (0.32; `<|im_end|>` 0.34), so it was not trained.
With `tool_parser=auto` (Hermes, from the template) no call would ever be parsed, so the
gateway runs with `llama3_json`, the parser of that format (a turn that is JSON objects of
`name` and `arguments`/`parameters`), and each prompt below is one the model answers with
a bare JSON call at temperature 0. Codex and Claude Code send no temperature and have no
setting for one, so `ScaffoldRecorder` writes 0 into their calls' bodies. Prompts are
short (a one-line system prompt; Claude Code with `--bare --tools Bash`; Codex with its
instructions replaced and its extra tools' features off: its first prompt is still ~1,800
tokens) and each session is bounded at `MAX_CALLS` model calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from tests.conftest import vllm_python
from tests.e2e.engine_recorder import EngineRecorder, ScaffoldRecorder
from tests.e2e.real_sessions import assert_token_truth
from undertow.adapters.gateway_client import GatewayAdmin
from undertow.gateway.engines.launch import BuiltinLauncher, VLLMLauncher, start_engine
from undertow.gateway.trees.tree import tree_from_json
from undertow.run.embedded import serve_gateway

# A test's time includes its class's engine start: vLLM's took 4-7 minutes here under load.
pytestmark = [pytest.mark.slow, pytest.mark.qwen, pytest.mark.agents, pytest.mark.timeout(2400),
              pytest.mark.asyncio(loop_scope="session")]
REPO = Path(__file__).resolve().parents[2]
AGENTS_BIN = REPO / ".cache" / "agents" / "node_modules" / ".bin"
SECRET = "pineapple"
NOTES = f"The secret word is {SECRET}.\n"
TOOL_PARSER = "llama3_json"  # the format this checkpoint writes (module docstring)
MAX_TOKENS = 64
MAX_CALLS = 2  # per session: mini-swe-agent's step limit, Claude Code's --max-turns, and
# the relay's bound for Codex, whose `exec` has none (it stops on a reply with no tool call)
SESSION_TIMEOUT_S = 1800
SYSTEM = "You are a helpful assistant that can interact with a computer."
# Codex's features that add tools or instructions a one-command task does not use (the
# multi-agent tool alone is ~11k characters of schema); its shell tool stays.
CODEX_FEATURES_OFF = ("multi_agent", "goals", "apps", "plugins", "image_generation",
                      "skill_search", "tool_suggest", "sleep_tool", "computer_use",
                      "browser_use", "in_app_browser")


@dataclass(frozen=True)
class Run:
    """A session's folder (`work`, the scaffold's cwd), its endpoint and its output."""

    root: Path
    base_url: str
    api_key: str

    @property
    def work(self) -> Path:
        return self.root / "work"


def base_env(run: Run) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENAI_", "ANTHROPIC_", "UNDERTOW_", "MSWEA_"))}
    path = os.pathsep.join([str(Path(sys.executable).parent), str(AGENTS_BIN), env["PATH"]])
    return {**env, "PATH": path, "HOME": str(run.root / "home"),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def mini_command(run: Run) -> tuple[list[str], dict[str, str]]:
    config = run.root / "notes-task.yaml"  # written as JSON, which YAML reads
    config.write_text(json.dumps({
        "agent": {"system_template": SYSTEM,
                  "instance_template": "{{task}}",
                  "step_limit": MAX_CALLS, "cost_limit": 0},
        "model": {"model_kwargs": {"temperature": 0.0, "max_tokens": MAX_TOKENS}}}))
    argv = [sys.executable, "-m", "minisweagent.run.mini", "-m", "openai/undertow",
            "-c", "mini.yaml", "-c", str(config),
            "-c", f"model.model_kwargs.api_base={run.base_url}",
            "-t", "What is in notes.txt? Call the bash tool.", "-y", "--exit-immediately",
            "-o", str(run.root / "trajectory.json")]
    env = {**base_env(run), "OPENAI_API_KEY": run.api_key, "MSWEA_CONFIGURED": "true",
           "MSWEA_COST_TRACKING": "ignore_errors",
           "MSWEA_GLOBAL_CONFIG_DIR": str(run.root / "mini-config")}
    return argv, env


def mini_tool_runs(run: Run, output: str) -> list[tuple[str, str]]:
    """(command, output) of each bash call in mini-swe-agent's saved trajectory."""
    messages = json.loads((run.root / "trajectory.json").read_text())["messages"]
    commands = {call["id"]: json.loads(call["function"]["arguments"])["command"]
                for message in messages for call in message.get("tool_calls") or ()}
    return [(commands[m["tool_call_id"]], m["content"]) for m in messages
            if m["role"] == "tool"]


def claude_command(run: Run) -> tuple[list[str], dict[str, str]]:
    argv = [str(AGENTS_BIN / "claude"), "-p", "What is in notes.txt? Call the Bash tool.",
            "--model", "undertow", "--max-turns", str(MAX_CALLS), "--output-format", "stream-json",
            "--verbose", "--bare", "--tools", "Bash", "--allowedTools", "Bash",
            "--system-prompt", SYSTEM]
    env = {**base_env(run), "ANTHROPIC_BASE_URL": run.base_url.removesuffix("/v1"),
           "ANTHROPIC_API_KEY": run.api_key, "ANTHROPIC_MODEL": "undertow",
           "ANTHROPIC_SMALL_FAST_MODEL": "undertow",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS), "DISABLE_AUTOUPDATER": "1",
           "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return argv, env


def claude_tool_runs(run: Run, output: str) -> list[tuple[str, str]]:
    """(command, result) of each Bash call in Claude Code's stream-json events."""
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    blocks = [block for event in events if event.get("type") in ("assistant", "user")
              for block in event["message"]["content"] if isinstance(block, dict)]
    commands = {b["id"]: b["input"]["command"] for b in blocks
                if b["type"] == "tool_use" and b["name"] == "Bash"}
    return [(commands[b["tool_use_id"]], json.dumps(b["content"])) for b in blocks
            if b["type"] == "tool_result"]


def codex_command(run: Run) -> tuple[list[str], dict[str, str]]:
    instructions = run.root / "instructions.md"
    instructions.write_text(  # a bare JSON example: without it the model may fence the call
        'Call the exec_command tool to read files. Write the call as a JSON object alone, '
        'with no markdown: {"name": "exec_command", "arguments": {"cmd": "..."}}\n')
    home = run.root / "codex-home"
    home.mkdir()
    options = ["model_provider=undertow", "model_providers.undertow.name=undertow",
               f"model_providers.undertow.base_url={run.base_url}",
               "model_providers.undertow.env_key=OPENAI_API_KEY",
               "model_providers.undertow.wire_api=responses",
               f"model_instructions_file={instructions}", "web_search=disabled",
               "tools.view_image=false",
               *(f"features.{name}=false" for name in CODEX_FEATURES_OFF)]
    argv = [str(AGENTS_BIN / "codex"), "exec", "-m", "undertow", "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", "--json",
            *(arg for option in options for arg in ("-c", option)),
            "What is in notes.txt? Call the exec_command tool with cmd `cat notes.txt`."]
    return argv, {**base_env(run), "OPENAI_API_KEY": run.api_key, "CODEX_HOME": str(home)}


def codex_tool_runs(run: Run, output: str) -> list[tuple[str, str]]:
    """(command, output) of each command Codex ran, from its `--json` events."""
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [(event["item"]["command"], event["item"].get("aggregated_output") or "")
            for event in events if event.get("type") == "item.completed"
            and event["item"].get("type") == "command_execution"]


SCAFFOLDS = {"mini-swe-agent": ("chat", mini_command, mini_tool_runs),
             "codex": ("responses", codex_command, codex_tool_runs),
             "claude-code": ("anthropic", claude_command, claude_tool_runs)}


@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_coder_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(qwen_coder_dir)


async def run_scaffold(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout=SESSION_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        raise
    return process.returncode, out.decode()


def ended_well(returncode: int, output: str, num_refused: int) -> bool:
    """Exit 0, or the non-zero exit of a scaffold stopped at its turn bound: Claude Code's
    own (`--max-turns`: its result event says `max_turns`), or the relay's (Codex)."""
    at_max_turns = '"terminal_reason":"max_turns"' in output.replace(" ", "")
    return returncode == 0 or at_max_turns or num_refused > 0


async def check_session(engine: str, scaffold: str, model_dir: Path, tokenizer,
                        tmp_path: Path) -> None:
    for program in ("codex", "claude"):
        if scaffold.startswith(program) and not (AGENTS_BIN / program).exists():
            pytest.skip(f"{program} is not installed in .cache/agents (make setup-agents)")
    api, command, tool_runs = SCAFFOLDS[scaffold]
    kind, _, engine_url = engine.rpartition("+")
    started_s = time.monotonic()
    async with EngineRecorder(engine_url) as engine_record:
        upstream = f"{kind}+{engine_record.url}" if kind else engine_record.url
        async with (serve_gateway(model_dir, tmp_path / "store", [upstream],
                                  tool_parser=TOOL_PARSER,
                                  default_max_tokens=MAX_TOKENS) as gateway,
                    GatewayAdmin(gateway.url, gateway.admin_token) as admin,
                    ScaffoldRecorder(gateway.url, temperature=0.0,
                                     max_calls=MAX_CALLS) as scaffold_record):
            session = await admin.open_session("real-agents", {"scaffold": scaffold})
            run = Run(tmp_path, session["base_url"].replace(gateway.url, scaffold_record.url),
                      session["api_key"])
            for folder in (run.work, tmp_path / "home"):
                folder.mkdir()
            (run.work / "notes.txt").write_text(NOTES)
            argv, env = command(run)
            returncode, output = await run_scaffold(argv, env, run.work)
            tree = tree_from_json(await admin.session_tree(session["session_id"]))
    print(f"{scaffold} on {kind or 'builtin'}: {len(engine_record.generations)} calls, "
          f"{time.monotonic() - started_s:.0f} s")
    assert ended_well(returncode, output, scaffold_record.num_refused), output[-4000:]
    assert_token_truth(tree, session["session_id"], engine_record.generations, api,
                       scaffold_record.calls, tokenizer)
    runs = tool_runs(run, output)
    assert any("notes.txt" in command and SECRET in result for command, result in runs), (
        runs, output[-3000:])


@pytest_asyncio.fixture(scope="class", loop_scope="session")
async def qwen_vllm(qwen_coder_dir, tmp_path_factory):
    """`vllm+URL` of vLLM's CPU build serving the Qwen model, for one class: stopped before
    the next class starts its engine. Eager (no torch.compile, which vLLM ran again on
    every start here, minutes under load): a session samples a few dozen tokens."""
    launcher = VLLMLauncher(python=vllm_python(), kv_cache_gib=1, max_model_len=8192,
                            enforce_eager=True)
    log_path = tmp_path_factory.mktemp("qwen-vllm") / "vllm.log"
    engine = await start_engine(launcher, qwen_coder_dir, log_path=log_path)
    try:
        yield f"vllm+{engine.url}"
    finally:
        await engine.stop()


@pytest_asyncio.fixture(scope="class", loop_scope="session")
async def qwen_builtin(qwen_coder_dir, tmp_path_factory):
    """URL of the built-in engine serving the Qwen model, for one class."""
    log_path = tmp_path_factory.mktemp("qwen-builtin") / "engine.log"
    engine = await start_engine(BuiltinLauncher(), qwen_coder_dir, log_path=log_path)
    try:
        yield engine.url
    finally:
        await engine.stop()


class Sessions:
    """Each scaffold's session on the class's `engine` (a fixture each subclass gives)."""

    @pytest.mark.parametrize("scaffold", list(SCAFFOLDS))
    async def test_a_real_session_keeps_token_truth(self, engine, qwen_coder_dir,
                                                    qwen_tokenizer, tmp_path, scaffold):
        await check_session(engine, scaffold, qwen_coder_dir, qwen_tokenizer, tmp_path)


@pytest.mark.vllm
class TestOnVLLM(Sessions):
    @pytest.fixture
    def engine(self, qwen_vllm):
        return qwen_vllm


class TestOnTheBuiltinEngine(Sessions):
    @pytest.fixture
    def engine(self, qwen_builtin):
        return qwen_builtin
