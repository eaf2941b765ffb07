#!/usr/bin/env python
"""Generation alone: one prefill per group and compiled decoding (issue 51, `trinity_trl.training.decoding`) against
transformers' plain ``generate`` as TRL calls it, on the bundled model (docs/generation.md#measured).

    python benchmarks/generation_speed.py               # CPU: prompt 256, completion 64, G 8, one torch thread
    python benchmarks/generation_speed.py --dry-run     # the tiny model, one repeat, one timed call

**Sides** (each repeat a fresh process per side, the order alternating; `harness`), all on the same weights in the
same dtype (float32) and one torch thread:

* ``plain``: ``model.generate`` on the G copies of the prompt, every row prefilled (TRL's transformers generation;
  our ``one_prefill_per_group=False, compile_generation="off"``);
* ``grouped``: one prefill per group (``one_prefill_per_group=True``, the default), eager decoding;
* ``compiled``: one prefill per group and compiled decoding (``compile_generation="on"``: transformers' static cache
  and its ``CompileConfig`` default, inductor, compiled on a CPU through transformers' own flag).

**The job**: one prompt of exactly ``P`` random token ids (seed 0), its ``G`` copies in consecutive rows (TRL's
default batch: one prompt, 8 completions), sampled at temperature 1 with no end-of-sequence token, so every row
decodes ``C`` tokens. Per process: a first call (``first_s``: the compilation for ``compiled``), then ``calls`` timed
calls (``generate_s``: their median). The grouped and compiled sides compare with ``plain`` (paired per repeat).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import harness

SIDES = ("plain", "grouped", "compiled")
#: model, prompt, completion, group
CPU_POINT = ("bundled", 256, 64, 8)
DRY_POINT = ("tiny", 24, 8, 4)


def run_side(spec: dict) -> dict:
    """In a fresh process: ``spec["calls"]`` timed generations of the side ``spec["side"]`` (see the module docs)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from trinity_trl.training.decoding import CacheLength, DecodingChoice, GroupedDecoding, compile_config_for

    torch.manual_seed(0)
    path = model_path(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt, completion, group, side = spec["prompt"], spec["completion"], spec["group"], spec["side"]
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab - 1, (1, prompt), generator=torch.Generator().manual_seed(0)).repeat(group, 1)
    mask = torch.ones_like(ids)
    settings = {"max_new_tokens": completion, "do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    config = GenerationConfig(**settings, pad_token_id=0, eos_token_id=[vocab + 1])  # no row ends early
    decoding = None
    if side != "plain":
        choice = DecodingChoice(compiled=side == "compiled", grouped=True)
        decoding = GroupedDecoding(choice, CacheLength(prompt, completion) if choice.compiled else None)
    if side == "compiled":
        config.disable_compile = False
        config.compile_config = compile_config_for("cpu")

    def generate() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            inputs = {"input_ids": ids, "attention_mask": mask, "generation_config": config}
            out = model.generate(**inputs) if decoding is None else decoding.generate(model, model.generate, **inputs)
        assert out.shape == (group, prompt + completion), out.shape
        return time.perf_counter() - start

    first = generate()
    timed = [generate() for _ in range(spec["calls"])]
    return {
        "generate_s": statistics.median(timed),
        "first_s": first,
        "timed_s": timed,
        "compilations": decoding.compilations if decoding is not None else 0,
        "dtype": str(model.dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def model_path(name: str) -> str:
    if name == "bundled":
        from trinity_trl.data import bundled_model_dir

        return str(bundled_model_dir())
    import bench_common as bc

    return bc.save_random_qwen2(tempfile.mkdtemp(prefix="generation-speed-"), hidden=64, layers=2, heads=4, kv_heads=2)


def render(report: dict) -> str:
    lines = ["## Reading", ""]
    for name, part in report["parts"].items():
        ratios = (part.get("summary") or {}).get("ratios", {})
        for side in ("grouped", "compiled"):
            stat = ratios.get(side, {}).get("generate_s")
            if stat:
                lines.append(
                    f"- {name}: `{side}` generation took {stat['median']:.2f}x `plain`'s "
                    f"(paired per repeat, {stat['min']:.2f}-{stat['max']:.2f})."
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_arguments(parser, repeats=3)
    parser.add_argument("--calls", type=int, default=3, help="timed generate calls per process (default 3)")
    args = parser.parse_args(argv)
    model, prompt, completion, group = DRY_POINT if args.dry_run else CPU_POINT
    repeats, calls = (1, 1) if args.dry_run else (args.repeats, args.calls)
    job = {"model": model, "prompt": prompt, "completion": completion, "group": group, "calls": calls}
    bench = harness.Bench(
        "generation_speed",
        harness.out_dir(args),
        config=job,
        title="Generation alone: one prefill per group and compiled decoding against plain generate",
        render=render,
        budget_s=args.budget,
    )
    point = f"{model} P{prompt} C{completion} G{group}"
    part = bench.part(point, description=f"{model}, prompt {prompt}, completion {completion}, {group} copies, float32")
    sides = [harness.Side(side, "generation_speed:run_side", {"side": side, **job}) for side in SIDES]
    part.run(sides, repeats, reference="plain", ratios=("generate_s",))
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
