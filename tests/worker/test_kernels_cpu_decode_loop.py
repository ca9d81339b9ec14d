"""A decode step's layers in one C++ call (`minivllm/worker/cpu_decode_loop.py`, source
`cpu_decode_layers.cpp`) equal the Python loop of `LlamaForCausalLM.forward` bit for bit, and the
model runner replays them exactly where they apply.

The op calls the kernels the Python loop calls, in the same order, so the comparison is
`torch.equal`, on the step's hidden states and on what it wrote into the KV cache: a tolerance
would hide a step done in another order. The Python loop itself is held to transformers by
tests/model/test_model_llama.py and test_engine_greedy.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.attention.abstract import AttentionMetadata
from minivllm.attention.selector import get_attention_backend
from minivllm.cpu import op_forwards
from minivllm.cpu.ops import SKINNY_GEMM_MAX_ROWS, skinny_gemm_fast
from minivllm.llm import LLM
from minivllm.lora.layers import LoRAMapping, wrap_linears
from minivllm.lora.peft_loader import LoRALayerWeights, lora_scale
from minivllm.lora.punica_selector import REFERENCE_OPS, PunicaOps, get_punica_ops
from minivllm.model.loader import load_model
from minivllm.model.models.llama import LlamaForCausalLM
from minivllm.model.resolver import resolve_model
from minivllm.sampling_params import SamplingParams
from minivllm.worker.cpu_decode_coverage import not_covered
from minivllm.worker.cpu_decode_loop import CpuDecodeLoop
from tests.model.test_model_llama import CONFIGS, save_tiny_llama

pytestmark = pytest.mark.cpu_isa  # run again at each lower instruction-set level (make test)

BLOCK_SIZE = 16
needs_avx512 = pytest.mark.skipif(
    not skinny_gemm_fast(), reason="the op applies where the skinny GEMM has its AVX-512 path"
)
# bfloat16 models replay where their linears are prepacked for oneDNN: a CPU with bf16 dot products.
BF16_HW = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="float32 weights are packed for oneDNN"
)
DTYPES = [
    pytest.param(torch.float32, marks=needs_avx512, id="float32"),
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(not BF16_HW, reason="no AVX512-BF16/AMX"),
        id="bfloat16",
    ),
]


def load(path: Path, backend: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(
        resolve_model(path), get_attention_backend(backend), dtype, torch.device("cpu")
    )


def capture(model: LlamaForCausalLM) -> CpuDecodeLoop | None:
    """What the model runner builds for this model (`ModelRunner.build_decode_loop`)."""
    backend = model.model.layers[0].self_attn.backend
    replay = CpuDecodeLoop.build(model, backend)
    assert replay is None or isinstance(replay, CpuDecodeLoop)
    return replay


def step_meta(
    model: LlamaForCausalLM, query_lens: list[int], seq_lens: list[int], tables: torch.Tensor
) -> AttentionMetadata:
    """A step's metadata with the backend's plan, as the model runner builds it."""
    starts = [0]
    slots: list[int] = []
    for q, s, table in zip(query_lens, seq_lens, tables.tolist()):
        starts.append(starts[-1] + q)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s - q, s)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    meta.plan = model.model.layers[0].self_attn.backend.plan(meta, BLOCK_SIZE)
    return meta


def prefilled(model: LlamaForCausalLM, prompt_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV cache holding random prompts of these lengths (computed by the Python loop), and the
    requests' shuffled block tables."""
    cfg = model.config
    blocks_each = -(-(max(prompt_lens) + 1) // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    num_blocks = blocks_each * len(prompt_lens) + 2
    ids = torch.randperm(num_blocks, generator=gen)[: blocks_each * len(prompt_lens)]
    tables = ids.view(len(prompt_lens), blocks_each).to(torch.int32)
    kv = torch.zeros(
        cfg.num_hidden_layers,
        2,
        num_blocks,
        BLOCK_SIZE,
        cfg.num_key_value_heads,
        cfg.head_dim,
        dtype=next(model.parameters()).dtype,
    )  # [layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    tokens = torch.randint(0, cfg.vocab_size, (sum(prompt_lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in prompt_lens])
    with torch.inference_mode():
        model(tokens, positions, kv, step_meta(model, prompt_lens, prompt_lens, tables))
    return kv, tables


# Linear weights prepacked for oneDNN (float32 wherever oneDNN is built in, bfloat16 with bf16 dot
# products) run oneDNN at every row count; plain float32 weights (where oneDNN does not pack them)
# the skinny GEMM, up to SKINNY_GEMM_MAX_ROWS rows, as the Python loop does per linear.
WEIGHTS = [
    pytest.param(torch.float32, True, marks=needs_onednn, id="float32"),
    pytest.param(torch.float32, False, marks=needs_avx512, id="float32-plain"),
    pytest.param(
        torch.bfloat16, True, marks=pytest.mark.skipif(not BF16_HW, reason="no AVX512-BF16/AMX")
    ),
]


@pytest.mark.parametrize("num_seqs", [5, 9, 70])
@pytest.mark.parametrize(("dtype", "packed"), WEIGHTS)
@pytest.mark.parametrize("name", ["mha-hd32", "gqa4-hd64", "mqa-hd64-theta5e5", "tinyllama-shape"])
def test_a_decode_step_equals_the_python_loop_bit_for_bit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    dtype: torch.dtype,
    packed: bool,
    num_seqs: int,
) -> None:
    _, path = save_tiny_llama(tmp_path, CONFIGS[name])
    if not packed:  # as on a torch without oneDNN
        monkeypatch.setattr(op_forwards, "onednn_packs", lambda weight: False)
    model = load(path, dtype=dtype)
    fused = capture(model)
    assert fused is not None and fused.packed is packed
    # contexts ending mid-block and at block edges
    prompt_lens = ([5, 16, 17, 40, 33] * 14)[:num_seqs]
    kv, tables = prefilled(model, prompt_lens)
    seq_lens = [n + 1 for n in prompt_lens]
    meta = step_meta(model, [1] * len(prompt_lens), seq_lens, tables)
    if not fused.applies(len(prompt_lens), meta):  # more rows than a plain weight's skinny GEMM
        assert not packed and num_seqs > SKINNY_GEMM_MAX_ROWS
        return
    tokens = torch.randint(0, model.config.vocab_size, (len(prompt_lens),))
    positions = torch.tensor(prompt_lens)
    kv_python = kv.clone()
    with torch.inference_mode():
        got = fused(tokens, positions, kv, meta)
        expected = model(tokens, positions, kv_python, meta)
    assert torch.equal(got, expected)
    assert torch.equal(kv, kv_python)  # the same K/V written into the same slots


@needs_avx512
def test_it_applies_to_decode_steps_of_at_most_the_skinny_gemm_s_rows(tmp_path: Path) -> None:
    _, path = save_tiny_llama(tmp_path, CONFIGS["gqa2-hd32-tied"])
    model = load(path)
    fused = capture(model)
    assert fused is not None
    tables = torch.arange(4 * 3, dtype=torch.int32).view(4, 3)
    decode = step_meta(model, [1] * 4, [9, 20, 31, 2], tables)
    assert fused.applies(4, decode)
    # With every linear prepacked (oneDNN is built into torch here), oneDNN runs any row count in
    # both paths; on plain weights, more rows than the skinny GEMM's go to MKL: the Python loop.
    assert fused.packed
    assert fused.applies(SKINNY_GEMM_MAX_ROWS + 1, decode)
    fused.packed = False
    assert not fused.applies(SKINNY_GEMM_MAX_ROWS + 1, decode)
    mixed = step_meta(model, [1, 5, 1, 2], [9, 20, 31, 2], tables)
    assert not fused.applies(9, mixed)
    decode.plan = None  # planned by another backend (or not at all)
    assert not fused.applies(4, decode)


@pytest.mark.parametrize(
    ("overrides", "backend", "dtype"),
    [
        ({"attention_bias": True}, "cpu", torch.float32),  # biases: the op has none
        ({"mlp_bias": True}, "cpu", torch.float32),
        ({}, "reference", torch.float32),  # the plain-PyTorch model stays plain
        ({}, "cpu", torch.float16),  # neither the skinny GEMM (float32) nor packed (bf16)
    ],
    ids=["attention-bias", "mlp-bias", "reference-backend", "float16"],
)
def test_models_it_cannot_run_exactly_keep_the_python_loop(
    tmp_path: Path, overrides: dict, backend: str, dtype: torch.dtype
) -> None:
    _, path = save_tiny_llama(tmp_path, CONFIGS["mha-hd32"] | overrides)
    assert capture(load(path, backend, dtype)) is None


def test_a_bfloat16_model_replays_exactly_where_its_linears_are_packed(tmp_path: Path) -> None:
    _, path = save_tiny_llama(tmp_path, CONFIGS["mha-hd32"])
    assert (capture(load(path, "cpu", torch.bfloat16)) is not None) is BF16_HW


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engine_runs_its_decode_steps_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Every decode step of a plain batch goes through the op, and greedy output is what the
    Python loop gives."""
    _, path = save_tiny_llama(tmp_path, CONFIGS["gqa2-hd32-tied"])
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (7, 20, 33)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    calls = []
    inner = CpuDecodeLoop.__call__

    def counted(self: CpuDecodeLoop, *args: object) -> torch.Tensor:
        calls.append(1)
        return inner(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CpuDecodeLoop, "__call__", counted)
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        dtype=str(dtype).removeprefix("torch."),
        cpu_kv_cache_space=0.25,
    )
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(calls) == 11  # one prefill step, then 11 decode steps
    llm.llm_engine.runner.decode_loop = None
    python = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == python


def test_a_wrong_number_of_weights_is_refused_by_name(tmp_path: Path) -> None:
    _, path = save_tiny_llama(tmp_path, CONFIGS["mha-hd32"])
    model = load(path)
    cfg = model.config
    kv = torch.zeros(cfg.num_hidden_layers, 2, 4, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"decode_layers: expected 12 weights for 2 layers"):
        torch.ops.minivllm_cpu.decode_layers(
            torch.zeros(1, cfg.hidden_size),
            torch.zeros(1, dtype=torch.int64),
            model.model.rotary_emb.cos_sin,
            kv,
            one.view(1, 1),
            one + 1,
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            [torch.zeros(1)] * 5,
            torch.ones(cfg.hidden_size),
            1e-5,
            1.0,
            cfg.num_attention_heads,
            [],  # no LoRA
            [],
            [],
            [],
            None,
        )


@needs_avx512
def test_a_forward_hook_on_a_layer_keeps_decode_steps_in_the_python_loop(tmp_path: Path) -> None:
    """A user's probe on a layer runs at every step: the C++ call would skip it."""
    _, path = save_tiny_llama(tmp_path, CONFIGS["gqa2-hd32-tied"])
    llm = LLM(str(path), skip_tokenizer_init=True)
    fused = llm.llm_engine.runner.decode_loop
    assert isinstance(fused, CpuDecodeLoop) and not fused.hooked()
    seen: list[int] = []
    layer = llm.llm_engine.model.model.layers[1]
    handle = layer.mlp.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, use_tqdm=False)
    assert seen == [6, 2, 2, 2]  # the prefill (2 x 3 tokens), then three decode steps of 2
    handle.remove()
    assert not fused.hooked()


@needs_avx512
def test_enforce_eager_keeps_every_step_in_the_python_loop(tmp_path: Path) -> None:
    _, path = save_tiny_llama(tmp_path, CONFIGS["gqa2-hd32-tied"])
    llm = LLM(str(path), skip_tokenizer_init=True, enforce_eager=True)
    assert llm.llm_engine.runner.decode_loop is None


# ---------------------------------------------------------------------------------- LoRA
# Three adapters in three slots, as tests/lora/lora_utils.py's peft adapters: attention only
# (rank 8), MLP only (rank 4), every linear under rsLoRA (rank 16, the slots' max rank).
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
ADAPTERS = [
    dict(r=8, lora_alpha=16, targets=ATTENTION),
    dict(r=4, lora_alpha=8, targets=MLP),
    dict(r=16, lora_alpha=32, targets=ATTENTION + MLP, use_rslora=True),
]


@pytest.fixture(scope="module")
def gqa_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GQA Llama, saved once: q and k/v slices of different sizes in the fused qkv."""
    return save_tiny_llama(tmp_path_factory.mktemp("lora-loop"), CONFIGS["gqa2-hd32-tied"])[1]


def with_adapters(model: LlamaForCausalLM, ops: PunicaOps) -> LoRAMapping:
    """The model's linears wrapped as the LoRA manager wraps them, and `ADAPTERS` in slots 0-2
    with random A and B."""
    dtype = next(model.parameters()).dtype
    mapping = LoRAMapping(ops=ops)
    wrapped = wrap_linears(model, mapping, len(ADAPTERS), 16, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    for slot, adapter in enumerate(ADAPTERS):
        rank = adapter["r"]
        for layer in wrapped.values():
            weights = {
                name: LoRALayerWeights(
                    (torch.randn(rank, fan_in, generator=gen) * 0.2).to(dtype),  # [r, in]
                    (torch.randn(fan_out, rank, generator=gen) * 0.2).to(dtype),  # [out, r]
                )
                for name, (fan_in, fan_out) in layer.targets.items()
                if name.rpartition(".")[2] in adapter["targets"]
            }
            layer.set_lora(slot, weights, lora_scale(adapter))
    return mapping


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "packed"), WEIGHTS)
def test_a_decode_step_with_lora_equals_the_python_loop_bit_for_bit(
    gqa_llama: Path,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    packed: bool,
    threads: int,
) -> None:
    """A batch of base rows and rows of three adapters (of ranks 8, 4 and 16; attention-only,
    MLP-only, and all linears under rsLoRA): each linear adds its Punica delta in the C++ loop
    exactly as its LoRA wrapper does in the Python loop."""
    if not packed:
        monkeypatch.setattr(op_forwards, "onednn_packs", lambda weight: False)
    model = load(gqa_llama, dtype=dtype)
    mapping = with_adapters(model, get_punica_ops("cpu"))
    fused = capture(model)
    assert fused is not None and fused.mapping is mapping and len(fused.lora_a) == 2 * 7
    prompt_lens = [5, 16, 17, 33, 9, 3]
    kv, tables = prefilled(model, prompt_lens)
    meta = step_meta(model, [1] * len(prompt_lens), [n + 1 for n in prompt_lens], tables)
    tokens = torch.randint(0, model.config.vocab_size, (len(prompt_lens),))
    positions = torch.tensor(prompt_lens)
    slots = torch.tensor([-1, 0, 1, 2, -1, 1])  # each row's adapter slot; -1 the base model
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            mapping.set(slots)
            assert fused.applies(len(prompt_lens), meta)
            kv_fused, kv_python = kv.clone(), kv.clone()
            got = fused(tokens, positions, kv_fused, meta)
            expected = model(tokens, positions, kv_python, meta)
            mapping.set(torch.full_like(slots, -1))  # no row with an adapter: the base model
            base = fused(tokens, positions, kv.clone(), meta)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, expected)
    assert torch.equal(kv_fused, kv_python)
    adapted = slots != -1
    assert not torch.equal(got[adapted], base[adapted])  # the adapters do change their rows


def test_lora_on_another_backend_s_kernels_keeps_the_python_loop(gqa_llama: Path) -> None:
    """The reference's shrink / expand (grouped matmuls) round otherwise than the CPU library's
    kernels the C++ loop calls."""
    model = load(gqa_llama)
    with_adapters(model, REFERENCE_OPS)
    reason = not_covered(model, model.model.layers[0].self_attn.backend)
    assert reason is not None and "runs the 'reference' shrink / expand" in reason
