"""simsched: a simulator and fuzzer for vLLM's native KV offloading scheduler."""
