"""A rollout source for `undertow train` tests: a scripted client, not a scaffold.

`rollout.source = "tests.e2e.scripted_rollouts:make_run_group"` makes each group's
sessions talk to the real gateway (and through it the real engine) with the real
`openai` client: two chat turns per session, sampled with a seed derived from the
group's launch index and the session's slot, so a rerun of the same index with the
same weights gives the same tokens. Sessions run one after another (the engine's
batch composition then never varies), and each is closed with a scripted reward
(1 for the first slot, 0 for the others) so that advantages are non-zero.
"""

from undertow.adapters.gateway_client import GatewayAdmin

TASK = "Fix the off-by-one error in parse_range() so that '1-3' yields [1, 2, 3]."


def make_run_group(context):
    from openai import AsyncOpenAI

    async def run_group(request) -> str:
        async with GatewayAdmin(context.gateway_url, context.admin_token) as admin:
            for slot in range(request.group_size):
                opened = await admin.open_session(request.group_id, {"slot": slot})
                client = AsyncOpenAI(base_url=opened["base_url"], api_key=opened["api_key"])
                messages = [{"role": "system", "content": "You are a careful engineer."},
                            {"role": "user", "content": TASK}]
                try:
                    for turn in range(2):
                        reply = await client.chat.completions.create(
                            model="undertow", messages=messages, max_tokens=8,
                            temperature=1.0, seed=1000 * request.index + 10 * slot + turn)
                        messages += [{"role": "assistant",
                                      "content": reply.choices[0].message.content or ""},
                                     {"role": "user", "content": "Go on."}]
                finally:
                    await client.close()
                await admin.close_session(opened["session_id"], 1.0 if slot == 0 else 0.0,
                                          {"slot": slot})
        return request.group_id
    return run_group
