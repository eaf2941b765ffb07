"""The one place that decides (`trinity_trl/packing/selection.py`): kernel requests, `auto` per device and dtype,
the calibration that keeps packing on CUDA only where it timed faster, and the fallbacks with their one log line."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from helpers import length_reward, tiny_grpo_kwargs
from packing_helpers import grouped_rows, padded_batch

from trinity_trl.packing import KERNELS, Calibration, PrefixPacking, check_kernel_request, choose
from trinity_trl.packing import selection as selection_module
from trinity_trl.packing.selection import Stopwatch, shape_class

CUDA = torch.device("cuda")


def test_a_kernel_that_cannot_run_here_is_an_error_when_the_trainer_is_built(tmp_path, tiny_model_dir):
    for kernel, message in (("varlen", "varlen"), ("flex", "FlexAttention"), ("bogus", "must be one of")):
        with pytest.raises(ValueError, match=message):
            check_kernel_request(kernel, "cpu")
    check_kernel_request("sdpa_segments", "cpu")
    check_kernel_request("auto", "cpu")
    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    with pytest.raises(ValueError, match="prefix_packing_kernel"):
        TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing_kernel="fast"))
    with pytest.raises(ValueError, match="no effect with prefix_packing=False"):
        TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing=False, prefix_packing_kernel="flex"))
    args = TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), prefix_packing_kernel="varlen"))
    with pytest.raises(ValueError, match="prefix_packing_kernel='varlen' cannot run here"):
        TrinityTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=_dataset())


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["What is 1+1?", "What is 2+2?"] * 4})


def test_auto_keeps_sdpa_segments_on_cpu_and_never_picks_it_on_cuda(monkeypatch):
    assert choose("auto", torch.device("cpu"), torch.float32).kernel.name == "sdpa_segments"
    assert choose("auto", torch.device("cpu"), torch.float32).calibrate is False
    available = {"flash_attn": False, "varlen": True, "flex": True}
    for name in available:
        monkeypatch.setattr(
            KERNELS[name], "unavailable", lambda device, name=name: None if available[name] else "missing"
        )
    bf16 = choose("auto", CUDA, torch.bfloat16)
    assert bf16.kernel.name == "varlen" and bf16.calibrate  # fused, and measured before it is kept
    assert choose("auto", CUDA, torch.float32).kernel.name == "flex"  # varlen has no fp32 kernel
    available["flash_attn"] = True
    assert choose("auto", CUDA, torch.float16).kernel.name == "flash_attn"
    available.update(flash_attn=False, varlen=False, flex=False)
    nothing = choose("auto", CUDA, torch.bfloat16)
    assert nothing.kernel is None and "padded rows" in nothing.reason  # TRL's forward, not sdpa_segments
    assert choose("auto", torch.device("mps"), torch.float32).kernel is None
    # a forced kernel: runs without calibration where it can, padded (with the reason) where this dtype cannot
    available["varlen"] = True
    assert choose("varlen", CUDA, torch.bfloat16).kernel.name == "varlen"
    assert not choose("varlen", CUDA, torch.bfloat16).calibrate
    fp32 = choose("varlen", CUDA, torch.float32)
    assert fp32.kernel is None and "float32" in fp32.reason
    assert choose("sdpa_segments", CUDA, torch.bfloat16).kernel.name == "sdpa_segments"  # forced: honoured


class FakeWatch:
    def __init__(self, seconds):
        self._seconds, self._end = seconds, seconds

    def seconds(self):
        return self._seconds


@pytest.mark.parametrize("packed_s, padded_s, kept", [(0.5, 1.0, True), (1.2, 1.0, False)])
def test_calibration_keeps_the_faster_layout_and_logs_once(caplog, packed_s, padded_s, kept):
    calibration = Calibration(trials=2)
    key = ("model", True, 8, 1024)
    layouts = []
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        for _ in range(10):
            packed, timed = calibration.next_layout(key)
            layouts.append((packed, timed))
            if timed:
                calibration.record(key, packed, FakeWatch(packed_s if packed else padded_s))
    assert [p for p, t in layouts if t].count(True) == 3 and [p for p, t in layouts if t].count(False) == 3
    assert all(p == kept and not t for p, t in layouts[6:])  # decided: no more trials
    lines = [r.getMessage() for r in caplog.records if "prefix packing," in r.getMessage()]
    assert len(lines) == 1 and ("packed kept" if kept else "padded kept") in lines[0], lines
    # the first (warm-up) run of each layout is not counted: a slow first packed call (compilation) does not decide
    slow_first = Calibration(trials=1)
    for seconds in (30.0, 1.0, 0.4, 1.0):
        packed, _ = slow_first.next_layout(key)
        slow_first.record(key, packed, FakeWatch(seconds if packed else 1.0))
    assert slow_first.next_layout(key) == (True, False)


def test_calibration_waits_for_marks_not_yet_reached():
    calibration = Calibration(trials=1)
    key = ("m", False, 2, 64)
    pending = FakeWatch(None)
    pending._end = object()  # the end mark is set, the GPU has not reached it
    for watch in (FakeWatch(1.0), FakeWatch(1.0), FakeWatch(0.5), pending):
        packed, _ = calibration.next_layout(key)
        calibration.record(key, packed, watch)
    assert calibration.next_layout(key) == (False, False) and calibration.verdict(key) is None
    pending._seconds = 0.9
    assert calibration.next_layout(key) == (True, False) and calibration.verdict(key) is True


def test_calibration_times_the_real_forward_and_backward_on_the_model(monkeypatch, caplog):
    """On CPU (wall-clock marks), with `auto` made to calibrate: the first micro-batches of a shape class alternate
    packed and padded, each timed from the forward to the end of its backward (the mark placed on the input
    embeddings), then the verdict holds for the class, logged once."""
    from helpers import build_tiny_model, build_tiny_tokenizer
    from trl.trainer.utils import add_fused_lm_head

    model = build_tiny_model(build_tiny_tokenizer())
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",))
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext)
    monkeypatch.setattr(
        packing, "choice", lambda model, device: selection_module.Choice(KERNELS["sdpa_segments"], calibrate=True)
    )
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(0)))
    labels = ids.masked_fill(mask == 0, -100)
    ran = []
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        for _ in range(8):
            out = packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {})
            if out is None:  # the padded forward, as TRL's helper runs it
                logps = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
            else:
                logps = out.logps
            logps.sum().backward()
            ran.append(out is not None)
    key = shape_class(model, True, ids.shape[0], ids.shape[1])
    trials = packing.calibration.classes[key]
    assert len(trials.packed) == len(trials.padded) == 3
    assert all(w.seconds() is not None and w.seconds() > 0 for w in trials.packed + trials.padded)
    assert trials.verdict is not None and ran[6:] == [trials.verdict] * 2
    assert len([r for r in caplog.records if "prefix packing," in r.getMessage()]) == 1
    assert not model._forward_hooks and not model._forward_pre_hooks  # the timing hooks removed themselves


def test_stopwatch_on_cpu_reads_wall_time():
    watch = Stopwatch(torch.device("cpu"))
    assert watch.seconds() is None
    watch.start()
    watch.stop()
    assert watch.seconds() >= 0.0


def test_a_forward_the_chosen_kernel_cannot_run_falls_back_with_one_log_line(caplog):
    """A forced kernel checked per forward (no training device given): each such forward runs padded, logged once."""
    from helpers import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(build_tiny_tokenizer())
    packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, "varlen")
    ids, mask, keep = padded_batch(grouped_rows(torch.Generator().manual_seed(0)))
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        for _ in range(3):
            assert packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {}) is None
    lines = [r.getMessage() for r in caplog.records if "prefix packing off" in r.getMessage()]
    assert len(lines) == 1 and "varlen" in lines[0] and "CUDA" in lines[0], lines
