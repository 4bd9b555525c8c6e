"""A verifiers taskset as a verifiers user writes one (`verifiers.v1`): sums to
work out with a calculator toolset over several turns, two weighted rewards. The tests import it
by module name, as `vf eval calc_taskset` would."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    a: int = 0
    b: int = 0
    broken: str = ""


class Calculator(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        if task.broken == "nan":
            return float("nan")
        if task.broken == "text":
            return "1.0"
        return float(str(task.a + task.b) in trace.last_reply)

    @vf.reward(weight=0.1)
    async def used_tool(self, task, trace) -> float:
        return float(bool(trace.tool_messages))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for i in range(8):
            data = SumData(
                name=f"sum{i}", prompt=f"What is {10 + i} + 7? Use the tool.", a=10 + i, b=7
            )
            yield SumTask(data, self.config.task)


__all__ = ["SumTaskset"]
