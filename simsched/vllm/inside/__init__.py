"""Code that runs INSIDE a release worker process (``python -m simsched.vllm.inside.main``).

Only the modules of this package import ``vllm``, and only inside the worker: the parent process
never imports them. Everything here detects a release's behaviour by what exists (fields,
functions, signatures), never by comparing version strings.
"""
