"""Tools for the reliability tests and `benchmarks/resilience.py`; training never imports them.

* `chaos_proxy`: a fault-injecting TCP proxy between the HTTP retriever client and a server.
* `bigram`: a real `Decoder` wired so that greedy decoding emits a token script we choose
  (hostile model output without a trained model).
* `hostile`: the hostile-output cases and the check that runs them through the rollout.
* `bad_inputs`: the table of bad config edits and malformed data files, each with the words
  its error must contain.
* `preemption`: run the real launcher in a subprocess, SIGKILL it at a chosen moment, re-run.
"""
