"""The app for a run: it wires the components together and shows what they do.

``launch`` is ``rlhf-run`` (private redis-server, embedded weight server, learner and workers as
child processes, supervision, the multirun comparison table), ``progress`` the live line,
``summary`` and ``plots`` what a run leaves behind, ``monitor`` is ``rlhf-monitor`` (a live view read from Redis).

It may import every component; no component imports it, so the learner, the workers, the buffer
and the weight server run the same under another launcher (torchrun, a cluster scheduler).
"""
