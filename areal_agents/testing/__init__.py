"""Test doubles that tests and benchmarks share: a scripted engine (``fake_engine``) and an
SGLang server that speaks SGLang's HTTP API over a real embedded engine (``fake_sglang``)."""
