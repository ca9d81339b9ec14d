"""Why each of vLLM's server tests that does not pass does not: the classes of
`benchmarks/vllm_openai_conformance.py`, one reason each. docs/serving.md shows the counts.

Keys of `EXCLUDED_MODULES` are test files (matched on their end); keys of `KNOWN_FAILURES` are node
ids (`file::test`, any parameters), or prefixes ending in `*`.
"""

from __future__ import annotations

_OTHER = "excluded"
_INTERNALS = "internals"

EXCLUDED_MODULES: dict[str, tuple[str, str]] = {
    # Another model, a GPU, audio, vision, LoRA: outside what one small text model can show.
    "correctness/test_lmeval.py": (
        _OTHER,
        "GSM8K accuracy of Qwen2-1.5B (benchmarks/lm_eval_compare.py is ours)",
    ),
    "correctness/test_transcription_api_correctness.py": (_OTHER, "audio: Whisper transcription"),
    "test_audio.py": (_OTHER, "audio: an Ultravox model"),
    "test_transcription_validation.py": (_OTHER, "audio: Whisper transcription"),
    "test_translation_validation.py": (_OTHER, "audio: Whisper translation"),
    "test_video.py": (_OTHER, "vision: a LLaVA-OneVision model"),
    "test_vision.py": (_OTHER, "vision: a Phi-3.5-vision model"),
    "responses/test_image.py": (_OTHER, "vision: Qwen2.5-VL through the Responses API"),
    "test_completion_with_image_embeds.py": (_OTHER, "vision: LLaVA image embeddings"),
    "test_completion_with_prompt_embeds.py": (
        _OTHER,
        "prompt embeddings (tensors in, --enable-prompt-embeds)",
    ),
    "test_default_mm_loras.py": (_OTHER, "LoRA on a multimodal model"),
    "test_lora_adapters.py": (_OTHER, "LoRA adapters"),
    "test_lora_resolvers.py": (_OTHER, "LoRA resolvers (also vLLM internals)"),
    "test_response_api_with_harmony.py": (
        _OTHER,
        "gpt-oss-20b and its Harmony format, built-in tools",
    ),
    "test_chat_with_tool_reasoning.py": (_OTHER, "QwQ-32B's reasoning parser with tools"),
    "test_multi_api_servers.py": (
        _OTHER,
        "a MoE model over several API server processes (data parallel)",
    ),
    "test_optional_middleware.py": (_OTHER, "an embedding (pooling) model"),
    "test_skip_tokenizer.py": (_OTHER, "a Prithvi geospatial model with tensor inputs"),
    "test_sleep.py": (_OTHER, "GPU sleep mode"),
    "test_tensorizer_entrypoint.py": (_OTHER, "tensorizer-serialized weights and LoRA"),
    "test_openai_schema.py": (
        _OTHER,
        "schema fuzzing with SmolVLM, a vision model (and schemathesis 3)",
    ),
    "test_shutdown.py": (_OTHER, "an engine crash injected through vLLM's own engine (GPU)"),
    # Unit tests of vLLM's Python objects (argparse, serving classes, parsers, renderers).
    "test_cli_args.py": (_INTERNALS, "vLLM's argument parser"),
    "test_serving_chat.py": (_INTERNALS, "vLLM's OpenAIServingChat with a mocked engine"),
    "test_serving_models.py": (_INTERNALS, "vLLM's OpenAIServingModels"),
    "test_chat_template.py": (_INTERNALS, "vLLM's apply_hf_chat_template on its example templates"),
    "test_run_batch.py": (_INTERNALS, "the `vllm run-batch` command"),
    "test_collective_rpc.py": (_INTERNALS, "a worker extension class loaded into vLLM's workers"),
    "test_oot_registration.py": (
        _INTERNALS,
        "an out-of-tree model registered with vLLM's registry",
    ),
    "test_token_in_token_out.py": (
        _INTERNALS,
        "vLLM's weight downloader and --skip-tokenizer-init on Qwen3",
    ),
    "tool_parsers/test_hunyuan_a13b_tool_parser.py": (_INTERNALS, "vLLM's tool parser classes"),
    "tool_parsers/test_llama3_json_tool_parser.py": (_INTERNALS, "vLLM's tool parser classes"),
    "tool_parsers/test_llama4_pythonic_tool_parser.py": (_INTERNALS, "vLLM's tool parser classes"),
    "tool_parsers/test_pythonic_tool_parser.py": (_INTERNALS, "vLLM's tool parser classes"),
}

# Parameters (a part of a test's name) that ask for what is excluded above.
EXCLUDED_PARAMETERS: dict[str, tuple[str, str]] = {
    "zephyr-lora": (_OTHER, "a LoRA adapter (zephyr-lora) as the model"),
}

KNOWN_FAILURES: dict[str, tuple[str, str]] = {}
