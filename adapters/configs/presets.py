"""Presets: SWE-agent, OpenHands, Claude Code and Codex CLI as `command` scaffolds.

Each preset returns a `CommandScaffold` whose command line and environment point the
program at the session's gateway endpoint; nothing of the program is patched. Where a
program edits files in its current directory (Claude Code, Codex), it must run where
the repository is: inside the sandbox (`where="sandbox"`, the default; the task image
must then hold Node.js and the CLI — published SWE images usually do not, so derive
one: `FROM task-image` + `npm install -g @anthropic-ai/claude-code @openai/codex`).
`where="host"` runs it on the host in the session's folder (useful to check that the
program talks to the gateway; it does not see the sandbox's repository).

- Claude Code (`npm i -g @anthropic-ai/claude-code`): print mode `claude -p`, the
  Anthropic Messages API at `ANTHROPIC_BASE_URL` (= `.../s/{session}`, the SDK adds
  `/v1/messages`) with `ANTHROPIC_API_KEY` = the session key; in the sandbox, tools
  allowed without prompts (`--dangerously-skip-permissions`, `IS_SANDBOX=1`); the
  gateway's model name for both its main and small models.
- Codex CLI (`npm i -g @openai/codex`): `codex exec`, the Responses API through a custom
  model provider (`model_providers.undertow` with `base_url` = the session's `/v1` URL,
  `env_key = OPENAI_API_KEY`, `wire_api = "responses"`), no approvals, workspace-write
  sandbox of its own disabled (the container is the sandbox).
- SWE-agent (`sweagent run`, installed from its git repository; it is not on PyPI):
  litellm model `openai/{model}` with `api_base`/`api_key` of the session, and a
  deployment that runs its commands in the session's existing container.
- OpenHands (`openhands-ai==0.62.0` from PyPI, Python 3.12 or 3.13, in its own
  virtualenv: `make setup-openhands`), headless `python -m openhands.core.main -f FILE
  -i N`: `LLM_MODEL=openai/{model}`, `LLM_BASE_URL`/`LLM_API_KEY` of the session, and
  its `cli` runtime (`RUNTIME=cli`: commands and edits run directly where OpenHands
  runs, in `WORKSPACE_BASE`), so it is set up like the CLIs above: in the sandbox (the
  task image must hold OpenHands; its workspace is the repository) or, on the host, in
  the session's folder. Its `docker` runtime builds an image from Docker Hub at start,
  which cannot be done here. No browser (`ENABLE_BROWSER=false`), litellm's bundled
  cost map, and every event logged. After each plain-text reply it tells the model to
  continue (`--no-auto-continue` in `extra_args` reads stdin instead); it exits when
  the model calls `finish` or after `max_iterations` steps. The 1.x releases of
  `openhands-ai` no longer hold this headless entry point (it moved to the `openhands`
  CLI package on the OpenHands SDK).
"""

from undertow.adapters.command import CommandScaffold


def claude_code(where: str = "sandbox", program: str = "claude", max_turns: int = 30,
                max_output_tokens: int = 4096, extra_args: str = "") -> CommandScaffold:
    command = (f'{program} -p "$(cat {{problem_file}})" --model {{model}} '
               f"--max-turns {max_turns} --output-format stream-json --verbose {extra_args}")
    env = {"ANTHROPIC_MODEL": "{model}", "ANTHROPIC_SMALL_FAST_MODEL": "{model}",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_TELEMETRY": "1",
           # Claude Code asks for 32k output tokens by default, more than a small model's
           # context leaves after its long system prompt.
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens)}
    if where == "sandbox":
        # Tools without prompts, which Claude Code allows as root only when told
        # (`IS_SANDBOX=1`) that it runs in a sandbox; on the host it keeps its prompts.
        command = f"cd {{repo_dir}} && {command} --dangerously-skip-permissions"
        env["IS_SANDBOX"] = "1"
    return CommandScaffold(command=command, where=where, env=env, name="claude-code")


def codex(where: str = "sandbox", program: str = "codex", extra_args: str = "") -> CommandScaffold:
    provider = ("-c model_provider=undertow "
                "-c 'model_providers.undertow.name=\"undertow\"' "
                "-c 'model_providers.undertow.base_url=\"{base_url}\"' "
                "-c 'model_providers.undertow.env_key=\"OPENAI_API_KEY\"' "
                "-c 'model_providers.undertow.wire_api=\"responses\"'")
    command = (f'{program} exec {provider} -m {{model}} --skip-git-repo-check '
               f'--dangerously-bypass-approvals-and-sandbox {extra_args} '
               f'"$(cat {{problem_file}})"')
    if where == "sandbox":
        command = f"cd {{repo_dir}} && {command}"
    return CommandScaffold(command=command, where=where, env={"CODEX_HOME": "{session_dir}"
                           if where == "host" else "/tmp/codex-home"}, name="codex")


def swe_agent(program: str = "sweagent", extra_args: str = "") -> CommandScaffold:
    command = (f"{program} run --agent.model.name=openai/{{model}} "
               "--agent.model.api_base={base_url} --agent.model.api_key={api_key} "
               "--agent.model.per_instance_cost_limit=0 --agent.model.total_cost_limit=0 "
               "--problem_statement.path={problem_file} "
               "--env.repo.type=preexisting --env.repo.repo_name={repo_dir} "
               "--env.deployment.type=docker --env.deployment.container_name={container} "
               f"--output_dir={{session_dir}}/sweagent {extra_args}")
    return CommandScaffold(command=command, where="host", name="swe-agent")


def openhands(where: str = "sandbox", program: str = "python -m openhands.core.main",
              max_iterations: int = 30, extra_args: str = "") -> CommandScaffold:
    command = f"{program} -f {{problem_file}} -i {max_iterations} {extra_args}"
    in_sandbox = where == "sandbox"
    env = {"LLM_MODEL": "openai/{model}", "LLM_BASE_URL": "{base_url}",
           "LLM_API_KEY": "{api_key}", "RUNTIME": "cli", "ENABLE_BROWSER": "false",
           "AGENT_ENABLE_BROWSING": "false", "LOG_ALL_EVENTS": "true",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "WORKSPACE_BASE": "{repo_dir}" if in_sandbox else "{session_dir}/workspace",
           "FILE_STORE_PATH": "/tmp/openhands" if in_sandbox else "{session_dir}/openhands"}
    if in_sandbox:
        command = f"cd {{repo_dir}} && {command}"
    return CommandScaffold(command=command, where=where, env=env, name="openhands")
