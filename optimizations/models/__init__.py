"""Model families and their weight formats: Llama-family decoders, encoders, pooling and sentence heads, safetensors and GGUF loading."""
