"""FSDP2 in a training cell (`sharding.py`), on CPU with gloo, and the device helpers.

- Two processes shard the tiny model (tied head, and `tiny-untied` with an LM head of
  its own, a unit of its own), and the Llama and Qwen2 architectures shrunk (tied heads,
  `conftest.py`), with `fully_shard` over a 2-process `DeviceMesh`,
  train one tree-packed step (four groups with branches, micro-batches of at most 48
  tokens, so there are many, an odd number, and one process runs an idle round) with
  gradient clipping and AdamW, and gather the gradients and parameters: each gradient
  equals the unsharded one within 1e-5 of its scale and each parameter within 1e-5
  what one unsharded process gets from `backward_step` on the same step, which moved
  them; the processes' losses and term counts sum to the single process's. Long
  micro-batches are scored in segments (`segments.py`), by both: the tied model in
  segments of 20 (two or three per micro-batch, rounds whose two micro-batches have
  different counts, a segment without terms), the untied one in segments of 32 (rounds
  of one segmented and one whole micro-batch, rounds of whole ones, segments without
  terms); in both the idle round pads a segmented one. (The single process scores in
  segments too because AdamW's first step moves a weight by up to its learning rate
  whatever its gradient's size: a gradient of 1e-9, which summing in another order
  (segments or not) turns into 4e-9, moved a weight 8e-5 apart on one process.)
- The device and the micro-batch token budget: "auto" is the CPU here, "cuda" without a
  GPU says what to do, and the budget grows with checkpointing and with shards.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from tests.learner.random_trees import build_random_tree
from tests.learner.test_losses import _assert_gradients_close
from undertow.learner.advantages import group_advantages
from undertow.learner.config import AdvantageConfig, LossConfig
from undertow.learner.model import PolicyModel
from undertow.learner.objective import backward_step
from undertow.learner.packing import pack_step
from undertow.learner.sharding import (
    DeviceError,
    full_parameters,
    micro_batch_token_budget,
    resolve_device,
    segments_of,
    shard_policy,
    sharded_backward_step,
)

MAX_TOKENS = 48
WORLD_SIZE = 2
CONFIG = LossConfig(name="grpo", correction="decoupled_ppo", entropy_coef=0.01,
                    max_importance_weight=1.5)
LR = 1e-3
HEAD_CHUNK_TOKENS = 16   # the LM head in several chunks per micro-batch
SEGMENT_TOKENS = {"tiny_model_dir": 20, "tiny_untied_model_dir": 32,   # module docstring
                  "tiny_llama_model_dir": 20, "tiny_qwen2_model_dir": 20}


def _packed_step():
    trees = [build_random_tree(seed, f"g{seed}", num_turns=3 + seed % 3) for seed in range(1, 5)]
    advantages = {(tree.group_id, s): a for tree in trees
                  for s, a in group_advantages(tree, AdvantageConfig()).items()}
    return pack_step(trees, advantages, MAX_TOKENS, CONFIG.paths_per_session)


def _train_one_step(policy, step_fn):
    """The step's stats and its whole gradients (before clipping) by parameter name."""
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=LR)
    optimizer.zero_grad(set_to_none=True)
    stats = step_fn()
    grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for name, p in policy.model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
    optimizer.step()
    return stats, grads


def _cell_member(rank: int, port: int, model_dir: str, out_dir: str,
                 segment_tokens: int) -> None:
    """One process of the cell: shard, train the step, write the gathered parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        policy = PolicyModel.load(model_dir, max_query_tokens=8,
                                  head_chunk_tokens=HEAD_CHUNK_TOKENS,
                                  max_segment_tokens=segment_tokens)
        policy.model.train()
        shard_policy(policy, mesh)
        head = policy.model.get_output_embeddings().weight
        if not policy.model.config.tie_word_embeddings:   # the head is sharded too
            assert head.to_local().shape[0] == head.shape[0] // WORLD_SIZE
        step = _packed_step()
        stats, grads = _train_one_step(policy, lambda: sharded_backward_step(
            policy, step, CONFIG, rank, WORLD_SIZE))
        parameters = full_parameters(policy)
        Path(out_dir, f"stats-{rank}.json").write_text(json.dumps(stats))
        if rank == 0:
            save_file({name: t.contiguous() for name, t in parameters.items()},
                      str(Path(out_dir, "parameters.safetensors")))
            save_file({name: t.contiguous() for name, t in grads.items()},
                      str(Path(out_dir, "gradients.safetensors")))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("model_dir_fixture", list(SEGMENT_TOKENS))
def test_a_sharded_cell_of_two_trains_the_step_one_process_trains(model_dir_fixture, request,
                                                                   tmp_path):
    tiny_model_dir = request.getfixturevalue(model_dir_fixture)
    untied = model_dir_fixture == "tiny_untied_model_dir"
    store = dist.TCPStore("127.0.0.1", 0, world_size=WORLD_SIZE + 1, is_master=True,
                          wait_for_workers=False)
    context = mp.get_context("spawn")
    segment_tokens = SEGMENT_TOKENS[model_dir_fixture]
    processes = [context.Process(target=_cell_member,
                                 args=(rank, store.port, str(tiny_model_dir), str(tmp_path),
                                       segment_tokens))
                 for rank in range(WORLD_SIZE)]
    for process in processes:
        process.start()

    policy = PolicyModel.load(tiny_model_dir, max_query_tokens=8,
                              head_chunk_tokens=HEAD_CHUNK_TOKENS,
                              max_segment_tokens=segment_tokens)
    policy.model.train()
    assert policy.model.config.tie_word_embeddings is not untied
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    step = _packed_step()
    assert len(step.micro_batches) % WORLD_SIZE == 1   # one process runs an idle round
    _assert_segments_as_described(policy, step, segment_tokens, untied)
    expected_stats, expected_grads = _train_one_step(
        policy, lambda: backward_step(policy, step, CONFIG))

    for process in processes:
        process.join(timeout=600)
        assert process.exitcode == 0
    # The gradient: AdamW's first step hardly depends on its scale, so check it first.
    _assert_gradients_close(load_file(str(tmp_path / "gradients.safetensors")), expected_grads)
    sharded = load_file(str(tmp_path / "parameters.safetensors"))
    assert sorted(sharded) == sorted(before)
    assert ("lm_head.weight" in sharded) is untied
    for name, parameter in policy.model.named_parameters():
        assert not torch.equal(parameter, before[name]) or name.endswith("norm.weight")
        assert torch.allclose(sharded[name], parameter.detach(), rtol=0, atol=1e-5), name
    stats = [json.loads((tmp_path / f"stats-{rank}.json").read_text())
             for rank in range(WORLD_SIZE)]
    assert sum(s["num_terms"] for s in stats) == expected_stats["num_terms"]
    assert math.isclose(sum(s["loss"] for s in stats), expected_stats["loss"],
                        rel_tol=1e-5, abs_tol=1e-6)


def _assert_segments_as_described(policy, step, segment_tokens: int, untied: bool) -> None:
    """The segment counts per round and the segments without terms of the module
    docstring (`policy` scores in segments of `segment_tokens`)."""
    counts = [segments_of(policy, micro_batch) for micro_batch in step.micro_batches]
    rounds = [counts[i:i + WORLD_SIZE] for i in range(0, len(counts), WORLD_SIZE)]
    assert rounds[-1][0] > 1 and len(rounds[-1]) == 1          # the idle round is padded
    if untied:
        assert [2, 1] in rounds and [1, 1] in rounds
    else:
        assert max(counts) == 3 and min(counts) == 2 and [2, 3] in rounds
    empty = [(micro_batch, start) for micro_batch, count in zip(step.micro_batches, counts,
                                                                strict=True) if count > 1
             for start in range(0, micro_batch.num_tokens, segment_tokens)
             if not ((micro_batch.term_predictor_index >= start)
                     & (micro_batch.term_predictor_index < start + segment_tokens)).any()]
    assert empty


def test_segments_of_counts_what_the_policy_scores_in_segments(policy32):
    step = _packed_step()
    longest = max(step.micro_batches, key=lambda mb: mb.num_tokens)
    saved = policy32.max_segment_tokens, policy32.attention
    try:
        policy32.max_segment_tokens = longest.num_tokens - 1
        assert segments_of(policy32, longest) == 2
        policy32.max_segment_tokens = 10
        assert segments_of(policy32, longest) == math.ceil(longest.num_tokens / 10)
        policy32.attention = "dense"          # dense attention never segments
        assert segments_of(policy32, longest) == 1
        policy32.attention, policy32.max_segment_tokens = "blocks", longest.num_tokens
        assert segments_of(policy32, longest) == 1
        policy32.max_segment_tokens = 0       # 0: never
        assert segments_of(policy32, longest) == 1
    finally:
        policy32.max_segment_tokens, policy32.attention = saved


def test_auto_is_the_cpu_without_a_gpu_and_cuda_says_what_to_do():
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: 'cuda' resolves")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"learner\.device: auto"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_device("tpu")


def test_the_token_budget_grows_with_checkpointing_and_shards(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    options = {"config": config, "free_bytes": 2 * 2**30, "num_parameters": 5_000_000,
               "compute_bytes": 2, "head_chunk_tokens": 1024}
    plain = micro_batch_token_budget(num_shards=1, activation_checkpointing=False, **options)
    checkpointed = micro_batch_token_budget(num_shards=1, activation_checkpointing=True,
                                            **options)
    assert 256 <= plain < checkpointed and plain % 256 == checkpointed % 256 == 0
    big = {**options, "num_parameters": 100_000_000}
    assert (micro_batch_token_budget(num_shards=1, activation_checkpointing=True, **big)
            < micro_batch_token_budget(num_shards=8, activation_checkpointing=True, **big))
    with pytest.raises(DeviceError, match="activation_checkpointing"):
        micro_batch_token_budget(num_shards=1, activation_checkpointing=True,
                                 **{**options, "free_bytes": 10 * 2**20})


def test_place_resolves_the_config_on_a_cpu(policy32):
    from undertow.learner.config import TrainConfig
    from undertow.learner.sharding import place

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: 'auto' would move the shared fixture onto it")
    fixed = place(TrainConfig(micro_batch_tokens=123, activation_checkpointing=True,
                              attention="dense"), policy32)
    try:
        assert fixed.max_tokens == 123 and policy32.activation_checkpointing
        assert policy32.attention == "dense"
        auto = place(TrainConfig(max_tokens=77, micro_batch_tokens="auto",
                                 mixed_precision="bf16"), policy32)
        assert auto.device == torch.device("cpu") and auto.max_tokens == 77
        assert not policy32.activation_checkpointing
        with auto.compute():
            product = torch.ones(2, 2) @ torch.ones(2, 2)
        assert product.dtype == torch.bfloat16   # computed in bf16; parameters stay float32
        assert next(policy32.model.parameters()).dtype == torch.float32
        with pytest.raises(DeviceError, match="flex_attention backward"):
            place(TrainConfig(attention="flex"), policy32)
    finally:
        place(TrainConfig(), policy32)


@pytest.mark.parametrize(("key", "value"), [("device", "gpu"), ("mixed_precision", "fp16"),
                                             ("attention", "sparse"),
                                             ("micro_batch_tokens", "lots"),
                                             ("micro_batch_tokens", 0)])
def test_the_learner_config_names_a_bad_device_field(key, value):
    from undertow.learner.config import TrainConfig

    with pytest.raises(ValueError, match=f"learner.{key}"):
        TrainConfig(**{key: value})


def test_bf16_compute_keeps_float32_gradients_close_to_float32_compute(policy32):
    """learner.mixed_precision "bf16" in one process (autocast): the gradient lands in the
    float32 parameters' dtype, differs from float32 compute (bf16 did run) and points the
    same way (cosine over all parameters above 0.95; elementwise bf16 differs by tens of
    percent of a parameter's largest gradient on this random model)."""
    from undertow.learner.sharding import compute_context

    step = _packed_step()
    policy32.model.zero_grad(set_to_none=True)
    backward_step(policy32, step, CONFIG)
    full = torch.cat([p.grad.flatten() for p in policy32.model.parameters()])
    policy32.model.zero_grad(set_to_none=True)
    with compute_context(torch.device("cpu"), "bf16"):
        backward_step(policy32, step, CONFIG)
    assert all(p.grad.dtype == torch.float32 for p in policy32.model.parameters())
    mixed = torch.cat([p.grad.flatten() for p in policy32.model.parameters()])
    policy32.model.zero_grad(set_to_none=True)
    assert not torch.equal(mixed, full)
    assert float(mixed @ full / (mixed.norm() * full.norm())) > 0.95


def test_the_run_config_section_takes_auto_or_a_number_of_tokens():
    from undertow.config import build_section
    from undertow.learner.config import TrainConfig

    section = {"device": "cpu", "mixed_precision": "bf16", "micro_batch_tokens": "auto"}
    assert build_section(TrainConfig, section, "learner").micro_batch_tokens == "auto"
    assert build_section(TrainConfig, {"micro_batch_tokens": 4096},
                         "learner").micro_batch_tokens == 4096
    assert build_section(TrainConfig, {"lr": 1}, "learner").lr == 1.0   # still coerced
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        build_section(TrainConfig, {"micro_batch_tokens": True}, "learner")
