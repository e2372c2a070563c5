"""``make gpu-check``: the one-call device check of the CUDA path (``python -m tandem.gpucheck``).

Runs on a GPU machine as it is: torch, triton, transformers and our source tree
on ``PYTHONPATH``; no Ray, no FastAPI, no network, nothing installed. It checks
the engine on CUDA against transformers (fp32 token-exact; bf16 greedy
agreement and logprob closeness), the Triton attention kernel against a
reference, the memory-sized KV cache, CUDA graphs on against off, the KV
transfer between two processes (CUDA IPC on one GPU, NCCL on two), a
stream-ordering probe, and the speed figures against floors measured in the
same run (decode step vs the HBM floor of a device-to-device copy, prefill vs
the bf16 peak of a large matmul). It prints one table and exits non-zero on a
failure or a missed target; without CUDA it fails at once. ``--dry-run`` runs
the same sections on the CPU with tiny sizes (Triton under its interpreter),
which CI does to keep the check's own plumbing working.
"""
