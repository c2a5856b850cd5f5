"""Presets: SWE-agent, OpenHands, Claude Code and Codex CLI as `command` scaffolds. How each
program is pointed at the gateway, and where it must run:
docs/adapters.md#presets-swe-agent-openhands-claude-code-codex-cli.
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
