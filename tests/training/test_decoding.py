"""`trinity_trl/training/decoding.py`: when compiled decoding and the grouped prefill run, and that they decode what
transformers' plain ``generate`` decodes (the tiny model; compiled with torch's ``eager`` backend, which compiles in
about 2 s a graph on this machine, inductor once for the numbers). The trainers' use (compilations across steps,
optimizer updates) is tests/trainers/test_generation_speed.py."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import TINY_MODEL_TERMS, build_tiny_model, build_tiny_tokenizer
from tolerance import assert_close
from transformers import CompileConfig, GenerationConfig

from trinity_trl.training.decoding import (
    CacheLength,
    DecodingChoice,
    GroupedDecoding,
    batch_bucket,
    choose_decoding,
    compile_config_for,
    compile_refusal,
    length_bucket,
    prompt_groups,
)

EAGER = {"backend": "eager", "mode": "default"}  # torch's eager backend: the graphs without code generation


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model64(tokenizer):
    return build_tiny_model(tokenizer).double().eval()


def batch(tokenizer, lengths: list[int], copies: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows: ``copies[i]`` consecutive copies of a random prompt of ``lengths[i]`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, len(tokenizer) - 1, (n,), generator=generator) for n in lengths]
    width = max(lengths)
    pad = tokenizer.pad_token_id
    rows = [(p, c) for p, c in zip(prompts, copies)]
    ids = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p, c in rows for _ in range(c)])
    mask = torch.stack(
        [
            torch.cat([torch.zeros(width - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
            for p, c in rows
            for _ in range(c)
        ]
    )
    return ids, mask


def greedy(tokenizer, new: int = 8, **settings) -> GenerationConfig:
    """Greedy unless ``settings`` say otherwise, returning every step's logits; an end-of-sequence id the model never
    draws: every row decodes all ``new`` tokens."""
    settings = {"do_sample": False, "output_logits": True, "return_dict_in_generate": True, **settings}
    return GenerationConfig(
        max_new_tokens=new, pad_token_id=tokenizer.pad_token_id, eos_token_id=[len(tokenizer) + 7], **settings
    )


def compiled(tokenizer, new: int = 8, **settings) -> GenerationConfig:
    return greedy(tokenizer, new, disable_compile=False, compile_config=compile_config_for("cpu", settings or EAGER))


def decode(decoding: GroupedDecoding, model, ids, mask, config, **kwargs):
    with decoding.around(model):
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **kwargs)


def assert_same_decoding(got, expected, rows: int | None = None) -> None:
    """The same tokens, and every step's logits close (``generate`` returns them in float32): a wrong position or
    cache entry moves logits long before it changes the tiny model's greedy tokens."""
    rows = rows or expected.sequences.shape[0]
    assert torch.equal(got.sequences, expected.sequences[:rows])
    assert_close(torch.stack(got.logits, 1), torch.stack(expected.logits, 1)[:rows], terms=TINY_MODEL_TERMS)


# ------------------------------------------------------------------------------------------------------ choices
@pytest.mark.parametrize(
    "setting, device, refusal, expected",
    [
        ("auto", "cuda", None, True),
        ("auto", "cpu", None, False),  # does not pay on a CPU (docs/generation.md#measured)
        ("auto", "cuda", "under FSDP (...)", False),  # quietly off where it cannot run
        ("on", "cpu", None, True),
        ("off", "cuda", None, False),
    ],
)
def test_compiled_decoding_is_on_on_cuda_by_default_and_where_asked(setting, device, refusal, expected, caplog):
    with caplog.at_level(logging.INFO, logger="trinity_trl"):
        choice = choose_decoding(setting, True, device=device, backend="transformers", refusal=refusal)
    assert choice == DecodingChoice(compiled=expected, grouped=True)
    assert not caplog.records


@pytest.mark.parametrize(
    "facts, reason",
    [
        ({"engine": "fsdp"}, "under FSDP"),
        ({"engine": "deepspeed", "zero3": True}, "under DeepSpeed ZeRO-3"),
        ({"engine": "single", "quantized": True}, "with a quantized model"),
        ({"engine": "ddp", "offloaded": True}, "offloaded to the CPU or disk"),
        ({"engine": "single", "cache": "offloaded"}, "cache_implementation='offloaded'"),
    ],
)
def test_on_is_refused_in_one_line_where_compiled_decoding_cannot_run(facts, reason):
    refusal = compile_refusal(**facts)
    assert reason in refusal
    with pytest.raises(ValueError, match="compile_generation='on' cannot run") as error:
        choose_decoding("on", True, device="cuda", backend="transformers", refusal=refusal)
    assert reason in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("engine", ["single", "ddp", "deepspeed"])  # DeepSpeed below ZeRO-3 keeps whole weights
def test_one_process_ddp_and_whole_weights_can_compile(engine):
    assert compile_refusal(engine=engine) is None


def test_with_vllm_an_explicit_setting_is_ignored_with_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        assert choose_decoding("auto", True, device="cuda", backend="vLLM", refusal=None) == DecodingChoice(
            False, False
        )
        assert not caplog.records  # the defaults: nothing to say
        choose_decoding("on", False, device="cuda", backend="vLLM", refusal=None)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "compile_generation='on' is ignored",
        "one_prefill_per_group=False is ignored",
    ]


def test_a_cache_of_the_users_turns_the_eager_grouped_prefill_off_with_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        choice = choose_decoding("off", True, device="cpu", backend="transformers", refusal=None, cache="offloaded")
    assert choice == DecodingChoice(compiled=False, grouped=False)
    assert len(caplog.records) == 1 and "cache_implementation='offloaded'" in caplog.records[0].getMessage()


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="compile_generation must be one of"):
        choose_decoding("yes", True, device="cpu", backend="transformers", refusal=None)


def test_on_a_cpu_the_compile_config_carries_transformers_flag_for_every_device():
    config = compile_config_for("cpu", {"backend": "eager"})
    assert config.backend == "eager" and config._compile_all_devices
    assert not getattr(compile_config_for("cuda"), "_compile_all_devices", None)
    given = CompileConfig(backend="aot_eager")
    assert compile_config_for("cpu", given).backend == "aot_eager" and given._compile_all_devices is None  # a copy


# ------------------------------------------------------------------------------------------------------ shapes
def test_lengths_round_up_to_a_few_buckets():
    assert [length_bucket(n) for n in (1, 64, 65, 100, 129, 300, 1024, 1025, 2000)] == [
        64,
        64,
        80,
        112,
        160,
        320,
        1024,
        1280,
        2048,
    ]
    assert all(length_bucket(n) >= n and length_bucket(n) <= 1.25 * n + 64 for n in range(1, 5000, 37))


def test_shrinking_batches_share_the_halves_of_the_largest():
    assert [batch_bucket(rows, 16) for rows in (16, 15, 9, 8, 5, 4, 3, 1)] == [16, 16, 16, 8, 8, 4, 4, 1]
    assert batch_bucket(12, 12) == 12 and batch_bucket(5, 12) == 6 and batch_bucket(7, 12) == 12
    assert batch_bucket(20, 16) == 20  # a larger batch is its own bucket


def test_the_cache_length_is_fixed_once_and_grows_with_one_line(caplog):
    length = CacheLength(longest_prompt=40, max_new_tokens=24)
    assert length.tokens == 64 and length.fit(12) == 64 and length.fit(40) == 64
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        assert length.fit(41) == 80
        assert length.fit(50) == 80
    assert len(caplog.records) == 1 and "growing it to 80" in caplog.records[0].getMessage()


def test_groups_are_runs_of_consecutive_identical_rows(tokenizer):
    ids, mask = batch(tokenizer, [5, 3, 5], [3, 2, 1])
    ids = torch.cat([ids, ids[:1]])  # the first prompt again, not next to its group: a group of its own
    mask = torch.cat([mask, mask[:1]])
    first, owner = prompt_groups(ids, mask)
    assert first.tolist() == [0, 3, 5, 6] and owner.tolist() == [0, 0, 0, 1, 1, 2, 3]


# ----------------------------------------------------------------------------------------- the grouped prefill
def test_one_prefill_per_group_decodes_the_greedy_tokens_of_separate_prefills(tokenizer, model64):
    """Prompts of different lengths (left padding), groups of 4, 3 (a group split across processes) and 1, in float64:
    the same tokens as transformers' ``generate`` prefilling every row."""
    ids, mask = batch(tokenizer, [7, 11, 4], [4, 3, 1])
    config = greedy(tokenizer)
    expected = model64.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    forwards = []
    handle = model64.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        got = decode(GroupedDecoding(DecodingChoice(compiled=False, grouped=True)), model64, ids, mask, config)
    finally:
        handle.remove()
    assert_same_decoding(got, expected)
    assert forwards[0] == (3, 10)  # the 3 distinct prompts, without their last token
    assert forwards[1] == (8, 1)  # then every row: its prompt's last token


def test_each_row_draws_its_own_first_token_from_its_own_logits(tokenizer):
    """The rows of a group start from one cache, and each draws its first token itself: their first-step logits are
    those of separate prefills (float32 tolerance), and sampled first tokens differ within a group (a prefill that
    sampled once and copied the token to the group would give them all one)."""
    model = build_tiny_model(tokenizer).eval()
    ids, mask = batch(tokenizer, [9, 6], [8, 8], seed=1)
    config = greedy(tokenizer, 1, output_logits=True, return_dict_in_generate=True)
    plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    grouped = GroupedDecoding(DecodingChoice(compiled=False, grouped=True))
    shared = decode(grouped, model, ids, mask, config)
    assert_close(shared.logits[0], plain.logits[0], terms=TINY_MODEL_TERMS)
    torch.manual_seed(0)
    sampling = greedy(tokenizer, 1, do_sample=True, temperature=5.0, return_dict_in_generate=True)
    first = decode(grouped, model, ids, mask, sampling).sequences[:, -1].view(2, 8)
    assert all(len(set(group.tolist())) > 1 for group in first)


# ---------------------------------------------------------------------------------------------- compiled decoding
def test_compiled_decoding_decodes_the_greedy_tokens_of_eager_decoding(tokenizer, model64):
    """Float64, torch's eager backend: the static cache (grouped or not), the shrinking batch padded to a bucket
    (filler rows dropped) and a longer prompt that grows the cache all decode what plain ``generate`` decodes; a call
    of a shape decoded before compiles nothing."""
    ids, mask = batch(tokenizer, [7, 11, 4], [4, 3, 1])
    config = compiled(tokenizer)
    for grouped in (True, False):
        decoding = GroupedDecoding(DecodingChoice(compiled=True, grouped=grouped), CacheLength(11, 8))
        expected = model64.generate(input_ids=ids, attention_mask=mask, generation_config=greedy(tokenizer))
        assert_same_decoding(decode(decoding, model64, ids, mask, config), expected)
        before = decoding.compilations
        assert_same_decoding(decode(decoding, model64, ids, mask, config), expected)  # the same shape again
        assert decoding.compilations == before and decoding.recompilations == 0
        assert_same_decoding(decode(decoding, model64, ids[:3], mask[:3], config), expected, rows=3)  # 3 rows in 4
        assert set(decoding._static) == {(8, 64), (4, 64)}
    long_ids, long_mask = batch(tokenizer, [70, 5], [2, 2], seed=3)
    expected = model64.generate(input_ids=long_ids, attention_mask=long_mask, generation_config=greedy(tokenizer))
    assert_same_decoding(decode(decoding, model64, long_ids, long_mask, config), expected)
    assert set(decoding._static) == {(4, 80)}  # the grown length replaced the shorter caches


@pytest.mark.slow
def test_inductor_compiled_decoding_decodes_the_greedy_tokens_of_eager_decoding(tokenizer, model64):
    """The one numeric check with inductor (generated C++ code, about 20 s to compile here): float64 greedy tokens
    identical to eager decoding and logits as close, with the grouped prefill."""
    ids, mask = batch(tokenizer, [7, 11], [4, 4], seed=2)
    decoding = GroupedDecoding(DecodingChoice(compiled=True, grouped=True), CacheLength(11, 6))
    expected = model64.generate(input_ids=ids, attention_mask=mask, generation_config=greedy(tokenizer, 6))
    got = decode(decoding, model64, ids, mask, compiled(tokenizer, 6, backend="inductor", mode="default"))
    assert_same_decoding(got, expected)
    assert decoding.compilations >= 1


# --------------------------------------------------------------------------------------------------------- on CUDA
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (run by `make test-gpu` on a GPU machine)"
)


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_auto_compiles_with_cuda_graphs_that_replay(tokenizer):
    """transformers' default ``CompileConfig`` on CUDA (inductor, ``reduce-overhead``): float32 tokens and logits of
    eager decoding; CUDA graphs are recorded on the first calls of a shape and replayed after (no recording, no
    compilation at a later call of that shape)."""
    model = build_tiny_model(tokenizer).cuda().eval()
    ids, mask = batch(tokenizer, [7, 11, 4], [4, 3, 1])
    ids, mask = ids.cuda(), mask.cuda()
    choice = choose_decoding("auto", True, device="cuda", backend="transformers", refusal=compile_refusal(engine="ddp"))
    assert choice == DecodingChoice(compiled=True, grouped=True)
    decoding = GroupedDecoding(choice, CacheLength(11, 8))
    config = greedy(tokenizer, disable_compile=False, compile_config=compile_config_for("cuda"))
    expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=greedy(tokenizer))
    for _ in range(3):  # inductor's CUDA graph trees warm up, then record
        assert_same_decoding(decode(decoding, model, ids, mask, config), expected)
    compiled, recorded = decoding.compilations, decoding.recordings
    assert compiled >= 1 and recorded >= 1
    for _ in range(2):
        assert_same_decoding(decode(decoding, model, ids, mask, config), expected)
    assert (decoding.compilations, decoding.recordings, decoding.recompilations) == (compiled, recorded, 0)


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_the_workers_thread_decodes_compiled_on_its_own_stream(tokenizer):
    """The asynchronous trainers' worker: a thread, its own CUDA stream, compiled decoding by default on CUDA; the
    recorded log-probs are those of a plain forward of the weights it loaded, at each of several weight loads."""
    import time

    from async_helpers import recomputed_logps, send
    from helpers import tiny_conversational_dataset

    from trinity_trl.algorithms import ADVANTAGE_FN, KL_FN, POLICY_LOSS_FN
    from trinity_trl.asynchronous.worker import GroupScorer, TransformersRolloutWorker
    from trinity_trl.training.advantages import AdvantageEstimator

    estimator = AdvantageEstimator(
        ADVANTAGE_FN.get("grpo")(),
        POLICY_LOSS_FN.get("ppo")(clip_range=0.2),
        KL_FN.get("none")(),
        gather=lambda x: x,
        pad_across_processes=lambda x, **k: x,
    )
    scorer = GroupScorer([lambda completions, **k: [1.0] * len(completions)], ["one"], torch.ones(1), estimator)
    worker = TransformersRolloutWorker(
        build_tiny_model(tokenizer).cuda(),
        tokenizer,
        tiny_conversational_dataset(8),
        scorer,
        num_generations=4,
        max_completion_length=6,
        temperature=0.7,
        eos_token_ids=[tokenizer.eos_token_id],
        groups_per_generate=2,
    )
    assert worker.decoding.choice.compiled
    for version, seed in ((1, 5), (2, 11)):
        model = build_tiny_model(tokenizer, seed=seed)  # on the CPU: the reference forward
        send(worker, model.cuda(), version=version)
        model.cpu()
        worker.start()  # loads the committed weights, then generates 2 groups a call on its own stream
        samples, deadline = [], time.monotonic() + 300
        while len(samples) < 8 and time.monotonic() < deadline:
            sample = worker.rollout_buffer.get(timeout=300)
            if sample.model_version == version:
                samples.append(sample)
        worker.stop()
        worker._stop.clear()  # ready to start again
        assert len(samples) == 8
        for sample in samples:
            assert_close(
                torch.tensor(sample.old_log_probs[sample.completion_mask == 1]),
                recomputed_logps(model, sample),
                terms=TINY_MODEL_TERMS,
            )
