"""Contract tests: the TRL 1.16 internals that `trinity_trl.trainers` relies on.

Our trainers subclass `GRPOTrainer` and use private seams (notes/TRL_1_16.md §1, §2.6). Each test here pins one fact
about them, observed on a real run of the tiny model, so that a TRL upgrade that changes a seam fails here, loudly and
by name, rather than silently changing training.
"""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
import transformers
import trl
from helpers import TINY_LOGP_SCALE, TINY_MODEL_TERMS, completion_text, length_reward, recording, tiny_grpo_kwargs
from tolerance import assert_close
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

REQUIRED_KEYS = {
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "num_items_in_batch",
}


def _arity(result):
    return len(result) if isinstance(result, tuple) else None


def position_reward(completions, **kwargs):
    """Reward = position of the completion in the reward call, so each row's reward names its row."""
    return [float(i) for i in range(len(completions))]


def _run(tmp_path, model_dir, dataset, **overrides) -> GRPOTrainer:
    args = GRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), **overrides))
    trainer = recording(GRPOTrainer)(
        model=model_dir,
        reward_funcs=[length_reward, position_reward],
        args=args,
        train_dataset=dataset,
    )
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def basic_run(tmp_path_factory, tiny_model_dir, tiny_dataset) -> GRPOTrainer:
    """beta=0, GA=1, spg=1: 2 optimizer steps, one generation of 4 rows (1 prompt x 4) per step."""
    return _run(tmp_path_factory.mktemp("basic_run"), tiny_model_dir, tiny_dataset)


@pytest.fixture(scope="module")
def ref_run(tmp_path_factory, tiny_model_dir, tiny_dataset) -> GRPOTrainer:
    """beta=0.04, GA=2, spg=4: one generation of 16 rows (4 prompts x 4) split into 4 micro-batches, 2 consumed."""
    return _run(
        tmp_path_factory.mktemp("ref_run"),
        tiny_model_dir,
        tiny_dataset,
        beta=0.04,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_steps=1,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Static contract: version, class attributes, signatures, helpers


def test_trl_version_is_1_16():
    assert trl.__version__.startswith("1.16."), f"trinity_trl pins TRL 1.16.*, found {trl.__version__}"


def test_grpo_loss_is_scaled_for_gradient_accumulation():
    # `_compute_loss` divides by the global token count of the whole generation batch, so Trainer must not divide
    # by gradient_accumulation_steps again; our `_compute_loss` replacement must keep this scaling.
    assert "loss_is_scaled_for_ga" in vars(GRPOTrainer)
    assert GRPOTrainer.loss_is_scaled_for_ga is True
    assert "loss_is_scaled_for_ga" in vars(transformers.Trainer)  # and transformers still reads the attribute


def _params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("_generate_and_score_completions", ["self", "inputs"]),
        (
            "_calculate_rewards",
            ["self", "inputs", "prompts", "completions", "completion_ids_list"],
        ),
        ("_compute_loss", ["self", "model", "inputs"]),
        ("_prepare_inputs", ["self", "generation_batch"]),
        (
            "compute_loss",
            ["self", "model", "inputs", "return_outputs", "num_items_in_batch"],
        ),
    ],
)
def test_seam_signatures(method, expected):
    assert _params(getattr(GRPOTrainer, method)) == expected


def test_per_token_logps_signature():
    signature = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
    assert list(signature.parameters)[:8] == [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ]
    defaults = {
        name: p.default for name, p in signature.parameters.items() if name in ("batch_size", "compute_entropy")
    }
    assert defaults == {"batch_size": None, "compute_entropy": False}
    # Every other parameter is an optional keyword (VLM inputs), so our calls with the first ones stay valid.
    assert all(p.default is None for p in list(signature.parameters.values())[8:])


def test_constructor_takes_rollout_func():
    assert "rollout_func" in inspect.signature(GRPOTrainer.__init__).parameters


def test_add_fused_lm_head_exists():
    from trl.trainer.utils import add_fused_lm_head

    params = inspect.signature(add_fused_lm_head).parameters
    assert next(iter(params)) == "model" and "temperature" in params and "outputs" in params


def test_split_tensor_dict_drops_rows_beyond_a_multiple_of_the_chunk_count():
    batch = {
        "x": torch.arange(10),
        "pair": torch.arange(20).view(10, 2),
        "names": [f"r{i}" for i in range(10)],
        "count": torch.tensor(7),
        "absent": None,
    }
    chunks = split_tensor_dict(batch, 4)
    assert len(chunks) == 4
    assert [c["x"].tolist() for c in chunks] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]  # rows 8 and 9 are gone, silently
    assert chunks[3]["names"] == ["r6", "r7"]
    assert chunks[1]["pair"].tolist() == [[4, 5], [6, 7]]
    assert all(c["count"] is batch["count"] for c in chunks)  # 0-dim tensors pass through unchanged
    assert all(c["absent"] is None for c in chunks)
    with pytest.raises(AttributeError):  # a Python scalar value is not supported (`.ndim`)
        split_tensor_dict({"x": torch.arange(4), "scalar": 1.5}, 2)


def test_shuffle_sequence_dict_applies_one_permutation_to_every_key():
    torch.manual_seed(0)
    batch = {
        "x": torch.arange(8),
        "pair": torch.arange(8).repeat_interleave(2).view(8, 2),
        "names": list(range(8)),
        "count": torch.tensor(3),
        "absent": None,
    }
    shuffled = shuffle_sequence_dict(batch)
    permutation = shuffled["x"].tolist()
    assert sorted(permutation) == list(range(8)) and permutation != list(range(8))
    assert shuffled["pair"][:, 0].tolist() == permutation
    assert shuffled["names"] == permutation
    assert shuffled["count"] is batch["count"] and shuffled["absent"] is None
    with pytest.raises(TypeError):  # a Python scalar value is not supported
        shuffle_sequence_dict({"x": torch.arange(4), "scalar": 1.5})


# ---------------------------------------------------------------------------------------------------------------------
# Observed contract: one real run of the tiny model


def test_generate_output_keys_and_shapes(basic_run):
    generated = basic_run.recorded.batches
    assert len(generated) == 2  # GA=1, spg=1: a fresh generation every optimizer step
    for output in generated:
        assert set(output) == REQUIRED_KEYS  # beta=0, GA % spg == 0, no vLLM/tools: nothing else
        batch = output["prompt_ids"].shape[0]
        assert batch == 4
        assert output["prompt_ids"].dtype == output["completion_ids"].dtype == torch.long
        assert output["prompt_mask"].shape == output["prompt_ids"].shape
        assert output["completion_mask"].shape == output["completion_ids"].shape
        assert output["completion_ids"].shape[1] <= 8  # max_completion_length
        assert output["advantages"].shape == (batch,) and output["advantages"].dtype == torch.float32
        assert output["num_items_in_batch"].ndim == 0
        # prompts are left-padded, completions right-padded
        assert bool(output["prompt_mask"][:, -1].all())
        mask = output["completion_mask"]
        assert bool((mask[:, 1:] <= mask[:, :-1]).all())
        # one process: the loss-token count of the whole generation batch
        assert output["num_items_in_batch"].item() == mask.sum().item()


def test_rewards_are_one_row_per_completion_in_order(basic_run):
    tokenizer = basic_run.processing_class
    for call, output in zip(basic_run.recorded.reward_calls, basic_run.recorded.batches, strict=True):
        rewards = call.rewards
        assert rewards.shape == (
            4,
            2,
        )  # (B_global, n_reward_funcs); one process, so B_global == B
        assert rewards[:, 0].tolist() == pytest.approx(length_reward(call.completions))
        assert rewards[:, 1].tolist() == [0.0, 1.0, 2.0, 3.0]
        # completion i of the reward call is row i of the output tensors
        for i, ids in enumerate(call.completion_ids):
            row = output["completion_ids"][i][output["completion_mask"][i].bool()]
            assert row.tolist() == ids
            assert completion_text(call.completions[i]) == tokenizer.decode(ids, skip_special_tokens=True)


def test_default_advantages_are_group_zscores_of_the_summed_rewards(basic_run):
    for call, output in zip(basic_run.recorded.reward_calls, basic_run.recorded.batches, strict=True):
        total = call.rewards.sum(dim=1).view(-1, 4)  # reward_weights default to 1
        assert bool((total.std(dim=1) > 0).all())  # position_reward alone guarantees a non-zero group std
        expected = (total - total.mean(dim=1, keepdim=True)) / (total.std(dim=1, keepdim=True) + 1e-4)
        assert_close(output["advantages"], expected.flatten(), terms=4, scale=2.0)  # z-scores over groups of 4


def test_groups_of_num_generations_share_a_prompt(ref_run):
    (rows,) = ref_run.recorded.rows
    (call,) = ref_run.recorded.reward_calls
    assert len(rows) == len(call.prompts) == 16  # per_device_bs * steps_per_generation
    prompts = [row["prompt"][0]["content"] for row in rows]
    groups = [prompts[g * 4 : (g + 1) * 4] for g in range(4)]
    assert all(len(set(group)) == 1 for group in groups)  # RepeatSampler: each prompt 4 times in a row
    assert len({group[0] for group in groups}) == 4  # and 4 different prompts
    assert [p[0]["content"] for p in call.prompts] == prompts  # reward call sees the rows in sampler order
    for row in rows:  # dataset columns travel with their row
        a, b = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split("+")
        assert row["answer"] == str(int(a) + int(b))


def test_per_token_logps_returns_logps_entropies_aux(basic_run):
    calls = basic_run.recorded.logps_calls
    assert calls, "_compute_loss no longer calls _get_per_token_logps_and_entropies"
    for call in calls:
        assert _arity(call.result) == 3
        logps, entropies, aux = call.result
        batch = call.arguments["input_ids"].shape[0]
        assert logps.shape == (batch, call.arguments["logits_to_keep"])
        assert call.arguments["compute_entropy"] is True  # _compute_loss always asks for entropies
        assert entropies is not None and entropies.shape == logps.shape
        assert aux is None  # dense model: no MoE auxiliary loss
        assert bool((logps <= 0).all())


def test_loss_inputs_are_the_generation_output_for_one_micro_batch(basic_run):
    loss_inputs = [call.inputs for call in basic_run.recorded.loss_calls]
    assert len(loss_inputs) == 2
    for inputs, output in zip(loss_inputs, basic_run.recorded.batches, strict=True):
        assert set(inputs) == set(output)
        assert inputs["num_items_in_batch"].item() == output["num_items_in_batch"].item()


def test_beta_adds_ref_logps_from_the_saved_model(ref_run):
    (output,) = ref_run.recorded.batches
    assert "ref_per_token_logps" in output
    assert output["ref_per_token_logps"].shape == output["completion_ids"].shape
    assert ref_run.ref_model is not None  # reloaded from config._name_or_path (the saved directory)
    assert any(
        call.arguments["model"] is ref_run.ref_model and _arity(call.result) == 3
        for call in ref_run.recorded.logps_calls
    )
    # Before the first update the policy and the reference are the same weights.
    mask = output["completion_mask"].bool()
    # two models holding the same weights, two forwards: the tiny model's chain at a log-prob's magnitude
    assert_close(
        output["ref_per_token_logps"][mask],
        output["old_per_token_logps"][mask],
        terms=TINY_MODEL_TERMS,
        scale=TINY_LOGP_SCALE,
    )


def test_loss_micro_batches_are_shuffled_slices_of_the_generation(ref_run):
    (output,) = ref_run.recorded.batches
    loss_inputs = [call.inputs for call in ref_run.recorded.loss_calls]
    assert len(loss_inputs) == 2  # GA=2 micro-batches of the 4 buffered ones were consumed
    assert set(loss_inputs[0]) == set(output)

    def row_keys(batch):
        return [
            (tuple(p.tolist()), tuple(c.tolist()), round(a.item(), 5))
            for p, c, a in zip(
                batch["prompt_ids"],
                batch["completion_ids"],
                batch["advantages"],
                strict=True,
            )
        ]

    generated = Counter(row_keys(output))
    seen = Counter()
    for inputs in loss_inputs:
        assert inputs["completion_ids"].shape[0] == 4  # per_device_train_batch_size
        assert inputs["old_per_token_logps"].shape == inputs["completion_ids"].shape
        # the count is for the whole generation batch, not for the micro-batch
        assert inputs["num_items_in_batch"].item() == output["completion_mask"].sum().item()
        seen.update(row_keys(inputs))
    assert not seen - generated  # every micro-batch row is a generation row, none twice


@pytest.mark.parametrize(
    ("gradient_accumulation_steps", "steps_per_generation", "num_iterations"),
    [(1, 1, 1), (2, 4, 1), (2, 2, 1), (1, 1, 2), (4, 2, 2)],
)
def test_old_logps_present_iff_ga_not_a_multiple_of_spg_times_iterations(
    request,
    tmp_path,
    tiny_model_dir,
    tiny_dataset,
    gradient_accumulation_steps,
    steps_per_generation,
    num_iterations,
):
    # notes/TRL_1_16.md §1.4 step 8 (no vLLM): otherwise `_compute_loss` uses `per_token_logps.detach()` as "old".
    expected = gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0
    key = (gradient_accumulation_steps, steps_per_generation, num_iterations)
    reuse = {
        (1, 1, 1): "basic_run",
        (2, 4, 1): "ref_run",
    }  # runs other tests already made
    if key in reuse:
        trainer = request.getfixturevalue(reuse[key])
    else:
        trainer = _run(
            tmp_path,
            tiny_model_dir,
            tiny_dataset,
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=steps_per_generation,
            num_iterations=num_iterations,
            max_steps=1,
        )
    for output in trainer.recorded.batches:
        assert ("old_per_token_logps" in output) is expected, key


# ---------------------------------------------------------------------------------------------------------------------
# Generation: what compiled decoding and the grouped prefill (trinity_trl/training/decoding.py) rely on


def test_trl_builds_its_generation_config_with_compilation_off(basic_run):
    """TRL 1.16 disables transformers' compiled decoding (``disable_compile=True``) and asks for no static cache: our
    trainers turn both on in this config after TRL built it (compile_generation)."""
    config = basic_run.generation_config
    assert config.disable_compile is True and config.cache_implementation is None


def test_trls_transformers_generation_calls_the_models_generate_with_its_config_alone(basic_run):
    """``_generate_single_turn`` (transformers path) calls ``generate`` of the unwrapped model with the padded ids,
    their mask and ``self.generation_config``, nothing else: what the grouped prefill's stand-in takes
    (trl_seams.intercepted)."""
    from trinity_trl.training.trl_seams import intercepted

    model = basic_run.accelerator.unwrap_model(basic_run.model_wrapped)
    seen = []

    def stand_in(*args, **kwargs):
        seen.append((args, kwargs))
        ids = kwargs["input_ids"]
        return torch.cat([ids, torch.full((ids.shape[0], 2), basic_run.eos_token_ids[0])], dim=1)

    with intercepted(model, "generate", stand_in):
        completions, _ = basic_run._generate_single_turn([[7, 8, 9], [10, 11]], None, {}, 1)
    assert "generate" not in vars(model)
    ((args, kwargs),) = seen
    assert args == () and set(kwargs) == {"input_ids", "attention_mask", "generation_config"}
    assert kwargs["generation_config"] is basic_run.generation_config
    assert kwargs["input_ids"].tolist() == [[7, 8, 9], [basic_run.processing_class.pad_token_id, 10, 11]]
    assert kwargs["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert completions == [[basic_run.eos_token_ids[0]]] * 2


def test_trls_checkpointing_toggles_add_an_input_hook_every_time(basic_run, tiny_model_dir):
    """TRL turns activation checkpointing off and on around each generation (``unwrap_model_for_generation``) and
    around its no-grad log-prob passes (``disable_gradient_checkpointing``); each time, transformers adds one more
    forward hook on a full fine-tuning model's input embeddings (which compiled decoding's guards then see). Our
    trainers undo it (trl_seams.input_hooks_kept, tests/training/test_trl_seams.py)."""
    from transformers import AutoModelForCausalLM
    from trl.models.utils import disable_gradient_checkpointing, unwrap_model_for_generation

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.gradient_checkpointing_enable()
    hooks = model.get_input_embeddings()._forward_hooks
    assert len(hooks) == 1 and len(model._require_grads_hooks) == 1
    with unwrap_model_for_generation(model, basic_run.accelerator):
        pass
    with disable_gradient_checkpointing(model):
        pass
    assert len(hooks) == 3 and len(model._require_grads_hooks) == 1  # the list keeps only the newest handle
