"""Hugging Face Qwen3 / Qwen3-MoE checkpoints in and out (see docs/hf.md).

- `config_json`: config.json <-> ModelConfig, refusing every field this runtime cannot honour; the
  resolution (`ConfigContainer.finalize`, below hf/) takes a pretrained checkpoint's architecture
  from it through the step its caller hands in (`apply_pretrained`, which records each field it
  replaces in the decision table);
- `names`: our parameter names <-> HF names, and the tensor transforms (pure functions on full
  tensors);
- `safetensors_io`: lazy, sliced reads of single-file or sharded safetensors; sharded writes with an
  index;
- `load`: an HF folder straight into any layout's shards (`checkpoint.pretrained_checkpoint=<HF
  folder>`);
- `convert`: `overlap convert import | export | roundtrip`.
"""
