"""The `minivllm bench` commands, one module each (`add_arguments(parser)`, `main(args) -> int`):
throughput.py, serve.py, memory.py, prefix.py, sharing.py. What they share: workload.py (the one
workload generator: random-token prompts, length profiles, Poisson arrivals), report.py (the one
table printer and the rows the docs' hook reads too), machine.py (the matmul peak and the one
copy-bandwidth probe) and common.py (the engine under test). `bench throughput`'s parts: floor.py
(the matmul floor), op_profile.py (`--profile`), hf_peers.py and isolated.py (the peers, each in a
process of its own). Microbenchmarks and investigations live outside the package, in the
top-level `benchmarks/` folder of a checkout.
"""
