"""Built-in environments for multi-turn episodes (``rollout.env._target_=rollout_workers.envs...``):
:class:`~rollout_workers.envs.calculator.Calculator` (a calculator tool for real chat models),
:class:`~rollout_workers.envs.python_tool.PythonTool` (a "run my code" tool, each program run in the
sandbox, rewarded by the row's tests) and :class:`~rollout_workers.envs.count_up.CountUpHints` (the
built-in task in turns, for the tiny model). The protocol they follow is :mod:`rollout_workers.environment`."""
