"""The seams of TRL's AsyncGRPOTrainer we use beyond its public ones (trinity_trl/asynchronous/async_grpo_seams.py):
each does what its reason says, and the contract checks fail loudly if TRL changes what they rely on."""

from __future__ import annotations

import inspect
import queue

import numpy as np
import pytest
import torch
from async_helpers import queue_item, rollout_sample
from helpers import TINY_MODEL_TERMS, build_tiny_model, build_tiny_tokenizer
from tolerance import assert_close

import trinity_trl.trainers.async_trinity  # noqa: F401 (imports TRL's experimental module without its warning)
from trinity_trl.asynchronous import async_grpo_seams
from trinity_trl.asynchronous.async_grpo_seams import (
    EXPERT_KEY,
    POLICY_VERSION_KEY,
    PolicyVersions,
    SampleStream,
    cpu_safe_peak_flops,
    kernel_for,
    packed_rows_of,
    register_tree_attention,
    trl_collator,
)
from trinity_trl.packing.kernels import gathered_keys


# --------------------------------------------------------------------------------------------- TRL's contract
def test_trl_contract():
    """What the seams rely on in TRL 1.16's experimental async module."""
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async
    from trl.experimental.async_grpo import packing
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    assert callable(trl_async.get_peak_flops_per_device)  # seam 1: looked up by name in TRL's __init__
    assert "get_peak_flops_per_device(self.accelerator" in inspect.getsource(trl_async.AsyncGRPOTrainer.__init__)
    assert packing.TREE_ATTENTION == async_grpo_seams.TRL_TREE_ATTENTION == "tree_fa3"  # seam 2
    assert "DataCollatorForRollout(" in inspect.getsource(trl_async.AsyncGRPOTrainer.get_train_dataloader)  # seam 3
    assert {"model_version", "metrics", "group_id"} <= set(inspect.signature(RolloutSample).parameters)
    source = inspect.getsource(trl_async.RolloutQueueDataset.__iter__)
    assert '"metrics": sample.metrics' in source and "staleness > self.max_staleness" in source
    # compute_loss replaced: TRL's step accounting that _log_step_metrics reads (account_step)
    log_step = inspect.getsource(trl_async.AsyncGRPOTrainer._log_step_metrics)
    for name in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples"):
        assert name in log_step


# --------------------------------------------------------------------------------------------- 1. peak FLOPs
def test_peak_flops_probe_is_cpu_safe():
    """TRL's probe calls torch.cuda.get_device_name, which raises on a CPU build of torch (AsyncGRPOTrainer then
    cannot be built); within the stand-in it answers None off CUDA (no MFU metric)."""
    from accelerate import Accelerator
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    accelerator = Accelerator(cpu=True)
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            trl_async.get_peak_flops_per_device(accelerator, "float32")
    original = trl_async.get_peak_flops_per_device
    with cpu_safe_peak_flops():
        assert trl_async.get_peak_flops_per_device(accelerator, "float32") is None
    assert trl_async.get_peak_flops_per_device is original  # restored


# --------------------------------------------------------------------------------------------- 2. tree attention
def _tree_row(samples):
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for sample in samples:
        row.add(queue_item(sample))
    return row, row.pack()


def _samples():
    """Three completions of one prompt (two share their first tokens) and one of another prompt."""
    p1, p2 = [5, 6, 7, 8, 9], [5, 6, 30, 31]
    return [
        rollout_sample(p1, [40, 41, 42, 43], [-1.0] * 4, 1.0, group_id=0),
        rollout_sample(p1, [40, 41, 50], [-1.0] * 3, -1.0, group_id=0),
        rollout_sample(p1, [60, 61, 62, 63, 64], [-1.0] * 5, 0.5, group_id=0),
        rollout_sample(p2, [70, 71], [-1.0] * 2, 0.0, group_id=1),
    ]


def test_trl_tree_layout_becomes_our_segments():
    """Each segment's gathered keys (its ancestors, then itself) are TRL's ``tree_kv_index`` for it."""
    _, packed = _tree_row(_samples())
    rows = packed_rows_of(packed["tree_kv_index"], packed["tree_cu_seqlens_q"], packed["tree_cu_seqlens_k"])
    layout = gathered_keys(rows.segments)
    assert np.array_equal(layout.key_index, packed["tree_kv_index"].numpy())
    assert np.array_equal(layout.cu_q, packed["tree_cu_seqlens_q"].numpy())
    assert np.array_equal(layout.cu_k, packed["tree_cu_seqlens_k"].numpy())
    assert any(seg.ancestors for seg in rows.segments)  # the fixture forks


@pytest.mark.parametrize("with_plan", [True, False], ids=["plan-per-forward", "plan-per-call"])
def test_tree_fa3_is_our_kernel_and_matches_each_sample_alone(with_plan, monkeypatch):
    """A packed row through ``"tree_fa3"`` (our registration) gives every trained token the log-prob that sample's
    own forward gives it (float64), and TRL's Hub kernel is never fetched."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import packing

    monkeypatch.setattr(packing, "_flash_attn", lambda: pytest.fail("TRL's Hub kernel was fetched"))
    register_tree_attention()
    assert AttentionInterface._global_mapping["tree_fa3"] is async_grpo_seams.tree_fa3_attention
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer).to(torch.float64).eval()
    samples = _samples()
    _, packed = _tree_row(samples)
    tree = {key: packed[key] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    extra = {}
    if with_plan:
        extra[async_grpo_seams.PLAN_KWARG] = async_grpo_seams.tree_plan(
            tree, kernel_for("auto", torch.device("cpu"), torch.float64), torch.device("cpu")
        )
    model.config._attn_implementation = "tree_fa3"
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"].unsqueeze(0),
            position_ids=packed["position_ids"].unsqueeze(0),
            tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
            **tree,
            **extra,
        ).logits[0]
    model.config._attn_implementation = "sdpa"
    packed_logps = torch.log_softmax(logits, -1)[packed["token_index"], packed["shift_labels"][packed["token_index"]]]
    alone = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor(sample.input_ids).unsqueeze(0)
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            alone.append(lp[torch.tensor(sample.completion_mask[1:]).bool()])
    assert_close(packed_logps, torch.cat(alone), terms=TINY_MODEL_TERMS)


def test_a_forced_kernel_that_cannot_run_is_one_line():
    with pytest.raises(ValueError, match="tree_attention_kernel='varlen' cannot run here") as info:
        kernel_for("varlen", torch.device("cpu"), torch.float32)
    assert "\n" not in str(info.value)
    assert kernel_for("auto", torch.device("cpu"), torch.float32).name == "sdpa_segments"


# --------------------------------------------------------------------------------------------- 3. sample fields
def test_sample_stream_stamps_policy_versions():
    versions = PolicyVersions()
    versions.record(1, 0)
    versions.record(2, 1)
    versions.record(3, 3)  # weight_sync_steps > 1: TRL's versions are not optimizer steps
    source = queue.Queue()
    for version in (1, 3, 2, 9):
        source.put(rollout_sample([1, 2], [3], [-1.0], 0.0, group_id=0, model_version=version))
    stream = SampleStream(source, versions)
    stamped = [stream.get(timeout=1).metrics[POLICY_VERSION_KEY] for _ in range(4)]
    assert stamped[:3] == [0.0, 3.0, 1.0] and np.isnan(stamped[3])


@pytest.mark.parametrize("ratio", [0.25, 0.2, 0.5])
def test_demonstrations_keep_their_share_of_the_kept_samples(ratio):
    """Demonstrations are mixed in at ``expert_ratio`` of the samples TRL keeps: rollouts its staleness filter drops
    are not counted (here every third rollout is stale)."""
    source = queue.Queue()
    for n in range(300):
        source.put(rollout_sample([1, 2], [3], [-1.0], 0.0, group_id=n // 4, model_version=0 if n % 3 == 2 else 5))

    def demonstration(model_version, group_id):
        return rollout_sample([1, 2], [4], [0.0], 0.0, group_id=group_id, model_version=model_version)

    stream = SampleStream(
        source,
        lambda v: 0.0,
        demonstrations=demonstration,
        expert_ratio=ratio,
        kept=lambda version: version == 5,
        model_version=lambda: 5,
    )
    kept = experts = 0
    while not source.empty():
        sample = stream.get(timeout=1)
        if sample.metrics[EXPERT_KEY]:
            experts += 1
            assert sample.model_version == 5  # never stale
        elif sample.model_version == 5:
            kept += 1
        assert experts <= ratio / (1 - ratio) * kept + 1e-9  # never ahead of the share
    assert experts == int(ratio / (1 - ratio) * kept + 1e-9)


def test_one_builder_lays_a_completion_out_as_trls_sample():
    """`completion_sample`: prompt then completion ids, the completion trained or not, behaviour log-probs 0 over the
    prompt (and over a completion sampled without them: a demonstration), one advantage, version and group."""
    from trinity_trl.asynchronous.async_grpo_seams import completion_sample

    sample = completion_sample(
        [1, 2],
        [3, 4, 5],
        [-0.5, -1.0, -1.5],
        trained=True,
        advantage=0.25,
        version=3,
        group_id=7,
        prompt=[{"role": "user", "content": "q"}],
        completion=[{"role": "assistant", "content": "a"}],
        metrics={"reward": 1.0},
    )
    assert sample.input_ids.dtype == np.int64 and sample.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert sample.completion_mask.tolist() == [0, 0, 1, 1, 1]
    assert sample.old_log_probs.dtype == np.float32 and sample.old_log_probs.tolist() == [0.0, 0.0, -0.5, -1.0, -1.5]
    assert (sample.advantage, sample.model_version, sample.group_id) == (0.25, 3, 7)
    assert sample.prompt[0]["content"] == "q" and sample.metrics == {"reward": 1.0}
    untrained = completion_sample(
        [1], [2, 3], None, trained=False, advantage=0, version=0, group_id=0, prompt=[], completion=[], metrics={}
    )
    assert untrained.completion_mask.tolist() == [0, 0, 0] and untrained.old_log_probs.tolist() == [0.0, 0.0, 0.0]


def test_the_collator_reads_each_samples_fields_back():
    samples = _samples()
    samples[0].metrics.update({POLICY_VERSION_KEY: 2.0})
    samples[1].metrics.update({POLICY_VERSION_KEY: 1.0})
    samples[2].metrics.update({EXPERT_KEY: 1.0})
    samples[3].metrics.update({POLICY_VERSION_KEY: 0.0})
    row, _ = _tree_row(samples)
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    with trl_collator():
        collator = trl_async.DataCollatorForRollout(0, 1)
    assert trl_async.DataCollatorForRollout.__name__ == "DataCollatorForRollout"  # restored
    batch = collator([[row]])
    assert batch["sample_count"].tolist() == [4.0]
    assert batch["sample_expert"].tolist() == [[0.0, 0.0, 1.0, 0.0]]
    versions = batch["sample_policy_version"][0]
    assert versions[[0, 1, 3]].tolist() == [2.0, 1.0, 0.0] and torch.isnan(versions[2])
    assert batch["global_n_samples"].tolist() == [4.0] and batch["global_n_expert"].tolist() == [1.0]


def test_the_trained_model_still_generates_and_scores_plain_batches():
    """Under ``"tree_fa3"`` a forward that is no packed row (a recipe's held-out generation, padded rows) runs SDPA
    with the model's mask: the same logits as the model loaded with ``sdpa``."""
    register_tree_attention()
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer).to(torch.float64).eval()
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        model.config._attn_implementation = "tree_fa3"
        got = model(input_ids=ids, attention_mask=mask).logits
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        model.config._attn_implementation = "sdpa"
        reference = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert_close(got[mask.bool()], expected[mask.bool()], terms=TINY_MODEL_TERMS)
    assert torch.equal(generated, reference)


# ------------------------------------------------------------------------------------------- models the kernels refuse
def _configs():
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    small = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    return {
        "qwen2-window-off": (Qwen2Config(**small, use_sliding_window=False, sliding_window=16), None),
        "qwen2-window-on": (
            Qwen2Config(**small, use_sliding_window=True, sliding_window=16, max_window_layers=1),
            "sliding window of 16 tokens in 1 of its 2 layers",
        ),
        "mistral-window": (MistralConfig(**small), "sliding window of 4096 tokens in every layer"),
        "mistral-no-window": (MistralConfig(**small, sliding_window=None), None),
        "gemma2": (Gemma2Config(**small), "sliding window of 4096 tokens in 1 of its 2 layers"),
        "gemma2-full-softcapped": (
            Gemma2Config(**small, sliding_window=None, layer_types=["full_attention"] * 2),
            "soft-caps its attention logits",
        ),
    }


@pytest.mark.parametrize("name", ["qwen2-window-off", "qwen2-window-on", "mistral-window", "mistral-no-window",
                                  "gemma2", "gemma2-full-softcapped"])  # fmt: skip
def test_models_the_tree_kernels_cannot_run_are_named_from_their_config(name):
    """Read from the config's layer types and window (no weights): a window that is set but off trains."""
    from trinity_trl.asynchronous.async_grpo_seams import tree_attention_refusal

    config, expected = _configs()[name]
    reason = tree_attention_refusal(config)
    assert reason is None if expected is None else expected in reason
