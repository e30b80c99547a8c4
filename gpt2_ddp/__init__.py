"""What train_gpt2.py calls besides its own loop: the swap-ins for DDP (data_parallel), Muon, the dtype's
autocast and loss scaler (precision), checkpoints, token shards, the tokenizer, metrics, HellaSwag,
GPT-2 weights in and out, the memory plan, and the config reader (docs/architecture.md maps them)."""
