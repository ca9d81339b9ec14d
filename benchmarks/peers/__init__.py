"""The peers minivllm is measured against, each in a process (or an interpreter) of its own."""
