"""The vLLM side: installing releases and talking to one worker process per release.

Nothing in this package imports ``vllm`` except the modules under ``simsched/vllm/inside/``,
which run only inside a release worker process."""
