"""A verifiers 0.4 taskset built locally for tests/rollouts/test_verifiers_v1.py: two arithmetic tasks, each scored by a
``@vf.reward`` on the final reply. verifiers loads a taskset by module name (its ``__all__`` names the class)."""

import verifiers.v1 as vf


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        """1 when the final reply states the answer."""
        return float(task.answer in trace.last_reply)


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for i in range(2):
            yield CalcTask(CalcData(prompt=f"task {i}: what is {i}*3-1?", answer=str(i * 3 - 1)))


__all__ = ["CalcTaskset"]
