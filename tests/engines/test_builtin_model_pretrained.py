"""The built-in forward on the pretrained models users train (SmolLM2-135M-Instruct, a
Llama; Qwen2.5-Coder-0.5B-Instruct, a Qwen2 with q/k/v biases), against transformers at
float32 on the same directory: a chat prompt's prefill logits, then greedy decode steps
batched over rows of different lengths, each row's logits and tokens as transformers'
`generate` gives them for that row alone. And a weight update from a checkpoint of the
real model (`/update_weights_from_disk`) makes the engine answer what transformers
answers with those weights. Qwen's forwards take seconds here, so its prompts are short."""

import gc
import shutil

import pytest
import torch

from tests.engines.builtin_client import generate, greedy, post
from undertow.gateway.engines.builtin.model import CausalLM, SlotKV, load_weights
from undertow.gateway.engines.builtin.model_config import ModelConfig
from undertow.gateway.render import Renderer

pytestmark = pytest.mark.slow

QUESTIONS = ["Hi", "Name a prime number larger than ten.", "What is 2+3?"]
NUM_STEPS = 4
MAX_ABS_DIFF = 1e-3   # float32 logits of magnitude 10-30, reduction orders differ


def chat_prompts(model_dir) -> list[list[int]]:
    renderer = Renderer(model_dir)
    return [renderer.encode(renderer.render([{"role": "user", "content": question}],
                                            add_generation_prompt=True))
            for question in QUESTIONS]


def transformers_reference(model_dir, prompts: list[list[int]]) -> dict:
    """Prefill logits of the first prompt, and each prompt's greedy tokens and per-step
    logits from `generate`, one row at a time; the model is freed before returning."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        prefill = model(torch.tensor([prompts[0]])).logits[0]
        rows = []
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_STEPS,
                                 min_new_tokens=NUM_STEPS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            rows.append((out.sequences[0, len(prompt):].tolist(),
                         torch.stack([step[0] for step in out.logits])))
    del model
    gc.collect()
    return {"prefill": prefill, "rows": rows}


@pytest.fixture(scope="module",
                params=["smollm2_dir", pytest.param("qwen_coder_dir", marks=pytest.mark.qwen)])
def pretrained(request):
    model_dir = request.getfixturevalue(request.param)
    prompts = chat_prompts(model_dir)
    reference = transformers_reference(model_dir, prompts)
    config = ModelConfig.from_dir(model_dir)
    return CausalLM(config, load_weights(model_dir, config)), prompts, reference


def test_prefill_logits_are_transformers(pretrained):
    ours, prompts, reference = pretrained
    kv = SlotKV(ours.config)
    kv.reserve(1, len(prompts[0]))
    logits = ours.prefill(kv, 0, prompts[0], 0, slice(None))
    assert (logits - reference["prefill"]).abs().max() < MAX_ABS_DIFF


def test_batched_greedy_decode_is_each_row_of_transformers(pretrained):
    ours, prompts, reference = pretrained
    assert len({len(prompt) for prompt in prompts}) == len(prompts)
    kv = SlotKV(ours.config)
    kv.reserve(len(prompts), max(map(len, prompts)) + NUM_STEPS)
    step_logits = [ours.prefill(kv, slot, prompt, 0, slice(-1, None))[0]
                   for slot, prompt in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(NUM_STEPS):
        for row, logits in enumerate(step_logits):
            expected_logits = reference["rows"][row][1]
            assert (logits - expected_logits[step]).abs().max() < MAX_ABS_DIFF, (row, step)
            tokens[row].append(int(logits.argmax()))
        positions = [len(prompt) + step for prompt in prompts]
        step_logits = list(ours.decode(kv, [row[-1] for row in tokens], positions))
    assert tokens == [row_tokens for row_tokens, _ in reference["rows"]]


def perturbed_checkpoint(model_dir, out) -> list[int]:
    """A checkpoint of the real model with its MLPs' down projections scaled (as a training
    step would change them), saved by transformers with the model's tokenizer files."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers[::2]:
            layer.mlp.down_proj.weight.mul_(1.5)
    model.save_pretrained(out)
    for path in model_dir.iterdir():
        if path.name.startswith(("tokenizer", "chat_template", "generation")):
            shutil.copy2(path, out / path.name)
    return model


async def test_a_weight_update_from_a_real_checkpoint_answers_as_transformers(
        smollm2_dir, start_engine, tmp_path):
    import aiohttp

    prompt = chat_prompts(smollm2_dir)[1]
    updated = perturbed_checkpoint(smollm2_dir, tmp_path / "step-000001")
    with torch.no_grad():
        expected = updated.generate(torch.tensor([prompt]), max_new_tokens=12,
                                    min_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    del updated
    gc.collect()
    body = {"input_ids": prompt, "sampling_params": greedy(12, ignore_eos=True)}
    with start_engine(smollm2_dir) as url:
        async with aiohttp.ClientSession() as session:
            before = (await generate(session, url, **body))["output_ids"]
            status, reply = await post(session, url, "/update_weights_from_disk", {
                "model_path": str(tmp_path / "step-000001"), "weight_version": "1"})
            assert (status, reply["success"]) == (200, True), reply
            after = await generate(session, url, **body)
    assert before != expected
    assert after["output_ids"] == expected
    assert after["meta_info"]["weight_version"] == "1"
