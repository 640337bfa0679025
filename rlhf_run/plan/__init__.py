"""``rlhf-plan``: stage costs (``profile``), the pipeline as a discrete-event simulation
(``simulate``) and the search over the run's knobs (``search``); :mod:`rlhf_run.plan.cli`."""
