"""A small tool-using agent written with the ``openai`` package alone, on the bundled arithmetic task.

`calculator_agent` is an ``async def agent(client, row)`` for ``StepGRPOTrainer(agent=...)``: it asks the model
a word problem from `trinity_trl.data.arithmetic_dataset`, runs a calculator for it (the model writes
``calc(EXPRESSION)``; the agent replies with the value), and gives one second try after a wrong answer. Reward: 1 for
the right final answer at the first try, 0.5 at the second, else 0 (the exact check of
`trinity_trl.data.arithmetic_reward`).

The calculator is called through text, not the API's function calling: SmolLM2-135M-Instruct, the bundled model,
does not write function calls (and its chat template cannot render tool schemas). An agent for a model that does
passes ``tools=[...]`` to ``client.chat.completions.create`` and reads ``message.tool_calls`` (docs/environments.md).
"""

from __future__ import annotations

import re
from typing import Any

from ...data.arithmetic import INSTRUCTION, extract_answer
from .calculator import safe_eval

_CALL = re.compile(r"calc\(([^()]*)\)")

#: the instruction after each problem: the calculator, then the task's own instruction (a probe of the bundled model
#: on 16 multiplication problems: 3 right with the task's instruction alone, 1 with only a calculator instruction)
CALCULATOR_AGENT_INSTRUCTION = (
    f"You may write calc(EXPRESSION), for example calc(3*4), to use a calculator.\n{INSTRUCTION}"
)
#: model calls one run may make (calculator calls, the answer, one second try)
MAX_CALLS = 4


async def calculator_agent(client: Any, row: dict[str, Any]) -> tuple[float, dict]:
    """Play one arithmetic problem (``row``: ``problem`` and ``answer``, as in ``arithmetic_dataset``).

    Returns ``(reward, info)``; ``info`` counts the calculator calls and says which try was right."""
    messages = [{"role": "user", "content": f"{row['problem']}\n{CALCULATOR_AGENT_INSTRUCTION}"}]
    tries, calc_calls = 0, 0
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        call = _CALL.search(text)
        if call is not None and "answer is" not in text.lower():  # a calculator call: run it, reply with the value
            calc_calls += 1
            try:
                result = f"calc({call.group(1)}) = {safe_eval(call.group(1))}"
            except ValueError as err:
                result = f"calc error: {err}. Use whole numbers and + - *."
            messages.append({"role": "user", "content": result})
            continue
        tries += 1
        if extract_answer(text) == str(row["answer"]).strip():
            return (1.0 if tries == 1 else 0.5), {"calc_calls": calc_calls, "right_at_try": tries}
        if tries == 2:
            break
        messages.append({"role": "user", "content": "That is not right. Try again. End with 'The answer is <number>.'"})
    return 0.0, {"calc_calls": calc_calls, "right_at_try": None}
