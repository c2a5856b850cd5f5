"""The built-in engine's OpenAI-compatible routes, driven by the real `openai` client."""

import aiohttp
import openai
import pytest

from tests.builtin_engine.wire import generate, greedy


def connect(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


async def test_chat_completion_matches_generate_on_the_rendered_prompt(builtin_engine_url,
                                                                       tiny_model_dir):
    from undertow.gateway.builtin_engine.tokenizer import Tokenizer

    async with connect(builtin_engine_url) as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        reply = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
            top_logprobs=2, extra_body={"ignore_eos": True})
        tokenizer = Tokenizer(tiny_model_dir)
        input_ids = tokenizer.encode(tokenizer.render_chat(messages))
        async with aiohttp.ClientSession() as session:
            native = await generate(session, builtin_engine_url, input_ids=input_ids,
                                    sampling_params=greedy(8, ignore_eos=True))
        choice = reply.choices[0]
        assert choice.message.role == "assistant"
        assert choice.message.content == native["text"]
        assert choice.finish_reason == "length"
        assert reply.usage.prompt_tokens == len(input_ids) and reply.usage.completion_tokens == 8
        assert len(choice.logprobs.content) == 8
        assert len(choice.logprobs.content[0].top_logprobs) == 2


async def test_chat_completion_streams_deltas_that_add_up(builtin_engine_url):
    async with connect(builtin_engine_url) as client:
        messages = [{"role": "user", "content": "count to three"}]
        kwargs = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0,
                  "extra_body": {"ignore_eos": True}}
        whole = await client.chat.completions.create(**kwargs)
        pieces, finish, usage = [], None, None
        async for chunk in await client.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert "".join(pieces) == whole.choices[0].message.content
        assert finish == "length"
        assert usage.completion_tokens == 10


async def test_completions_with_text_and_token_prompts(builtin_engine_url):
    async with connect(builtin_engine_url) as client:
        text = await client.completions.create(model="tiny", prompt="import os", max_tokens=6,
                                               temperature=0, logprobs=2)
        streamed = []
        async for chunk in await client.completions.create(model="tiny", prompt="import os",
                                                           max_tokens=6, temperature=0,
                                                           stream=True):
            streamed.append(chunk.choices[0].text)
        tokens = await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4,
                                                 temperature=0, seed=3,
                                                 extra_body={"return_token_ids": True})
        assert "".join(streamed) == text.choices[0].text
        assert len(text.choices[0].logprobs.tokens) == 6
        assert text.usage.completion_tokens == 6
        assert len(tokens.choices[0].model_extra["token_ids"]) == tokens.usage.completion_tokens


async def test_models_and_errors(builtin_engine_url):
    async with connect(builtin_engine_url) as client:
        models = await client.models.list()
        assert len(models.data) == 1
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                            temperature=-1)
        with pytest.raises(openai.BadRequestError, match="messages"):
            await client.chat.completions.create(model="tiny", messages=[])
