"""Small HTTP helpers the built-in engine tests share (plain aiohttp, SGLang's wire format)."""

import json
import random

import aiohttp

VOCAB_LOW, VOCAB_HIGH = 3, 2700  # ordinary tokens of the tiny model (no special tokens)


def prompt(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(VOCAB_LOW, VOCAB_HIGH), k=length)


async def generate(session: aiohttp.ClientSession, url: str, **body) -> dict:
    async with session.post(url + "/generate", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def stream(session: aiohttp.ClientSession, url: str, on_chunk=None, **body) -> list:
    """The SSE chunks of a streamed /generate, then the string "[DONE]"."""
    chunks = []
    async with session.post(url + "/generate", json={**body, "stream": True}) as reply:
        assert reply.status == 200, await reply.text()
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        async for line in reply.content:
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: "), line
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                chunks.append("[DONE]")
                break
            chunks.append(json.loads(data))
            if on_chunk is not None:
                await on_chunk(chunks[-1])
    return chunks


async def post(session: aiohttp.ClientSession, url: str, path: str, body=None) -> tuple:
    async with session.post(url + path, json=body) as reply:
        text = await reply.text()
        return reply.status, (json.loads(text) if text.strip().startswith(("{", "[")) else text)


async def get(session: aiohttp.ClientSession, url: str, path: str):
    async with session.get(url + path) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, **extra}
