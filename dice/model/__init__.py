"""The model: SDAR's Qwen3 decoder with block-diffusion attention, its packed RL input, checkpoints and tokenizer
(DESIGN.md §2-3, §7).

| module | |
| --- | --- |
| `sdar` | `SDAR` and `ModelConfig`: Qwen3 layers (q/k/v and gate/up stacked), unshifted logits, the public shapes |
| `attention` | the one block-diffusion mask predicate for dense and FlexAttention masks; the KV cache |
| `packing` | BiC-RL's update input: a response's trace rounds beside one clean stream, packed into token-sized micro-batches, their log-probabilities and FLOPs |
| `checkpoint` | SDAR folders: single or sharded safetensors, tied embeddings, atomic saves, published tensor names |
| `tokenizer` | byte-level BPE: SDAR's tokenizer files, or one trained for a from-scratch model |
"""
