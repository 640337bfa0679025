"""Built-in environments for multi-turn episodes (``rollout.env._target_=rollout_workers.envs...``).

* :class:`rollout_workers.envs.calculator.Calculator`: a calculator tool for real chat models
  (tool calls in the tokenizer's chat-template format, arithmetic evaluated safely).
* :class:`rollout_workers.envs.python_tool.PythonTool`: a "run my code" tool, each program run in
  the sandbox (:mod:`rollout_workers.sandbox`), rewarded by the row's tests.
* :class:`rollout_workers.envs.count_up.CountUpHints`: the built-in ``count_up`` task in turns,
  small enough for the tiny model on a CPU, where the environment's answers make a higher reward
  reachable (``conf/experiment/multi_turn.yaml``).

The protocol they follow is :mod:`rollout_workers.environment`.
"""
