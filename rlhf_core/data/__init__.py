"""Small data sets the package ships, generated here (nothing downloaded).

* ``arithmetic.jsonl``: 200 arithmetic word problems in GSM8K's shape (``question``, and an
  ``answer`` that works the problem and ends ``#### <number>``), written by
  ``python -m rlhf_core.data.make_arithmetic``; for the tests and the docs of ``reward=math``::

      rlhf-run reward=math data=jsonl rollout.max_prompt_tokens=128 \\
          data.path=$(python -c "from rlhf_core.data import ARITHMETIC; print(ARITHMETIC)")
"""

from pathlib import Path

ARITHMETIC = Path(__file__).resolve().parent / "arithmetic.jsonl"
