"""Inference engines behind one protocol (:mod:`areal_agents.engines.protocol`).

- ``protocol``: ``Engine``, ``SamplingParams``, ``GenerateResult``, ``WeightUpdate``.
- ``embedded``: transformers + torch in this process, continuous batching on CPU or GPU;
  its worker thread (``batching``), KV caches (``kv_cache``), decode-step attention hooks
  (``attention``) and sampling (``sampling``).
- ``remote``, ``vllm``, ``sglang``: servers driven over HTTP, token ids in and out.
- ``router``: several replicas as one engine, a session's calls on one replica.
- ``launch``: starting a server from its own virtual environment, free ports.
- ``weights``, ``weight_files``, ``weight_transfer``: weight updates in memory, on disk and
  over a process group.

Nothing here imports the proxy, the rollout or the trainer.
"""
