"""What the tests share (test modules import from here, never from each other's private names):

- ``servers``: real servers on loopback ports (``InProcessServer``, ``ServerProcess``);
- ``packaged``: the packaged real models (``smollm2_gguf``, ``smollm2_gguf_path``), skipping when absent;
- ``prompts``: ``prompt_ids(n, seed)``, the same ids for the same seed everywhere;
- ``waits``: conditions with a deadline instead of fixed sleeps (``wait_until``, ``wait_for``,
  ``wait_no_live_caches``, ``wait_no_listed_caches``) and ``subscribe_from_now`` (a KV-event
  subscription that misses nothing, so no sleep until it is live);
- ``llama``: the llama.cpp executor's books, ``assert_no_leak``, the logits tolerance ``TOL``.
"""
