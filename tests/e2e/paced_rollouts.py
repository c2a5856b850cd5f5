"""A rollout source for pool runs of `undertow train`: scripted sessions with paced tools.

`rollout.source = "tests.e2e.paced_rollouts:make_run_group"`. Each group's sessions run at
the same time (so they spread over the cells' engines), each a scripted client talking to
the real gateway with the real `openai` client: `num_turns` chat turns of `max_tokens`
tokens, each followed by a "tool call" that sleeps `tool_latency_s[slot]` seconds (the
list is cycled), which is how a long-tailed workload is made: a few slow sessions hold
their batch open while the others are long done. Sampling is seeded by the group's
launch index, the slot and the turn. Slot 0 is rewarded 1, the others 0.

Options (`rollout.scaffold_options`): `num_turns` (2), `max_tokens` (8),
`tool_latency_s` ([0.0]).
"""

import asyncio

from undertow.adapters.gateway_client import GatewayAdmin

TASK = "Fix the off-by-one error in parse_range() so that '1-3' yields [1, 2, 3]."


def make_run_group(context):
    from openai import AsyncOpenAI

    options = dict(context.rollout.scaffold_options)
    num_turns = int(options.get("num_turns", 2))
    max_tokens = int(options.get("max_tokens", 8))
    latencies_s = [float(s) for s in options.get("tool_latency_s", [0.0])]

    async def run_session(admin, request, slot: int) -> None:
        opened = await admin.open_session(request.group_id, {"slot": slot})
        client = AsyncOpenAI(base_url=opened["base_url"], api_key=opened["api_key"])
        messages = [{"role": "system", "content": "You are a careful engineer."},
                    {"role": "user", "content": TASK}]
        try:
            for turn in range(num_turns):
                reply = await client.chat.completions.create(
                    model="undertow", messages=messages, max_tokens=max_tokens,
                    temperature=1.0, seed=1000 * request.index + 10 * slot + turn)
                messages += [{"role": "assistant",
                              "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": "Go on."}]
                await asyncio.sleep(latencies_s[slot % len(latencies_s)])
        finally:
            await client.close()
        await admin.close_session(opened["session_id"], 1.0 if slot == 0 else 0.0,
                                  {"slot": slot})

    async def run_group(request) -> str:
        async with GatewayAdmin(context.gateway_url, context.admin_token) as admin:
            await asyncio.gather(*(run_session(admin, request, slot)
                                   for slot in range(request.group_size)))
        return request.group_id
    return run_group
