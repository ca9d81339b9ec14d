"""The `minivllm bench` commands, one module each (`add_arguments(parser)`, `main(args) -> int`):
throughput.py, serve.py, memory.py, prefix.py, sharing.py, paper.py, startup.py. What they share:
workload.py (the one workload generator: random-token prompts, length profiles, Poisson
arrivals), report.py (the one table printer and the rows the docs' hook reads too), machine.py
(the matmul peak and the one copy-bandwidth probe), isolated.py (a system in a fresh process, with
its peak RSS), engine_under_test.py (the engine a bench drives) and llama_cpp.py (llama.cpp's
llama-server, the one peer a user runs: `bench throughput` and `bench serve` take
`--llama-server PATH`; it is a binary the user built and an HTTP client, no dependency).

The other peers (transformers, vLLM's CPU build), the matmul floor, the op profile and the other
investigations are not commands a user runs: they live outside the package, in the top-level
`benchmarks/` folder of a checkout, and build on these modules.

The commands import the offline API, the engine's arguments and, for `bench paper`, the experiments;
nothing in the package imports them.
"""
