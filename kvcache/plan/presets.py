"""Model and GPU presets for `kvcache plan`: the fields of each model's published config.json.

Model presets keep the config.json field names, so they go through the same parser as a
user's config file (values as released; base models, not their -Instruct variants, unless
named). `num_parameters` is the total of the released weights without multi-token-prediction
layers (DeepSeek-V3, Qwen3-Next ship one more). GPU memory is the total nvidia-smi reports.
"""
from __future__ import annotations

MiB = 2**20

# name -> (Hugging Face repository the config comes from, total parameters, config.json fields)
MODEL_PRESETS: dict[str, tuple[str, int, dict]] = {
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", 8_030_261_248, dict(
        model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
        torch_dtype="bfloat16")),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", 70_553_706_496, dict(
        model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=28672, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
        torch_dtype="bfloat16")),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B", 405_853_388_800, dict(
        model_type="llama", num_hidden_layers=126, hidden_size=16384, num_attention_heads=128, num_key_value_heads=8,
        intermediate_size=53248, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False,
        torch_dtype="bfloat16")),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", 494_032_768, dict(
        model_type="qwen2", num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768, sliding_window=32768,
        use_sliding_window=False, max_window_layers=24, tie_word_embeddings=True, torch_dtype="bfloat16")),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B", 7_615_616_512, dict(
        model_type="qwen2", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072, sliding_window=131072,
        use_sliding_window=False, max_window_layers=28, tie_word_embeddings=False, torch_dtype="bfloat16")),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B", 72_706_203_648, dict(
        model_type="qwen2", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
        intermediate_size=29568, vocab_size=152064, max_position_embeddings=131072, sliding_window=131072,
        use_sliding_window=False, max_window_layers=80, tie_word_embeddings=False, torch_dtype="bfloat16")),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", 46_702_792_704, dict(
        model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16")),
    "mistral-7b-v0.1": ("mistralai/Mistral-7B-v0.1", 7_241_732_096, dict(
        model_type="mistral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
        tie_word_embeddings=False, torch_dtype="bfloat16")),
    "gemma-2-9b": ("google/gemma-2-9b", 9_241_705_984, dict(
        model_type="gemma2", num_hidden_layers=42, hidden_size=3584, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, intermediate_size=14336, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
        tie_word_embeddings=True, torch_dtype="float32")),
    "gemma-2-27b": ("google/gemma-2-27b", 27_227_128_320, dict(
        model_type="gemma2", num_hidden_layers=46, hidden_size=4608, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, intermediate_size=36864, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
        tie_word_embeddings=True, torch_dtype="float32")),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", 15_706_484_224, dict(
        model_type="deepseek_v2", num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, vocab_size=102400, max_position_embeddings=163840,
        tie_word_embeddings=False, torch_dtype="bfloat16")),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", 671_026_419_200, dict(
        model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, vocab_size=129280, max_position_embeddings=163840,
        tie_word_embeddings=False, torch_dtype="bfloat16")),
    "gpt-3-175b": ("Brown et al. 2020, Table 2.1 (no public config.json)", 175_000_000_000, dict(
        model_type="gpt3", num_hidden_layers=96, hidden_size=12288, num_attention_heads=96, head_dim=128,
        intermediate_size=49152, vocab_size=50257, max_position_embeddings=2048, tie_word_embeddings=True,
        torch_dtype="float16")),
    "tinyllama-1.1b": ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", 1_100_048_384, dict(
        model_type="llama", num_hidden_layers=22, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False,
        torch_dtype="bfloat16")),
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", 134_515_008, dict(
        model_type="llama", num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
        torch_dtype="bfloat16")),
    "qwen3-next-80b-a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct", 79_674_391_296, dict(
        model_type="qwen3_next", num_hidden_layers=48, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=5120,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10,
        vocab_size=151936, max_position_embeddings=262144, tie_word_embeddings=False, torch_dtype="bfloat16")),
}

# name -> total memory in bytes, as nvidia-smi reports it
GPU_PRESETS: dict[str, int] = {
    "a100-40gb": 40_960 * MiB,
    "a100-80gb": 81_920 * MiB,
    "h100-80gb": 81_559 * MiB,
    "h200": 143_771 * MiB,
    "l4": 23_034 * MiB,
    "rtx-4090": 24_564 * MiB,
    "a10g": 23_028 * MiB,
    "l40s": 46_068 * MiB,
}
